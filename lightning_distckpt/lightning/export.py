"""Lightning checkpoints to and from one ``torch.save`` file (``lightning-distckpt convert``).

:mod:`lightning_distckpt.convert` handles any checkpoint as keys, objects and common state. A
checkpoint that ``DistCheckpointIO`` or the strategies wrote carries the manifest of its tree, and is
exported here as Lightning's own checkpoint dict with whole tensors (``LightningModule.load_from_checkpoint``
reads it), a ``Fabric.save`` checkpoint as the saved state; any ``torch.save``'d dict is imported the
way ``DistCheckpointIO`` saves a Lightning checkpoint. Everything else goes to the core's functions.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

from .. import convert
from ..convert import ConvertReport
from ..progress import Progress
from ..core.errors import FormatError
from ..serialization import load_common_state_dict
from ..storage.safe_pickle import load_file
from ..storage.tensorstore_io import StorageOptions
from .checkpoint_io import FOREIGN_ADVICE, DistCheckpointIO, foreign_writer
from .tree import MANIFEST_KEY, iter_tensor_leaves


def export_torch_file(source: str, destination: str, extra_safe_globals: Sequence[Any] = (),
                      progress: Optional[Progress] = None) -> ConvertReport:
    """Consolidate the checkpoint ``source`` into the ``torch.save`` file ``destination``: a Lightning
    (Trainer or Fabric) checkpoint as the dict it was saved from, each tensor whole (report kind
    ``"lightning"``); any other as :func:`lightning_distckpt.convert.export_torch_file` writes it.
    ``progress`` (:mod:`lightning_distckpt.progress`) counts the bytes written."""
    t0 = time.perf_counter()
    source, destination = convert.check_export(source, destination, extra_safe_globals)  # never over the source
    common = load_common_state_dict(source, extra_safe_globals)
    if not (isinstance(common, dict) and MANIFEST_KEY in common):
        if os.path.isfile(os.path.join(source, ".metadata")):  # DCP: not ours to export
            raise FormatError(f"checkpoint {source} was written {foreign_writer(source)}. {FOREIGN_ADVICE}")
        return convert.export_torch_file(source, destination, extra_safe_globals, progress)
    # dict(): a fabric.save checkpoint is read as a FabricCheckpoint; the file holds a plain dict.
    payload = dict(DistCheckpointIO(extra_safe_globals=extra_safe_globals).load_checkpoint(source))
    nbytes = convert.save_file_atomic(payload, destination, progress)
    n_tensors = sum(1 for _ in iter_tensor_leaves(payload))
    return ConvertReport(source, destination, "lightning", n_tensors, 0, nbytes,
                         time.perf_counter() - t0)


def import_torch_file(source: str, destination: str, storage: StorageOptions = StorageOptions(),
                      extra_safe_globals: Sequence[Any] = ()) -> ConvertReport:
    """Save the ``torch.save`` file ``source`` as the checkpoint directory ``destination``.

    A file that :func:`export_torch_file` wrote from a checkpoint other than Lightning's gets its keys,
    objects and common state back (:func:`lightning_distckpt.convert.import_torch_file`). Any other
    dict (a Lightning checkpoint, a model ``state_dict``, nested training state) is saved the way
    ``DistCheckpointIO`` saves Lightning checkpoints: each tensor whole, keyed by its path
    (``state_dict/layer.weight``), everything else common state, plus the manifest that
    ``DistCheckpointIO.load_checkpoint`` and ``load_lightning_module`` read back (report kind ``"tree"``).
    """
    t0 = time.perf_counter()
    source, destination = convert.check_import(source, destination, storage, extra_safe_globals)
    payload = load_file(source, extra_safe_globals)
    if not isinstance(payload, dict) or convert.is_export_payload(payload):
        return convert.import_export_payload(payload, source, destination, storage, t0)
    DistCheckpointIO().save_checkpoint(payload, destination, storage_options=storage)
    n_tensors = sum(1 for _, t in iter_tensor_leaves(payload) if t.ndim > 0)
    return ConvertReport(source, destination, "tree", n_tensors, 0,
                         convert.directory_bytes(destination), time.perf_counter() - t0)
