"""fit benchmark (issue 4): fit's time per optimizer step against a hand-written loop.

Both train the same TinyGPT (``autoaccum.demo``) from the same weights with AdamW, on the same
tokens, at the same plan: ``target_batch = micro_batch x accum_steps``. The hand-written loop is
the nanoGPT one: index the global batch, cut it into micro-batches, scale each micro-batch's
mean loss by its share of the samples, backward, one optimizer step, zero the gradients, read
the step's loss as a float (fit reads it every step too). fit gets ``plan=`` so that it does
not probe; its time is the wall time of the whole ``fit()`` call (setup included) divided by
the steps. The probe's own cost is measured apart, by one fit call that probes.

Variants are interleaved (the order alternates every repetition), the first repetition is a
discarded warm-up, and the table reports medians over the others and their ratio.

Prints a table, then one JSON document. Not part of the test run.

    python benchmarks/fit_bench.py [--steps 20] [--repeats 7] [--threads 1] [--json-only]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import statistics
import sys
import time

import torch

import autoaccum
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss
from autoaccum.plan import Plan

TARGET, MICRO = 64, 16
NUM_SAMPLES = 4096


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_loop(model: torch.nn.Module, tokens: torch.Tensor, steps: int, device: torch.device) -> float:
    """The loop one writes by hand; returns seconds per optimizer step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(tokens), generator=g)
    _sync(device)
    started = time.perf_counter()
    for step in range(steps):
        batch = tokens[order[step * TARGET:(step + 1) * TARGET]].to(device)
        loss_sum = 0.0
        for micro in batch.split(MICRO):
            loss = token_loss(model, micro)
            # each .backward() adds to .grad: weight each micro-batch mean by its share of the samples
            (loss * (len(micro) / TARGET)).backward()
            loss_sum += loss.detach() * len(micro)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss_sum / TARGET)  # the step's loss, read as fit reads it
    _sync(device)
    return (time.perf_counter() - started) / steps


def fit_run(model: torch.nn.Module, tokens: torch.Tensor, steps: int, device: torch.device) -> tuple[float, float]:
    """``autoaccum.fit`` at the same plan; returns (wall seconds per step, fit's own step time per step)."""
    _sync(device)
    started = time.perf_counter()
    result = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, MICRO),
                           epochs=None, max_steps=steps, device=device, progress=False)
    _sync(device)
    wall = (time.perf_counter() - started) / steps
    return wall, result.samples_seen / result.samples_per_s / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    logging.disable(logging.INFO)  # fit's banner and summary would be printed on every run
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    torch.manual_seed(0)
    base = TinyGPT().to(device)  # 2 layers, dim 128, 64 tokens, vocab 256
    tokens = synthetic_tokens(NUM_SAMPLES)
    times: dict[str, list[float]] = {"hand loop": [], "fit": [], "fit (inside steps)": []}
    for rep in range(args.repeats + 1):
        order = ("hand loop", "fit") if rep % 2 == 0 else ("fit", "hand loop")
        for variant in order:
            model = copy.deepcopy(base)
            if variant == "hand loop":
                t = hand_loop(model, tokens, args.steps, device)
                if rep:
                    times["hand loop"].append(t)
            else:
                wall, inside = fit_run(model, tokens, args.steps, device)
                if rep:
                    times["fit"].append(wall)
                    times["fit (inside steps)"].append(inside)

    # the probe, apart: one fit that probes (plan from measurements), then the same number of steps
    model = copy.deepcopy(base)
    probed = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, epochs=None, max_steps=args.steps,
                           device=device, budget="64MiB" if device.type != "cuda" else None, progress=False)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["fit"] / med["hand loop"]
    report = {
        "benchmark": "fit_bench", "device": str(device), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "model": "TinyGPT(vocab 256, seq 64, dim 128, 2 layers), fp32, AdamW",
        "plan": f"target {TARGET} = micro {MICRO} x accum {TARGET // MICRO}", "steps_per_run": args.steps,
        "repeats": args.repeats,
        "median_s_per_step": med, "all_s_per_step": times,
        "ratio_fit_over_hand": ratio, "goal": "ratio <= 1.03",
        "probe": {"probe_time_s": probed.probe_time_s, "plan": probed.plan.describe(),
                  "probe_steps": probed.probe.probe_steps if probed.probe else None,
                  "budget": "64 MiB (emulated)" if device.type != "cuda" else "device"},
        "command": " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv),
    }
    if not args.json_only:
        print(f"fit vs hand-written loop · {device} · {torch.get_num_threads()} thread(s) · {report['model']}")
        print(f"plan {report['plan']} · {args.steps} steps per run · median of {args.repeats} interleaved runs")
        print(f"{'variant':<22}{'ms / step':>12}{'vs hand loop':>15}")
        for name, value in med.items():
            print(f"{name:<22}{value * 1e3:>12.2f}{value / med['hand loop']:>14.3f}x")
        print(f"probe (apart): {probed.probe_time_s:.2f} s, {report['probe']['probe_steps']} training steps, "
              f"chose {probed.plan.describe()} under {report['probe']['budget']}")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
