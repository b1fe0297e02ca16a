"""A user's folder to put where a checkpoint of ours was, and a digest to show it was left as it was."""

import hashlib
import os

from lightning_distckpt.storage.layout import COMMIT_MARKER


def users_dir(path) -> str:
    """A user's folder, with a file named like our marker in it (an old removal deleted that one first) and a
    ``data/`` folder of their own."""
    os.makedirs(os.path.join(path, "data"))
    for name, text in [("notes.txt", "mine"), (COMMIT_MARKER, "a user's file"), ("data/x.bin", "12345")]:
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return str(path)


def tree_digest(root) -> dict:
    """Every file under ``root`` (relative path) -> its SHA-256."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out
