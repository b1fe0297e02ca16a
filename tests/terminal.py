"""Commands run with stderr on a pseudo-terminal, as a person at a shell sees them (a progress bar is
drawn only on a terminal): what stdout received and every byte the terminal received."""

from __future__ import annotations

import os
import subprocess
import threading
from typing import List, Sequence, Tuple


def drain(master: int, into: List[bytes]) -> None:
    """Collect what the terminal shows until its last writer closes it (EIO)."""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the last writer closed it
            return
        if not chunk:
            return
        into.append(chunk)


def run_on_terminal(argv: Sequence[str]) -> Tuple[int, bytes, bytes]:
    """``argv`` run with stderr on a pseudo-terminal, stdout a pipe: exit status, stdout, and every
    byte the terminal received."""
    master, slave = os.openpty()
    proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    seen: List[bytes] = []
    reader = threading.Thread(target=drain, args=(master, seen), daemon=True)
    reader.start()
    try:
        out = proc.communicate(timeout=120)[0]  # a failure bound
        reader.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, out, b"".join(seen)
