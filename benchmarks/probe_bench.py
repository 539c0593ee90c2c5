"""Probe benchmark: what the probe costs, in optimizer steps of the plan it picks, and the limit it
finds against brute force.

CPU, emulated budget (the tracked counter raises torch.OutOfMemoryError at the allocation that crosses
it). Per model, budget and target: the probe's wall and CPU time, passes, OOMs and largest fitting
micro-batch; one optimizer step of its plan (guarded, fastest of 3 after 2 warm-up); the probe in
step-equivalents; brute force: the largest micro-batch whose two accumulation steps (two
forward/backward passes, then AdamW) of a fresh model run under ``budget * (1 - headroom)``.

    python benchmarks/probe_bench.py [--json-only] [--threads N]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import bench_main, classify, hand_step, largest_fitting, markdown_table, mlp, seeded, vectors
from headtohead.workloads import ConvBN
from torch import nn

import autoaccum
from autoaccum import emulated_budget
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss
from autoaccum.plan.task import Task
from autoaccum.search.throughput import measure

HEADROOM = 0.1
UPPER = 4096  # brute force stops doubling here
GOAL_STEP_EQUIVALENTS = 3.0  # the probe costs at most 3 optimizer steps of its plan ...
GOAL_FOUND_SHARE = 0.95  # ... with 0 OOMs, finding at least 95% of the brute-force limit


@dataclass
class Shape:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], object]
    loss_fn: Callable[[nn.Module, object], torch.Tensor]
    budgets: tuple[tuple[str, int], ...]  # (budget, target batch)


def _image_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)


SHAPES = (
    Shape("mlp 256-512-512-10", lambda: mlp(256, 512), lambda b: vectors(b, 256, seed=b), classify,
          (("16MiB", 4096), ("40MiB", 16384))),
    Shape("tinygpt (demo)", seeded(TinyGPT), lambda b: synthetic_tokens(b, seed=b), token_loss,  # 2 x 128, 64 tok
          (("32MiB", 96), ("64MiB", 256))),
    Shape("cnn 32x32 + batchnorm", seeded(lambda: ConvBN(16, 32)), _image_batch, classify,
          (("16MiB", 256), ("64MiB", 1024))),
)


def _runs_under(shape: Shape, b: int, budget_bytes: int) -> bool:
    """Two accumulation steps at micro-batch ``b`` of a fresh model (the benchmarks' hand-written step over
    the same batch twice: the second forward/backward runs with the first's gradients in memory), each
    ending in the AdamW step."""
    model = shape.make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        with emulated_budget(budget_bytes, model, optimizer):
            batch = shape.make_batch(b)
            for _ in range(2):
                hand_step(model, optimizer, [batch, batch], shape.loss_fn)
    except torch.OutOfMemoryError:
        return False
    return True


def brute_force(shape: Shape, usable_bytes: int) -> tuple[int, int]:
    """(largest micro-batch that runs under ``usable_bytes``, runs spent finding it): doubling up to
    ``UPPER``, then bisection, checked at ``b`` and ``b + 1``; 0 if none runs."""
    best, runs = largest_fitting(lambda b: _runs_under(shape, b, usable_bytes), UPPER)
    if best and best < UPPER and not (_runs_under(shape, best, usable_bytes)
                                      and not _runs_under(shape, best + 1, usable_bytes)):
        raise RuntimeError(f"{shape.name}: memory is not monotone in the micro-batch near {best}")
    return best, runs + (2 if best and best < UPPER else 0)


def _probe(shape: Shape, budget_bytes: int, target: int) -> dict:
    cpu = time.process_time()
    report = autoaccum.probe(model=shape.make_model(), loss_fn=shape.loss_fn, make_batch=shape.make_batch,
                             target_batch=target, budget=budget_bytes, headroom=HEADROOM)
    return {"wall_time_s": report.wall_time_s, "cpu_time_s": time.process_time() - cpu, "passes": report.probe_steps,
            "ooms": report.probe_ooms, "sizes": [c.micro_batch for c in report.candidates],
            "max_fitting": report.max_fitting_micro_batch, "plan_micro": report.plan.micro_batch,
            "plan_accum": report.plan.accum_steps}


def _step(shape: Shape, budget_bytes: int, target: int, micro: int) -> dict:
    """One optimizer step of ``target`` at ``micro`` (all its micro-batches), fastest of 3 after 2 warm-up."""
    task = Task(model=shape.make_model(), loss_fn=shape.loss_fn, make_batch=shape.make_batch)
    out = {}
    for clock in ("wall", "cpu"):
        m = measure(task, target, micro, budget=budget_bytes, headroom=HEADROOM, warmup_steps=2, measure_steps=3,
                    clock=clock)
        if not m.ok:
            raise RuntimeError(f"{shape.name}: the plan's micro-batch {micro} did not run as a guarded step: "
                               f"{m.status}")
        out[f"{clock}_s"] = m.step_time_s
    return out


def run(args: object = None) -> dict:
    # one-time costs (the dispatch mode's first use, kernel set-up) must not land on the first row
    warm = SHAPES[0]
    autoaccum.probe(model=warm.make_model(), loss_fn=warm.loss_fn, make_batch=warm.make_batch, target_batch=4,
                    budget="1GiB")
    rows = []
    for shape in SHAPES:
        for budget, target in shape.budgets:
            budget_bytes = autoaccum.parse_bytes(budget)
            usable = int(budget_bytes * (1 - HEADROOM))
            p = _probe(shape, budget_bytes, target)
            step = _step(shape, budget_bytes, target, p["plan_micro"])
            p.update(step_wall_s=step["wall_s"], step_cpu_s=step["cpu_s"],
                     step_equivalents=p["wall_time_s"] / step["wall_s"],
                     step_equivalents_cpu=p["cpu_time_s"] / step["cpu_s"])
            best, brute_runs = brute_force(shape, usable)
            met = (max(p["step_equivalents"], p["step_equivalents_cpu"]) <= GOAL_STEP_EQUIVALENTS and p["ooms"] == 0
                   and p["max_fitting"] >= GOAL_FOUND_SHARE * best)
            rows.append({"model": shape.name, "budget": budget, "usable_bytes": usable, "target_batch": target,
                         "probe": p, "brute_force": {"largest": best, "runs": brute_runs}, "goal_met": met})
    return {"benchmark": "probe", "device": "cpu (tracked meter, emulated budget)", "headroom": HEADROOM,
            "rows": rows, "goal_met": sum(r["goal_met"] for r in rows)}


def table(result: dict) -> str:
    lines = [("model", "budget", "target", "wall s", "CPU s", "passes", "OOMs", "found", "brute force", "found/brute",
              "plan", "step wall s", "step-eq (wall)", "step-eq (CPU)")]
    for r in result["rows"]:
        p, b = r["probe"], r["brute_force"]["largest"]
        lines.append((r["model"], r["budget"], str(r["target_batch"]), f"{p['wall_time_s']:.2f}",
                      f"{p['cpu_time_s']:.2f}", str(p["passes"]), str(p["ooms"]), str(p["max_fitting"]), str(b),
                      f"{p['max_fitting'] / b:.1%}", f"{p['plan_micro']} x {p['plan_accum']}",
                      f"{p['step_wall_s']:.3f}", f"{p['step_equivalents']:.2f}", f"{p['step_equivalents_cpu']:.2f}"))
    return (markdown_table(lines) + f"\n\nGoal (<= {GOAL_STEP_EQUIVALENTS:g} step-equivalents by wall and CPU time, "
            f"0 OOMs, found >= {GOAL_FOUND_SHARE:.0%} of brute force): met on {result['goal_met']} of "
            f"{len(result['rows'])} rows.")


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table))
