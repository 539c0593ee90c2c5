"""Search benchmark: the probe's pick and the search's winner against an exhaustive sweep.

CPU, emulated budget. Per workload: the probe's pick; ``autoaccum.search`` over the micro-batch alone
(fp32) and over its default space (micro-batch x checkpointing x autocast); a sweep of every distinct
plan up to the first that does not fit, measured as a trial is. Then the named configurations and the
sweep's ``--sweep-top`` best are measured again in ``--rounds`` interleaved rounds: *samples/s* is the
median reading, *vs sweep* its ratio to the sweep's best (the goal: the micro-batch winner >= 0.97),
*paired* the median per-round ratio with its standard error. ``--clock cpu`` (the default, one thread)
times steps by this process's CPU time, which other processes on a shared machine do not inflate.

    python benchmarks/search_bench.py [--clock cpu] [--n-trials 20] [--rounds 7] [--runs 1] [--json-only]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import bench_main, classify, markdown_table, mlp, vectors
from torch import nn

import autoaccum
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import Task
from autoaccum.search import SearchSpace, search
from autoaccum.search.compare import paired_ratios
from autoaccum.search.knobs import Knobs
from autoaccum.search.throughput import make_bench

HEADROOM = 0.1
MEASURE: dict = {"warmup_steps": 2, "measure_steps": 5}


@dataclass
class Workload:
    name: str
    make_task: Callable[[], Task]
    target_batch: int
    budget: int


def _gpt_task() -> Task:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=128, seq_len=32, dim=64, layers=2, heads=4)
    return Task(model=model, loss_fn=token_loss,
                make_batch=lambda b: synthetic_tokens(b, seq_len=32, vocab_size=128, seed=b), name="tiny-gpt")


def _mlp_task() -> Task:
    model = mlp(64, 4096, depth=1, act=nn.GELU)  # wide: activations dominate
    return Task(model=model, loss_fn=classify, make_batch=lambda b: vectors(b, 64, seed=b), name="mlp")


WORKLOADS = (
    Workload("tiny-gpt (2x64, 32 tok), target 96, 8 MiB", _gpt_task, 96, 8 * 2**20),
    Workload("mlp 64-4096-10, target 256, 8 MiB", _mlp_task, 256, 8 * 2**20),
)


def _sweep(task: Task, target: int, usable: int) -> tuple[list[dict], float]:
    """Every distinct plan from micro-batch 1 up, measured like a trial, until the first that does not fit."""
    started = time.perf_counter()
    bench = make_bench(task, None, target, usable, **MEASURE)
    rows: list[dict] = []
    seen: set[int] = set()
    for size in range(1, target + 1):
        micro = Plan.for_target(target, size).micro_batch  # the even cut: 50 of 256 runs as 43 x 6
        if micro in seen:
            continue
        seen.add(micro)
        m = bench.run(micro, Knobs())
        rows.append({"micro_batch": micro, "status": m.status, "samples_per_s": m.samples_per_s,
                     "peak_bytes": m.peak_bytes})
        if not m.ok:
            break
    return rows, time.perf_counter() - started


def _verify(task: Task, target: int, usable: int, configs: list[tuple[int, Knobs]],
            rounds: int) -> dict[tuple[int, Knobs], list[float]]:
    """Each distinct configuration measured ``rounds`` times, interleaved (the same noise for all)."""
    bench = make_bench(task, None, target, usable, **MEASURE)
    runs: dict[tuple[int, Knobs], list[float]] = {c: [] for c in dict.fromkeys(configs)}
    order = list(runs)
    for i in range(rounds):
        for micro, knobs in order[i % len(order):] + order[:i % len(order)]:  # rotate: no config always first
            m = bench.run(micro, knobs)
            runs[(micro, knobs)].append(m.samples_per_s if m.ok else 0.0)
    return runs


def _paired(runs: list[float], reference: list[float]) -> tuple[float, float]:
    """(median per-round ratio to ``reference``, its standard error from the ratios' MAD)."""
    ratios = paired_ratios(runs, reference)
    if not ratios:
        return 0.0, float("inf")
    ratio = statistics.median(ratios)
    mad = statistics.median(abs(r - ratio) for r in ratios)
    return ratio, math.sqrt(math.pi / 2) * 1.4826 * mad / math.sqrt(len(ratios))


def _searched(result: Any) -> dict:
    return {"wall_time_s": result.wall_time_s, "trials": result.n_trials_run, "stopped": result.stopped,
            "samples_per_s": result.samples_per_s, "comparison": [c.to_dict() for c in result.comparison]}


def run_workload(w: Workload, n_trials: int, rounds: int, sweep_top: int) -> dict:
    task = w.make_task()
    usable = int(w.budget * (1 - HEADROOM))
    fixed = SearchSpace(saver=("none",), autocast=("fp32",), compile=(False,))
    micro_only = search(task, w.target_batch, n_trials=n_trials, budget=w.budget, headroom=HEADROOM, space=fixed,
                        study_name=f"bench-micro-{w.name}", **MEASURE)
    full = search(task, w.target_batch, n_trials=n_trials, budget=w.budget, headroom=HEADROOM,
                  study_name=f"bench-full-{w.name}", **MEASURE)
    sweep_rows, sweep_s = _sweep(task, w.target_batch, usable)
    feasible = [r for r in sweep_rows if r["status"] == "ok"]
    # the sweep's best is decided like the search's: its top readings measured again, in turn
    sweep_top_sizes = [r["micro_batch"] for r in sorted(feasible, key=lambda r: -r["samples_per_s"])[:sweep_top]]
    named = {
        "probe pick": (micro_only.probe_plan.micro_batch, Knobs()),
        "search (micro only)": (micro_only.plan.micro_batch, micro_only.knobs),
        "search (default space)": (full.plan.micro_batch, full.knobs),
    }
    runs = _verify(task, w.target_batch, usable, [*named.values(), *((b, Knobs()) for b in sweep_top_sizes)], rounds)
    median = {c: statistics.median(v) for c, v in runs.items()}
    named["sweep best"] = max(((b, Knobs()) for b in sweep_top_sizes), key=lambda c: median[c])
    sweep = named["sweep best"]
    paired = {c: _paired(v, runs[sweep]) for c, v in runs.items()}
    return {
        "workload": w.name, "target_batch": w.target_batch, "budget_bytes": w.budget, "usable_bytes": usable,
        "largest_feasible_micro_batch": feasible[-1]["micro_batch"],
        "configs": {name: {"micro_batch": c[0], "accum_steps": Plan.for_target(w.target_batch, c[0]).accum_steps,
                           "knobs": c[1].describe(), "samples_per_s": median[c], "runs": runs[c],
                           "spread": min(runs[c]) / max(runs[c]) if max(runs[c]) > 0 else 0.0,
                           "vs_sweep_best": median[c] / median[sweep], "paired_vs_sweep_best": paired[c][0],
                           "paired_noise": paired[c][1]}
                    for name, c in named.items()},
        "search_micro_only": {**_searched(micro_only), "probe_wall_time_s": micro_only.probe_wall_time_s,
                              "finalists": [{"trial": n, "runs": list(r)} for n, r in micro_only.confirmed]},
        "search_default_space": _searched(full),
        "sweep": {"wall_time_s": sweep_s, "plans_measured": len(sweep_rows), "top_plans_verified": sweep_top_sizes,
                  "rows": sweep_rows},
        "goal_met": median[named["search (micro only)"]] >= 0.97 * median[sweep],
    }


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                        help="time steps by wall clock or by this process's CPU time (default cpu: a shared "
                             "machine's other processes do not count; needs --threads 1)")
    parser.add_argument("--n-trials", type=int, default=20, help="search trials (default 20)")
    parser.add_argument("--rounds", type=int, default=7, help="verification rounds per configuration (7)")
    parser.add_argument("--sweep-top", type=int, default=5, help="sweep plans measured again (5)")
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole benchmark this many times (1)")


def run(args: argparse.Namespace) -> dict:
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("search_bench.py: --clock cpu equals elapsed time only with --threads 1")
    MEASURE["clock"] = args.clock
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runs = [[run_workload(w, args.n_trials, args.rounds, args.sweep_top) for w in WORKLOADS] for _ in range(args.runs)]
    return {"benchmark": "search", "autoaccum": autoaccum.__version__, "optuna": optuna.__version__,
            "clock": args.clock, "n_trials": args.n_trials, "rounds": args.rounds, "sweep_top": args.sweep_top,
            "runs": runs, "goal_met": sum(r["goal_met"] for results in runs for r in results),
            "workload_runs": len(WORKLOADS) * args.runs, "load_average_after": os.getloadavg()[0]}


def table(doc: dict) -> str:
    runs = doc["runs"]
    rows = [("run", "workload", "config", "micro", "accum", "knobs", "samples/s", "spread", "vs sweep",
             "paired ± noise", "wall s")]
    for i, results in enumerate(runs, 1):
        for r in results:
            walls = {f"search ({label})": f"{r[key]['wall_time_s']:.1f} ({r[key]['trials']} trials)"
                     for label, key in (("micro only", "search_micro_only"), ("default space", "search_default_space"))}
            walls["sweep best"] = f"{r['sweep']['wall_time_s']:.1f} ({r['sweep']['plans_measured']} plans)"
            for j, (name, c) in enumerate(r["configs"].items()):
                rows.append((str(i) if j == 0 else "", r["workload"] if j == 0 else "", name, str(c["micro_batch"]),
                             str(c["accum_steps"]), c["knobs"], f"{c['samples_per_s']:,.0f}", f"{c['spread']:.2f}",
                             f"{c['vs_sweep_best']:.3f}",
                             f"{c['paired_vs_sweep_best']:.3f} ± {c['paired_noise']:.3f}", walls.get(name, "-")))
    met = [f"run {i} {r['workload']}: {r['goal_met']}" for i, results in enumerate(runs, 1) for r in results]
    return (markdown_table(rows) + f"\n\nThe micro-batch winner >= 0.97 of the sweep's best: {'; '.join(met)} (met in "
            f"{doc['goal_met']} of {doc['workload_runs']} workload-runs).")


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table, options))
