"""Run a script's ranks as torchrun would: one process per rank, each with ``LOCAL_RANK``,
``WORLD_SIZE`` and ``MASTER_*`` set, so Lightning and Fabric see processes created externally and
launch nothing themselves.

The processes are forked from the test suite's fork server (``dist_utils``), which imported torch,
Lightning and this package once. A fresh interpreter pays ~5 s of imports on this machine, and
Lightning's own launcher starts rank 1 only after rank 0 finished importing, so a 2-rank Trainer
run used to spend most of its time importing. The script itself runs unchanged, as ``__main__``
with its own ``sys.argv`` and ``sys.path[0]``; its stdout and stderr go to a log file each.
``LDC_TEST_SCRIPT_LAUNCH=subprocess`` runs ``python SCRIPT`` instead (Lightning's own launcher).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Dict, List, Optional, Tuple

from dist_utils import free_port, fork_server_context

LAUNCH_ENV = "LDC_TEST_SCRIPT_LAUNCH"
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK")


def script_env() -> Dict[str, str]:
    """This process's environment for a script's ranks: one thread each, Python's warnings off, and
    no launcher variables inherited (run_ranks sets its own)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in LAUNCHER_VARS:
        env.pop(var, None)
    return env


def _rank_main(script: str, argv: List[str], environ: Dict[str, str], cwd: str, log: str) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the fork server's environment and directory are the ones it started with
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)  # a rank dying of a signal (native code) shows its stacks in its log
    if environ.get("PYTHONWARNINGS") == "ignore":  # read at interpreter start, which this process skipped
        warnings.simplefilter("ignore")
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` would
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: late teardown of C++ worker threads (gloo's, tensorstore's)
    # occasionally aborts a process whose work is done (see dist_utils._worker).
    os._exit(code)


def start_script(script: str, argv: List[str], environ: Dict[str, str], log: str,
                 cwd: Optional[str] = None) -> multiprocessing.process.BaseProcess:
    """Start ``python script argv`` with exactly ``environ``, forked from the fork server; its
    stdout and stderr go to ``log``. Its ``exitcode`` is the script's, or minus the signal that
    ended it."""
    p = fork_server_context().Process(target=_rank_main, args=(script, argv, environ, cwd or os.getcwd(), log))
    p.start()
    return p


def stop_all(procs: List[multiprocessing.process.BaseProcess]) -> None:
    """SIGKILL those of ``procs`` still running (a hang, or the rest of a job that lost a rank), reap all."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and was reaped) since is_alive() asked
                pass
    for p in procs:
        p.join()


def read_log(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def run_ranks(script: str, argv: List[str], environ: Dict[str, str], world_size: int, timeout: float,
              cwd: Optional[str] = None) -> Tuple[int, str]:
    """Run ``script argv`` on ``world_size`` ranks in ``cwd`` (default: this process's); returns (the
    first non-zero exit code or 0, every rank's output). A rank that fails leaves the others to
    notice it through the scripts' own collective timeouts; ``timeout`` bounds a hang, it is no
    schedule."""
    cwd = cwd or os.getcwd()
    if os.environ.get(LAUNCH_ENV) == "subprocess":
        return _run_subprocess(script, argv, environ, timeout, cwd)
    inherited = {k: v for k, v in environ.items() if k not in LAUNCHER_VARS}  # never a port picked for another run
    env = {**inherited, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world_size), "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(world_size)}
    logdir = tempfile.mkdtemp(prefix="script_ranks_")
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(world_size)]
    procs = [start_script(script, argv, {**env, "LOCAL_RANK": str(r)}, logs[r], cwd) for r in range(world_size)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        stop_all(procs)
    codes = [p.exitcode for p in procs]
    code = next((c for c in codes if c != 0), 0)
    output = "\n".join(f"--- rank {r} (exit {c}) ---\n{read_log(logs[r])}" for r, c in enumerate(codes))
    shutil.rmtree(logdir, ignore_errors=True)
    return code, output


def outcome(call) -> dict:
    """In a rank script: ``{"type": None, **what call() returned}``, or the error it raised (type and message)."""
    try:
        got = call()
        return {"type": None, **(got or {})}
    except Exception as e:  # the outcome under test
        return {"type": type(e).__name__, "message": str(e)}


def write_outcomes(out: str, res: dict) -> None:
    """In a rank script: this rank's outcomes where :func:`agreed_outcomes` reads them."""
    import json

    with open(out + ".rank" + os.environ["LOCAL_RANK"] + ".json", "w") as f:
        json.dump(res, f)


def agreed_outcomes(root: str, text: str, *argv: str) -> dict:
    """Write ``text`` as a script in ``root`` and run it on 2 ranks with ``root`` and an output prefix (then
    ``argv``); each rank writes ``<out>.rank<LOCAL_RANK>.json`` (:func:`write_outcomes`; the script imports
    ``tests/`` modules). Returns rank 0's outcomes, checked to equal rank 1's (what a test of an agreed error
    or restore asks)."""
    import json

    script, out = os.path.join(root, "runs.py"), os.path.join(root, "out")
    with open(script, "w") as f:
        f.write(text)
    env = script_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                      env.get("PYTHONPATH")]))
    code, output = run_ranks(script, [root, out, *argv], env, 2, 600)
    assert code == 0, output[-8000:]
    ranks = []
    for rank in range(2):
        with open(f"{out}.rank{rank}.json") as f:
            ranks.append(json.load(f))
    assert ranks[0] == ranks[1], "the ranks' outcomes differ"
    return ranks[0]


def _run_subprocess(script: str, argv: List[str], environ: Dict[str, str], timeout: float,
                    cwd: str) -> Tuple[int, str]:
    proc = subprocess.run([sys.executable, script, *argv], env=environ, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    return proc.returncode, f"{proc.stdout}\n{proc.stderr}"


def script_results(script, *argv, cwd):
    """Run ``python -c script argv...`` in ``cwd`` (one process) and return the JSON of each line it
    prints as ``RESULT {...}``; fails showing its output when it printed none."""
    import json

    r = subprocess.run([sys.executable, "-c", script, *map(str, argv)], capture_output=True, text=True,
                       timeout=300, env=script_env(), cwd=cwd)
    results = [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, r.stdout[-3000:] + r.stderr[-3000:]
    return results
