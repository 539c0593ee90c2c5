"""Probe benchmark (issues 2 and 15): what the probe costs in optimizer steps of the plan it picks,
its OOMs, and the limit it finds against brute force -- the probe of issue 15 (one pass per size)
against the schedule before it (``steps_per_size=2``: a warm-up pass and a timed pass per size),
measured side by side in one run.

For each model shape, emulated budget and target batch (the tracked counter raises
torch.OutOfMemoryError at the allocation that crosses the budget, so a CPU behaves like a small
device; the targets make the plans need 5-7 micro-steps, with the share above the limit so the
target never caps the search):

- probe, old and new (the order alternating between rows, each on a fresh model): wall time and
  this process's CPU time, forward/backward passes, OOMs it triggered, the sizes it measured, the
  largest size it found to fit (``max_fitting_micro_batch``) and its plan;
- step: one optimizer step of that plan (all its micro-batches), as a search trial measures it
  (``autoaccum.search.throughput.measure``: guarded, accumulated steps, the fastest of 3 timed after 2
  warm-up, timed without the counter -- the fastest a training step runs here, so the ratio is
  the conservative one); by the wall clock and by CPU time;
- step-equivalents: probe time / step time (wall / wall, and CPU / CPU);
- brute force: the largest micro-batch that truly runs two full accumulation steps (two
  forward/backward passes summed into the gradients, then the AdamW step) of a fresh model copy
  under ``budget * (1 - headroom)``, found by doubling + bisection over real runs and checked at
  ``b`` and ``b + 1``.

Cold start (``--cold N``, default 3): the demo probe of the README (``autoaccum probe --budget
64MiB``: TinyGPT, target 256) in fresh processes, old and new alternating, each followed by a
second (warm) probe and its plan's step; and the time torch takes to import ``torch._dynamo`` in a
fresh process, which the first optimizer built in a process pays (``Optimizer.add_param_group`` is
wrapped in ``torch._disable_dynamo``): the CLI's probe builds the demo's optimizer, so its first
probe pays it; ``fit`` builds the optimizer before it probes.

Prints a table, then one JSON document, and writes the sub-section "### Probe cost" of
"## Speed (issue 15)" in benchmarks/RESULTS.md (``--no-write`` to skip; the rest stays as it is). Not part
of the test run.

    python benchmarks/probe_bench.py [--json-only] [--no-write] [--threads N] [--cold N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import autoaccum
from autoaccum import emulated_budget
from autoaccum.cli import TinyGPT, synthetic_tokens, token_loss
from autoaccum.plan.task import Task
from autoaccum.search.throughput import measure
from results_md import RESULTS, SPEED, markdown_table, write_subsection

SECTION = "### Probe cost"  # of SPEED, "## Speed (issue 15)"
HEADROOM = 0.1
UPPER = 4096  # brute force stops doubling here
GOAL_STEP_EQUIVALENTS = 3.0  # issue 15: the probe costs at most 3 optimizer steps of its plan ...
GOAL_FOUND_SHARE = 0.95  # ... with 0 OOMs, finding at least 95% of the brute-force limit
VARIANTS = {"old": 2, "new": None}  # steps_per_size: the schedule before issue 15, and the default


@dataclass
class Shape:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], object]
    loss_fn: Callable[[nn.Module, object], torch.Tensor]
    budgets: tuple[tuple[str, int], ...]  # (budget, target batch)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _mlp_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 256, generator=g), torch.randint(0, 10, (b,), generator=g)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def _image_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)


def _classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT()  # the demo's model: 2 layers, dim 128, 64 tokens


SHAPES = (
    Shape("mlp 256-512-512-10", _mlp, _mlp_batch, _classify, (("16MiB", 4096), ("40MiB", 16384))),
    Shape("tinygpt (demo)", _gpt, lambda b: synthetic_tokens(b, seed=b), token_loss, (("32MiB", 96), ("64MiB", 256))),
    Shape("cnn 32x32 + batchnorm", _cnn, _image_batch, _classify, (("16MiB", 256), ("64MiB", 1024))),
)


def _runs_under(shape: Shape, b: int, budget_bytes: int) -> bool:
    """Two accumulation steps at micro-batch ``b`` of a fresh model: two forward/backward passes
    summing into the gradients (the second runs with the first's in memory), then the AdamW step."""
    model = shape.make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        with emulated_budget(budget_bytes, model, optimizer):
            batch = shape.make_batch(b)
            for _ in range(2):
                optimizer.zero_grad(set_to_none=True)
                for _micro in range(2):
                    loss = shape.loss_fn(model, batch)
                    loss.backward()
                    del loss
                optimizer.step()
    except torch.OutOfMemoryError:
        return False
    return True


def brute_force(shape: Shape, usable_bytes: int, smallest: int = 1) -> tuple[int, int]:
    """(largest micro-batch that runs under ``usable_bytes``, runs spent finding it): doubling from
    ``smallest`` (the smallest size the model trains at), then bisection; 0 if none runs."""
    runs = 0

    def ok(b: int) -> bool:
        nonlocal runs
        runs += 1
        return _runs_under(shape, b, usable_bytes)

    if not ok(smallest):
        return 0, runs
    lo, hi = smallest, 2 * smallest
    while hi <= UPPER and ok(hi):
        lo, hi = hi, 2 * hi
    if hi > UPPER:
        return min(lo, UPPER), runs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if not (ok(lo) and not ok(lo + 1)):
        raise RuntimeError(f"{shape.name}: memory is not monotone in the micro-batch near {lo}")
    return lo, runs


def _probe(shape: Shape, budget_bytes: int, target: int, steps_per_size: int | None) -> dict:
    model = shape.make_model()
    cpu = time.process_time()
    report = autoaccum.probe(model=model, loss_fn=shape.loss_fn, make_batch=shape.make_batch, target_batch=target,
                             budget=budget_bytes, headroom=HEADROOM, steps_per_size=steps_per_size)
    return {"wall_time_s": report.wall_time_s, "cpu_time_s": time.process_time() - cpu, "passes": report.probe_steps,
            "optimizer_steps": report.optimizer_steps, "ooms": report.probe_ooms,
            "sizes": [c.micro_batch for c in report.candidates], "max_fitting": report.max_fitting_micro_batch,
            "plan_micro": report.plan.micro_batch, "plan_accum": report.plan.accum_steps, "fit_note": report.fit_note}


def _step(shape: Shape, budget_bytes: int, target: int, micro: int) -> dict:
    """One optimizer step of ``target`` at ``micro`` (all its micro-batches), fastest of 3 after 2 warm-up."""
    task = Task(model=shape.make_model(), loss_fn=shape.loss_fn, make_batch=shape.make_batch)
    out = {}
    for clock in ("wall", "cpu"):
        m = measure(task, target, micro, budget=budget_bytes, headroom=HEADROOM, warmup_steps=2, measure_steps=3,
                    clock=clock)
        if not m.ok:
            raise RuntimeError(f"{shape.name}: the plan's micro-batch {micro} did not run as a guarded step: {m.status}")
        out[f"{clock}_s"] = m.step_time_s
    return out


def run_rows() -> list[dict]:
    rows = []
    for shape in SHAPES:
        for budget, target in shape.budgets:
            budget_bytes = autoaccum.parse_bytes(budget)
            usable = int(budget_bytes * (1 - HEADROOM))
            order = list(VARIANTS) if len(rows) % 2 == 0 else list(VARIANTS)[::-1]
            probes = {name: _probe(shape, budget_bytes, target, VARIANTS[name]) for name in order}
            steps = {micro: _step(shape, budget_bytes, target, micro)
                     for micro in dict.fromkeys(probes[name]["plan_micro"] for name in order)}
            for p in probes.values():
                step = steps[p["plan_micro"]]
                p.update(step_wall_s=step["wall_s"], step_cpu_s=step["cpu_s"],
                         step_equivalents=p["wall_time_s"] / step["wall_s"],
                         step_equivalents_cpu=p["cpu_time_s"] / step["cpu_s"])
            best, brute_runs = brute_force(shape, usable)
            rows.append({"model": shape.name, "budget": budget, "budget_bytes": budget_bytes, "usable_bytes": usable,
                         "target_batch": target, "params": sum(p.numel() for p in shape.make_model().parameters()),
                         "order": order, "probe": probes, "brute_force": {"largest": best, "runs": brute_runs}})
    return rows


_COLD = """
import json, sys, time
import torch
torch.set_num_threads({threads})
import autoaccum
from autoaccum.cli import demo_task
from autoaccum.search.throughput import measure
task = demo_task()
out = {{}}
for when in ("cold", "warm"):
    cpu = time.process_time()
    report = autoaccum.probe(task, target_batch=256, budget="64MiB", steps_per_size={steps})
    out[when] = {{"wall_time_s": report.wall_time_s, "cpu_time_s": time.process_time() - cpu,
                  "passes": report.probe_steps, "plan_micro": report.plan.micro_batch}}
step = {{c: measure(task, 256, report.plan.micro_batch, budget="64MiB", clock=c).step_time_s for c in ("wall", "cpu")}}
out["step_wall_s"], out["step_cpu_s"] = step["wall"], step["cpu"]
print(json.dumps(out))
"""

_DYNAMO = """
import json, time
import torch
import autoaccum
started = time.perf_counter()
import torch._dynamo
print(json.dumps({"import_s": time.perf_counter() - started}))
"""


def _python(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cold(repeats: int, threads: int) -> dict:
    """The README's demo probe in fresh processes, old and new alternating; torch._dynamo's import apart."""
    readings: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    imports = []
    for i in range(repeats):
        order = list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]
        for name in order:
            readings[name].append(_python(_COLD.format(threads=threads, steps=VARIANTS[name])))
        imports.append(_python(_DYNAMO)["import_s"])
    summary = {}
    for name, runs in readings.items():
        med = statistics.median
        summary[name] = {
            "runs": runs,
            "cold_wall_s": med(r["cold"]["wall_time_s"] for r in runs),
            "cold_cpu_s": med(r["cold"]["cpu_time_s"] for r in runs),
            "warm_wall_s": med(r["warm"]["wall_time_s"] for r in runs),
            "warm_cpu_s": med(r["warm"]["cpu_time_s"] for r in runs),
            "step_wall_s": med(r["step_wall_s"] for r in runs), "step_cpu_s": med(r["step_cpu_s"] for r in runs),
            "cold_step_equivalents": med(r["cold"]["wall_time_s"] / r["step_wall_s"] for r in runs),
            "warm_step_equivalents": med(r["warm"]["wall_time_s"] / r["step_wall_s"] for r in runs),
            "cold_step_equivalents_cpu": med(r["cold"]["cpu_time_s"] / r["step_cpu_s"] for r in runs),
            "warm_step_equivalents_cpu": med(r["warm"]["cpu_time_s"] / r["step_cpu_s"] for r in runs),
            "passes": runs[0]["cold"]["passes"], "plan_micro": runs[0]["cold"]["plan_micro"],
        }
    return {"repeats": repeats, "variants": summary, "dynamo_import_s": statistics.median(imports),
            "dynamo_import_runs": imports}


def run(cold: int, threads: int) -> dict:
    # one-time costs (the dispatch mode's first use, kernel set-up) must not land on the first row
    autoaccum.probe(model=_mlp(), loss_fn=_classify, make_batch=_mlp_batch, target_batch=4, budget="1GiB")
    rows = run_rows()
    return {"version": 2, "kind": "autoaccum.bench.probe", "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "python": platform.python_version(),
            "device": "cpu (tracked meter, emulated budget)", "headroom": HEADROOM, "variants": VARIANTS,
            "rows": rows, "cold": run_cold(cold, threads) if cold else None}


def table(result: dict) -> str:
    head = ("model", "budget", "target", "probe", "wall s", "CPU s", "passes", "OOMs", "sizes", "found", "brute force",
            "found/brute", "plan", "step wall s", "step CPU s", "step-eq (wall)", "step-eq (CPU)")
    lines = [head]
    for r in result["rows"]:
        b = r["brute_force"]["largest"]
        for i, name in enumerate(VARIANTS):
            p = r["probe"][name]
            lines.append((r["model"] if i == 0 else "", r["budget"] if i == 0 else "", str(r["target_batch"]) if i == 0
                          else "", name, f"{p['wall_time_s']:.2f}", f"{p['cpu_time_s']:.2f}", str(p["passes"]),
                          str(p["ooms"]), str(len(p["sizes"])), str(p["max_fitting"]), str(b),
                          f"{p['max_fitting'] / b:.1%}", f"{p['plan_micro']} x {p['plan_accum']}",
                          f"{p['step_wall_s']:.3f}", f"{p['step_cpu_s']:.3f}", f"{p['step_equivalents']:.2f}",
                          f"{p['step_equivalents_cpu']:.2f}"))
    return markdown_table(lines)


def cold_table(result: dict) -> str:
    cold = result["cold"]
    lines = [("probe", "passes", "cold wall s", "cold CPU s", "warm wall s", "warm CPU s", "step wall s", "step CPU s",
              "cold step-eq (wall)", "cold step-eq (CPU)", "warm step-eq (wall)", "warm step-eq (CPU)")]
    for name, v in cold["variants"].items():
        lines.append((name, str(v["passes"]), f"{v['cold_wall_s']:.2f}", f"{v['cold_cpu_s']:.2f}",
                      f"{v['warm_wall_s']:.2f}", f"{v['warm_cpu_s']:.2f}", f"{v['step_wall_s']:.3f}",
                      f"{v['step_cpu_s']:.3f}", f"{v['cold_step_equivalents']:.2f}",
                      f"{v['cold_step_equivalents_cpu']:.2f}", f"{v['warm_step_equivalents']:.2f}",
                      f"{v['warm_step_equivalents_cpu']:.2f}"))
    return markdown_table(lines)


def write_section(result: dict, command: str, path: Path = RESULTS) -> None:
    sequences = "; ".join(f"{r['model']} @ {r['budget']}: " + ", ".join(
        f"{name} {' -> '.join(map(str, r['probe'][name]['sizes']))}" for name in VARIANTS) for r in result["rows"])
    worst = {name: max(r["probe"][name]["step_equivalents"] for r in result["rows"]) for name in VARIANTS}
    met = [r for r in result["rows"] if max(r["probe"]["new"]["step_equivalents"],
                                            r["probe"]["new"]["step_equivalents_cpu"]) <= GOAL_STEP_EQUIVALENTS
           and r["probe"]["new"]["ooms"] == 0
           and r["probe"]["new"]["max_fitting"] >= GOAL_FOUND_SHARE * r["brute_force"]["largest"]]
    load = (f", load average {result['load_average_before'][0]:.1f} before and {result['load_average'][0]:.1f} after"
            if "load_average" in result else "")
    parts = [
        SECTION, "",
        f"Command: `{command}` · {result['date']} · {result['machine']}{load} · torch {result['torch']}, "
        f"python {result['python']}, {result['threads']} intra-op thread(s) · total wall time "
        f"{result['total_wall_time_s']:.0f} s", "",
        "CPU with the tracked meter and an emulated budget (an OOM is raised at the allocation that crosses the "
        f"budget), headroom {result['headroom']:.0%}. *old*: `steps_per_size=2` (the schedule before issue 15: a "
        "warm-up pass and a timed pass per size); *new*: the default (one pass per size: its peak and its time). "
        "Both measure the optimizer phase once (two complete steps at the smallest size). Targets chosen so the "
        "plans need 5-7 micro-steps, with the share above the limit (the target never caps the search).", "",
        table(result), "",
        "Columns: *passes* = forward/backward passes the probe ran (an OOM counts as one); *found* = "
        "`max_fitting_micro_batch`; *brute force* = the largest micro-batch whose two full accumulation steps "
        "(two micro-batches, then AdamW) on a fresh model run under `budget x (1 - headroom)`; *step* = one "
        "optimizer step of the probe's plan (all its micro-batches), guarded, the fastest of 3 after 2 warm-up, "
        "timed without the counter (so the ratio is the conservative one); *step-eq* = probe time / step time. "
        f"Worst row: old {worst['old']:.2f}, new {worst['new']:.2f} step-equivalents (wall).", "",
        f"Goal (issue 15: the new probe at <= {GOAL_STEP_EQUIVALENTS:g} step-equivalents by wall and by CPU time, "
        f"0 OOMs, found >= {GOAL_FOUND_SHARE:.0%} of brute force): met on {len(met)} of {len(result['rows'])} rows.",
        "",
        f"Sizes measured, in order: {sequences}.", "",
    ]
    if result["cold"]:
        cold = result["cold"]
        parts += [
            f"Cold start: the README's demo probe (`autoaccum probe --budget 64MiB`: TinyGPT, target 256) in a fresh "
            f"process, {cold['repeats']} processes per variant alternating, medians; then a second probe in the "
            "same process (warm) and the plan's step.", "",
            cold_table(result), "",
            f"Importing `torch._dynamo` in a fresh process (after `import torch, autoaccum`) took "
            f"{cold['dynamo_import_s']:.2f} s (median of {len(cold['dynamo_import_runs'])}): the first optimizer "
            "built in a process pays it (`Optimizer.add_param_group` is wrapped in `torch._disable_dynamo`). The "
            "CLI's probe builds the demo's optimizer, so its cold probe includes it; `fit` builds the optimizer "
            "before it probes, and any training pays it once. Here the first optimizer is built by the cache's "
            "fingerprint (`describe_optimizer`), before the probe's own timer starts: the *cold wall* column (the "
            "report's `wall_time_s`) leaves the import out, the *cold CPU* column (this process's CPU time over the "
            "whole `probe()` call) has it in.", "",
        ]
    if not result["cuda"]:
        parts += ["No GPU on this machine: the CUDA probe (the issue's GPU MLP row) is unconfirmed by this run.", ""]
    write_subsection(SECTION, "\n".join(parts), SPEED, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-only", action="store_true", help="print only the JSON document")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steadier timings on a shared machine)")
    parser.add_argument("--cold", type=int, default=3, help="fresh processes per variant for the cold start (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()
    result = run(args.cold, args.threads)
    result["load_average_before"] = load_before
    result["total_wall_time_s"] = time.perf_counter() - started
    result["threads"] = args.threads
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    result["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result["load_average"] = os.getloadavg()
    if not args.json_only:
        print(table(result))
        print()
        if result["cold"]:
            print(cold_table(result))
            print(f"torch._dynamo import: {result['cold']['dynamo_import_s']:.2f} s")
            print()
    print(json.dumps(result, indent=1))
    if not args.no_write:
        write_section(result, "python benchmarks/probe_bench.py" + "".join(f" {a}" for a in sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
