"""OOMGuard in a plain PyTorch training loop: exact accumulation, and recovery from an OOM.

Your loop keeps its model, optimizer, data and loss; ``guard.step(batch, loss_fn)`` replaces
``loss.backward(); optimizer.step()`` for one global batch. Here the CPU plays a small GPU
(``autoaccum.emulated_budget``): the first micro-batch size does not fit once AdamW has created its
state, the guard halves it and replays the same step on the same samples. At the end the weights
are compared with a run that never ran out of memory: an OOM changes nothing but speed.

    python examples/existing_loop.py
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import autoaccum

TARGET_BATCH = 256


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)  # a mean over the micro-batch: the guard weights it


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, budget: str | None) -> autoaccum.OOMGuard:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = None if budget is None else autoaccum.emulated_budget(budget, model, optimizer)
    guard = autoaccum.OOMGuard(model, optimizer, target_batch=TARGET_BATCH, micro_batch=TARGET_BATCH, meter=meter)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    with meter if meter is not None else torch.enable_grad():
        for step, start in enumerate(range(0, len(x), TARGET_BATCH)):
            idx = order[start:start + TARGET_BATCH]
            stats = guard.step((x[idx], y[idx]), loss_fn)  # one optimizer step on all 256 samples
            for change in stats.changes:
                print(f"  step {step + 1}: {change.describe()}")
            if budget is not None and step % 4 == 0:
                print(f"  step {step + 1}: loss {stats.loss:.4f}, {stats.plan.describe()}, "
                      f"peak {autoaccum.format_bytes(stats.peak_bytes)}, attempts {stats.attempts}")
    return guard


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(4096, 32, dtype=torch.float64)
    y = (x @ torch.randn(32, 8, dtype=torch.float64)).argmax(dim=1)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 8)).double()
    reference = copy.deepcopy(model)

    print("training under an emulated 1.8 MiB budget:")
    guard = train(model, x, y, budget="1.8MiB")
    train(reference, x, y, budget=None)  # the same steps with all 256 samples at once, no budget

    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    print(f"{guard.steps} optimizer steps, {guard.ooms} OOM(s) recovered, plan now {guard.plan.describe()}")
    print(f"largest weight difference from the run without OOMs: {diff:.1e} (fp64)")


if __name__ == "__main__":
    main()
