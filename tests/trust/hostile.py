"""Shared bounds for the hostile-input suites (tests/trust/): how many hypothesis cases a CI run
tries (derandomised, so CI is repeatable) and how many the ``long`` runs try.

``pytest -m long tests/trust`` runs the long versions; ``LDC_HOSTILE_EXAMPLES=N`` sets their count.
"""

import os
import threading
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import pytest
from hypothesis import HealthCheck, settings

SHORT = settings(max_examples=int(os.environ.get("LDC_HOSTILE_SHORT", "12")), deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
LONG = settings(max_examples=int(os.environ.get("LDC_HOSTILE_EXAMPLES", "500")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def run_bounded(fn: Callable[[], Any], seconds: float = 30.0,
                on_timeout: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """``{"value": fn()}`` or ``{"error": exception}`` (any BaseException: judged by the caller);
    fails the test if ``fn`` is still running after ``seconds`` (a hang), calling ``on_timeout``
    first (e.g. to open a FIFO the blocked thread waits on, so it ends)."""
    out: Dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if on_timeout is not None:
            on_timeout()
            t.join(seconds)
        pytest.fail(f"no answer within {seconds} s")
    return out


def snapshot(root: str, skip: Sequence[str] = ()) -> Dict[str, Tuple[int, int]]:
    """Every file and link under ``root`` outside the folders ``skip``, with its size and mtime:
    compared before and after a case to show nothing outside what it may write changed."""
    found = {}
    for d, dirs, files in os.walk(root):
        if any(d == x or d.startswith(x + os.sep) for x in skip):
            continue
        for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            st = os.lstat(os.path.join(d, f))
            found[os.path.join(d, f)] = (st.st_size, st.st_mtime_ns)
    return found


#: how ``damage_bytes`` changes a file
DAMAGE = ["flip", "zero", "cut", "insert", "delete"]


def damage_bytes(data: bytes, how: str, at: int, span: int, mask: int, extra: bytes) -> bytes:
    """``data`` with a byte flipped (xor ``mask``), ``span`` bytes zeroed or deleted, cut short, or
    ``extra`` inserted, at ``at`` (taken modulo the length)."""
    at = at % (len(data) + 1) if how in ("insert", "cut") else at % max(len(data), 1)
    if how == "flip":
        return data[:at] + bytes([data[at] ^ mask]) + data[at + 1:] if data else data
    if how == "zero":
        return data[:at] + bytes(len(data[at:at + span])) + data[at + span:]
    if how == "cut":
        return data[:at]
    if how == "insert":
        return data[:at] + extra + data[at:]
    return data[:at] + data[at + span:]  # delete


def edit_dcp_metadata(path: str, edit: Callable[[Any], None]) -> None:
    """Apply ``edit`` to the DCP checkpoint ``path``'s ``.metadata`` (a test's own file, unpickled here)."""
    import pickle

    meta_path = os.path.join(path, ".metadata")
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)


def resizable(t: Any) -> bool:
    """Whether the tensor ``t``'s storage can still be resized (as torch's own tensors can): a storage
    a numpy array or a calloc buffer backs is not, and FSDP or ``resize_`` then raise."""
    try:
        t.resize_(t.numel() + 7)
    except RuntimeError as e:
        assert "not resizable" in str(e), e
        return False
    return True
