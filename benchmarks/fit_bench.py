"""fit benchmark: fit's time per optimizer step against a hand-written loop at the same plan.

Both train the same TinyGPT from the same weights with AdamW on the same tokens at
``target = micro x accum``; the hand loop is the benchmarks' shared step (``common.hand_step``:
micro-batch losses scaled by their share, one step), the loss read as a float; fit gets ``plan=`` (no
probe) and its whole call is timed. Runs
alternate, the first is a warm-up; the result is the median of the per-repetition ratios fit / hand,
by wall clock and by process CPU time. The probe's own cost is measured apart, by one fit that probes.

    python benchmarks/fit_bench.py [--steps 5] [--repeats 15] [--threads 1] [--dim 128 --seq 64] [--json-only]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time

import torch
from common import bench_main, hand_step, markdown_table, sync

import autoaccum
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss
from autoaccum.plan.plan import Plan

TARGET, MICRO = 64, 16
NUM_SAMPLES = 4096


def hand_loop(model: torch.nn.Module, tokens: torch.Tensor, steps: int, device: torch.device) -> tuple[float, float]:
    """The loop one writes by hand; returns (wall, CPU) seconds per optimizer step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(tokens), generator=g)
    sync(device)
    started, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        batch = tokens[order[step * TARGET:(step + 1) * TARGET]].to(device)
        float(hand_step(model, optimizer, batch.split(MICRO), token_loss))  # the step's loss, read as fit reads it
    sync(device)
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


def fit_run(model: torch.nn.Module, tokens: torch.Tensor, steps: int, device: torch.device) -> tuple[float, float]:
    """``autoaccum.fit`` at the same plan, the whole call timed; returns (wall, CPU) seconds per step."""
    sync(device)
    started, cpu = time.perf_counter(), time.process_time()
    result = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, MICRO),
                           epochs=None, max_steps=steps, device=device, progress=False)
    sync(device)
    assert result.optimizer_steps == steps
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per variant (after one warm-up)")
    parser.add_argument("--dim", type=int, default=128, help="TinyGPT width (a multiple of 4)")
    parser.add_argument("--seq", type=int, default=64, help="TinyGPT sequence length")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def run(args: argparse.Namespace) -> dict:
    logging.disable(logging.INFO)  # fit's banner and summary would be printed on every run
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = TinyGPT(seq_len=args.seq, dim=args.dim).to(device)  # 2 layers, 4 heads, vocab 256
    tokens = synthetic_tokens(NUM_SAMPLES, seq_len=args.seq)
    runs = {"hand loop": hand_loop, "fit": fit_run}
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in runs}
    for rep in range(args.repeats + 1):
        for name in (("hand loop", "fit") if rep % 2 == 0 else ("fit", "hand loop")):
            wall, cpu = runs[name](copy.deepcopy(base), tokens, args.steps, device)
            if rep:  # the first repetition warms up (lazy imports, allocator, kernels)
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)

    # the probe, apart: one fit that probes (plan from measurements), then the same number of steps
    probed = autoaccum.fit(copy.deepcopy(base), tokens, TARGET, loss_fn=token_loss, epochs=None, max_steps=args.steps,
                           device=device, budget="64MiB" if device.type != "cuda" else None, progress=False)
    ratio = {clock: statistics.median(f / h for f, h in zip(times["fit"][clock], times["hand loop"][clock]))
             for clock in ("wall", "cpu")}
    return {
        "benchmark": "fit_bench", "device": str(device),
        "model": f"TinyGPT(vocab 256, seq {args.seq}, dim {args.dim}, 2 layers), fp32, AdamW",
        "plan": f"target {TARGET} = micro {MICRO} x accum {TARGET // MICRO}", "steps_per_run": args.steps,
        "repeats": args.repeats, "all_s_per_step": times,
        "median_s_per_step": {name: {clock: statistics.median(v) for clock, v in t.items()}
                              for name, t in times.items()},
        "ratio_fit_over_hand": ratio, "speed_fit_over_hand": {c: 1 / r for c, r in ratio.items()},
        "goal": "fit's samples/s >= 0.99 x the hand loop's",
        "probe": {"probe_time_s": probed.probe_time_s, "plan": probed.plan.describe(),
                  "probe_steps": probed.probe.probe_steps if probed.probe else None,
                  "budget": "64 MiB (emulated)" if device.type != "cuda" else "device"},
    }


def table(report: dict) -> str:
    ratio, probe, r = report["ratio_fit_over_hand"], report["probe"], report
    rows = [(name, f"{m['wall'] * 1e3:.2f}", f"{m['cpu'] * 1e3:.2f}") for name, m in r["median_s_per_step"].items()]
    return "\n".join([
        f"fit vs hand-written loop · {r['device']} · {r['threads']} thread(s) · {r['model']}",
        f"plan {r['plan']} · {r['steps_per_run']} steps per run · {r['repeats']} interleaved repetitions", "",
        markdown_table([("variant", "wall ms/step", "CPU ms/step"), *rows,
                        ("fit / hand (median of paired ratios)", f"{ratio['wall']:.3f}x", f"{ratio['cpu']:.3f}x")]),
        "", f"fit's samples/s over the hand loop's: {1 / ratio['wall']:.3f} (wall), {1 / ratio['cpu']:.3f} (CPU); "
            "goal >= 0.99",
        f"probe (apart): {probe['probe_time_s']:.2f} s, {probe['probe_steps']} training steps, chose {probe['plan']} "
        f"under {probe['budget']}"])


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table, options))
