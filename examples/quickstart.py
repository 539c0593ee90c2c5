"""Quickstart: ``autoaccum.fit`` trains a small classifier at an exact global batch of 256.

The device here is the CPU made to look like a small GPU: ``budget="256KiB"`` is an emulated
memory budget, too small for 256 samples at once, so fit measures a few real training steps,
plans micro-batch x accumulation steps = 256, and trains. The gradient of every optimizer step is
that of one 256-sample batch; only the speed depends on the plan. Runs in seconds:

    python examples/quickstart.py
"""

import logging

import torch
from torch import nn

import autoaccum


def main() -> None:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("autoaccum.fit").setLevel(logging.INFO)  # fit's banner and summary go through logging
    torch.manual_seed(0)
    # 4,096 points in 20 dimensions, 4 classes given by a random linear map
    x = torch.randn(4096, 20)
    y = (x @ torch.randn(20, 4)).argmax(dim=1)
    model = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 4))

    result = autoaccum.fit(model, (x, y), target_batch=256, lr=1e-3, base_batch=64, lr_rule="sqrt",
                           epochs=5, budget="256KiB")

    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    plan = result.final_plan
    print(f"plan: {plan.describe()} (from {result.plan_source}, {result.probe_time_s:.2f} s of probing)")
    print(f"{result.optimizer_steps} steps, {result.samples_seen:,} samples, lr {result.lr:.2g}, "
          f"final loss {result.final_loss:.3f}, train accuracy {accuracy:.1%}, "
          f"{result.samples_per_s:,.0f} samples/s, {result.oom_events} OOMs recovered")


if __name__ == "__main__":
    main()
