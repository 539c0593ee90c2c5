"""The measured parts of one model's row, each a plain dict saved as soon as it is done.

:func:`estimate` (``probe(estimate=True)``, on fake tensors of the model's device),
:func:`squeezed` (under one squeeze: the probe, brute force, and fit, or fit against the hand loop),
:func:`sweep` (balanced plans at the exact target, timed as search trials are) and :func:`search`
(the optional Optuna search against fp32 at the largest micro-batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import logging.handlers
import math
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import autoaccum
from autoaccum.plan.batch import map_tensors
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import Task
from autoaccum.search.knobs import Knobs
from autoaccum.search.throughput import make_bench
from autoaccum.step.losses import default_loss

from . import loops
from .brute import brute_around, brute_force, run_try
from .models import Built, fresh_model
from .squeeze import SQUEEZES, Squeezed, SqueezeKind, release, squeeze

__all__ = ["Settings", "estimate", "search", "squeezed", "sweep"]

logger = logging.getLogger("real_gpu")


@dataclass(frozen=True)
class Settings:
    """How much each part measures (a GPU model must stay under 10 minutes; the CPU smoke, seconds).

    Attributes:
        headroom: the fraction of the budget kept free, for the probe and the brute force alike.
        fit_steps: steps of ``fit`` on each plan.
        max_tries: tries per brute-force search (doubling to 16384 and bisecting back takes 29).
        sweep_plans, sweep_floor: the balanced plans timed, nearest the largest limit first, down to
            ``1 / sweep_floor`` of it.
        warmup_steps, measure_steps: a timing's optimizer steps before timing (the optimizer's state
            appears in the first, its peak in the second), and timed (the fastest counts).
        confirm_rounds: how often the sweep's fastest plans, the picks, the search's winner and its
            baseline are timed again, in turn.
        search_trials: Optuna trials.
        rows: which set of rows (``issue16``, the default rows, or ``issue40``, which measure less a part so
            that a GPU session holds every row and the GPU tests in about five minutes).
        squeezes: the squeezes run (issue40: the other process on CUDA, the emulated budget on a CPU).
        brute: ``search`` (doubling and bisection, twice) or ``around`` (once, from the probe's answer, and
            tries at half and a quarter of it for the estimate's error).
        compare_rounds: rounds of fit against the hand-written loop (``loops``; 0: none, a plain fit of
            ``fit_steps`` steps instead).
    """

    headroom: float = 0.1
    fit_steps: int = 50
    max_tries: int = 32
    sweep_plans: int = 16
    sweep_floor: int = 4
    warmup_steps: int = 2
    measure_steps: int = 3
    confirm_rounds: int = 2
    search_trials: int = 10
    rows: str = "issue16"
    squeezes: tuple[str, ...] = SQUEEZES
    brute: str = "search"
    compare_rounds: int = 0

    @classmethod
    def for_size(cls, size: str, fit_steps: int | None = None, search_trials: int | None = None,
                 rows: str = "issue16") -> Settings:
        """The GPU defaults; at ``cpu`` size a smoke test of the code paths (one timed step, no confirmation).
        The issue40 rows: one brute-force search around the probe's answer, three plans in the sweep (timed once
        after the two warm-up steps, the fastest and the pick once more), three rounds of fit against the hand
        loop; at ``cpu`` size the emulated budget and one round."""
        if rows == "issue40":
            base = cls(rows=rows, squeezes=("process",) if size == "gpu" else ("budget",), brute="around",
                       max_tries=12, sweep_plans=3, sweep_floor=2, measure_steps=1, confirm_rounds=1,
                       compare_rounds=3 if size == "gpu" else 1, search_trials=0)
        elif rows != "issue16":
            raise ValueError(f"Invalid rows: {rows!r}. Allowed values: issue16, issue40")
        else:
            base = cls() if size == "gpu" else cls(max_tries=24, sweep_plans=2, measure_steps=1, confirm_rounds=0,
                                                     search_trials=4)
        return dataclasses.replace(base, fit_steps=base.fit_steps if fit_steps is None else fit_steps,
                                   search_trials=base.search_trials if search_trials is None else search_trials)

    def to_dict(self) -> dict[str, Any]:
        """As saved in a results file (tuples as lists), so that a file's settings compare equal to these."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def _task(built: Built, device: torch.device) -> Task:
    """The probe's task. Its batches are the first rows of the data ``fit`` trains on (made once), as
    ``fit``'s own probe slices a dataset (generating each size's batch afresh would time the generator)."""
    data = built.data
    return Task(model=fresh_model(built, device), loss_fn=default_loss, name=built.workload.name,
                make_batch=lambda b: map_tensors(data, lambda t: t[:b]))


def _quiet() -> contextlib.ExitStack:
    """Silence the BatchNorm advice and Hugging Face notes a benchmark run would repeat."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def estimate(built: Built, device: torch.device, settings: Settings) -> dict[str, Any]:
    """``probe(estimate=True)`` for the squeezes' budget: no memory used, no step run."""
    w = built.workload
    started = time.perf_counter()
    with _quiet():
        report = autoaccum.probe(_task(built, device), target_batch=w.target_batch, budget=w.budget_bytes,
                                 headroom=settings.headroom, estimate=True, precision=w.precision)
    seconds = time.perf_counter() - started
    release(device)
    return {"report": report.to_dict(), "seconds": seconds}


def _probe(built: Built, device: torch.device, sq: Squeezed, settings: Settings) -> dict[str, Any]:
    torch.manual_seed(0)
    try:
        with _quiet():
            report = autoaccum.probe(_task(built, device), target_batch=built.workload.target_batch,
                                     budget=sq.probe_budget, headroom=settings.headroom,
                                     precision=built.workload.precision)
    except autoaccum.DoesNotFitError as exc:
        return {"error": f"DoesNotFitError: {str(exc).splitlines()[0]}"}
    finally:
        release(device)
    return report.to_dict()


def _step_times(log_file: Path) -> list[float]:
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    return [float(json.loads(line)["step_time_s"]) for line in lines if line.strip()]


def _fit(built: Built, device: torch.device, sq: Squeezed, report: dict[str, Any], settings: Settings) -> dict:
    """``settings.fit_steps`` steps of ``fit`` on the probe's plan under the squeeze: OOMs, peaks, step time."""
    w = built.workload
    # the guard's plan changes, one log record each: kept even when fit raises
    changes, guard_logger = logging.handlers.BufferingHandler(capacity=2**31), logging.getLogger("autoaccum.guard")
    guard_logger.addHandler(changes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    error, result = None, None
    with tempfile.TemporaryDirectory() as tmp, _quiet():
        log_file = Path(tmp) / "steps.jsonl"
        torch.manual_seed(0)
        try:
            result = autoaccum.fit(
                fresh_model(built, device), built.data, w.target_batch,
                loss_fn=default_loss, plan=autoaccum.ProbeReport.from_dict(report), device=device,
                budget=sq.probe_budget, headroom=settings.headroom, max_steps=settings.fit_steps, epochs=None,
                by_length=False, progress=False, verbose=False, log_file=log_file, precision=w.precision)
        except (torch.OutOfMemoryError, autoaccum.AutoAccumError) as exc:  # an OOM the guard did not replay
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        finally:
            guard_logger.removeHandler(changes)
        times = _step_times(log_file)
    release(device)
    steady = times[2:] if len(times) > 2 else times  # the first steps create the optimizer state
    messages = [record.getMessage() for record in changes.buffer]
    return {
        "steps": None if result is None else result.optimizer_steps, "steps_logged": len(times),
        "ooms": result.oom_events if result is not None else sum(" OOM " in f" {m} " for m in messages),
        "plan_changes": messages, "error": error,
        "final_micro_batch": None if result is None else result.final_plan.micro_batch,
        "peak_bytes": None if result is None else result.peak_bytes,
        "reserved_peak_bytes": int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None,
        "step_time_s": statistics.median(steady) if steady else None,
    }


def _found(report: dict[str, Any]) -> int | None:
    return max((c["micro_batch"] for c in report.get("candidates", ()) if c["status"] == "ok"), default=None)


def squeezed(built: Built, kind: SqueezeKind, device: torch.device, settings: Settings) -> dict[str, Any]:
    """Probe, brute force, and fit, all under squeeze ``kind`` (the issue40 rows: fit against the hand loop)."""
    w = built.workload
    started = time.perf_counter()
    compared = None
    with squeeze(kind, w.budget_bytes, device) as sq:
        usable = int(sq.true_budget_bytes * (1 - settings.headroom))
        report = _probe(built, device, sq, settings)
        timings = {"probe_s": time.perf_counter() - started}

        def attempt(b: int) -> Any:
            return run_try(built, default_loss, b, device, usable, sq.emulate)

        start = _found(report)
        if settings.brute == "around" and start is not None:
            searches = [brute_around(attempt, start, built.smallest, w.target_batch, settings.max_tries)]
            tried = {t.micro_batch for t in searches[0].tries}
            # more sizes that fit, for the estimate's error (not part of the search)
            extra = [attempt(b) for b in sorted({max(built.smallest, start // 2), max(built.smallest, start // 4)})
                     if b not in tried and b < start]
        else:
            extra = []
            searches = [brute_force(attempt, built.smallest, w.target_batch, settings.max_tries)
                        for _ in range(2 if settings.brute == "search" else 1)]
        timings["brute_s"] = time.perf_counter() - started - timings["probe_s"]
        if "error" in report:
            fitted = None
        elif settings.compare_rounds:
            compared = loops.compare(built, device, report, settings.compare_rounds, sq.probe_budget, settings.headroom)
            fitted = {"steps": compared["fit_steps"], "ooms": compared["fit_ooms"],
                      "error": "; ".join(compared["fit_errors"]) or None,
                      "peak_bytes": max((r["fit"].get("peak_bytes") or 0 for r in compared["runs"]), default=None),
                      "step_time_s": w.target_batch / compared["fit_samples_per_s"]
                      if compared["fit_samples_per_s"] else None}
        else:
            fitted = _fit(built, device, sq, report, settings)
        timings["fit_s"] = time.perf_counter() - started - timings["probe_s"] - timings["brute_s"]
    return {"kind": kind, "true_budget_bytes": sq.true_budget_bytes, "usable_bytes": usable,
            "enforced_by": sq.enforced_by, "probe": report, "brute_force": [s.to_dict() for s in searches],
            "extra_tries": [dataclasses.asdict(t) for t in extra], "fit": fitted, "compare": compared, "timings": timings, "wall_time_s": time.perf_counter() - started}


def sweep_sizes(target: int, smallest: int, top: int, floor: int, most: int) -> tuple[list[int], bool]:
    """The balanced micro-batches ``ceil(target / k)`` from ``top`` down to ``top / floor`` (the largest
    ``most`` of them), and whether ``most`` cut the list."""
    sizes = sorted({math.ceil(target / k) for k in range(1, target + 1)}, reverse=True)
    sizes = [b for b in sizes if max(smallest, top // floor) <= b <= top]
    return sizes[:most], len(sizes) > most


def sweep(built: Built, device: torch.device, squeezes: dict[str, dict], settings: Settings) -> dict[str, Any]:
    """Every balanced plan up to the largest brute-force limit, and each squeeze's pick, timed as search
    trials are (real guarded steps of the whole target, fastest of ``measure_steps``); then the three
    fastest under each limit and the picks again, ``confirm_rounds`` times in turn. On CUDA it runs
    unsqueezed (a plan's speed does not depend on what else holds memory); on the CPU under the budget."""
    w = built.workload
    limits = {k: min(s["limit"] for s in r["brute_force"]) for k, r in squeezes.items()}
    picks = {k: r["probe"]["plan"]["micro_batch"] for k, r in squeezes.items() if "plan" in r["probe"]}
    sizes, capped = sweep_sizes(w.target_batch, built.smallest, max(limits.values()), settings.sweep_floor,
                                settings.sweep_plans)
    usable = int(w.budget_bytes * (1 - settings.headroom)) if device.type != "cuda" else \
        torch.cuda.get_device_properties(device).total_memory
    started = time.perf_counter()
    readings: dict[int, list[float]] = {}
    with _quiet():
        bench = make_bench(_task(built, device), None, w.target_batch, usable, settings.warmup_steps,
                           settings.measure_steps)

        knobs = Knobs(autocast=w.precision)  # type: ignore[arg-type] - a workload's precision

        def measure(b: int) -> None:
            m = bench.run(b, knobs)
            readings.setdefault(b, []).append(m.samples_per_s if m.ok else 0.0)

        for b in dict.fromkeys([*sizes, *picks.values()]):
            measure(b)
        again = set(picks.values())
        for limit in limits.values():
            fitting = sorted((b for b in readings if b <= limit), key=lambda b: -max(readings[b]))
            again.update(fitting[:3])
        order = sorted(again)
        for i in range(settings.confirm_rounds if len(readings) > 1 else 0):  # one plan: nothing to compare
            for b in order[i % len(order):] + order[:i % len(order)]:  # rotate: no size always first
                measure(b)
    bench = None  # the closure held it; its memory is released below
    release(device)
    return {"sizes": sizes, "capped": capped, "floor": settings.sweep_floor, "usable_bytes": usable,
            "readings": {str(b): r for b, r in readings.items()}, "wall_time_s": time.perf_counter() - started,
            "accum_steps": {str(b): Plan.for_target(w.target_batch, b).accum_steps for b in readings}}


def search(built: Built, device: torch.device, budget_row: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The Optuna search (micro-batch x checkpointing x autocast; compile left out: compiling takes about a
    minute per trial) from squeeze (iii)'s probe report; then its winner and fp32 at the largest micro-batch
    that fits, timed alike, in turn (``confirm_rounds + 1`` times each, the fastest reading counts)."""
    from autoaccum.search import SearchSpace

    report = autoaccum.ProbeReport.from_dict(budget_row["probe"])
    w = built.workload
    task = _task(built, device)
    optuna_logger = logging.getLogger("optuna")
    level = optuna_logger.level
    optuna_logger.setLevel(logging.WARNING)  # one INFO line per trial otherwise
    try:
        with _quiet():
            result = autoaccum.search(task, w.target_batch, report=report, n_trials=settings.search_trials,
                                      space=SearchSpace(compile=(False,)), confirm_top=2, confirm_rounds=2,
                                      warmup_steps=settings.warmup_steps, measure_steps=settings.measure_steps)
            bench = make_bench(task, None, w.target_batch, report.usable_bytes, settings.warmup_steps,
                               settings.measure_steps)
            largest = report.max_fitting_micro_batch
            configs = {"winner": (result.plan.micro_batch, result.knobs), "fp32_largest": (largest, Knobs())}
            readings: dict[str, list[Any]] = {name: [] for name in configs}
            for _ in range(settings.confirm_rounds + 1):
                for name, (micro, knobs) in configs.items():
                    readings[name].append(bench.run(micro, knobs))
    finally:
        optuna_logger.setLevel(level)
    bench = None  # the closure held it; its memory is released below
    release(device)
    best = {name: max((m.samples_per_s or 0.0 for m in runs), default=0.0) for name, runs in readings.items()}
    return {"winner": {"plan": result.plan.to_dict(), "knobs": result.knobs.describe(),
                       "samples_per_s": best["winner"], "search_samples_per_s": result.samples_per_s},
            "fp32_largest": {"micro_batch": largest, "plan": Plan.for_target(w.target_batch, largest).to_dict(),
                             "status": [m.status for m in readings["fp32_largest"]],
                             "samples_per_s": best["fp32_largest"]},
            "speedup": best["winner"] / best["fp32_largest"] if best["fp32_largest"] else None,
            "trials": result.n_trials_run, "stopped": result.stopped, "wall_time_s": result.wall_time_s}
