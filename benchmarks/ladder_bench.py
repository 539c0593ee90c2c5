"""When one sample does not fit: fit turning to the memory savers against a hand-configured run.

A TinyGPT whose one-sample step does not fit the memory it is given, at a long sequence. Per budget:

- ``fit``: ``autoaccum.fit`` with nothing configured (the probe turns to the saver with which the smallest
  micro-batch fits and picks the micro-batch there); its saver, plan, OOMs and samples/s (probe excluded);
- ``hand``: what a user would configure by hand: checkpointing on, the largest micro-batch that fits
  found by brute force (real steps on a fresh model, keeping the same 10% headroom the probe keeps),
  a plain accumulation loop at that micro-batch; its samples/s, measured in the same process right
  after fit's.

The target: fit >= 0.95 x hand. On CUDA the memory is squeezed by a second process holding the rest
of the card (autoaccum reads what is free); on a CPU by an emulated budget. Prints a table, then JSON.

    python benchmarks/ladder_bench.py                                  # CPU, small sizes
    python benchmarks/ladder_bench.py --device cuda --seq 4096 --dim 768 --layers 12 --budget 3GiB
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = str(Path(__file__).resolve().parent)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

from common import HEADROOM_KEPT  # noqa: E402

import autoaccum  # noqa: E402
from autoaccum.demo import TinyGPT, synthetic_tokens, token_loss  # noqa: E402
from autoaccum.memory.savers import apply_saver  # noqa: E402
from autoaccum.units import format_bytes, parse_bytes  # noqa: E402


def _model(args: argparse.Namespace, device: torch.device) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, layers=args.layers,
                   heads=args.heads).to(device)


def _squeeze(args: argparse.Namespace, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        from realgpu.squeeze import squeeze

        return squeeze("process", parse_bytes(args.budget), device)
    return contextlib.nullcontext()


def _hand_rate(args: argparse.Namespace, device: torch.device, data: torch.Tensor, micro: int, saver: str,
               budget: int | None) -> float:
    """Samples/s of a plain accumulation loop at ``micro`` on ``saver`` (steps after the first two)."""
    model = _model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    meter = autoaccum.emulated_budget(budget, model, opt) if budget is not None else contextlib.nullcontext()
    starts = []
    with meter, apply_saver(model, saver):
        for step in range(args.steps):
            _sync(device)
            starts.append(time.perf_counter())
            batch = data[(step * args.target) % len(data):][:args.target]
            opt.zero_grad(set_to_none=True)
            for part in batch.split(micro):
                (token_loss(model, part) * (len(part) / len(batch))).backward()
            opt.step()
        _sync(device)
        starts.append(time.perf_counter())
    return args.target * (args.steps - 2) / (starts[-1] - starts[2])


def _fits(args: argparse.Namespace, device: torch.device, data: torch.Tensor, micro: int, saver: str,
          budget: int | None) -> bool:
    """Two accumulated steps at ``micro`` on ``saver`` on a fresh model run out of no memory."""
    model = _model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    meter = autoaccum.emulated_budget(budget, model, opt) if budget is not None else contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        free, _ = torch.cuda.mem_get_info(device)
        usable = HEADROOM_KEPT * (free + torch.cuda.memory_reserved(device))
    try:
        with meter, apply_saver(model, saver):
            for _ in range(2):
                for _ in range(2):
                    token_loss(model, data[:micro]).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        ok = device.type != "cuda" or torch.cuda.max_memory_allocated(device) <= usable
    except torch.OutOfMemoryError:
        ok = False
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ok


def _brute_force(args: argparse.Namespace, device: torch.device, data: torch.Tensor, saver: str,
                 budget: int | None) -> int:
    """The largest micro-batch (up to the target) whose steps fit on ``saver``: doubling, then bisection."""
    budget = None if budget is None else int(budget * HEADROOM_KEPT)
    lo, hi = 0, None
    size = 1
    while size <= args.target:
        if _fits(args, device, data, size, saver, budget):
            lo, size = size, size * 2
        else:
            hi = size
            break
    hi = hi if hi is not None else args.target + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(args, device, data, mid, saver, budget) else (lo, mid)
    return lo


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--budget", default="6MB", help="the memory left to this process")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--target", type=int, default=8, help="the global batch")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each run (the first two not timed)")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)
    data = synthetic_tokens(args.target * args.steps, args.seq, args.vocab).to(device)
    with _squeeze(args, device):
        budget = None if device.type == "cuda" else parse_bytes(args.budget)
        model = _model(args, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        result = autoaccum.fit(model, data, target_batch=args.target, loss_fn=token_loss, optimizer=opt,
                               max_steps=args.steps, epochs=None, budget=budget, progress=False, verbose=False)
        saver, micro = result.plan.saver, result.final_plan.micro_batch
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hand_rung = "checkpointing" if saver == "none" else saver
        hand_micro = _brute_force(args, device, data, hand_rung, budget)
        hand = _hand_rate(args, device, data, hand_micro, hand_rung, budget) if hand_micro else 0.0
    row = {"saver": saver, "savers_tried": [r for r, _ in result.probe.savers_tried] if result.probe else [],
           "plan": result.plan.describe(), "micro": micro, "fit_ooms": result.oom_events,
           "fit_samples_per_s": result.samples_per_s, "probe_s": result.probe_time_s,
           "hand_rung": hand_rung, "hand_micro": hand_micro, "hand_samples_per_s": hand,
           "fit_vs_hand": result.samples_per_s / hand if hand else None}
    report = {"benchmark": "ladder_bench", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else f"CPU ({platform.machine()})", "torch": torch.__version__, "budget": args.budget,
              "model": f"TinyGPT dim {args.dim} x {args.layers} layers, {args.seq} tokens, vocab {args.vocab}",
              "target": args.target, "steps": args.steps, "row": row,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": "python benchmarks/ladder_bench.py " + " ".join(sys.argv[1:])}
    if not args.json_only:
        print(f"{report['model']}, target {args.target}, {format_bytes(parse_bytes(args.budget))} left, {report['device']}")
        print(f"fit: {row['plan']} (savers below: {', '.join(row['savers_tried']) or '-'}), {row['fit_ooms']} OOMs, "
              f"{row['fit_samples_per_s']:.2f} samples/s (probe {row['probe_s']:.1f} s)")
        print(f"hand: {hand_rung}, micro {hand_micro} (brute force), {hand:.2f} samples/s")
        print(f"fit / hand: {row['fit_vs_hand']:.3f}x (target >= 0.95)" if row["fit_vs_hand"] else "hand: nothing fits")
        print()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
