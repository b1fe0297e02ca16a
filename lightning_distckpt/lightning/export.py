"""The Lightning cases of :func:`lightning_distckpt.export.to_torch_file` / ``from_torch_file``.

A checkpoint that ``DistCheckpointIO`` or the strategies wrote carries the manifest of its tree and
is exported as Lightning's own checkpoint dict with whole tensors (``LightningModule.load_from_checkpoint``
reads it), a ``Fabric.save`` checkpoint as the saved state; any ``torch.save``'d dict other than a
``to_torch_file`` export is imported the way ``DistCheckpointIO`` saves a Lightning checkpoint.
``lightning_distckpt.export`` calls these only for those cases, so the rest never imports Lightning.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Sequence

from .. import convert
from ..convert import ConvertReport
from ..core.errors import FormatError
from ..export.torch_file import from_torch_file, to_torch_file
from ..progress import Progress
from ..storage.tensorstore_io import StorageOptions
from .checkpoint_io import DistCheckpointIO
from .foreign import foreign_advice, foreign_writer
from .tree import iter_tensor_leaves

# The names of release 0.2 (one function per direction now, in lightning_distckpt.export).
export_torch_file = to_torch_file
import_torch_file = from_torch_file


def export_lightning_checkpoint(source: str, destination: str, extra_safe_globals: Sequence[Any],
                                progress: Optional[Progress], started: float) -> ConvertReport:
    """Write the Lightning checkpoint ``source`` (checked, absolute) to the file ``destination`` as the
    dict it was saved from, each tensor whole (report kind ``"lightning"``; ``started``: when the
    export began)."""
    # dict(): a fabric.save checkpoint is read as a FabricCheckpoint; the file holds a plain dict.
    payload = dict(DistCheckpointIO(extra_safe_globals=extra_safe_globals).load_checkpoint(source))
    nbytes = convert.save_file_atomic(payload, destination, progress)
    n_tensors = sum(1 for _ in iter_tensor_leaves(payload))
    return ConvertReport(source, destination, "lightning", n_tensors, 0, nbytes, time.perf_counter() - started)


def refuse_foreign(source: str) -> None:
    """Raise the FormatError for a checkpoint another tool wrote (a DCP directory): not ours to export."""
    raise FormatError(f"checkpoint {source} was written {foreign_writer(source)}. {foreign_advice(source)}")


def import_tree(payload: Dict[str, Any], source: str, destination: str, storage: StorageOptions,
                started: float) -> ConvertReport:
    """Save the dict ``payload`` read from ``source`` as ``DistCheckpointIO`` saves a Lightning
    checkpoint, at ``destination`` (checked; report kind ``"tree"``)."""
    DistCheckpointIO().save_checkpoint(payload, destination, storage_options=storage)
    n_tensors = sum(1 for _, t in iter_tensor_leaves(payload) if t.ndim > 0)
    return ConvertReport(source, destination, "tree", n_tensors, 0,
                         convert.directory_bytes(destination), time.perf_counter() - started)
