"""Deterministic models, data and hand-written references for the fit and data tests.

The references share no code with autoaccum. They draw each epoch's sample order by the rule
documented in ``autoaccum.plan.data`` -- ``torch.randperm(n)`` with a generator seeded
``seed * 1_000_003 + epoch`` -- cut it into consecutive global batches (the last one holding what
remains) and take one full-batch optimizer step per global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss

__all__ = ["Mlp", "cross_entropy", "epoch_order", "global_batches", "gpt", "gpt_tokens", "max_abs_diff",
           "mlp_data", "reference_fit", "resumable_run", "token_loss"]

VOCAB, SEQ = 32, 12


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The documented order rule: a fresh permutation per epoch from ``seed * 1_000_003 + epoch``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g)


def global_batches(num_samples: int, target_batch: int, seed: int, epochs: int) -> list[torch.Tensor]:
    """Sample indices of every optimizer step of ``epochs`` passes, in order."""
    out = []
    for epoch in range(epochs):
        order = epoch_order(num_samples, seed, epoch)
        out.extend(order[i:i + target_batch] for i in range(0, num_samples, target_batch))
    return out


def gpt(seed: int = 0) -> TinyGPT:
    """A two-layer TinyGPT in fp64, small enough for a CPU test."""
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=VOCAB, seq_len=SEQ, dim=16, layers=2, heads=2).double()


def gpt_tokens(num_samples: int, seed: int = 0) -> torch.Tensor:
    """``num_samples`` learnable sequences of ``SEQ + 1`` tokens (inputs and shifted targets)."""
    return synthetic_tokens(num_samples, seq_len=SEQ, vocab_size=VOCAB, seed=seed)


class Mlp(nn.Module):
    """Linear -> tanh -> dropout -> Linear: dropout makes the global RNG part of the result."""

    def __init__(self, d_in: int = 6, hidden: int = 16, d_out: int = 3, p: float = 0.1, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Dropout(p), nn.Linear(hidden, d_out))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp_data(num_samples: int, seed: int = 1, dtype: torch.dtype = torch.float32,
             d_in: int = 6, d_out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_samples, d_in, generator=g, dtype=dtype),
            torch.randint(0, d_out, (num_samples,), generator=g))


def reference_fit(model: nn.Module, loss_on: Callable[[nn.Module, torch.Tensor], torch.Tensor], num_samples: int,
                  target_batch: int, *, seed: int = 0, epochs: int = 1, lr: float = 1e-3,
                  unweighted_micro: int | None = None) -> list[float]:
    """One AdamW step per global batch on the full batch; ``loss_on(model, indices)`` is its mean loss.
    Trains ``model`` in place and returns the loss of every step.

    ``unweighted_micro``: the negative control -- accumulate micro-batches of this size with each
    micro-batch mean weighted ``1 / count`` (wrong when the last micro-batch is smaller).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for idx in global_batches(num_samples, target_batch, seed, epochs):
        opt.zero_grad()
        if unweighted_micro is None:
            loss = loss_on(model, idx)
            loss.backward()
            losses.append(loss.item())
        else:
            parts = idx.split(unweighted_micro)
            for part in parts:
                (loss_on(model, part) / len(parts)).backward()
        opt.step()
    return losses


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


#: what the resume tests train: 150 samples at target 64 (64 + 64 + 22 per epoch) for 3 epochs, with
#: dropout, warmup, clipping and the sqrt LR rule, so that every piece of state a resume restores matters
RESUME_SAMPLES, RESUME_TARGET, RESUME_EPOCHS = 150, 64, 3


def resumable_run(checkpoint_dir: str | Path, loss_fn: Callable[..., Any] | None = None,
                  **overrides: Any) -> tuple[Any, Mlp]:
    """The run the SIGKILL tests interrupt: called alike by the killed child and the resuming parent."""
    import autoaccum
    from autoaccum.plan.plan import Plan

    model = Mlp(p=0.2, seed=3)
    kwargs: dict[str, Any] = dict(
        loss_fn=loss_fn or cross_entropy, plan=Plan.for_target(RESUME_TARGET, 16), epochs=RESUME_EPOCHS,
        lr=0.05, base_batch=32, lr_rule="sqrt", warmup_steps=2, max_grad_norm=1.0, seed=7,
        checkpoint_dir=checkpoint_dir, checkpoint_every=1, resume="auto", progress=False)
    kwargs.update(overrides)
    result = autoaccum.fit(model, mlp_data(RESUME_SAMPLES), RESUME_TARGET, **kwargs)
    return result, model
