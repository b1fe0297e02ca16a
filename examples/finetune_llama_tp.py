"""Fine-tune pretrained Hugging Face weights under tensor parallelism: each rank reads only its shards.

One command (CPU, gloo, 2 processes; nothing downloaded)::

    python examples/finetune_llama_tp.py [--dir DIR]

1. builds a tiny ``transformers`` Llama from a ``LlamaConfig`` and saves it with
   ``save_pretrained(..., max_shard_size="60KB")`` (a sharded Hugging Face directory with an index);
2. trains a small LightningModule on 2 processes under ``DistCheckpointStrategy(tensor_parallel_size=2)``:
   in ``configure_model`` it builds the Llama's embedding, first MLP (gate/up column-parallel, down
   row-parallel), final norm and head, and ``load_module_weights(self, DIR, key_map=...)`` reads each
   rank's slices of those tensors straight from the safetensors files;
3. in this process, builds the same module un-sharded (TP 1) from the same directory and checks that
   its loss on the first batch is the loss the TP 2 run logged at step 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, Tuple

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.nn import functional as F

from lightning_distckpt.lightning import DistCheckpointStrategy, load_module_weights
from lightning_distckpt.lightning.parallel import ParallelState, module_sharded_state_dict, parallel_state_of
from tp_layers import ColumnParallelLinear, RowParallelLinear  # examples/tp_layers.py (this script's directory)

VOCAB, HIDDEN, INTERMEDIATE, SEQ, BATCH, STEPS = 128, 32, 64, 16, 4, 6
HF_TO_OURS = {
    "model.embed_tokens.weight": "embed.weight",
    "model.layers.0.mlp.gate_proj.weight": "gate.weight",
    "model.layers.0.mlp.up_proj.weight": "up.weight",
    "model.layers.0.mlp.down_proj.weight": "down.weight",
    "model.norm.weight": "norm_weight",
    "lm_head.weight": "head.weight",
}


def save_pretrained_llama(directory: str) -> None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:  # not a dependency of the library: the test extras bring it
        sys.exit(f"{sys.argv[0]}: this example builds its Llama with transformers ({e}); "
                 "install it: pip install transformers (or pip install -e \".[test]\")")

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="60KB")


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


class LlamaMLPLM(LightningModule):
    """Embedding, one gated MLP (tensor-parallel), RMS norm and head, initialized from a Llama."""

    def __init__(self, pretrained: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = None
        self.losses: Dict[int, float] = {}

    def configure_model(self) -> None:
        if self.embed is not None:
            return
        self.ps = parallel_state_of(self)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.gate = ColumnParallelLinear(HIDDEN, INTERMEDIATE, self.ps, bias=False)
        self.up = ColumnParallelLinear(HIDDEN, INTERMEDIATE, self.ps, bias=False)
        self.down = RowParallelLinear(INTERMEDIATE, HIDDEN, self.ps, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        # Each rank reads its slices of gate/up/down and the replicated tensors whole; the Llama's
        # other tensors (attention, layer norms) are skipped by the key map (None).
        load_module_weights(self, self.hparams.pretrained, key_map=HF_TO_OURS.get)

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, Any]:
        return module_sharded_state_dict(self, prefix, replica_id=self.ps.replicated_id)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.down(F.silu(self.gate(x)) * self.up(x))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return self.head(x)

    def loss(self, step: int) -> torch.Tensor:
        inputs, targets = batch(step)
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

    def training_step(self, _: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(0)  # fine-tune on one fixed batch: its loss must go down
        self.losses[self.global_step] = loss.item()
        return loss

    def train_dataloader(self) -> Any:
        return range(STEPS)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="finetune_llama_")
    pretrained = os.path.join(root, "llama")
    if "LOCAL_RANK" not in os.environ:  # the launching process; Lightning re-runs this script for rank 1
        save_pretrained_llama(pretrained)
    torch.set_num_threads(1)
    model = LlamaMLPLM(pretrained)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DistCheckpointStrategy(tensor_parallel_size=2),
                      max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root)
    trainer.fit(model)
    if trainer.global_rank != 0:
        return
    # The same network un-sharded, from the same files, in this process alone.
    whole = LlamaMLPLM(pretrained)
    whole.ps = ParallelState.single()
    with torch.no_grad():
        whole.configure_model()
        reference = whole.loss(0).item()
    summary = {"losses": model.losses, "reference_loss0": reference, "parallel": model.ps.describe(),
               "checks": {"initial_loss_matches": abs(model.losses[0] - reference) <= 1e-5 * abs(reference),
                          "loss_decreases": model.losses[STEPS - 1] < model.losses[0]}}
    for step, loss in sorted(model.losses.items()):
        print(f"   step {step}: loss {loss:.6f}")
    print(f"   TP 1 reference loss at step 0: {reference:.6f}")
    print("OK" if all(summary["checks"].values()) else f"FAILED {summary['checks']}")
    with open(os.path.join(root, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    sys.exit(0 if all(summary["checks"].values()) else 1)


if __name__ == "__main__":
    main()
