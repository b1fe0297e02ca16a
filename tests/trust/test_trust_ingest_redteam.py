"""Red team of the rank-0 ingest (``lightning_distckpt.ingest``) and the inference loader: what every rank
sees when a call, a source or a module is not what the transfer expects.

What a probe found (each fails on the old code, as its test says):

* A rank calling the wrong side (a rank testing its *local* rank 0 calls ``broadcast_and_shard_state_dict``),
  or rank 0 passing a state dict that is not a mapping, raised at once on that rank alone; the others waited
  for it in the first collective until the group's timeout (here: its socket closed, a ``CollectiveError``).
  Now the error travels in that first collective: every rank raises the same ``ArgumentError``.
* A source that changes between rank 0's check and its send (a lazy mapping that reads its file at each
  lookup, as accelerate's offloaded-weights loader does, over a file replaced meanwhile): a tensor of another
  dtype was broadcast at its new size, and gloo aborted the receiver (SIGABRT: "Received data size doesn't
  match expected size"); a grown tensor was cut as if it had the checked shape (silently truncated). Now
  rank 0 checks each tensor again where it reads it: every rank raises the same error naming the key.
* ``DistModule.load_state_dict`` found a key no entry fills (non-tensor extra state, under ``strict``) or a
  shard of another shape than the module's tensor only in torch's load, after the module's other tensors
  were overwritten. Now both are refused on every rank before any data moves, the module left as it was.
* Tied weights (one tensor under two names) loaded with ``assign=True`` came back as two tensors (torch's own
  load keeps them one storage), and a twin saved once (a Hugging Face tied embedding) stayed on the meta
  device. Now the names share one shard.

Found sound, kept as regressions: float8 / bfloat16 / complex / bool / zero-size tensors through the
broadcast from torch and safetensors files, bit-exact; ranks whose templates disagree (a key only one rank
asks for: loaded; another global shape on one rank: the same ShardingError everywhere); the inference
loader into non-contiguous parameters (channels_last, a transposed view) and its failures leaving the module
untouched. Hang guard: the groups time out after ``GROUP_TIMEOUT_S``; a rank left waiting gets a
``CollectiveError``, distinct from the errors asserted. Nothing waits on time otherwise.
"""

import os

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

import lightning_distckpt as ldc
from dist_utils import run_distributed
from lightning_distckpt.core.errors import CheckpointingError, ShardingError
from lightning_distckpt.ingest import (DistModule, broadcast_and_shard_state_dict, load_state_dict,
                                       shard_broadcasted_state_dict)
from lightning_distckpt.lightning.inference import load_module_weights

GROUP_TIMEOUT_S = 30
ST = ldc.ShardedTensor


def _meta(shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _outcome(fn):
    """("ok", value) or (the error's class name, its message)."""
    try:
        return "ok", fn()
    except CheckpointingError as e:
        return type(e).__name__, str(e)


def _ingest(rank, source, entries, **options):
    out = {}
    if rank == 0:
        broadcast_and_shard_state_dict(source, entries, out, **options)
    else:
        shard_broadcasted_state_dict(entries, out, **options)
    return out


# -- a call on the wrong side, a state dict that is not one ------------------------------------------------
def _wrong_calls(rank, world):
    entries = {"w": ST.from_rank_offsets("w", _meta((2,)), (0, rank, world))}
    full = {"w": torch.arange(4.0)}
    scenarios = [
        # rank 1 believes it is rank 0 (its local rank on a second node): it broadcasts too
        lambda: broadcast_and_shard_state_dict(full, entries, {}) if rank < 2 else _ingest(rank, None, entries),
        lambda: _ingest(rank, [("w", torch.arange(4.0))], entries),  # rank 0's state dict: a list of pairs
        lambda: _ingest(rank, full, entries, bucket_bytes=0 if rank == 1 else 64),  # one rank's bad option
        lambda: torch.equal(_ingest(rank, full, entries)["w"], full["w"].chunk(world)[rank]),  # still in step
    ]
    outcomes = []
    for scenario in scenarios:
        outcomes.append(_outcome(scenario))
        if outcomes[-1][0] in ("CollectiveError", "ok") and len(outcomes) < len(scenarios):
            break  # not agreed (the old code): no collective follows, so the ranks part instead of waiting
    return outcomes


def test_a_wrong_call_on_one_rank_fails_every_rank_alike():
    per_rank = run_distributed(_wrong_calls, 2, timeout_s=GROUP_TIMEOUT_S)
    assert per_rank[0] == per_rank[1], per_rank  # old: rank 0 got a CollectiveError (rank 1 had left)
    wrong_side, not_a_mapping, bad_option, good = per_rank[0]
    assert wrong_side[0] == "ArgumentError" and "rank 1: broadcast_and_shard_state_dict runs on global rank 0" \
        in wrong_side[1], wrong_side
    assert not_a_mapping[0] == "ArgumentTypeError" and "rank 0: state_dict must be a mapping" in not_a_mapping[1]
    assert bad_option[0] == "ArgumentError" and "rank 1: bucket_bytes must be a positive int" in bad_option[1]
    assert good == ("ok", True)


# -- a source that changes between rank 0's check and its send --------------------------------------------
class _ReadsFileEachTime(dict):
    """A lazy state dict over a safetensors file, reading the file again at each lookup (as accelerate's
    offloaded-weights loader does). ``replace_after``: after that many lookups another writer replaces the
    file (renamed into place: the new file, whole) with ``later``."""

    def __init__(self, path, keys, later, replace_after):
        super().__init__(dict.fromkeys(keys))
        self.path, self.later, self.replace_after, self.lookups = path, later, replace_after, 0

    def __getitem__(self, key):
        self.lookups += 1
        with safe_open(self.path, framework="pt") as f:
            tensor = f.get_tensor(key)
        if self.lookups == self.replace_after:
            safetensors.torch.save_file(self.later, self.path + ".new")
            os.replace(self.path + ".new", self.path)
        return tensor

    def __contains__(self, key):
        return dict.__contains__(self, key) and self[key] is not None


FIRST = torch.arange(48.0).view(8, 6)
LATER = {"wider": FIRST.double(), "grown": -torch.arange(96.0).view(16, 6), "int": FIRST.int()}


def _changing_source(rank, world, folder):
    entries = {"w": ST.from_rank_offsets("w", _meta((8 // world, 6)), (0, rank, world))}
    outcomes = []
    for case, later in LATER.items():
        for after in range(1, 6):  # wherever the lookup that sees the new file falls
            source = None
            if rank == 0:
                path = os.path.join(folder, f"{case}{after}.safetensors")
                safetensors.torch.save_file({"w": FIRST}, path)
                source = _ReadsFileEachTime(path, ["w"], {"w": later}, after)
            outcome = _outcome(lambda: _ingest(rank, source, entries, bucket_bytes=1)["w"])
            if outcome[0] == "ok":  # loaded: exactly the version checked, never a cut of another
                outcome = ("ok", torch.equal(outcome[1], FIRST.chunk(world)[rank]))
            outcomes.append((case, after, outcome))
            if outcome[0] == "CollectiveError":
                return outcomes
    return outcomes


def test_a_source_changed_after_rank0_checked_it_fails_every_rank_alike(tmp_path):
    per_rank = run_distributed(_changing_source, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)  # old: SIGABRT
    assert len(per_rank[0]) == 3 * 5, per_rank
    for (case, after, mine), (_, _, theirs) in zip(*per_rank):
        assert mine == theirs or (mine[0] == "ok" and theirs[0] == "ok"), (case, after, mine, theirs)
        assert mine[1] is True if mine[0] == "ok" else "'w'" in mine[1], (case, after, mine)  # old: grown cut
        assert mine[0] in ("ok", "ShardingError", "CheckpointingError"), (case, after, mine)
    assert {o[0] for _, _, o in per_rank[0]} >= {"ok", "CheckpointingError"}  # both sides of the change seen


# -- DistModule: refused before anything is loaded ---------------------------------------------------------
class _WithExtraState(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4))

    def get_extra_state(self):
        return {"step": 3}

    def set_extra_state(self, state):
        self.state = state


class _FlatEntry(nn.Module):
    """Describes ``b`` as a flattened range: a shard of shape (6,) for a (2, 3) parameter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4))
        self.b = nn.Parameter(torch.zeros(2, 3))

    def sharded_state_dict(self):
        return {"a": ST.from_rank_offsets("a", self.a),
                "b": ST.from_rank_offsets_flat("b", torch.zeros(6), (2, 3), flattened_range=slice(0, 6))}


def _module_refused(rank, world):
    outcomes = []
    for module, full in ((_WithExtraState(), {"a": torch.ones(4)}),
                         (_FlatEntry(), {"a": torch.ones(4), "b": torch.ones(2, 3)})):
        before = {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
        try:
            DistModule(module).load_state_dict(full if rank == 0 else {})
            outcome = ("ok", "")
        except Exception as e:  # old: torch's RuntimeError, after the load
            outcome = (type(e).__name__, str(e))
        after = {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
        outcomes.append((outcome, all(torch.equal(after[k], v) for k, v in before.items())))
    return outcomes


def test_distmodule_refuses_before_loading_anything():
    per_rank = run_distributed(_module_refused, 2, timeout_s=GROUP_TIMEOUT_S)
    assert per_rank[0] == per_rank[1], per_rank
    (extra, extra_untouched), (flat, flat_untouched) = per_rank[0]
    assert extra_untouched and flat_untouched, per_rank[0]  # old: 'a' already overwritten with ones
    assert extra[0] == "MissingKeysError" and "'_extra_state'" in extra[1] and "strict=False" in extra[1], extra
    assert flat[0] == "ShardingError" and "'b' has shape (2, 3)" in flat[1] and "(6,)" in flat[1], flat


# -- tied weights ------------------------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


def _tied(rank, world, paths):
    out = []
    for path in paths:
        with torch.device("meta"):
            model = _Tied()
        result = DistModule(model).load_state_dict(load_state_dict(path), strict=False, assign=True)
        out.append((list(result.missing_keys), model.head.weight.device.type,
                    model.head.weight.data_ptr() == model.embed.weight.data_ptr(),
                    torch.equal(model.embed.weight.detach(), torch.load(paths[0])["embed.weight"])))
    return out


def test_tied_weights_stay_one_tensor(tmp_path):
    source = _Tied()
    both = str(tmp_path / "both.pt")
    torch.save(source.state_dict(), both)  # both names, one storage
    once = str(tmp_path / "once.safetensors")
    safetensors.torch.save_model(source, once)  # the tensor once (as Hugging Face saves a tied embedding)
    assert list(safetensors.torch.load_file(once)) == ["embed.weight"]
    for rank_result in run_distributed(_tied, 2, [both, once], timeout_s=GROUP_TIMEOUT_S):
        # old: two storages for the torch file; the head left on the meta device for the safetensors file
        assert rank_result == [([], "cpu", True, True)] * 2, rank_result


# -- found sound: dtypes, zero-size tensors, templates that differ between ranks ---------------------------
def _kinds():
    g = torch.Generator().manual_seed(0)
    return {"f8": torch.randn(8, 4, generator=g).to(torch.float8_e4m3fn),
            "f8b": torch.randn(8, 4, generator=g).to(torch.float8_e5m2),
            "bf": torch.randn(8, 4, generator=g).to(torch.bfloat16),
            "cx": torch.randn(8, 4, dtype=torch.complex64, generator=g),
            "empty_rows": torch.empty(0, 4), "empty_cols": torch.empty(8, 0),
            "mask": torch.rand(8, 4, generator=g) > 0.5, "u8": torch.arange(32, dtype=torch.uint8).view(8, 4)}


def _bits(t):
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _kinds_and_templates(rank, world, paths):
    full = _kinds()
    rows = lambda k, dtype: ST.from_rank_offsets(k, _meta((8 // world, 4), dtype), (0, rank, world))  # noqa: E731
    entries = {"f8": rows("f8", torch.float32), "bf": rows("bf", torch.float8_e4m3fn), "mask": rows("mask", torch.bool),
               "u8": rows("u8", torch.int64),
               "f8b": ST.from_rank_offsets("f8b", _meta((8, 4 // world), torch.float8_e5m2), (1, rank, world)),
               "cx": ST.from_rank_offsets("cx", _meta((8, 4 // world), torch.complex128), (1, rank, world)),
               "empty_rows": ST.from_rank_offsets("empty_rows", _meta((0, 4 // world)), (1, rank, world)),
               "empty_cols": ST.from_rank_offsets("empty_cols", _meta((8 // world, 0)), (0, rank, world))}
    if rank == 1:  # a key only this rank asks for
        entries["whole_u8"] = ST.from_rank_offsets("u8", _meta((8, 4), torch.uint8), replica_id=1)
    want = {"f8": full["f8"].float(), "bf": full["bf"].to(torch.float8_e4m3fn), "mask": full["mask"],
            "u8": full["u8"].long()}
    want = {k: v.chunk(world, 0)[rank] for k, v in want.items()}
    want.update({"f8b": full["f8b"].chunk(world, 1)[rank], "cx": full["cx"].to(torch.complex128).chunk(world, 1)[rank],
                 "empty_rows": torch.empty(0, 4 // world), "empty_cols": torch.empty(8 // world, 0)})
    if rank == 1:
        want["whole_u8"] = full["u8"]
    exact = []
    for path in paths:
        out = _ingest(rank, load_state_dict(path), entries, bucket_bytes=64)
        exact.append(sorted(out) == sorted(want) and all(
            out[k].dtype == v.dtype and torch.equal(_bits(out[k]), _bits(v)) for k, v in want.items()))
    local = (4 if rank == 0 else 2, 4)  # rank 1 describes a global shape of (4, 4)
    other_shape = {"bf": ST.from_rank_offsets("bf", _meta(local, torch.bfloat16), (0, rank, world))}
    return exact, _outcome(lambda: _ingest(rank, load_state_dict(paths[0]), other_shape))


def test_dtypes_zero_size_and_differing_templates(tmp_path):
    paths = [str(tmp_path / "k.safetensors"), str(tmp_path / "k.pt")]
    safetensors.torch.save_file(_kinds(), paths[0])
    torch.save(_kinds(), paths[1])
    per_rank = run_distributed(_kinds_and_templates, 2, paths, timeout_s=GROUP_TIMEOUT_S)
    assert [exact for exact, _ in per_rank] == [[True, True]] * 2
    assert per_rank[0][1] == per_rank[1][1] and per_rank[0][1][0] == "ShardingError"
    assert "'bf' has shape (8, 4) but rank 1's entry 'bf' describes a global shape (4, 4)" in per_rank[0][1][1]


# -- found sound: the inference loader ---------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.conv = nn.Conv2d(3, 4, 3)


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_inference_loader_fills_non_contiguous_parameters_and_fails_untouched(tmp_path, suffix):
    state = {k: v.detach().clone() for k, v in _Net().state_dict().items()}
    save = torch.save if suffix == "pt" else safetensors.torch.save_file
    good, bad = str(tmp_path / f"good.{suffix}"), str(tmp_path / f"bad.{suffix}")
    save(state, good)
    save({**state, "conv.bias": torch.ones(5)}, bad)
    module = _Net().to(memory_format=torch.channels_last)
    module.fc.weight = nn.Parameter(torch.zeros(4, 4).t())  # a transposed view
    assert not module.conv.weight.is_contiguous() and not module.fc.weight.is_contiguous()
    load_module_weights(module, good)
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    assert module.conv.weight.is_contiguous(memory_format=torch.channels_last)
    fresh = _Net()
    before = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ShardingError, match="'conv.bias' has global shape \\(5,\\)"):
        load_module_weights(fresh, bad)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
