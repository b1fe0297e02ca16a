"""To and from one ``torch.save`` file, for tools that expect ``torch.load``.

:func:`to_torch_file` writes a Lightning checkpoint (Trainer or Fabric: it carries the manifest of
its tree) as Lightning's own checkpoint dict with whole tensors, and any other checkpoint as
``{"tensors": {key: tensor}, "objects": {key: {offset: object}}, "common": common_state}``.
:func:`from_torch_file` turns such an export back into a checkpoint directory, and any other
``torch.save``'d dict into one the way ``DistCheckpointIO`` saves a Lightning checkpoint.

Lightning is imported only for the Lightning cases (:mod:`lightning_distckpt.lightning.export`);
the rest is :mod:`lightning_distckpt.convert`. Single process; outputs appear atomically; files are
read with ``weights_only=True``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

from .. import convert
from ..convert import ConvertReport
from ..progress import Progress
from ..reading.formats.detect import is_hf_model_directory
from ..serialization import load_common_state_dict, load_plain_tensors
from ..reading.formats.files import check_torch_payload
from ..storage.safe_pickle import load_file
from ..storage.tensorstore_io import StorageOptions
from .tensors import LIGHTNING_MANIFEST_KEY

DCP_METADATA = ".metadata"  # the file that marks a torch.distributed.checkpoint directory


def to_torch_file(source: Any, destination: Any, extra_safe_globals: Sequence[Any] = (),
                  progress: Optional[Progress] = None) -> ConvertReport:
    """Consolidate the checkpoint ``source`` into the ``torch.save`` file ``destination``.

    A Lightning (Trainer or Fabric) checkpoint becomes the dict it was saved from, each tensor whole
    (``LightningModule.load_from_checkpoint`` reads it; report kind ``"lightning"``); any other
    checkpoint (ours, or a ``.safetensors`` / ``torch.save`` file or Hugging Face directory: no
    objects, the file's other entries as the common state; a DCP directory is refused, saying what
    reads it) becomes ``{"tensors", "objects", "common"}`` (kind ``"tensors"``), which
    :func:`from_torch_file` turns back into a checkpoint. Single process; the file appears
    atomically. ``progress`` (:mod:`lightning_distckpt.progress`) counts the bytes written.
    ``extra_safe_globals``: further trusted types its objects and common state may hold. Returns a
    :class:`ConvertReport`.

    Raises:
        ArgumentError, ArgumentTypeError: an argument that is wrong (naming it), an output over the input.
        CheckpointNotFoundError, IncompleteCheckpointError: nothing, or no committed checkpoint, at the source.
        FormatError: the source fails its checks (UnsafeContentError: a type not allowed to deserialize).
        CheckpointingError: writing failed; ``destination`` is left as it was. (A DCP source: a FormatError
            saying what reads it.)
    """
    t0 = time.perf_counter()
    source, destination = convert.check_export(source, destination, extra_safe_globals)  # never over the source
    common = load_common_state_dict(source, extra_safe_globals)
    if isinstance(common, dict) and LIGHTNING_MANIFEST_KEY in common:
        from ..lightning.export import export_lightning_checkpoint  # Lightning's dict: imports Lightning

        return export_lightning_checkpoint(source, destination, extra_safe_globals, progress, t0)
    if os.path.isfile(os.path.join(source, DCP_METADATA)):  # DCP: not ours to export; the advice is Lightning's
        from ..lightning.export import refuse_foreign

        refuse_foreign(source)
    return convert.export_torch_file(source, destination, extra_safe_globals, progress)


def from_torch_file(source: Any, destination: Any, storage: StorageOptions = StorageOptions(),
                    extra_safe_globals: Sequence[Any] = ()) -> ConvertReport:
    """Save the ``torch.save`` file ``source`` (or a ``.safetensors`` file, or a Hugging Face model
    directory: its tensors, as ``load_plain_tensors`` reads them) as the checkpoint directory ``destination``.

    A file that :func:`to_torch_file` wrote from a checkpoint other than Lightning's gets its keys,
    objects and common state back (report kind ``"tensors"``). Any other dict (a Lightning
    checkpoint, a model ``state_dict``, nested training state) is saved the way ``DistCheckpointIO``
    saves Lightning checkpoints: each tensor whole, keyed by its path (``state_dict/layer.weight``),
    everything else common state, plus the manifest that ``DistCheckpointIO.load_checkpoint`` and
    ``load_lightning_module`` read back (kind ``"tree"``; this imports Lightning).

    ``storage``: the layout of the checkpoint written (:class:`~lightning_distckpt.StorageOptions`);
    ``extra_safe_globals``: further trusted types the file may hold. Returns a :class:`ConvertReport`.

    Raises:
        ArgumentError, ArgumentTypeError: an argument that is wrong (naming it), an output over the input.
        CheckpointNotFoundError, IncompleteCheckpointError: nothing, or no committed checkpoint, at the source.
        FormatError: the source fails its checks (UnsafeContentError: a type not allowed to deserialize).
        CheckpointingError: the save failed; nothing is committed at ``destination``.
    """
    t0 = time.perf_counter()
    source, destination = convert.check_import(source, destination, storage, extra_safe_globals)
    if os.path.isdir(source) and is_hf_model_directory(source):  # each tensor checked as its file is read
        payload: Any = load_plain_tensors(source)
    else:
        payload = load_file(source, extra_safe_globals)
        check_torch_payload(source, payload)  # as every reader: dense CPU tensors, shapes, copy-out budget
    if not isinstance(payload, dict) or convert.is_export_payload(payload):
        return convert.import_export_payload(payload, source, destination, storage, t0)
    from ..lightning.export import import_tree  # saved as DistCheckpointIO saves a Lightning checkpoint

    return import_tree(payload, source, destination, storage, t0)
