"""The built-in demo task: a small GPT-style transformer (``TinyGPT``) on synthetic tokens, so that
``autoaccum probe`` and ``autoaccum.fit`` run without a task of the user's (``autoaccum probe`` with no
``--task``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autoaccum.plan.task import Task

__all__ = ["TinyGPT", "demo_task", "synthetic_tokens", "token_loss"]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-norm blocks, tied head."""

    def __init__(self, vocab_size: int = 256, seq_len: int = 64, dim: int = 128, layers: int = 2,
                 heads: int = 4) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) / math.sqrt(dim))
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def synthetic_tokens(num_samples: int, seq_len: int = 64, vocab_size: int = 256, seed: int = 0) -> torch.Tensor:
    """Learnable synthetic sequences: each token is the previous one plus a per-sequence stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
    stride = torch.randint(1, 8, (num_samples, 1), generator=g)
    return (start + stride * torch.arange(seq_len + 1)) % vocab_size


def token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over all tokens of the batch."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def demo_task(device: torch.device | str = "cpu", seed: int = 0) -> Task:
    """TinyGPT (2 layers, dim 128, 64 tokens) with AdamW on synthetic tokens."""
    torch.manual_seed(seed)
    model = TinyGPT().to(device)
    return Task(model=model, loss_fn=token_loss,
                make_batch=lambda b: synthetic_tokens(b, seed=seed + b).to(device), name="demo: TinyGPT")
