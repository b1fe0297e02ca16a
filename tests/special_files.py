"""Shared by the special-file and link tests (tests/trust/test_trust_special_files.py, tests/trust/test_trust_links.py,
tests/trust/test_hostile_special_files.py): checkpoints of every format we read, built locally with
the real writers (``ldc.save``, ``torch.save``, safetensors, torch DCP; Megatron-Core's layout by
our exporter, which tests/interop/test_megatron.py checks against megatron-core), a way to put a FIFO, a
socket, a directory or a link in place of one of their files, and the commands run on them.

Run as a script (:class:`Runner`) it reads commands, one JSON line each, runs each in turn in
its process and answers each with one line, so the test that started it bounds each command (no
answer for 60 s: it hangs) and knows which one hung.
"""

import contextlib
import io
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, List, Optional

import torch

import lightning_distckpt as ldc

TESTS = os.path.dirname(os.path.abspath(__file__))
BOUND_S = 60.0  # a command that says nothing for this long hangs (a failure bound, not a timing)
OBJECT = {"note": "kept"}
EPOCH = 3
CHUNK_BYTES = 64 << 10  # w is stored in 5 chunks, b packed
_OUTCOME = "@@outcome "


def full() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 256, generator=g), "b": torch.arange(6, dtype=torch.float32)}


# -- building checkpoints ------------------------------------------------------------------------
def save_ours(path: str, layout: str = "ocdbt") -> str:
    t = full()
    state = {"w": ldc.ShardedTensor.from_rank_offsets("w", t["w"]), "b": ldc.ShardedTensor.from_rank_offsets("b", t["b"]),
             "o": ldc.ShardedObject("o", OBJECT, (1,), (0,)), "epoch": EPOCH}
    ldc.save(state, path, storage=ldc.StorageOptions(layout=layout, chunk_bytes=CHUNK_BYTES))
    return path


def save_torch_file(path: str) -> str:
    torch.save(full(), path)
    return path


def save_safetensors_file(path: str) -> str:
    from safetensors.torch import save_file

    save_file(full(), path)
    return path


def save_hf(path: str, indexed: bool, torch_bin: bool = False) -> str:
    """A Hugging Face model directory: ``model.safetensors`` (or ``pytorch_model.bin``), or two
    shards with ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    os.makedirs(path)
    t = full()
    if torch_bin:
        torch.save(t, os.path.join(path, "pytorch_model.bin"))
    elif not indexed:
        save_file(t, os.path.join(path, "model.safetensors"))
    else:
        names = {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        for key, name in names.items():
            save_file({key: t[key]}, os.path.join(path, name))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": names}, f)
    return path


def save_dcp(path: str) -> str:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # single process, no process group: DCP says so
        warnings.simplefilter("ignore")
        dcp.save(full(), checkpoint_id=path)
    return path


def save_megatron(path: str, scratch: str) -> str:
    ldc.export.to_megatron(save_ours(scratch), path)
    return path


def build(fmt: str, path: str) -> str:
    """A checkpoint of format ``fmt`` at ``path`` (a file for ``torch`` / ``safetensors``)."""
    if fmt in ("ocdbt", "zarr"):
        return save_ours(path, fmt)
    if fmt == "megatron":
        return save_megatron(path, path + ".src")
    return {"torch": save_torch_file, "safetensors": save_safetensors_file, "dcp": save_dcp,
            "hf": lambda p: save_hf(p, False), "hf_index": lambda p: save_hf(p, True),
            "hf_bin": lambda p: save_hf(p, False, torch_bin=True)}[fmt](path)


def data_file(ckpt: str, pattern: str) -> str:
    """The largest file under ``ckpt/data/rank_00000`` whose relative path contains ``pattern``."""
    base = os.path.join(ckpt, "data", "rank_00000")
    found = [os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(base) for f in fs]
    found = [r for r in found if pattern in r]
    return max(found, key=lambda r: os.path.getsize(os.path.join(ckpt, r)))


# Files of each format that a reader opens: (format, relative path or a function of the checkpoint).
TARGETS = {
    "ocdbt": ["common.pt", "metadata.json", "COMMITTED", "data/rank_00000/manifest.ocdbt",
              lambda ck: data_file(ck, "/d/")],
    "zarr": [lambda ck: data_file(ck, "t/w/0/c/"), lambda ck: data_file(ck, "p/float32/c/"),
             "data/rank_00000/o/o/0", "data/rank_00000/t/w/0/zarr.json"],
    "torch": [""], "safetensors": [""],  # the file itself
    "hf": ["model.safetensors"], "hf_bin": ["pytorch_model.bin"],
    "hf_index": ["model-00001-of-00002.safetensors", "model.safetensors.index.json"],
    "dcp": [".metadata", "__0_0.distcp"],
    "megatron": ["common.pt", "metadata.json", ".metadata", "__0_1.distcp"],
}


def target_paths(fmt: str, ckpt: str) -> List[str]:
    return [os.path.join(ckpt, t(ckpt) if callable(t) else t) if t != "" else ckpt for t in TARGETS[fmt]]


# -- special files -------------------------------------------------------------------------------
def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def make_special(path: str, kind: str, link_to: Optional[str] = None) -> None:
    """Replace ``path`` by a FIFO, a Unix socket, an empty directory or a link to ``link_to``."""
    _remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # bound under a short name (AF_UNIX paths are short), then moved in place
        short = tempfile.mkdtemp(prefix="ldc-sock-")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.path.join(short, "s"))  # the socket file stays after close; nobody listens
            os.rename(os.path.join(short, "s"), path)
        finally:
            sock.close()
            shutil.rmtree(short)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "link":
        os.symlink(link_to, path)
    else:
        raise ValueError(kind)


def unblock_fifos(root: str) -> None:
    """Open every FIFO under ``root`` for writing and close it: a reader blocked on one (the bug
    these tests look for) then sees end of file, so a hung thread can finish."""
    import stat

    for d, dirs, files in os.walk(root):
        for name in files + dirs:
            p = os.path.join(d, name)
            try:
                if stat.S_ISFIFO(os.lstat(p).st_mode):
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader waiting


# -- commands ------------------------------------------------------------------------------------
def template(fmt: str) -> Dict[str, Any]:
    t = {k: ldc.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in full().items()}
    if fmt in ("ocdbt", "zarr", "megatron"):
        t["o"] = ldc.ShardedObject("o", None, (1,), (0,))
    return t


def check_loaded(fmt: str, out: Dict[str, Any]) -> Optional[str]:
    """None when ``out`` holds exactly what was saved, else what differs."""
    want = full()
    for key, value in want.items():
        if not torch.equal(out[key], value):
            return f"{key} differs"
    if fmt in ("ocdbt", "zarr", "megatron") and (out.get("o") != OBJECT or out.get("epoch") != EPOCH):
        return f"object / common state differ: {out.get('o')!r}, {out.get('epoch')!r}"
    return None


def run_one(cmd: Dict[str, Any]) -> Dict[str, Any]:
    """Run one command here: ``{"op": "load", "fmt", "path"}``, ``{"op": "cli", "argv"}`` or
    ``{"op": "save", "path"}``. The outcome: ``ok`` (and ``exact`` for loads) or the error's
    type, whether it is a CheckpointingError, and its message."""
    err = io.StringIO()
    try:
        if cmd["op"] == "load":
            bad = check_loaded(cmd["fmt"], ldc.load(template(cmd["fmt"]), cmd["path"]))
            return {"ok": bad is None, "exact": bad is None, "detail": bad}
        if cmd["op"] == "save":
            save_ours(cmd["path"])
            return {"ok": True}
        from lightning_distckpt.cli.main import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(cmd["argv"])
        return {"ok": rc == 0, "rc": rc, "message": err.getvalue()[-2000:], "stdout": out.getvalue()[-4000:]}
    except ldc.CheckpointingError as e:
        return {"ok": False, "error": type(e).__name__, "checkpointing_error": True, "message": str(e)[:2000]}
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        return {"ok": False, "error": type(e).__name__, "checkpointing_error": False, "message": str(e)[:2000]}


class Runner:
    """A Python process that runs commands (:func:`run_one`) one at a time, sent as JSON lines on its
    stdin, answering each with a line; imports are paid once for many commands. A command that does
    not answer within ``bound_s`` fails the calling test and the process is killed (the next
    :meth:`run` starts a fresh one)."""

    def __init__(self, bound_s: float = BOUND_S) -> None:
        self.bound_s = bound_s
        self.proc: Optional[subprocess.Popen] = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.said: List[str] = []

    def _start(self) -> subprocess.Popen:
        self.lines = queue.Queue()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=TESTS, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # both read: never full
        lines = self.lines
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True).start()
        return proc

    def run(self, commands: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The outcome of each command, in order."""
        return [self.run_one(c) for c in commands]

    def run_one(self, command: Dict[str, Any]) -> Dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc, self.said = self._start(), []
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        while True:
            try:
                line = self.lines.get(timeout=self.bound_s)
            except queue.Empty:
                self.close()
                raise AssertionError(f"hung: {command} gave no answer in {self.bound_s:.0f} s") from None
            if line is None:
                code = self.close()
                raise AssertionError(f"the runner died (exit {code}) on {command}: {''.join(self.said)[-3000:]}")
            if line.startswith(_OUTCOME):
                return json.loads(line[len(_OUTCOME):])
            self.said.append(line)

    def close(self) -> Optional[int]:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        proc.kill()
        return proc.wait()


def run_bounded(commands: List[Dict[str, Any]], bound_s: float = BOUND_S) -> List[Dict[str, Any]]:
    """:class:`Runner` ``.run`` in a process of its own."""
    runner = Runner(bound_s)
    try:
        return runner.run(commands)
    finally:
        runner.close()


def _main() -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        print(_OUTCOME + json.dumps({**cmd, **run_one(cmd)}), flush=True)


if __name__ == "__main__":
    _main()
