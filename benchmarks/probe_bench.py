"""Probe benchmark (issue 2): the probe's search vs brute force vs a naive doubling ladder.

For each model shape and emulated budget (the tracked counter raises torch.OutOfMemoryError at
the crossing, so a CPU behaves like a small device) it reports:

- probe: wall time, training steps spent, OOMs it triggered, the largest micro-batch it found to
  fit (``max_fitting_micro_batch``) and the plan's micro-batch;
- brute force: the largest micro-batch that truly runs two full accumulation steps (two
  forward/backward passes summed into the gradients, then the AdamW step) of a fresh model copy
  under ``budget * (1 - headroom)``, found by
  doubling + bisection over real runs and checked at ``b`` and ``b + 1``;
- ladder: 1, 2, 4, ... with the same steps per size as the probe, stopping at the first size that
  runs out of memory or over the usable budget; its choice is the last power of two that fit.

Prints a table, then one JSON document, and writes the section "## Probe (issue 2)" of
benchmarks/RESULTS.md (``--no-write`` to skip; other sections stay as they are). Not part of the
test run.

    python benchmarks/probe_bench.py [--json-only] [--no-write] [--threads N]
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import autoaccum
from autoaccum import TrackedMemory, emulated_budget
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss
from results_md import RESULTS, bench_main, markdown_table, replace_section

SECTION = "## Probe (issue 2)"
HEADROOM = 0.1
STEPS_PER_SIZE = 3  # the probe's default
UPPER = 4096  # target batch = the largest size worth trying


@dataclass
class Shape:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], object]
    loss_fn: Callable[[nn.Module, object], torch.Tensor]
    budgets: tuple[str, ...]


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
    Shape("mlp 256-512-512-10", _mlp, _mlp_batch, _classify, ("16MiB", "40MiB")),
    Shape("tinygpt (demo)", _gpt, lambda b: synthetic_tokens(b, seed=b), token_loss, ("32MiB", "64MiB")),
    Shape("cnn 32x32 + batchnorm", _cnn, _image_batch, _classify, ("16MiB", "64MiB")),
)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, shape: Shape, b: int, steps: int) -> None:
    """``steps`` accumulation steps at micro-batch ``b``: two forward/backward passes summing into
    the gradients (the second runs with the first's gradients in memory), then the AdamW step --
    what a training step at a target of 4096 really runs."""
    batch = shape.make_batch(b)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _micro in range(2):
            loss = shape.loss_fn(model, batch)
            loss.backward()
            del loss
        optimizer.step()


def _runs_under(shape: Shape, b: int, budget_bytes: int) -> bool:
    model = shape.make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        with emulated_budget(budget_bytes, model, optimizer):
            _steps(model, optimizer, shape, b, 2)
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


def ladder(shape: Shape, budget_bytes: int, usable_bytes: int) -> dict:
    """Doubling ladder on one model and optimizer (as a naive auto-batcher does it)."""
    model = shape.make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    steps = ooms = 0
    chosen = 0
    started = time.perf_counter()
    b = 1
    while b <= UPPER:
        failed = False
        try:
            with TrackedMemory(budget_bytes).track(model, optimizer) as mem:
                _steps(model, optimizer, shape, b, STEPS_PER_SIZE)
            peak = mem.peak_bytes
        except torch.OutOfMemoryError:
            failed = True
        if failed:
            steps, ooms = steps + 1, ooms + 1
            optimizer.zero_grad(set_to_none=True)
            break
        steps += STEPS_PER_SIZE
        if peak > usable_bytes:
            break
        chosen, b = b, 2 * b
    return {"steps": steps, "ooms": ooms, "chosen": chosen, "wall_time_s": time.perf_counter() - started}


def run() -> dict:
    # one-time costs (the dispatch mode's first use, kernel set-up) must not land on the first row
    autoaccum.probe(model=_mlp(), loss_fn=_classify, make_batch=_mlp_batch, target_batch=4, budget="1GiB")
    ladder(SHAPES[0], 2**30, 2**30)
    rows = []
    for shape in SHAPES:
        for budget in shape.budgets:
            budget_bytes = autoaccum.parse_bytes(budget)
            usable = int(budget_bytes * (1 - HEADROOM))
            model = shape.make_model()
            report = autoaccum.probe(model=model, loss_fn=shape.loss_fn, make_batch=shape.make_batch,
                                     target_batch=UPPER, budget=budget_bytes, headroom=HEADROOM,
                                     steps_per_size=STEPS_PER_SIZE)
            best, brute_runs = brute_force(shape, usable)
            rows.append({
                "model": shape.name, "budget": budget, "budget_bytes": budget_bytes, "usable_bytes": usable,
                "params": sum(p.numel() for p in model.parameters()),
                "probe": {"wall_time_s": report.wall_time_s, "steps": report.probe_steps, "ooms": report.probe_ooms,
                          "candidates": [c.micro_batch for c in report.candidates],
                          "max_fitting": report.max_fitting_micro_batch, "plan_micro": report.plan.micro_batch,
                          "fit_note": report.fit_note},
                "brute_force": {"largest": best, "runs": brute_runs},
                "ladder": ladder(shape, budget_bytes, usable),
            })
    return {"version": 1, "kind": "autoaccum.bench.probe", "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
            "python": platform.python_version(), "device": "cpu (tracked meter, emulated budget)",
            "headroom": HEADROOM, "steps_per_size": STEPS_PER_SIZE, "target_batch": UPPER, "rows": rows}


def table(result: dict) -> str:
    head = ("model", "budget", "probe s", "steps", "OOMs", "sizes", "found", "brute force", "found/brute",
            "ladder s", "ladder steps", "ladder OOMs", "ladder pick", "pick/brute")
    lines = [head]
    for r in result["rows"]:
        p, b, lad = r["probe"], r["brute_force"]["largest"], r["ladder"]
        lines.append((r["model"], r["budget"], f"{p['wall_time_s']:.2f}", str(p["steps"]), str(p["ooms"]),
                      str(len(p["candidates"])), str(p["max_fitting"]), str(b), f"{p['max_fitting'] / b:.1%}",
                      f"{lad['wall_time_s']:.2f}", str(lad["steps"]), str(lad["ooms"]), str(lad["chosen"]),
                      f"{lad['chosen'] / b:.1%}"))
    return markdown_table(lines)


def write_section(result: dict, command: str, path: Path = RESULTS) -> None:
    """Replace (or add) this benchmark's section of RESULTS.md; other sections stay as they are."""
    sequences = "; ".join(f"{r['model']} @ {r['budget']}: {' -> '.join(map(str, r['probe']['candidates']))}"
                          for r in result["rows"])
    section = "\n".join([
        SECTION, "",
        f"Command: `{command}` · {result['date']} · {result['machine']} · torch {result['torch']}, "
        f"python {result['python']}, {result['threads']} intra-op thread(s) · total wall time "
        f"{result['total_wall_time_s']:.0f} s", "",
        f"CPU with the tracked meter and an emulated budget (an OOM is raised at the allocation that crosses "
        f"the budget). Headroom {result['headroom']:.0%}, {result['steps_per_size']} training steps (forward, "
        f"backward, AdamW step) per size, target batch {result['target_batch']} (so the target never caps "
        f"the search).", "",
        table(result), "",
        "Columns: *probe s / steps / OOMs / sizes* = the probe's wall time, training steps it ran (a step that "
        "ran out of memory counts as one), OOMs it triggered and sizes it measured; *found* = "
        "`max_fitting_micro_batch`, the largest size it measured under `budget x (1 - headroom)`; *brute force* "
        "= the largest micro-batch whose two full accumulation steps (two micro-batches, then AdamW) on a fresh model run under that usable budget "
        "(doubling + bisection over real runs, checked at b and b + 1); *ladder* = a naive 1, 2, 4, ... "
        "doubling ladder with the same steps per size, stopping at the first OOM or size over the usable "
        "budget; its pick is the last power of two that fit. Wall times are of a shared machine: compare "
        "steps and OOMs rather than seconds.", "",
        f"Sizes the probe measured, in order: {sequences}.", "",
    ] + ([] if result["cuda"] else [
        "No GPU on this machine: the CUDA meter and `autoaccum probe --device cuda` are covered by tests "
        "marked `gpu`, which skipped here; the CUDA path is unconfirmed by this run.", ""]))
    replace_section(SECTION, section, path)


def main() -> int:
    return bench_main(__doc__, "probe_bench.py", run, table, write_section)


if __name__ == "__main__":
    sys.exit(main())
