"""``lightning-distckpt`` / ``python -m lightning_distckpt``: look into and check checkpoints.

    lightning-distckpt inspect DIR [--json]     keys, global shapes, dtypes, bytes, shard grid, writers
                                                (a node-local tier root: steps and rank stores held)
    lightning-distckpt validate DIR [--json]    read every stored byte; exit 1 if anything is damaged
                                                (both also take a DCP or Megatron-Core torch_dist directory)
    lightning-distckpt clean DIR [--dry-run]    remove staging directories that killed saves left behind
                                                (s3://bucket/prefix: uncommitted versions)
    lightning-distckpt convert SRC DST          checkpoint -> torch.save file, file -> checkpoint, or re-layout
                                                (--to safetensors | dcp | megatron: Hugging Face, DCP or
                                                Megatron-Core torch_dist directory)

Every command takes ``-v``/``--verbose``, ``--log-level LEVEL`` and ``-q``/``--quiet`` (no progress
bar; one is drawn on stderr only when it is a terminal): :mod:`.output`.

Exit status: 0 fine; 1 the checkpoint is damaged (validate); 2 not a checkpoint, an incomplete
(uncommitted) one, an unsupported format, or bad usage; 3 an internal error (a bug: its traceback is
printed); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM: unwound as Ctrl-C is, so what a convert
had written is removed). Errors are one line on stderr, no traceback.
Subcommands live in one ``argparse`` subparser group: add new ones with
:func:`add_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional

from ..core.errors import ArgumentError, CheckpointingError
from ..core.shown import MESSAGE_LIMIT, shown
from ..storage.paths import local_path
from ..storage.stores import open_store
from ..version import __version__
from .numbers import float_in, int_in
from .output import bar, command_logging, emit, json_text, output_options, verbosity

if TYPE_CHECKING:
    from ..convert import ConvertReport
    from ..progress import Progress

EXIT_OK, EXIT_DAMAGED, EXIT_UNUSABLE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM  # as a shell reports the signals
MAX_INFLIGHT_MIB = 1 << 20  # validate --max-inflight-mib: up to 1 TiB
CHUNK_MIB = (1 / 1024, 1 << 20)  # convert --chunk-mib: the chunk sizes StorageOptions takes, 1 KiB to 1 TiB

Handler = Callable[[argparse.Namespace], int]


class UsageError(ArgumentError):
    """Bad arguments or a path that cannot be a checkpoint (exit status 2)."""


def _require_existing(path: str, file_ok: bool = False) -> None:
    """A missing local ``path``: a UsageError naming it, the committed checkpoints beside it, and
    a stranded commit (after finishing one killed between its two renames). ``file_ok``: a file
    may be meant too (convert's source)."""
    if not os.path.exists(path):
        from ..storage.commit import recover_interrupted_commit
        from ..storage.committed import describe_missing

        recover_interrupted_commit(path)  # a commit killed between its two renames: finish it
        if not os.path.exists(path):
            text = describe_missing(path)
            if file_ok and text.startswith("no such directory"):
                text = "no such file or directory" + text[len("no such directory"):]
            raise UsageError(f"{path}: {text}")


def _checkpoint_path(path: str) -> str:
    if not open_store(path).file_system:  # opening it says what is wrong (no bucket, no marker, ...) in one line
        return path
    local_path(path)  # a URL is refused as such, not as a missing directory
    _require_existing(path)
    if not os.path.isdir(path):
        raise UsageError(f"{path}: is a file, not a checkpoint directory (a torch.save or .safetensors file: "
                         f"`lightning-distckpt convert {path} DIR` makes a checkpoint of it)")
    return path


def _hint(args: argparse.Namespace, error: CheckpointingError) -> str:
    """For a local directory refused as no checkpoint: what it is instead, and what to pass."""
    from ..core.errors import CheckpointNotFoundError, IncompleteCheckpointError
    from ..reading.formats.detect import is_hf_model_directory
    from ..storage.layout import is_checkpoint_dir
    from ..storage.committed import committed_inside

    path = getattr(args, "checkpoint", None) or getattr(args, "source", None)
    if (not isinstance(error, IncompleteCheckpointError) or isinstance(error, CheckpointNotFoundError)
            or not path or not os.path.isdir(path) or is_checkpoint_dir(path)):
        return ""
    if committed_inside(path):  # the load's own error names them and what to pass (storage/committed.py)
        return ""
    if is_hf_model_directory(path):
        return ("; it is a Hugging Face model directory: `lightning-distckpt convert DIR OUT` makes a checkpoint of "
                "it, and lightning_distckpt.load(template, DIR, key_map=...) reads it as it is (docs/ingest.md)")
    return ""


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..reading.checkpoint import OpenedCheckpoint
    from .foreign import (open_foreign, open_tensor_files, render_foreign, render_tensor_files, summarize_foreign,
                          summarize_tensor_files)
    from ..tiers.views import render_tier, tier_summary
    from .inspect import render, summarize

    try:
        local: Optional[str] = local_path(args.checkpoint)
    except CheckpointingError:  # a URL: said below, where a store opens it
        local = None
    files = open_tensor_files(local) if local else None
    if files is not None:  # a torch.save / safetensors file, a Hugging Face directory: its tensors
        with bar(args, "inspect", unit="key", quick=True) as progress:
            summary = summarize_tensor_files(files, progress)
        emit(json_text(summary) if args.json else render_tensor_files(summary))
        return EXIT_OK
    path = _checkpoint_path(args.checkpoint)
    with bar(args, "inspect", unit="key", quick=True) as progress:  # keys described, any format
        foreign = open_foreign(path)  # a DCP or Megatron-Core directory
        tiers = tier_summary(path) if foreign is None and open_store(path).file_system else None
        if tiers is not None:  # node-local tiers: a node root, or a directory of them
            summary, show = tiers, render_tier
        elif foreign is not None:
            summary, show = summarize_foreign(foreign, progress), render_foreign
        else:
            summary, show = summarize(OpenedCheckpoint.open(path), progress), render
    emit(json_text(summary) if args.json else show(summary))
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from ..progress import note
    from ..validation import validate
    from .validate import as_json, render

    with bar(args, "validate") as progress:
        on_key = None if args.json or not verbosity(args) else (lambda key: note(progress, f"checked {shown(key)}"))
        report = validate(_checkpoint_path(args.checkpoint), max_inflight_bytes=args.max_inflight_mib << 20,
                          on_key=on_key, require_checksums=args.require_checksums, progress=progress)
    emit(json_text(as_json(report)) if args.json else render(report))  # a reader gone keeps the verdict
    return EXIT_OK if report.ok else EXIT_DAMAGED


def cmd_clean(args: argparse.Namespace) -> int:
    from .clean import as_json, clean, render

    if open_store(args.directory, what="directory").file_system and not os.path.isdir(args.directory):
        what = "not a directory" if os.path.lexists(args.directory) else "no such directory"  # a file, a FIFO
        raise UsageError(f"{args.directory}: {what}")
    with bar(args, "clean", quick=True) as progress:
        actions = clean(args.directory, args.older_than, args.dry_run, progress)
    emit(json_text(as_json(actions)) if args.json else render(actions, args.directory))
    return EXIT_DAMAGED if any(a.action == "failed" for a in actions) else EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ..export import from_torch_file, relayout, to_torch_file  # Lightning checkpoints: Lightning's dict
    from ..reading.formats.detect import is_hf_model_directory
    from ..storage.tensorstore_io import StorageOptions

    for what, path in (("source", args.source), ("destination", args.destination)):
        if path == "-":  # no stream is read or written: a file named "-" would be made in the working directory
            raise UsageError(f"{what} -: convert reads and writes files and directories, not stdin / stdout; give a "
                             f"path (./- for a file named -)")
    remote = not open_store(args.source, what="source").file_system  # opening it says what is wrong
    if not remote:
        _require_existing(local_path(args.source, "source"), file_ok=True)
    open_store(args.destination, what="destination")  # a URL no store serves is refused now
    hf_dir = not remote and os.path.isdir(args.source) and is_hf_model_directory(args.source)
    to = args.to or ("torch" if (remote or os.path.isdir(args.source)) and not hf_dir else "distckpt")
    _check_export_options(args, to)
    chunk_bytes = None if args.chunk_mib is None else int(args.chunk_mib * 2**20)  # finite, in range: parsed so
    overrides = {k: v for k, v in (("layout", args.layout), ("chunk_bytes", chunk_bytes)) if v is not None}
    try:
        storage = StorageOptions(**overrides)
    except (ValueError, TypeError) as e:  # StorageOptions' own checks
        raise UsageError(str(e)) from None
    if args.max_shard_size is not None and to != "safetensors":
        raise UsageError(f"--max-shard-size applies to --to safetensors, not to --to {to}")
    with bar(args, f"convert to {to}") as progress:
        if to in ("safetensors", "dcp", "megatron"):
            report = _export(args, to, bool(overrides), progress)
        elif to == "torch":
            if not remote and not os.path.isdir(args.source):
                raise UsageError(f"{args.source}: is a file; --to torch converts a checkpoint directory")
            if overrides:
                raise UsageError("--layout / --chunk-mib apply to checkpoint outputs, not to --to torch")
            report = to_torch_file(args.source, args.destination, progress=progress)
        elif (remote or os.path.isdir(args.source)) and not hf_dir:
            report = relayout(args.source, args.destination, storage, progress)
        else:
            report = from_torch_file(args.source, args.destination, storage)
    emit(json_text(asdict(report)) if args.json else shown(report.describe(), MESSAGE_LIMIT))
    return EXIT_OK


def _check_export_options(args: argparse.Namespace, to: str) -> None:
    """``--only`` / ``--include`` apply to the exports, ``--config`` to ``--to safetensors``."""
    if (args.only is not None or args.include) and to not in ("safetensors", "dcp", "megatron"):
        raise UsageError(f"--only / --include apply to --to safetensors, dcp or megatron, not to --to {to}")
    if args.config is not None and to != "safetensors":
        raise UsageError(f"--config applies to --to safetensors, not to --to {to}")


def _export(args: argparse.Namespace, to: str, storage_overrides: bool,
            progress: Optional["Progress"]) -> "ConvertReport":
    """``convert --to safetensors`` / ``--to dcp`` / ``--to megatron`` (lightning_distckpt.export)."""
    from ..export import parse_size, to_dcp, to_megatron, to_safetensors
    from ..export.safetensors_out import DEFAULT_MAX_SHARD_SIZE

    if storage_overrides:
        raise UsageError(f"--layout / --chunk-mib apply to checkpoint outputs, not to --to {to}")
    chosen = dict(only=args.only, include=tuple(args.include), progress=progress)
    if to == "dcp":
        return to_dcp(args.source, args.destination, **chosen)
    if to == "megatron":
        return to_megatron(args.source, args.destination, **chosen)
    try:  # the Python API's parser: a size string (its messages name max_shard_size)
        size = parse_size(args.max_shard_size if args.max_shard_size is not None else DEFAULT_MAX_SHARD_SIZE)
    except CheckpointingError as e:
        raise UsageError(f"--max-shard-size: {e}") from None
    return to_safetensors(args.source, args.destination, max_shard_size=size, config=args.config, **chosen)


def add_command(sub: "argparse._SubParsersAction", name: str, handler: Handler, help: str) -> argparse.ArgumentParser:
    """Register a subcommand; ``handler(args)`` returns the exit status. It takes the output
    options (:mod:`.output`) too."""
    p = sub.add_parser(name, help=help, description=help, parents=[output_options()])
    p.set_defaults(handler=handler)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-distckpt",
        description="Inspect, validate, convert and clean up after lightning_distckpt (sharded) checkpoints.",
        epilog="exit status: 0 ok, 1 damaged checkpoint (validate) or a leftover clean could not remove, "
               "2 not a (complete) checkpoint or bad usage, 3 internal error, 130 interrupted, 143 terminated",
        parents=[output_options()],
    )
    parser.add_argument("--version", action="version", version=f"lightning_distckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = add_command(sub, "inspect", cmd_inspect,
                    "show keys, global shapes, dtypes, bytes, shard grid and writer ranks, and whether the "
                    "checkpoint is complete (reads metadata only)")
    p.add_argument("checkpoint", help="checkpoint directory or s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p = add_command(sub, "validate", cmd_validate,
                    "read every chunk of every stored shard, every object and the common state; report missing "
                    "or unreadable data (exit status 1)")
    p.add_argument("checkpoint", help="checkpoint directory or s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--max-inflight-mib", type=int_in(1, MAX_INFLIGHT_MIB), default=256, metavar="MIB",
                   help="bytes read at once per shard (default 256 MiB)")
    p.add_argument("--require-checksums", action="store_true",
                   help="a checkpoint written before checksums (format 1 or 2) is damage (exit status 1), "
                   "not a warning")
    p = add_command(sub, "clean", cmd_clean,
                    "remove the hidden staging directories of saves that never committed (killed jobs); keeps "
                    "those a running save may still use and any committed checkpoint whose rename was interrupted")
    p.add_argument("directory", help="directory holding checkpoints (or one checkpoint: its own leftovers); "
                   "s3://bucket/prefix: the versions no commit marker names, there and below")
    p.add_argument("--older-than", type=float_in(0.0, sys.float_info.max, low_inclusive=True), default=600.0,
                   metavar="SECONDS", help="only remove directories unchanged for this long (default 600; a finite "
                   "number >= 0): saves on other nodes cannot be seen from here")
    p.add_argument("--dry-run", "-n", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--json", action="store_true", help="print the actions as JSON")
    p = add_command(sub, "convert", cmd_convert,
                    "convert a checkpoint directory to one torch.save file (Lightning checkpoints become Lightning's "
                    "own checkpoint dict), a torch.save file to a checkpoint directory, a checkpoint to another "
                    "storage layout (--to distckpt with a directory source), or export one as a Hugging Face "
                    "safetensors directory, a PyTorch DCP or a Megatron-Core torch_dist checkpoint (--to)")
    p.add_argument("source", help="checkpoint directory (or s3://bucket/prefix) or torch.save file")
    p.add_argument("destination", help="output file (--to torch) or checkpoint directory (or s3://bucket/prefix)")
    p.add_argument("--to", choices=["torch", "distckpt", "safetensors", "dcp", "megatron"],
                   help="output kind (default: torch for a directory source, distckpt for a file); safetensors: "
                   "a Hugging Face model directory (a Trainer checkpoint's module weights), dcp: a PyTorch DCP "
                   "directory, megatron: a Megatron-Core torch_dist directory")
    p.add_argument("--max-shard-size", help="--to safetensors: bytes per file, e.g. 5GB (default), 500MiB")
    p.add_argument("--only", choices=["model"], help="exports: only the model's weights, without optimizer state "
                   "(of a Trainer checkpoint: the LightningModule's weights; --to safetensors does this by default)")
    p.add_argument("--include", action="append", default=[], metavar="PREFIX",
                   help="exports: only tensors whose stored key or exported name starts with PREFIX (repeatable)")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help="--to safetensors: copy this Hugging Face config.json beside the weights (from_pretrained "
                   "reads the directory); an existing different config.json there is refused")
    p.add_argument("--layout", choices=["ocdbt", "zarr"], help="storage layout of a checkpoint output")
    p.add_argument("--chunk-mib", type=float_in(CHUNK_MIB[0], CHUNK_MIB[1], low_inclusive=True), metavar="MIB",
                   help=f"chunk size of a checkpoint output, MiB (from {CHUNK_MIB[0]:g}, 1 KiB, to "
                   f"{CHUNK_MIB[1]}, 1 TiB)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``lightning-distckpt`` console script; returns the exit status."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a first try: the commands, not argparse's one line
        parser.print_help(sys.stderr)
        return EXIT_UNUSABLE
    args = parser.parse_args(argv)
    try:
        with command_logging(args), _terminate_unwinds():
            return args.handler(args)
    except CheckpointingError as e:  # UsageError included; damage found by validate is its report, not an error
        # one line, whatever names of the checkpoint's the message holds (a forged line, escape sequences)
        print(f"lightning-distckpt {args.command}: error: {shown(f'{e}{_hint(args, e)}', MESSAGE_LIMIT)}",
              file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt as e:
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. piped into head
        return EXIT_OK
    except OSError as e:  # the system refused something no check of ours said first: one line, as our errors
        print(f"lightning-distckpt {args.command}: error: {shown(f'{type(e).__name__}: {e}', MESSAGE_LIMIT)}",
              file=sys.stderr)
        return EXIT_UNUSABLE
    except Exception as e:  # a bug: not exit status 1, which says "damaged" (a script may delete the checkpoint)
        traceback.print_exc()
        print(f"lightning-distckpt {args.command}: internal error (a bug, please report it with the traceback "
              f"above): {shown(f'{type(e).__name__}: {e}', MESSAGE_LIMIT)}", file=sys.stderr)
        return EXIT_INTERNAL


class Terminated(KeyboardInterrupt):
    """SIGTERM while a command ran (a scheduler preempting the job, ``kill``)."""


@contextlib.contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread: the command unwinds as on Ctrl-C, so a
    convert removes its staging directory or temporary file (killed by the signal's default action,
    it left them for ``clean``). A second SIGTERM kills at once. A handler the program running
    :func:`main` set, and any thread but the main one, are left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def on_term(signum: int, frame: Optional[FrameType]) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
