"""A small MLP and rows with sample ids, for the Lightning and multi-process Accelerate tests (no
transformers import: spawned processes start in seconds).

Each row has 8 features and 4 class targets; with ``padded`` each keeps 1..4 targets and the rest
are -100, so a mean over targets is a token-level loss. fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

N = 64


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 12)).double()


def samples(padded: bool = False, n: int = N) -> list[dict[str, torch.Tensor]]:
    """``n`` rows (the first ``N`` the same whatever ``n``)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        y = torch.randint(0, 3, (4,), generator=g)
        if padded:
            y[int(torch.randint(1, 5, (1,), generator=g)):] = -100
        rows.append({"ids": torch.tensor(i), "x": torch.randn(8, generator=g, dtype=torch.float64), "y": y})
    return rows


def mean_loss(net: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The mean over the batch's targets."""
    return F.cross_entropy(net(batch["x"]).reshape(-1, 3), batch["y"].reshape(-1), ignore_index=-100)


def token_loss(net: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss as a sum over the targets and their count (token-exact across micro-batches)."""
    logits = net(batch["x"]).reshape(-1, 3)
    return (F.cross_entropy(logits, batch["y"].reshape(-1), ignore_index=-100, reduction="sum"),
            batch["y"].ne(-100).sum())
