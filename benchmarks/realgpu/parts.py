"""The measured parts of one row, each a plain dict saved as soon as it is done.

:func:`estimate` (``probe(estimate=True)``, on fake tensors of the model's device), :func:`squeezed`
(under the squeeze: the probe, brute force around its answer, and fit against the hand-written loop)
and :func:`sweep` (balanced plans at the exact target, timed as search trials are).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from common import quiet

import autoaccum
from autoaccum.plan.batch import map_tensors
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import Task
from autoaccum.search.knobs import Knobs
from autoaccum.search.throughput import make_bench
from autoaccum.step.losses import default_loss

from .brute import brute_around, run_try
from .loops import compare
from .models import Built
from .squeeze import Squeezed, release, squeeze

__all__ = ["Settings", "estimate", "squeezed", "sweep"]


@dataclass(frozen=True)
class Settings:
    """How much each part measures: a GPU session holds every row and the GPU tests in about five
    minutes; the CPU smoke run takes seconds.

    Attributes:
        headroom: the fraction of the budget kept free, for the probe and the brute force alike.
        max_tries: tries of the brute-force search around the probe's answer.
        sweep_plans, sweep_floor: the balanced plans timed, nearest the limit first, down to
            ``1 / sweep_floor`` of it.
        warmup_steps, measure_steps: a timing's optimizer steps before timing (the optimizer's state
            appears in the first, its peak in the second), and timed (the fastest counts).
        confirm_rounds: how often the sweep's fastest plans and the pick are timed again, in turn.
        compare_rounds: rounds of fit against the hand-written loop (``loops``).
    """

    headroom: float = 0.1
    max_tries: int = 12
    sweep_plans: int = 3
    sweep_floor: int = 2
    warmup_steps: int = 2
    measure_steps: int = 1
    confirm_rounds: int = 1
    compare_rounds: int = 3

    @classmethod
    def for_size(cls, size: str) -> Settings:
        """The GPU settings; at ``cpu`` size one round of fit against the hand loop."""
        return cls() if size == "gpu" else cls(compare_rounds=1)

    def to_dict(self) -> dict[str, Any]:
        """As saved in a results file (compared with a file's settings before it is reused)."""
        return dataclasses.asdict(self)


def _task(built: Built) -> Task:
    """The probe's task. Its batches are the first rows of the data ``fit`` trains on (made once), as
    ``fit``'s own probe slices a dataset (generating each size's batch afresh would time the generator)."""
    data = built.data
    return Task(model=built.model, loss_fn=default_loss, name=built.workload.name,
                make_batch=lambda b: map_tensors(data, lambda t: t[:b]))


def estimate(built: Built, device: torch.device, settings: Settings) -> dict[str, Any]:
    """``probe(estimate=True)`` for the squeeze's budget: no memory used, no step run."""
    w = built.workload
    started = time.perf_counter()
    with quiet():
        report = autoaccum.probe(_task(built), target_batch=w.target_batch, budget=w.budget_bytes,
                                 headroom=settings.headroom, estimate=True, precision=w.precision)
    seconds = time.perf_counter() - started
    release(device)
    return {"report": report.to_dict(), "seconds": seconds}


def _probe(built: Built, device: torch.device, sq: Squeezed, settings: Settings) -> dict[str, Any]:
    torch.manual_seed(0)
    try:
        with quiet():
            report = autoaccum.probe(_task(built), target_batch=built.workload.target_batch,
                                     budget=sq.probe_budget, headroom=settings.headroom,
                                     precision=built.workload.precision)
    except autoaccum.DoesNotFitError as exc:
        return {"error": f"DoesNotFitError: {str(exc).splitlines()[0]}"}
    finally:
        release(device)
    return report.to_dict()


def found(report: dict[str, Any]) -> int | None:
    """The largest micro-batch the probe measured to fit."""
    return max((c["micro_batch"] for c in report.get("candidates", ()) if c["status"] == "ok"), default=None)


def squeezed(built: Built, device: torch.device, settings: Settings) -> dict[str, Any]:
    """The probe, brute force around its answer, and fit against the hand loop, all under the squeeze
    (the other process on CUDA, the emulated budget on a CPU)."""
    w = built.workload
    kind = "process" if device.type == "cuda" else "budget"
    started = time.perf_counter()
    compared = None
    with squeeze(kind, w.budget_bytes, device) as sq:
        usable = int(sq.true_budget_bytes * (1 - settings.headroom))
        report = _probe(built, device, sq, settings)
        timings = {"probe_s": time.perf_counter() - started}

        def attempt(b: int) -> Any:
            return run_try(built, default_loss, b, device, usable, sq.emulate)

        start = found(report) or built.smallest
        search = brute_around(attempt, start, built.smallest, w.target_batch, settings.max_tries)
        tried = {t.micro_batch for t in search.tries}
        # more sizes that fit, for the estimate's error (not part of the search)
        extra = [attempt(b) for b in sorted({max(built.smallest, start // 2), max(built.smallest, start // 4)})
                 if b not in tried and b < start]
        timings["brute_s"] = time.perf_counter() - started - timings["probe_s"]
        if "error" not in report:
            compared = compare(built, device, report, settings.compare_rounds, sq.probe_budget, settings.headroom)
        timings["compare_s"] = time.perf_counter() - started - timings["probe_s"] - timings["brute_s"]
    return {"kind": kind, "true_budget_bytes": sq.true_budget_bytes, "usable_bytes": usable,
            "enforced_by": sq.enforced_by, "probe": report, "brute_force": search.to_dict(),
            "extra_tries": [dataclasses.asdict(t) for t in extra], "compare": compared, "timings": timings,
            "wall_time_s": time.perf_counter() - started}


def sweep_sizes(target: int, smallest: int, top: int, floor: int, most: int) -> tuple[list[int], bool]:
    """The balanced micro-batches ``ceil(target / k)`` from ``top`` down to ``top / floor`` (the largest
    ``most`` of them), and whether ``most`` cut the list."""
    sizes = sorted({math.ceil(target / k) for k in range(1, target + 1)}, reverse=True)
    sizes = [b for b in sizes if max(smallest, top // floor) <= b <= top]
    return sizes[:most], len(sizes) > most


def sweep(built: Built, device: torch.device, squeezed: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Every balanced plan up to the brute-force limit, and the probe's pick, timed as search trials are
    (real guarded steps of the whole target, fastest of ``measure_steps``); then the three fastest under
    the limit and the pick again, ``confirm_rounds`` times in turn. On CUDA it runs unsqueezed (a plan's
    speed does not depend on what else holds memory); on the CPU under the budget."""
    w = built.workload
    limit = squeezed["brute_force"]["limit"]
    picks = [squeezed["probe"]["plan"]["micro_batch"]] if "plan" in squeezed["probe"] else []
    sizes, capped = sweep_sizes(w.target_batch, built.smallest, limit, settings.sweep_floor, settings.sweep_plans)
    usable = int(w.budget_bytes * (1 - settings.headroom)) if device.type != "cuda" else \
        torch.cuda.get_device_properties(device).total_memory
    started = time.perf_counter()
    readings: dict[int, list[float]] = {}
    with quiet():
        bench = make_bench(_task(built), None, w.target_batch, usable, settings.warmup_steps,
                           settings.measure_steps)

        knobs = Knobs(autocast=w.precision)  # type: ignore[arg-type] - a workload's precision

        def measure(b: int) -> None:
            m = bench.run(b, knobs)
            readings.setdefault(b, []).append(m.samples_per_s if m.ok else 0.0)

        for b in dict.fromkeys([*sizes, *picks]):
            measure(b)
        fitting = sorted((b for b in readings if b <= limit), key=lambda b: -max(readings[b]))
        order = sorted({*picks, *fitting[:3]})
        for i in range(settings.confirm_rounds if len(readings) > 1 else 0):  # one plan: nothing to compare
            for b in order[i % len(order):] + order[:i % len(order)]:  # rotate: no size always first
                measure(b)
    bench = None  # the closure held it; its memory is released below
    release(device)
    return {"sizes": sizes, "capped": capped, "floor": settings.sweep_floor, "usable_bytes": usable,
            "readings": {str(b): r for b, r in readings.items()}, "wall_time_s": time.perf_counter() - started,
            "accum_steps": {str(b): Plan.for_target(w.target_batch, b).accum_steps for b in readings}}
