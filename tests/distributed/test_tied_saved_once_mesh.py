"""Tied weights written once (format 8) on a 2-D mesh of 4 real gloo processes, and read back across world sizes.

Core: TP 2 x DP 2 (rank = 2 * dp + tp), the tied embedding (``model.embed_tokens.weight`` and ``lm_head.weight``,
one memory) row-split over TP and replicated over DP (``replica_id`` = the DP rank), plus an untied ``dense``
column-split over TP. Every rank's shards (main replicas on DP 0, replicas on DP 1) tie alike, so the key is stored
once and recorded in ``aliases``; read back at 4, 2 and 1 ranks with other splits, tied and untied templates,
bit-exact. A layout where one DP replica's head is a clone (untied there) is written twice and reads right.

Lightning: DistCheckpointModelParallelStrategy on a 2-D device mesh (data_parallel 2 x tensor_parallel 2, 4
processes) with the tied module of tests/lightning/test_tied_saved_once_lightning.py (its embedding 1024 x 64 fp32:
128 KiB a TP rank), saved, then resumed at the same mesh (4 processes) and at TP 2 (2 processes).

Hang guard: every group's timeout (GROUP_TIMEOUT_S); a rank left waiting records a CollectiveError, told apart from
the outcomes asserted.
"""

import json
import os

import pytest
import torch

from dist_utils import run_distributed
from tier_parity_scripts import GROUP_TIMEOUT_S

ROWS, COLS = 512, 64  # 128 KiB of fp32; 64 KiB a TP rank: at planning/aliases.TIE_MIN_BYTES, so looked at
EMB, HEAD, DENSE = "model.embed_tokens.weight", "lm_head.weight", "dense.weight"


def _values(shape=(ROWS, COLS), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _dense():
    return _values((COLS, 96), seed=1)


def _mesh_state(ldc, rank, untied_dp=None, emb=None, dense=None):
    """Rank ``rank`` of TP 2 x DP 2: the embedding's TP rows (replica ``dp``), the head its very memory (but on DP
    rank ``untied_dp``: a clone, negated, so a read served from the embedding would come back wrong), and
    ``dense``'s TP columns."""
    tp, dp = rank % 2, rank // 2
    emb = _values() if emb is None else emb
    dense = _dense() if dense is None else dense
    local = emb.chunk(2, 0)[tp].contiguous()
    head = -local if dp == untied_dp else local
    cols = dense.chunk(2, 1)[tp].contiguous()
    return {
        EMB: ldc.ShardedTensor.from_rank_offsets(EMB, local, (0, tp, 2), replica_id=dp),
        HEAD: ldc.ShardedTensor.from_rank_offsets(HEAD, head, (0, tp, 2), replica_id=dp),
        DENSE: ldc.ShardedTensor.from_rank_offsets(DENSE, cols, (1, tp, 2), replica_id=dp),
    }


def _meta(ck):
    with open(os.path.join(ck, "metadata.json")) as f:
        return json.load(f)


def _stored_bytes(ck):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ck, "data")) for f in fs)


def _save_mesh(rank, world, ck, untied_dp):
    """Save at TP 2 x DP 2; this rank's local ties (what its records carry)."""
    import lightning_distckpt as ldc
    from lightning_distckpt.planning.aliases import local_ties

    state = _mesh_state(ldc, rank, untied_dp)
    tensors = [state[k] for k in (EMB, HEAD, DENSE)]
    ties = {tensors[i].key: key for i, key in local_ties(tensors).items()}
    ldc.save(state, ck)
    return ties


def _read_split(ldc, ck, rank, world, split, tied, neg_head):
    """Read ``ck`` with this rank's piece of the embedding and head (``split``: (dim, parts) over ``world`` ranks) and
    the whole of ``dense``; whether all came back bit-exact and the template's tie (or its absence) kept."""
    dim, parts = split
    emb, want_dense = _values(), _dense()
    piece = rank % parts
    mine = emb.chunk(parts, dim)[piece]
    zeros = torch.zeros_like(mine).contiguous()
    head = zeros if tied else zeros.clone()
    tpl = {EMB: ldc.ShardedTensor.from_rank_offsets(EMB, zeros, (dim, piece, parts), replica_id=rank // parts),
           HEAD: ldc.ShardedTensor.from_rank_offsets(HEAD, head, (dim, piece, parts), replica_id=rank // parts),
           DENSE: ldc.ShardedTensor.from_rank_offsets(DENSE, torch.zeros_like(want_dense), replica_id=rank)}
    got = ldc.load(tpl, ck, strict="raise_all")
    a, b = got[EMB], got[HEAD]
    want_head = -mine if neg_head and not tied else mine
    return (torch.equal(a, mine) and torch.equal(b, want_head) and torch.equal(got[DENSE], want_dense)
            and (a.data_ptr() == b.data_ptr()) == tied)


def _read_back(rank, world, ck, splits, neg_head):
    import lightning_distckpt as ldc

    out = {}
    for split in splits:
        for tied in (True, False) if not neg_head else (False,):  # a tied template can hold one value only
            out[f"{split} tied={tied}"] = _read_split(ldc, ck, rank, world, split, tied, neg_head)
    return out


def test_tp2_dp2_stores_the_tie_once_and_reads_at_4_2_1_ranks(tmp_path):
    """The default 4-process case: every rank (main replicas and replicas) ties alike, the alias is recorded, its
    bytes stored once; 4 ranks (rows by 4, columns by 2 x 2 replicas), 2 ranks (columns), 1 process read it."""
    import lightning_distckpt as ldc

    ck = str(tmp_path / "ck")
    ties = run_distributed(_save_mesh, 4, ck, None, timeout_s=GROUP_TIMEOUT_S)
    assert ties == [{EMB: HEAD}] * 4, ties  # every rank's records carry the same tie (to the smaller key)
    meta = _meta(ck)
    assert meta["format_version"] == 8
    assert meta["aliases"] == {EMB: {"target": HEAD, "global_shape": [ROWS, COLS], "dtype": "float32"}}
    assert EMB not in meta["tensors"] and HEAD in meta["tensors"] and DENSE in meta["tensors"]
    stored = _stored_bytes(ck)
    once = (ROWS * COLS + COLS * 96) * 4
    assert once * 0.95 <= stored < once + ROWS * COLS * 4 * 0.5, (stored, once)  # the embedding's bytes once
    four = run_distributed(_read_back, 4, ck, [(0, 4), (1, 2)], False, timeout_s=GROUP_TIMEOUT_S)
    assert all(all(r.values()) for r in four), four
    two = run_distributed(_read_back, 2, ck, [(1, 2), (0, 1)], False, timeout_s=GROUP_TIMEOUT_S)
    assert all(all(r.values()) for r in two), two
    assert all(_read_back(0, 1, ck, [(0, 1)], False).values())
    assert torch.equal(ldc.load_plain_tensors(ck)[EMB], _values())
    assert ldc.validate(ck).problems == []


@pytest.mark.long
@pytest.mark.parametrize("untied_dp", [0, 1])
def test_one_dp_replica_untied_is_written_twice(tmp_path, untied_dp):
    """One DP replica's head is its own tensor (negated): ranks disagree, so the head is stored as itself. Untied on
    DP 0 (the main replicas): the head stored is the negated one, and reads back so; untied on DP 1 (replicas,
    never written): the head stored is DP 0's, the embedding's values."""
    ck = str(tmp_path / "ck")
    ties = run_distributed(_save_mesh, 4, ck, untied_dp, timeout_s=GROUP_TIMEOUT_S)
    assert [bool(t) for t in ties] == [r // 2 != untied_dp for r in range(4)], ties
    meta = _meta(ck)
    assert "aliases" not in meta and meta["format_version"] == 7 and EMB in meta["tensors"]
    assert _stored_bytes(ck) >= (2 * ROWS * COLS + COLS * 96) * 4 * 0.95
    neg = untied_dp == 0
    for world, splits in ((4, [(0, 4)]), (2, [(1, 2)])):
        got = run_distributed(_read_back, world, ck, splits, neg, timeout_s=GROUP_TIMEOUT_S)
        assert all(all(r.values()) for r in got), (world, got)
    assert all(_read_back(0, 1, ck, [(0, 1)], neg).values())


def _lightning_script():
    """tests/lightning/test_tied_saved_once_lightning.py's rank script (its ``Tied`` module and helpers) without its
    scenarios, its Trainer on ``WORLD`` devices, and this file's scenarios."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning",
                        "test_tied_saved_once_lightning.py")
    spec = importlib.util.spec_from_file_location("tied_saved_once_lightning", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    head = mod.RANKS.split('\nif SCENARIO == "ddp":')[0]
    assert "class Tied(" in head and "def trainer(" in head
    return head + LIGHTNING_SCENARIOS


LIGHTNING_SCENARIOS = r"""
WORLD = int(os.environ["WORLD_SIZE"])


def trainer(strategy, steps, seen=None, **kw):  # the script's Trainer, on every process of this run
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                      callbacks=[seen] if seen else [], enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                      default_root_dir=folder, **kw)


def save_on_mesh(path):
    '''train_and_save at data_parallel 2 x tensor_parallel 2, with the mesh the embedding is on and whether this
    rank's bytes of it reach planning/aliases.TIE_MIN_BYTES (so the tie is looked for on every rank).'''
    from torch.distributed.tensor import DTensor

    from lightning_distckpt.planning.aliases import TIE_MIN_BYTES

    t, model = trainer(mp(2, 2)(), 2), Tied()
    t.fit(model)
    w = model.emb.weight
    local = w.to_local() if isinstance(w, DTensor) else w
    mesh = {"world": t.world_size, "placements": [str(p) for p in getattr(w, "placements", ())],
            "enough": local.nbytes >= TIE_MIN_BYTES}
    t.save_checkpoint(path)
    return {"end": state(t, model), "meta": meta(path), "mesh": mesh}


ck = os.path.join(folder, "dp2tp2")
if SCENARIO == "mesh":
    record("dp2tp2 save", lambda: save_on_mesh(ck))
    record("dp2tp2 into dp2tp2", lambda: resume(mp(2, 2), ck))
elif SCENARIO == "tp2":
    record("dp2tp2 into tp2", lambda: resume(mp(1, 2), ck))
"""


def _run_script(tmp_path, world, scenario):
    """The rank script on ``world`` processes in ``tmp_path`` (its ``ck`` kept between runs); every rank's results."""
    from script_ranks import run_ranks, script_env
    from tier_parity_scripts import AGREED, script_preamble

    path = tmp_path / "ranks.py"
    path.write_text(script_preamble() + _lightning_script())
    (tmp_path / "ck").mkdir(exist_ok=True)
    out = tmp_path / f"out_{scenario}"
    code, output = run_ranks(str(path), [str(tmp_path / "ck"), str(out), scenario], script_env(), world,
                             timeout=300)
    results = []
    for rank in range(world):
        res = tmp_path / f"out_{scenario}.rank{rank}.json"
        assert res.is_file(), f"rank {rank} wrote no results (exit {code}):\n{output[-6000:]}"
        results.append(json.loads(res.read_text()))
    assert code == 0, output[-6000:]
    for res in results:
        for name, (kind, got) in res.items():
            assert kind in AGREED and kind == "ok", (name, kind, got)
    return results


def _same(got, want):
    return got["tie"] and all(got[k] == want[k] for k in ("emb", "head", "exp_avg", "exp_avg_sq", "norm"))


def test_lightning_dp2_tp2_mesh_stores_the_tie_once_and_resumes_at_the_mesh_and_at_tp2(tmp_path):
    """Also the 2-D mesh itself: the LayerNorm, left out of TP, is FSDP2-sharded over the data_parallel sub-mesh
    only; each TP rank's sub-mesh held it as main and the save was refused (model_parallel.on_sub_mesh)."""
    mesh = _run_script(tmp_path, 4, "mesh")
    for r in mesh:
        saved = r["dp2tp2 save"][1]
        assert saved["mesh"]["world"] == 4 and len(saved["mesh"]["placements"]) == 2, saved["mesh"]
        assert saved["mesh"]["enough"], saved["mesh"]
        assert saved["meta"] == {"format": 8, "aliases": {"state_dict/head.weight": "state_dict/emb.weight"}}
        back = r["dp2tp2 into dp2tp2"][1]
        assert _same(back, saved["end"]) and back["states"] == 3 and back["step"] == 2, (back, saved["end"])
    for key in mesh[0]:
        assert all(r[key] == mesh[0][key] for r in mesh), key
    tp2 = _run_script(tmp_path, 2, "tp2")
    want = mesh[0]["dp2tp2 save"][1]["end"]
    for r in tp2:
        back = r["dp2tp2 into tp2"][1]
        assert _same(back, want) and back["states"] == 3 and back["step"] == 2, (back, want)
