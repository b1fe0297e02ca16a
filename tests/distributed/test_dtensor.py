"""DTensor leaves in ``ldc.save`` / ``ldc.load``: sharded tensors keyed by tree path, saved once per
unique shard, loaded back into DTensors of any other mesh or placement (real gloo groups)."""

import logging
import os
import zlib
from typing import Dict, List

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.placement_types import _StridedShard

import lightning_distckpt as ldc
from lightning_distckpt.core.dtensors import _strided_is_contiguous, dtensor_key, shard_dtensors
from lightning_distckpt.core.errors import ShardingError
from lightning_distckpt.reading.checkpoint import open_checkpoint
from dist_utils import run_distributed

# key -> global shape of the tensors saved on 2 ranks (mesh (2,)) and on 4 ranks (meshes (4,), (2, 2))
SHAPES_ON_2 = {"model/w": (8, 6), "model/b": (5,), "model/r": (4, 3), "opt/state/0/exp_avg": (6, 7)}
SHAPES_ON_4 = {"u10": (10, 3), "u3": (3, 4), "ss": (10, 2), "rs": (6, 4), "sr": (5, 6), "fsdp_tp": (8, 3)}


def full(key: str, shape) -> torch.Tensor:
    """The global tensor of ``key``: the same on every rank, random bits (bit-exact comparisons)."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def dt(key: str, shapes: Dict[str, tuple], mesh, placements) -> DTensor:
    return distribute_tensor(full(key, shapes[key]), mesh, placements)


def blank(key: str, shapes: Dict[str, tuple], mesh, placements) -> DTensor:
    return distribute_tensor(torch.zeros(shapes[key]), mesh, placements)


def check_local(got: DTensor, key: str, shapes: Dict[str, tuple]) -> None:
    """``got``'s local shard is exactly the expected slice of ``key``'s global tensor."""
    want = distribute_tensor(full(key, shapes[key]), got.device_mesh, got.placements).to_local()
    assert torch.equal(got.to_local(), want), key


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save_on_2(rank, world, ckpt, async_ckpt):
    mesh = init_device_mesh("cpu", (2,))
    state = {
        "model": {"w": dt("model/w", SHAPES_ON_2, mesh, [Shard(0)]),
                  "b": dt("model/b", SHAPES_ON_2, mesh, [Shard(0)]),  # uneven: 3 + 2
                  "r": dt("model/r", SHAPES_ON_2, mesh, [Replicate()])},
        "opt": {"state": [{"exp_avg": dt("opt/state/0/exp_avg", SHAPES_ON_2, mesh, [Shard(1)])}]},
        "step": 7,
    }
    handler = Collect()
    logging.getLogger("lightning_distckpt").addHandler(handler)
    ldc.save(state, ckpt)
    ldc.save(state, async_ckpt, async_save=True).finalize()
    return handler.messages


@pytest.fixture(scope="module")
def saved_on_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtensor2")
    ckpt, async_ckpt = str(root / "ck"), str(root / "ck_async")
    warnings = run_distributed(_save_on_2, 2, ckpt, async_ckpt)
    return ckpt, async_ckpt, warnings


def test_dtensors_are_saved_as_sharded_tensors_not_common_state(saved_on_2):
    """Defect 4: a dict of DTensors was common state (a warning, rank 0's shard only, an unreadable common.pt)."""
    ckpt, async_ckpt, warnings = saved_on_2
    assert warnings == [[], []]
    for path in (ckpt, async_ckpt):
        meta = ldc.load_tensors_metadata(path)
        assert {k: v.global_shape for k, v in meta.items()} == SHAPES_ON_2
        assert ldc.load_common_state_dict(path) == {"step": 7}
        plain = ldc.load_plain_tensors(path)
        for key, shape in SHAPES_ON_2.items():
            assert torch.equal(plain[key], full(key, shape)), key


def test_replicated_dtensor_written_once(saved_on_2):
    index = open_checkpoint(saved_on_2[0]).index
    replicated = index.tensors["model/r"].shards
    assert [(s.offset, s.shape) for s in replicated] == [((0, 0), (4, 3))]
    assert sorted((s.offset, s.shape) for s in index.tensors["model/b"].shards) == [((0,), (3,)), ((3,), (2,))]


def _load_on_4_and_save(rank, world, ckpt, out):
    flat = init_device_mesh("cpu", (4,))
    grid = init_device_mesh("cpu", (2, 2))
    w = torch.nn.Parameter(blank("model/w", SHAPES_ON_2, flat, [Shard(1)]))  # 6 columns on 4: 2, 2, 2, 0
    local_before = w.to_local().data_ptr()
    template = {
        "model": {"w": w, "b": blank("model/b", SHAPES_ON_2, flat, [Shard(0)]),  # 5 on 4: 2, 2, 1, 0
                  "r": blank("model/r", SHAPES_ON_2, grid, [Shard(0), Replicate()])},
        "opt": {"state": [{"exp_avg": blank("opt/state/0/exp_avg", SHAPES_ON_2, grid, [Shard(0), Shard(1)])}]},
        "step": 0,
    }
    out_state = ldc.load(template, ckpt)
    assert out_state["model"]["w"] is w and w.to_local().data_ptr() == local_before  # filled in place
    assert out_state["step"] == 7
    for key in SHAPES_ON_2:
        node = out_state
        for part in key.split("/"):
            node = node[int(part)] if isinstance(node, list) else node[part]
        check_local(node, key, SHAPES_ON_2)
    ldc.save({
        "u10": dt("u10", SHAPES_ON_4, flat, [Shard(0)]),  # 3, 3, 3, 1 rows
        "u3": dt("u3", SHAPES_ON_4, flat, [Shard(0)]),  # 1, 1, 1, 0 rows: an empty shard
        "ss": dt("ss", SHAPES_ON_4, grid, [Shard(0), Shard(0)]),  # 10 -> 5, 5 -> 3, 2, 3, 2
        "rs": dt("rs", SHAPES_ON_4, grid, [Replicate(), Shard(1)]),
        "sr": dt("sr", SHAPES_ON_4, grid, [Shard(1), Replicate()]),
        # FSDP2 over tensor parallel: rows split by tp first, then each tp slice by dp (contiguous slices)
        "fsdp_tp": dt("fsdp_tp", SHAPES_ON_4, grid, [_StridedShard(0, split_factor=2), Shard(0)]),
    }, out)


@pytest.fixture(scope="module")
def saved_on_4(saved_on_2, tmp_path_factory):
    """Loads the 2-rank checkpoint on 4 ranks (other meshes and placements), then saves uneven DTensors."""
    out = str(tmp_path_factory.mktemp("dtensor4") / "ck")
    run_distributed(_load_on_4_and_save, 4, saved_on_2[0], out)
    return out


def test_load_2_ranks_into_4_other_placements_and_save_uneven(saved_on_4):
    plain = ldc.load_plain_tensors(saved_on_4)
    for key, shape in SHAPES_ON_4.items():
        assert torch.equal(plain[key], full(key, shape)), key
    index = open_checkpoint(saved_on_4).index
    assert sorted(s.shape[0] for s in index.tensors["ss"].shards) == [2, 2, 3, 3]
    assert sorted(s.shape[0] for s in index.tensors["u3"].shards if s.shape[0]) == [1, 1, 1]
    # replicated mesh dims: one stored shard per unique shard, each byte once
    for key in ("rs", "sr"):
        shards = index.tensors[key].shards
        assert len(shards) == 2 and sum(s.shape[0] * s.shape[1] for s in shards) == full(key, SHAPES_ON_4[key]).numel()


def _load_on_2(rank, world, ckpt):
    mesh = init_device_mesh("cpu", (2,))
    for loader in ("two_stage", "parallel", "every_rank"):
        template = {"u10": blank("u10", SHAPES_ON_4, mesh, [Replicate()]),
                    "u3": blank("u3", SHAPES_ON_4, mesh, [Shard(1)]),
                    "ss": blank("ss", SHAPES_ON_4, mesh, [Shard(1)]),
                    "rs": blank("rs", SHAPES_ON_4, mesh, [Shard(0)]),
                    "sr": _transposed_local("sr", mesh, rank),
                    "fsdp_tp": blank("fsdp_tp", SHAPES_ON_4, mesh, [Shard(1)])}
        sr_local = template["sr"].to_local()
        loaded = ldc.load(template, ckpt, loader=loader)
        for key in SHAPES_ON_4:
            assert loaded[key] is template[key]
            check_local(loaded[key], key, SHAPES_ON_4)
        assert loaded["sr"].to_local().data_ptr() == sr_local.data_ptr()  # copied into the template's own memory
    partial = DTensor.from_local(torch.zeros(10, 3), mesh, [Partial()], run_check=False)
    with pytest.raises(ShardingError, match="'u10'.*Partial"):
        ldc.load({"u10": partial}, ckpt)


def _transposed_local(key: str, mesh, rank: int) -> DTensor:
    """A Shard(0) DTensor whose local tensor is not contiguous (read elsewhere, then copied in)."""
    rows = (3, 2)[rank]  # 5 rows on 2 ranks
    local = torch.zeros(SHAPES_ON_4[key][1], rows).t()
    assert not local.is_contiguous()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=SHAPES_ON_4[key], stride=(6, 1))


def test_load_4_ranks_into_2(saved_on_4):
    run_distributed(_load_on_2, 2, saved_on_4)


def test_load_into_one_process_without_dtensor(saved_on_4):
    key, shape = "ss", SHAPES_ON_4["ss"]
    template = {key: ldc.ShardedTensor.from_rank_offsets(key, torch.zeros(shape))}
    assert torch.equal(ldc.load(template, saved_on_4)[key], full(key, shape))


def _refuse(rank, world, ckpt, case):
    mesh = init_device_mesh("cpu", (2,))
    state = {"model": {"w": dt("model/w", SHAPES_ON_2, mesh, [Shard(0)])}}
    partial = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()], run_check=False)
    if case == "partial" or (case == "partial_on_rank_1" and rank == 1):
        state["model"]["p"] = partial
    elif case == "in_tuple":
        state["model"]["p"] = (dt("model/w", SHAPES_ON_2, mesh, [Shard(0)]),)
    with pytest.raises(ShardingError) as err:
        ldc.save(state, ckpt)
    return str(err.value), sorted(err.value.failures)


@pytest.mark.parametrize("case, failing, says", [("partial", [0, 1], "Partial"), ("partial_on_rank_1", [1], "Partial"),
                                                 ("in_tuple", [0, 1], "tuple")])
def test_undescribable_dtensor_refused_on_every_rank_before_writing(tmp_path, case, failing, says):
    ckpt = str(tmp_path / "ck")
    for message, failed in run_distributed(_refuse, 2, ckpt, case):
        assert "'model/p" in message and says in message, message
        assert failed == failing
    assert not os.path.exists(ckpt)


def test_key_is_the_tree_path():
    assert dtensor_key(("model", "layers", 0, "w")) == "model/layers/0/w"
    with pytest.raises(ShardingError):
        dtensor_key(())
    tree = {"a": [1, (torch.ones(1), "x")], "b": {"c": 2}}
    assert shard_dtensors(tree) is tree  # no DTensor: the tree itself, namedtuples and all


def test_strided_shards_accepted_only_when_contiguous():
    fsdp_over_tp = [_StridedShard(0, split_factor=2), Shard(0)]  # rows 0-1 | 4-5 | 2-3 | 6-7
    assert _strided_is_contiguous((8, 3), (2, 2), fsdp_over_tp)
    assert _strided_is_contiguous((7, 3), (2, 2), fsdp_over_tp)  # uneven
    assert not _strided_is_contiguous((8, 3), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)])  # rows 0, 2 | 1, 3
    assert not _strided_is_contiguous((8,), (4,), [_StridedShard(0, split_factor=2)])  # rows 0, 4 | 1, 5 | ...


def _fsdp_model(mesh_shape):
    """A two-layer MLP under FSDP2, over tensor parallel on a 2-D mesh (placements with _StridedShard),
    after one optimizer step (so Adam's moments exist, as DTensors)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(len(mesh_shape))  # other weights under each layout: the load must overwrite them
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))
    if len(mesh_shape) == 2:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return model, opt


def _fsdp_tp_save(rank, world, ckpt):
    model, opt = _fsdp_model((2, 2))
    ldc.save({"model": model.state_dict(), "optim": opt.state_dict()}, ckpt)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _fsdp_load(rank, world, ckpt, saved):
    model, opt = _fsdp_model((2,))
    state = ldc.load({"model": model.state_dict(), "optim": opt.state_dict()}, ckpt)
    opt.load_state_dict(state["optim"])
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), saved[name]), name
    return opt.state_dict()["state"][0]["exp_avg"].full_tensor()


def test_fsdp2_over_tensor_parallel_4_ranks_resumes_under_fsdp2_on_2(tmp_path):
    ckpt = str(tmp_path / "ck")
    saved = run_distributed(_fsdp_tp_save, 4, ckpt)[0]
    plain = ldc.load_plain_tensors(ckpt)
    for name, value in saved.items():
        assert torch.equal(plain[f"model/{name}"], value), name
    exp_avg = run_distributed(_fsdp_load, 2, ckpt, saved)[0]
    assert torch.equal(exp_avg, plain["optim/state/0/exp_avg"])
