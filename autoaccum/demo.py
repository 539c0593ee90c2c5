"""The built-in demo: a small GPT-style transformer on synthetic tokens. No downloads, no files."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autoaccum.task import Task

__all__ = ["TinyGPT", "demo_task", "pad_rows", "padded_token_loss", "synthetic_tokens", "token_loss"]


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


def pad_rows(rows: list[dict[str, torch.Tensor]], pad: int = 0) -> dict[str, torch.Tensor]:
    """Rows ``{"input_ids": 1-D tensor}`` right-padded to the longest, as a tokenizer's padding
    collator does: ``input_ids``, ``attention_mask`` and ``labels`` (the ids, -100 on padding)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])], mask[i, :len(r["input_ids"])] = r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def padded_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy of a :func:`pad_rows` batch, summed over its real tokens, and their
    count: the ``(loss_sum, num_items)`` form, normalised once per optimizer step."""
    logits = model(batch["input_ids"][:, :-1])
    targets = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (targets != -100).sum()


def demo_task(device: torch.device | str = "cpu", seed: int = 0) -> Task:
    """TinyGPT (2 layers, dim 128, 64 tokens) with AdamW on synthetic tokens."""
    torch.manual_seed(seed)
    model = TinyGPT().to(device)
    return Task(model=model, loss_fn=token_loss,
                make_batch=lambda b: synthetic_tokens(b, seed=seed + b).to(device), name="demo: TinyGPT")
