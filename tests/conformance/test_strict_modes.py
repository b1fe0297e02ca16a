"""Every ``StrictHandling`` mode against megatron-core's own ``dist_checkpointing.load``, side by
side on 2 gloo processes, on a checkpoint megatron-core wrote: which keys are missing and which
unexpected, whether the load raises, logs or returns them, and the returned sets' positions.

A difference is a failing test, except the deliberate ones (docs/interop.md), which are asserted
as such: a key asked for but absent keeps its template value in our result (megatron-core drops
it); a raise happens on every rank, also where only another rank asked for an absent key
(megatron-core raises on that rank alone and leaves the others waiting in the load's collectives,
so that case is run with the non-raising modes only on its side).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

import pytest

import lightning_distckpt as ldc
from dist_utils import run_distributed

from .megatron_side import CURRENT, STORED, cpu_only_megatron, normal, outcome, template

pytest.importorskip("megatron.core.dist_checkpointing")

WORLD = 2
# Each scenario: the keys each rank asks for (``c`` is not in the checkpoint).
SCENARIOS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "exact": (STORED, STORED),
    "left_out": (("w", "b", "r"), ("w", "b", "r")),  # layers.w and obj saved, asked for by no rank
    "extra": (STORED + ("c",), STORED + ("c",)),
    "both": (("w", "obj", "c"), ("w", "obj", "c")),
    "split_asks": (("w", "r", "obj"), ("b", "layers.w", "obj")),  # each saved key asked by some rank
    "extra_on_rank0": (STORED + ("c",), STORED),  # megatron-core raises on rank 0 alone
}
RAISING = ("assume_ok_unexpected", "raise_unexpected", "raise_all")
MODES = [m.value for m in ldc.StrictHandling]


def _replica(keys_of_ranks: Tuple[Tuple[str, ...], ...], key: str, rank: int) -> int:
    """The replica id of ``key`` on ``rank``: 0 (main) on the first rank asking for it."""
    first = next(r for r, keys in enumerate(keys_of_ranks) if key in keys)
    return 0 if rank == first else rank


def _templates(mod: Any, scenario: str, rank: int) -> Dict[str, Any]:
    """One main replica per tensor over the ranks: megatron-core checks the access integrity."""
    asked = SCENARIOS[scenario]
    return template(mod, asked[rank], rank, WORLD, lambda key: _replica(asked, key, rank))


def _compare(rank: int, world: int) -> Tuple[List[str], Dict[Tuple[str, str], Any]]:
    """Both libraries load every scenario under every mode; returns the differences found and
    megatron-core's outcomes (what the comparison compared with)."""
    cpu_only_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling as MegatronStrict

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    problems: List[str] = []
    seen: Dict[Tuple[str, str], Any] = {}
    for mode in MODES:
        for scenario in SCENARIOS:
            where = f"rank {rank} {mode} {scenario}"
            ours = outcome(lambda: ldc.load(_templates(ldc, scenario, rank), CURRENT, strict=MegatronStrict(mode)),
                           "lightning_distckpt")
            if scenario == "extra_on_rank0" and mode in RAISING:
                # deliberate: every rank raises, naming rank 0's absent key
                if ours.raised is None or "'c'" not in ours.raised:
                    problems.append(f"{where}: ours did not raise on every rank naming 'c': {ours}")
                continue
            theirs = outcome(lambda: dist_checkpointing.load(_templates(dist_checkpointing.mapping, scenario, rank),
                                                             CURRENT, strict=mode), "megatron.core")
            problems += _differences(where, ours, theirs)
            seen[(mode, scenario)] = theirs
    return problems, seen


def _differences(where: str, ours: Any, theirs: Any) -> List[str]:
    """What differs between the two outcomes beyond the deliberate differences."""
    if (ours.raised is None) != (theirs.raised is None):
        return [f"{where}: raised: ours {ours.raised!r}, megatron-core {theirs.raised!r}"]
    if theirs.raised is not None:
        return [f"{where}: megatron-core says {title!r}, ours does not: {ours.raised}"
                for title in ("Unexpected keys", "Missing keys") if title in theirs.raised and title not in ours.raised]
    out = []
    for field in ("returned", "logged_missing", "logged_unexpected"):
        if getattr(ours, field) != getattr(theirs, field):
            out.append(f"{where}: {field}: ours {getattr(ours, field)}, megatron-core {getattr(theirs, field)}")
    # deliberate: an absent key asked for stays in our result, with its template value
    if theirs.result_keys is not None and not theirs.result_keys <= ours.result_keys:
        out.append(f"{where}: result keys: ours {ours.result_keys}, megatron-core {theirs.result_keys}")
    elif theirs.result_keys is not None and not (ours.result_keys - theirs.result_keys) <= {"c"}:
        out.append(f"{where}: our result has more than the absent key: {ours.result_keys - theirs.result_keys}")
    return out


def test_every_mode_as_megatron_core_does():
    (problems0, seen0), (problems1, seen1) = run_distributed(_compare, WORLD, timeout_s=300)
    assert problems0 + problems1 == [], "\n".join(problems0 + problems1)
    # what was compared: megatron-core's meaning of the words, on each rank
    both_missing, both_unexpected = {"b", "r", "layers.w"}, {"c"}
    for seen in (seen0, seen1):
        assert seen[("return_all", "both")].returned == (both_missing, both_unexpected)
        assert seen[("return_unexpected", "both")].returned == (set(), both_unexpected)
        assert seen[("log_all", "both")][2:4] == (both_missing, both_unexpected)
        assert seen[("log_unexpected", "left_out")][2:4] == (None, None)  # missing keys not looked for
        assert seen[("raise_unexpected", "left_out")].raised is None
        assert seen[("raise_all", "left_out")].raised is not None
        assert seen[("return_all", "split_asks")].returned == (set(), set())
    assert seen0[("return_all", "extra_on_rank0")].returned == (set(), {"c"})
    assert seen1[("return_all", "extra_on_rank0")].returned == (set(), set())  # each rank its own


def test_mode_table_matches_megatron_core():
    """Names, values and what each mode looks for, returns or skips: megatron-core's own
    classification (``StrictHandling.requires_*``), no process needed."""
    from megatron.core.dist_checkpointing.validation import StrictHandling as M

    assert [(m.name, m.value) for m in ldc.StrictHandling] == [(m.name, m.value) for m in M]
    for theirs in M:
        ours = ldc.StrictHandling.parse(theirs)  # megatron-core's member is accepted as it is
        assert ours.value == theirs.value
        assert ours.returns_keys == M.requires_returning_mismatch_keys(theirs)
        # megatron-core gathers every rank's keys for IGNORE_ALL too, then drops what it found
        assert ours.needs_missing == (M.requires_global_app_metadata(theirs) and theirs is not M.IGNORE_ALL)


@pytest.mark.parametrize("missing,unexpected", [({"b"}, set()), (set(), {"c"}), ({"b", "x"}, {"c"})])
def test_mismatch_message_uses_megatron_core_words(missing, unexpected):
    """Megatron-Core's ``maybe_report_missing_and_unexpected_keys`` beside ours: the same titles and
    labels; ours lists each set sorted."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import maybe_report_missing_and_unexpected_keys

    from lightning_distckpt.core.strict import mismatch_message

    with pytest.raises(CheckpointingException) as theirs:
        maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=True)
    assert normal(mismatch_message(missing, unexpected, "for this rank")) == normal(str(theirs.value))


@pytest.mark.parametrize("loader", ["every_rank", "parallel", "two_stage"])
def test_absent_keys_are_skipped_by_every_loader(tmp_path, loader):
    """A tensor and an object the checkpoint lacks: skipped by each loader (template values kept),
    returned as this rank's unexpected keys; the saved key asked for by nobody is missing."""
    import torch

    ldc.save({"a": ldc.ShardedTensor.from_rank_offsets("a", torch.arange(4.0)),
              "b": ldc.ShardedTensor.from_rank_offsets("b", torch.ones(2))}, tmp_path / "ck")
    template = {"a": ldc.ShardedTensor.from_rank_offsets("a", torch.zeros(4)),
                "c": ldc.ShardedTensor.from_rank_offsets("c", torch.full((3,), 5.0)),
                "x": ldc.ShardedObject("x", "kept", (1,), (0,), replica_id=0)}
    out, missing, unexpected = ldc.load(template, tmp_path / "ck", strict="return_all", loader=loader)
    assert (missing, unexpected) == ({"b"}, {"c", "x"})
    assert torch.equal(out["a"], torch.arange(4.0)) and torch.equal(out["c"], torch.full((3,), 5.0))
    assert out["x"] == "kept"
