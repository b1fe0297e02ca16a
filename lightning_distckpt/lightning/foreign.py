"""Who wrote a checkpoint that is not what its reader expects (torch DCP, Hugging Face, fabric.save,
another tool), and what to do with it instead: the words of the errors that refuse it."""

from __future__ import annotations

import os
from typing import Optional

from ..core.errors import FormatError
from ..reading.formats.detect import is_hf_model_directory
from ..storage.inside import enclosing_checkpoint
from .tree import KIND_PLAIN, KIND_SHARDED

#: What to do with a checkpoint none of ours wrote.
FOREIGN_ADVICE = ("Resume it with the strategy that wrote it, or load its weights into your module with "
                  "lightning_distckpt.load(template, path, key_map=...) (its tensors: "
                  "lightning_distckpt.load_plain_tensors(path))")


def foreign_writer(path: str) -> str:
    """Who wrote a checkpoint directory with no manifest of ours (a torch.distributed.checkpoint one,
    a Hugging Face model directory, or other)."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return ("by torch.distributed.checkpoint (DCP: Lightning's own ModelParallelStrategy / FSDPStrategy, "
                "or torch's dcp.save), not by lightning_distckpt")
    if is_hf_model_directory(path):
        return ("by Hugging Face save_pretrained (a model directory: config.json and weights, no training state), "
                "not by lightning_distckpt")
    return "without the Lightning integration's manifest (by lightning_distckpt.save, or another tool)"


WEIGHTS_ONLY = ("holds model weights only (a state dict of tensors: torch.save(model.state_dict()), a .safetensors "
                "or pytorch_model.bin file), not a Trainer's checkpoint")
WEIGHTS_ADVICE = ("To start from these weights, load them into your module with "
                  "lightning_distckpt.lightning.load_module_weights(module, path, key_map=...) in configure_model and "
                  "call trainer.fit without ckpt_path (docs/lightning.md, section 5)")


def foreign_advice(path: str) -> str:
    """What to do with a checkpoint directory another tool wrote (see :func:`foreign_writer`)."""
    return WEIGHTS_ADVICE if is_hf_model_directory(path) else FOREIGN_ADVICE


TRAINER_RESUMES_NEWEST = "(a Trainer: ckpt_path=\"last\" resumes from the newest in ModelCheckpoint's dirpath)"
#: What to do about a checkpoint path with nothing at it (the hints before it say where committed ones are).
NOT_FOUND_ADVICE = f"check the path {TRAINER_RESUMES_NEWEST}"


def fabric_writer(kind: Optional[str]) -> str:
    """Who wrote a checkpoint with no Trainer entries, from its manifest's kind (None: not ours). The
    kind is read from the checkpoint: anything but a string is no kind we wrote."""
    if kind is not None and not isinstance(kind, str):
        return "by fabric.save or another tool (its manifest's kind is not one we write)"
    return {None: "by fabric.save or another tool (no Lightning state_dict / loops entries)",
            KIND_PLAIN: "by fabric.save with DistCheckpointIO under a rank-0 strategy (stock DDP / single device)",
            KIND_SHARDED: "by fabric.save under FabricDistCheckpointStrategy"}.get(
                kind, "by fabric.save under FabricDistCheckpointModelParallelStrategy")


def refuse_file_inside(target: str) -> None:
    """A file of one of our checkpoints is no checkpoint of its own: its ``common.pt`` is a ``torch.save``
    file, of the common state alone, which read as a Lightning checkpoint failed on Lightning's
    ``KeyError: 'state_dict'`` or on missing keys, saying nothing of the directory to pass."""
    if not os.path.isfile(target):
        return
    found = enclosing_checkpoint(target)
    if found is not None:
        raise FormatError(f"{target} is a file of the checkpoint {found} (its {os.path.basename(target)}), not a "
                          f"checkpoint of its own: pass that directory")
