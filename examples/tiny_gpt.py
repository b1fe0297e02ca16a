"""A small tensor-parallel GPT-like LightningModule and a deterministic token stream (for the examples).

* Attention: q/k/v are column-parallel (each TP rank owns ``n_heads / tp`` heads), the output
  projection is row-parallel. MLP: column-parallel up-projection, row-parallel down-projection.
  Embeddings, LayerNorms and the LM head are replicated.
* ``sharded_state_dict`` describes all of it, so checkpoints reshard between TP sizes and DP
  replicas are written once.
* :class:`TokenStream` yields step ``s``'s global batch as a pure function of ``s`` (sequences of a
  fixed random Markov chain), sliced for this data-parallel rank: a run resumed at step ``s`` sees
  exactly the data an uninterrupted run would, under any world size.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn import functional as F

from lightning_distckpt.lightning.parallel import ParallelState, module_sharded_state_dict, parallel_state_of
from tp_layers import ColumnParallelLinear, RowParallelLinear  # examples/tp_layers.py: use your TP library's


class TokenStream:
    """Batches for steps ``first_step .. last_step - 1`` of a synthetic language."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, first_step: int, last_step: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} must be divisible by the data-parallel size {dp_size}")
        self.vocab, self.seq_len, self.global_batch = vocab, seq_len, global_batch
        self.first_step, self.last_step = first_step, last_step
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        g = torch.Generator().manual_seed(seed)
        # A sparse-ish random bigram table: each token has a few likely successors (learnable).
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        self.transitions = torch.softmax(logits, dim=-1)

    def __len__(self) -> int:
        return max(0, self.last_step - self.first_step)

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(self.global_batch, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (self.global_batch,), generator=g)
        for t in range(1, self.seq_len + 1):
            tokens[:, t] = torch.multinomial(self.transitions[tokens[:, t - 1]], 1, generator=g).squeeze(1)
        part = self.global_batch // self.dp_size
        mine = tokens[self.dp_rank * part:(self.dp_rank + 1) * part]
        return mine[:, :-1], mine[:, 1:]

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for step in range(self.first_step, self.last_step):
            yield self.batch(step)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ps: ParallelState) -> None:
        super().__init__()
        if n_heads % ps.tp_size:
            raise ValueError(f"n_heads={n_heads} must be divisible by tensor_parallel_size={ps.tp_size}")
        self.local_heads, self.head_dim = n_heads // ps.tp_size, d_model // n_heads
        self.q = ColumnParallelLinear(d_model, d_model, ps)
        self.k = ColumnParallelLinear(d_model, d_model, ps)
        self.v = ColumnParallelLinear(d_model, d_model, ps)
        self.proj = RowParallelLinear(d_model, d_model, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.local_heads, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ps: ParallelState) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, ps)
        self.fc1 = ColumnParallelLinear(d_model, 4 * d_model, ps)
        self.fc2 = RowParallelLinear(4 * d_model, d_model, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_heads: int, n_layers: int, ps: ParallelState) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, ps) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TinyGPT(LightningModule):
    """The GPT above, trained on :class:`TokenStream`. Build it under any TP x DP split."""

    def __init__(self, vocab: int = 64, seq_len: int = 32, d_model: int = 64, n_heads: int = 4, n_layers: int = 2,
                 lr: float = 3e-3, global_batch: int = 8, total_steps: int = 12, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt: Any = None
        self.losses: Dict[int, float] = {}

    def configure_model(self) -> None:
        """Build the layers for this rank's place in the TP x DP grid (called once the groups exist)."""
        if self.gpt is not None:
            return
        hp = self.hparams
        self.ps = parallel_state_of(self)
        torch.manual_seed(hp.seed)  # identical global weights on every rank, whatever the split
        self.gpt = GPT(hp.vocab, hp.seq_len, hp.d_model, hp.n_heads, hp.n_layers, self.ps)

    def sharded_state_dict(self, prefix: str = "") -> Dict[str, Any]:
        """TP layers describe their shards; everything else is replicated (written once)."""
        return module_sharded_state_dict(self, prefix, replica_id=self.ps.replicated_id)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def loss(self, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inp, target = batch
        return F.cross_entropy(self(inp).flatten(0, 1), target.flatten())

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        value = loss.detach().clone()
        if self.ps.dp_size > 1:  # the whole global batch's loss, comparable across world sizes
            dist.all_reduce(value, group=self.ps.dp_group)
            value /= self.ps.dp_size
        self.losses[self.global_step] = value.item()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def stream(self, first_step: int, last_step: int, dp_rank: int = 0, dp_size: int = 1) -> TokenStream:
        hp = self.hparams
        return TokenStream(hp.vocab, hp.seq_len, hp.global_batch, first_step, last_step, dp_rank, dp_size, hp.seed)

    def train_dataloader(self) -> TokenStream:
        return self.stream(self.trainer.global_step, self.hparams.total_steps, self.ps.dp_rank, self.ps.dp_size)
