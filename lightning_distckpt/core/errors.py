"""Exception hierarchy: every error the library raises derives from ``CheckpointingError``.

Errors that callers may expect as builtins mix the builtin in (``ShardingError`` is a
``ValueError``, ``MissingKeysError`` a ``KeyError``, ...), so ``except ValueError`` keeps working.
An error agreed over ranks (:meth:`lightning_distckpt.comm.Comm.agree`) carries ``failures``:
``{rank: RankFailure}``, the type, message and traceback each failing rank raised.
"""

from __future__ import annotations

import contextlib
import re
import traceback as _traceback
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Type

#: The most characters of a rank's formatted traceback a :class:`RankFailure` keeps (the end:
#: the innermost frames and the error line), so an agreement's all-gather stays small.
TRACEBACK_LIMIT = 4096
#: Where an agreed error's message turns from the one-line-per-failure summary to the remote
#: ranks' tracebacks (:func:`lightning_distckpt.comm.Comm.agree`).
TRACEBACK_SECTION = "\n--- traceback of rank "


@dataclass(frozen=True)
class RankFailure:
    """What one rank raised: the error's class name (one of this module's, or a foreign one), its
    message and its formatted traceback (the last :data:`TRACEBACK_LIMIT` characters; empty when
    not known), as PyTorch DCP's ``CheckpointException`` keeps each rank's traceback."""

    rank: int
    type_name: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"

    @property
    def raised_at(self) -> str:
        """Where the error was raised: the traceback's innermost frame line (``File "...", line
        N, in f``), or "" without a traceback."""
        frames = [ln.strip() for ln in self.traceback.splitlines() if ln.lstrip().startswith('File "')]
        return frames[-1] if frames else ""

    @classmethod
    def of(cls, rank: int, error: BaseException) -> "RankFailure":
        """``error`` as rank ``rank`` reports it. An error already agreed for one rank (re-raised
        through another agreement) keeps that rank's message and traceback, not nested twice."""
        inner = error.failures if isinstance(error, CheckpointingError) else {}
        if len(inner) == 1:
            first = next(iter(inner.values()))
            return cls(rank, type(error).__name__, first.message, first.traceback or _formatted(error))
        return cls(rank, type(error).__name__, str(error).split(TRACEBACK_SECTION, 1)[0], _formatted(error))


def _formatted(error: BaseException) -> str:
    """``error``'s formatted traceback (with its causes), cut to its last TRACEBACK_LIMIT characters."""
    text = "".join(_traceback.format_exception(error))
    if len(text) <= TRACEBACK_LIMIT:
        return text
    return f"[... {len(text) - TRACEBACK_LIMIT} characters cut ...]\n" + text[-TRACEBACK_LIMIT:]


# What tensorstore appends to the message of a failed HTTP request (an S3 object store's): the server's
# answer body (an XML document, whose error for a bad signature holds the access key's id, the string
# signed and the canonical request) and request-id headers. Errors say the status and tensorstore's words.
_HTTP_DETAIL = re.compile(r"\s*\[(?:http_response_body|x-amz[\w-]*)='.*?'\](?=\s|\[|$)", re.S)
_HTTP_STATUS = re.compile(r"\s*\[http_response_code='(\d+)'\]")


def without_http_detail(text: str) -> str:
    """``text`` (an error message, perhaps quoting tensorstore's) without HTTP answer bodies and
    request-id headers; the HTTP status said as ``(HTTP 416)``."""
    if "[http_" not in text and "[x-amz" not in text:
        return text
    return _HTTP_STATUS.sub(r" (HTTP \1)", _HTTP_DETAIL.sub("", text))


class CheckpointingError(Exception):
    """Base class of all errors raised by lightning_distckpt.

    ``failures`` is filled when the error was agreed over ranks: ``{rank: RankFailure}``.
    """

    failures: Dict[int, RankFailure]

    def __init__(self, *args: object) -> None:
        super().__init__(*(without_http_detail(a) if isinstance(a, str) else a for a in args))
        self.failures = {}


class ArgumentError(CheckpointingError, ValueError):
    """An argument of a library call has a value it cannot take."""


class ArgumentTypeError(CheckpointingError, TypeError):
    """An argument of a library call has a type it cannot take."""


class ConfigError(CheckpointingError, ValueError):
    """A configuration (YAML / dict) has unknown keys or values of the wrong type or range."""


class ShardingError(CheckpointingError, ValueError):
    """A sharded state dict entry has inconsistent metadata (shape, offset, dtype, replicas)."""


class ValidationError(CheckpointingError):
    """The ranks' shards do not describe a consistent checkpoint (gaps, overlaps, disagreements)."""


class IncompleteCheckpointError(CheckpointingError, ValueError):
    """The directory holds no committed checkpoint (a save that did not finish, or no checkpoint). A
    ValueError too: Lightning's ModelParallelStrategy (Trainer's and Fabric's) raises ``ValueError`` ("does
    not point to a valid checkpoint") for such a path, and code that resumes under it catches that."""


class CheckpointNotFoundError(IncompleteCheckpointError, FileNotFoundError):
    """Nothing is at the checkpoint path: the directory does not exist. A FileNotFoundError too, as
    Lightning's CheckpointIO contract has it (and a ValueError, as stock ModelParallelStrategy raises for
    it); the message says "does not exist", Megatron-Core's words."""


@contextlib.contextmanager
def naming_file(path: str) -> Iterator[None]:
    """An OSError raised in the block that names no file gets ``path``: a full disk met by a write
    or an fsync on a descriptor says nothing of the file, and a failed save must say which it was."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:  # str(e) names the file only with an errno
            e.filename = path
        raise


def not_found(path: str, detail: str = "no such directory") -> CheckpointNotFoundError:
    """The error for a checkpoint path where there is nothing: ours (``detail``: why, and where a
    good checkpoint is) with Megatron-Core's "does not exist" for scrapers of its logs."""
    return CheckpointNotFoundError(f"checkpoint {path}: {detail} (directory {path} does not exist)")


class FormatError(CheckpointingError):
    """The checkpoint's format or version is unknown, or its metadata is malformed."""


class UnsafeContentError(FormatError):
    """Stored content would need code to run or a type that is not allowed to deserialize."""


def allow_type_advice(name: str) -> str:
    """How a user who trusts a checkpoint allows the refused type ``name``: the argument of our calls, the
    Lightning plugin's and the YAML config's, and torch's process-wide list, which also serves calls without
    such an argument (Megatron-Core-shaped ones)."""
    return (f"If the checkpoint is trusted, allow the type with the extra_safe_globals=[{name}] argument of "
            f"lightning_distckpt.load / load_common_state_dict / DistCheckpointIO(...) (the plugin the Lightning / "
            f"Fabric strategies use), or the checkpoint config's safe_globals: ['{name}'] (YAML; a strategy's "
            f"checkpoint: section), or for every load in the process, calls without that argument included, "
            f"torch.serialization.add_safe_globals([{name}])")


class MissingKeysError(CheckpointingError, KeyError):
    """Keys asked for are not in the checkpoint (or, in strict modes, keys in it were not asked for)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class SaveFailedError(CheckpointingError):
    """Writing failed on at least one rank; nothing was committed."""


class CollectiveError(CheckpointingError, RuntimeError):
    """A collective over the ranks failed: a rank died, timed out or left."""


def error_class(type_name: str) -> Optional[Type[CheckpointingError]]:
    """The library error class named ``type_name`` (only this module's: a name from another rank
    never selects arbitrary code), else None."""
    cls = globals().get(type_name)
    if isinstance(cls, type) and issubclass(cls, CheckpointingError):
        return cls
    return None
