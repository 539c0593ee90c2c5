"""autoaccum: ``autoaccum.probe`` plans micro x accum from real steps, then ``autoaccum.fit(plan=report)``.

That is what ``fit(budget=...)`` does in one call, split in two so that the probe's cost is reported
apart and training runs on the benchmark's device.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import autoaccum

from ..context import Context, RunResult
from ..recorder import Recorder
from ..workloads import Batch, make_optimizer, slice_batch
from .common import pair_loss


class GlobalBatchIterable:
    """Global batches of ``target`` samples in data order (autoaccum's ``fit`` takes them as given)."""

    def __init__(self, data: Batch, target: int, steps: int) -> None:
        self.data, self.target, self.steps = data, target, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Batch]:
        for k in range(self.steps):
            yield slice_batch(self.data, k * self.target, (k + 1) * self.target)


def run(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    w = ctx.workload
    model = recorder.watch_model(copy.deepcopy(ctx.base).to(ctx.device))
    optimizer = make_optimizer(model)
    recorder.watch_optimizer(optimizer)

    pair = pair_loss(recorder, ctx.device)  # (sum, count): the step divided once by its item count

    first = slice_batch(ctx.data, 0, w.target_batch)
    result = RunResult(model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The probe enforces the same budget with its own counter (an emulated device on CPU).
        report = autoaccum.probe(model=model, loss_fn=pair, make_batch=lambda b: slice_batch(first, 0, b),
                                 optimizer=optimizer, target_batch=w.target_batch, budget=ctx.budget_bytes)
        result.find_steps, result.find_time_s, result.find_ooms = report.probe_steps, report.wall_time_s, \
            report.probe_ooms
        recorder.phase = "train"
        recorder.new_attempt()
        budget.track(model, optimizer)
        with budget:
            fitted = autoaccum.fit(model, GlobalBatchIterable(ctx.data, w.target_batch, ctx.steps), w.target_batch,
                                   loss_fn=pair, optimizer=optimizer, plan=report, max_steps=ctx.steps,
                                   epochs=None, device=ctx.device, progress=False)
    result.micro_batch, result.planned_micro = fitted.final_plan.micro_batch, report.plan.micro_batch
    result.train_ooms, result.saver = fitted.oom_events, fitted.final_plan.saver
    result.notes.append(f"probe: largest fitting micro-batch {report.max_fitting_micro_batch} under "
                        f"{autoaccum.format_bytes(report.usable_bytes)} (budget less {report.headroom:.0%} headroom); "
                        f"plan {report.plan.describe()}; final {fitted.final_plan.describe()}"
                        + "".join(f"; {saver} did not fit one sample" for saver, _ in report.savers_tried))
    result.notes.extend(f"plan change: {c.describe()}" for c in fitted.plan_changes)
    result.notes.extend(f"warning: {str(c.message)[:90]}..." for c in caught if "BatchNorm" in str(c.message))
    return result
