"""autoaccum in a typical Accelerate loop: exact global batches and OOM replay, Accelerate's own step.

The change to the loop, three lines::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
  + guard = guard_for(accelerator, model, optimizer)
    for batch in loader:                                # one global batch (this process's share)
  -     with accelerator.accumulate(model):
  -         accelerator.backward(loss_fn(model, batch))
  +     guard.accumulate(batch, loss_fn)                # probes at the first batch; replays on OOM
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

Here the CPU plays a small GPU (``autoaccum.emulated_budget``), which loses memory after 10 steps
(another process took some): the guard replays that step with a smaller micro-batch on the same
samples. The run is compared with Accelerate's own loop on the whole global batch, no budget.

    python examples/accelerate_loop.py
"""

import contextlib
import logging

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import autoaccum
from autoaccum.integrations.accelerate import guard_for

GLOBAL_BATCH = 256


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)  # the mean over the batch it is given


def train(guarded: bool, data: torch.utils.data.TensorDataset) -> tuple[nn.Module, object]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 8)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=16)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = guard_for(accelerator, model, optimizer) if guarded else None
    device = autoaccum.emulated_budget("1.7MiB", model) if guarded else contextlib.nullcontext()
    with device:
        for step, batch in enumerate(loader, 1):
            if guard is not None:
                guard.accumulate(batch, loss_fn)
            else:
                accelerator.backward(loss_fn(model, batch))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if guard is not None and step == 10:
                device.budget_bytes = autoaccum.parse_bytes("1.1MiB")  # the device has less from now on
    return accelerator.unwrap_model(model), guard


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # the guard's plan changes
    torch.manual_seed(0)
    x = torch.randn(4096, 32, dtype=torch.float64)
    y = (x @ torch.randn(32, 8, dtype=torch.float64)).argmax(dim=1)
    data = torch.utils.data.TensorDataset(x, y)

    model, lazy = train(True, data)
    reference, _ = train(False, data)
    guard = lazy.guard
    first = guard.changes[0].old.describe() if guard.changes else guard.plan.describe()
    print(f"first plan ({lazy.plan_source}): {first}")
    print(f"{guard.steps} optimizer steps, {guard.ooms} OOM(s) replayed, plan now {guard.plan.describe()}")
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    print(f"largest weight difference from Accelerate's full-batch loop: {diff:.1e} (fp64)")


if __name__ == "__main__":
    main()
