"""Guard benchmark: what ``OOMGuard.step`` costs over a hand-written accumulation loop, and what one
OOM recovery costs.

1. Overhead: the same TinyGPT, AdamW, micro-batch and global batches, stepped by the benchmarks'
   hand-written step (``common.hand_step``: per micro-batch loss * share, backward; step; the loss as a
   float) and by ``guard.step``, in alternating blocks; the median of the per-repeat ratios guard / hand.
2. Recovery: an OOM injected in the loss of the first micro-batch (no work lost) or of the last one
   (almost a whole step lost); the guard halves the micro-batch and replays. The extra time of that
   step over a normal one, in step-times.

    python benchmarks/guard_bench.py [--device cpu|cuda] [--clock wall|cpu] [--repeats 9] [--json-only]
"""

from __future__ import annotations

import argparse
import copy
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from common import bench_main, hand_step, sync

import autoaccum
from autoaccum import OOMGuard, Plan
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss

_clock = time.perf_counter  # ``--clock cpu``: this process's CPU time (a shared machine's waits left out)


def _timed(step: Callable[[], object], device: torch.device) -> float:
    sync(device)
    started = _clock()
    step()
    sync(device)
    return _clock() - started


def _model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=256, seq_len=args.seq_len, dim=args.dim, layers=args.layers, heads=args.heads).to(device)


def overhead(args: argparse.Namespace, device: torch.device) -> dict:
    hand_model = _model(args, device)
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-4)
    model = copy.deepcopy(hand_model)
    guard = OOMGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-4), target_batch=args.target,
                     micro_batch=args.micro)
    batches = [synthetic_tokens(args.target, seq_len=args.seq_len, seed=i).to(device) for i in range(args.steps)]
    variants = {"hand": lambda b: float(hand_step(hand_model, hand_opt, b.split(args.micro), token_loss)),
                "guard": lambda b: guard.step(b, token_loss).loss}

    def block(name: str, batches: list[torch.Tensor]) -> float:
        return _timed(lambda: [variants[name](b) for b in batches], device) / len(batches)

    for name in variants:  # warm-up: lazy optimizer state, allocator, kernels
        block(name, batches[:args.warmup])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name in (variants if r % 2 == 0 else reversed(variants)):
            times[name].append(block(name, batches))
    ratios = [g / h for g, h in zip(times["guard"], times["hand"])]
    return {"step_s": times, "medians_s": {n: statistics.median(t) for n, t in times.items()},
            "paired_ratio_median": statistics.median(ratios), "paired_ratios": ratios}


def recovery(args: argparse.Namespace, device: torch.device) -> dict:
    """Wall time of a step with one injected OOM, against normal steps at micro and micro / 2."""
    model = _model(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = synthetic_tokens(args.target, seq_len=args.seq_len, seed=0).to(device)
    cases = {"first micro-batch": 1, "last micro-batch": Plan.for_target(args.target, args.micro).accum_steps}

    def failing_loss(fail_at: int) -> Callable:
        calls = [0]

        def loss_fn(m: torch.nn.Module, part: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            loss = token_loss(m, part)
            if calls[0] == fail_at:
                raise torch.OutOfMemoryError("benchmark: injected OOM")
            return loss
        return loss_fn

    def run(micro: int, fail_at: int | None) -> float:
        guard = OOMGuard(model, optimizer, target_batch=args.target, micro_batch=micro)
        t = _timed(lambda: guard.step(batch, token_loss if fail_at is None else failing_loss(fail_at)), device)
        if fail_at is not None and (guard.plan.micro_batch != micro // 2 or guard.ooms != 1):
            raise RuntimeError(f"the injected OOM was not recovered as expected: {guard.changes}")
        return t

    measured = {"normal_micro": (args.micro, None), "normal_half": (args.micro // 2, None),
                **{f"oom_{case}": (args.micro, at) for case, at in cases.items()}}
    for micro, _ in list(measured.values())[:2]:  # warm-up
        run(micro, None)
    samples: dict[str, list[float]] = {k: [] for k in measured}
    for _ in range(args.repeats):
        for key, (micro, at) in measured.items():
            samples[key].append(run(micro, at))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"medians_s": med, "samples_s": samples,
            "extra_step_times": {case: med[f"oom_{case}"] / med["normal_micro"] - 1 for case in cases}}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", type=int, default=32, help="global batch")
    parser.add_argument("--micro", type=int, default=8, help="micro-batch of both variants")
    for name, default in (("--dim", 128), ("--layers", 2), ("--heads", 4), ("--seq-len", 64)):  # the TinyGPT
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time by wall clock or by this process's CPU time (CPU device, one thread)")


def run(args: argparse.Namespace) -> dict:
    if args.clock == "cpu":
        if args.device != "cpu":
            raise SystemExit("guard_bench.py: --clock cpu measures the CPU device only")
        global _clock
        _clock = time.process_time
    logging.getLogger("autoaccum").setLevel(logging.ERROR)  # the injected OOMs are expected
    device = torch.device(args.device)
    return {
        "benchmark": "guard", "autoaccum": autoaccum.__version__, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "clock": args.clock, "model": f"TinyGPT dim {args.dim} x {args.layers} layers, seq {args.seq_len}",
        "plan": Plan.for_target(args.target, args.micro).describe(), "micro": args.micro, "repeats": args.repeats,
        "steps": args.steps, "overhead": overhead(args, device), "recovery": recovery(args, device),
    }


def table(result: dict) -> str:
    ov, rec = result["overhead"], result["recovery"]
    m, r = ov["medians_s"], rec["medians_s"]
    return "\n".join([
        f"guard on {result['device_name']} ({result['device']}, {result['threads']} thread(s)), torch "
        f"{result['torch']}; {result['model']}; {result['plan']}; {result['clock']} clock; AdamW; "
        f"{result['repeats']} repeats x {result['steps']} steps",
        f"hand loop {m['hand'] * 1e3:.2f} ms/step, guard.step {m['guard'] * 1e3:.2f} ms/step; guard / hand paired "
        f"median {ov['paired_ratio_median']:.3f} (range {min(ov['paired_ratios']):.3f}-{max(ov['paired_ratios']):.3f})",
        f"OOM recovery, micro {result['micro']} -> {result['micro'] // 2}: normal step {r['normal_micro'] * 1e3:.2f} "
        f"ms, at the half {r['normal_half'] * 1e3:.2f} ms; extra step-times with one OOM: " + ", ".join(
            f"at the {case} {x:+.2f}" for case, x in rec["extra_step_times"].items())])


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table, options))
