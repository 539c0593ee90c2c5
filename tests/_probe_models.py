"""Small deterministic tasks and a brute-force fit check for the probe tests and the benchmark.

The brute force runs real training steps of a fresh copy of the model under an emulated budget
(``autoaccum.emulated_budget``) and shares no code with the probe's search.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from autoaccum import TrackedMemory, emulated_budget
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss


def mlp(in_dim: int = 32, hidden: int = 64, out_dim: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, out_dim))


def convnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 8))


def image_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, 8, 8, generator=g), torch.randint(0, 8, (b,), generator=g)


def stateful_mlp(seed: int = 0) -> nn.Module:
    """BatchNorm (running stats change in every training step) and Dropout (draws from the RNG).
    The batch norm runs over 4 channels of 64 features, so one sample is a valid batch."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(4), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 8))


def stateful_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 4, 32, generator=g), torch.randint(0, 8, (b,), generator=g)


def mlp_batch(in_dim: int = 32, out_dim: int = 8) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def make(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, in_dim, generator=g), torch.randint(0, out_dim, (b,), generator=g)
    return make


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def tiny_gpt(seed: int = 0, **kwargs: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(**{"vocab_size": 64, "seq_len": 16, "dim": 32, "layers": 1, "heads": 2, **kwargs})


def gpt_batch(seq_len: int = 16, vocab_size: int = 64) -> Callable[[int], torch.Tensor]:
    return lambda b: synthetic_tokens(b, seq_len=seq_len, vocab_size=vocab_size, seed=b)


gpt_loss = token_loss


def runs_under(model: nn.Module, make_batch: Callable, loss_fn: Callable, micro_batch: int, budget_bytes: int,
               steps: int = 2) -> bool:
    """True when ``steps`` full accumulation steps of a fresh copy of ``model`` with a fresh AdamW
    run at ``micro_batch`` without an emulated OOM. A step is what the guard runs when the target
    needs more than one micro-batch: two forward/backward passes summing into the gradients (the
    second with the first's gradients in memory), then the AdamW step."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        with emulated_budget(budget_bytes, model, optimizer):
            batch = make_batch(micro_batch)
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                for _micro in range(2):
                    loss = loss_fn(model, batch)
                    loss.backward()
                    del loss
                optimizer.step()
    except torch.OutOfMemoryError:
        return False
    return True


def largest_fitting(model: nn.Module, make_batch: Callable, loss_fn: Callable, budget_bytes: int,
                    limit: int = 4096) -> int:
    """The largest micro-batch for which :func:`runs_under` holds: doubling, then bisection; 0 if none.
    Checked at the end: it runs and one more sample does not."""
    def ok(b: int) -> bool:
        return runs_under(model, make_batch, loss_fn, b, budget_bytes)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    assert ok(lo) and not ok(lo + 1)
    return lo


def measure_phases(model: nn.Module, make_batch: Callable, loss_fn: Callable, micro_batch: int,
                   steps: int = 2) -> tuple[int, int]:
    """(forward/backward peak, optimizer-step peak) in bytes over ``steps`` training steps of a fresh
    copy of ``model`` with a fresh AdamW, counted by the tracked meter."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters())
    fwd_bwd = opt = 0
    with TrackedMemory().track(model, optimizer) as mem:
        batch = make_batch(micro_batch)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            mem.reset_peak()
            loss = loss_fn(model, batch)
            loss.backward()
            del loss
            fwd_bwd = max(fwd_bwd, mem.peak_bytes)
            mem.reset_peak()
            optimizer.step()
            opt = max(opt, mem.peak_bytes)
    return fwd_bwd, opt
