"""The tensor-parallel GPT configured entirely from YAML with LightningCLI.

    python examples/cli_gpt.py fit --config configs/cli_gpt_tp.yaml --trainer.default_root_dir runs/gpt
    python examples/cli_gpt.py fit --config configs/cli_gpt_tp.yaml --trainer.default_root_dir runs/gpt \\
        --trainer.max_steps 12 --ckpt_path last          # resume from the newest complete checkpoint

The YAML picks the strategy (``class_path: lightning_distckpt.lightning.DistCheckpointStrategy``), its tensor
parallel size and every checkpoint setting (storage layout, chunk size, I/O threads, parallel save,
loader, strictness, async save); see configs/cli_gpt_tp.yaml. Unknown checkpoint keys fail with
an error naming them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_distckpt.lightning  # noqa: E402,F401  (registers strategy="ddp_distckpt")
from tiny_gpt import TinyGPT  # noqa: E402


def main() -> None:
    LightningCLI(TinyGPT, save_config_kwargs={"overwrite": True})
    if dist.is_available() and dist.is_initialized():  # leave together
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
