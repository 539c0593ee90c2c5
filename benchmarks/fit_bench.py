"""fit benchmark: fit's time per optimizer step against a hand-written loop at the same plan.

Both train the same TinyGPT from the same weights with AdamW on the same tokens at
``target = micro x accum``; the hand loop is nanoGPT's (micro-batch losses scaled by their share, one
step, the loss read as a float); fit gets ``plan=`` (no probe) and its whole call is timed. Runs
alternate, the first is a warm-up; the result is the median of the per-repetition ratios fit / hand,
by wall clock and by process CPU time. The probe's own cost is measured apart, by one fit that probes.

    python benchmarks/fit_bench.py [--steps 5] [--repeats 15] [--threads 1] [--dim 128 --seq 64] [--json-only]
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
from autoaccum.plan.plan import Plan

TARGET, MICRO = 64, 16
NUM_SAMPLES = 4096


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_loop(model: torch.nn.Module, tokens: torch.Tensor, steps: int, device: torch.device) -> tuple[float, float]:
    """The loop one writes by hand; returns (wall, CPU) seconds per optimizer step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(tokens), generator=g)
    _sync(device)
    started, cpu = time.perf_counter(), time.process_time()
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
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


def fit_run(model: torch.nn.Module, tokens: torch.Tensor, steps: int, device: torch.device) -> tuple[float, float]:
    """``autoaccum.fit`` at the same plan, the whole call timed; returns (wall, CPU) seconds per step."""
    _sync(device)
    started, cpu = time.perf_counter(), time.process_time()
    result = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, plan=Plan.for_target(TARGET, MICRO),
                           epochs=None, max_steps=steps, device=device, progress=False)
    _sync(device)
    assert result.optimizer_steps == steps
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per variant (after one warm-up)")
    parser.add_argument("--dim", type=int, default=128, help="TinyGPT width (a multiple of 4)")
    parser.add_argument("--seq", type=int, default=64, help="TinyGPT sequence length")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    logging.disable(logging.INFO)  # fit's banner and summary would be printed on every run
    torch.set_num_threads(args.threads)
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
    model = copy.deepcopy(base)
    probed = autoaccum.fit(model, tokens, TARGET, loss_fn=token_loss, epochs=None, max_steps=args.steps,
                           device=device, budget="64MiB" if device.type != "cuda" else None, progress=False)

    median = {name: {clock: statistics.median(v) for clock, v in t.items()} for name, t in times.items()}
    ratio = {clock: statistics.median(f / h for f, h in zip(times["fit"][clock], times["hand loop"][clock]))
             for clock in ("wall", "cpu")}
    report = {
        "benchmark": "fit_bench", "device": str(device), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "model": f"TinyGPT(vocab 256, seq {args.seq}, dim {args.dim}, 2 layers), fp32, AdamW",
        "plan": f"target {TARGET} = micro {MICRO} x accum {TARGET // MICRO}", "steps_per_run": args.steps,
        "repeats": args.repeats, "median_s_per_step": median, "all_s_per_step": times,
        "ratio_fit_over_hand": ratio, "speed_fit_over_hand": {c: 1 / r for c, r in ratio.items()},
        "goal": "fit's samples/s >= 0.99 x the hand loop's",
        "probe": {"probe_time_s": probed.probe_time_s, "plan": probed.plan.describe(),
                  "probe_steps": probed.probe.probe_steps if probed.probe else None,
                  "budget": "64 MiB (emulated)" if device.type != "cuda" else "device"},
        "command": " ".join(["python"] + sys.argv),
    }
    if not args.json_only:
        print(f"fit vs hand-written loop · {device} · {torch.get_num_threads()} thread(s) · {report['model']}")
        print(f"plan {report['plan']} · {args.steps} steps per run · {args.repeats} interleaved repetitions")
        print(f"{'variant':<12}{'wall ms/step':>14}{'CPU ms/step':>14}")
        for name, m in median.items():
            print(f"{name:<12}{m['wall'] * 1e3:>14.2f}{m['cpu'] * 1e3:>14.2f}")
        print(f"{'fit / hand':<12}{ratio['wall']:>13.3f}x{ratio['cpu']:>13.3f}x   (time, median of paired ratios)")
        print(f"fit's samples/s over the hand loop's: {1 / ratio['wall']:.3f} (wall), {1 / ratio['cpu']:.3f} (CPU); "
              "goal >= 0.99")
        print(f"probe (apart): {probed.probe_time_s:.2f} s, {report['probe']['probe_steps']} training steps, "
              f"chose {probed.plan.describe()} under {report['probe']['budget']}")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
