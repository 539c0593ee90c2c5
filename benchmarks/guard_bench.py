"""Guard benchmark (issue 3): what ``OOMGuard.step`` costs over a hand-written accumulation loop,
and what one OOM recovery costs.

1. Per-step overhead. The same model (TinyGPT), the same AdamW, the same micro-batch and the same
   pre-made global batches, stepped by
   - ``hand``: the loop everyone writes (zero_grad; per micro-batch: loss * share, backward;
     step; zero_grad; the step's loss as a float), and
   - ``guard``: ``guard.step(batch, token_loss)``.
   The variants alternate in blocks (order flipped every repeat); each block times ``--steps``
   steps after warm-up. Reported: the median per-step time of each variant and the median of the
   per-repeat ratios guard / hand (the paired ratio, robust to drift of the machine).
   In the same blocks, the inf/NaN check before the optimizer step (issue 14): ``guard`` (the
   default, ``nonfinite="stop"``) against ``guard, check off`` (``nonfinite=None``), and the same
   pair with clipping (``max_grad_norm=1.0``, where the check is the norm clipping computes
   anyway). Reported: the paired ratios check on / check off, and the check alone (the guard's
   function on the model's real gradients, timed over many calls) as a share of a step.
2. OOM recovery. An injected ``torch.OutOfMemoryError`` in the loss of the first micro-batch (no
   work lost) or of the last one (almost a whole step lost); the guard releases, halves the
   micro-batch and replays. Reported: the extra time of that step over a normal step at the
   starting micro-batch, in step-times (wall and process CPU time), the normal step at the halved
   one, and the time spent releasing memory (``gc.collect`` where needed and, on CUDA,
   ``empty_cache``) with what was collected. Three variants (issue 15): with a meter that reads
   memory (CPU: a counting ``TrackedMemory``; CUDA: the allocator, the default), without one (CPU:
   the default; CUDA: ``meter=NullMeter()``), and without one with the full ``gc.collect()`` every
   recovery made before issue 15 (the same run's baseline).

Prints a table, then one JSON document. Not part of the test run.

    python benchmarks/guard_bench.py [--device cpu|cuda] [--clock wall|cpu] [--json-only]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import autoaccum
from autoaccum import OOMGuard, Plan, TrackedMemory
from autoaccum.memory import Meter, NullMeter
from autoaccum.cli import TinyGPT, synthetic_tokens, token_loss
from autoaccum.step.optim import _check_finite


#: the clock of the overhead blocks and of the check alone: wall time, or with ``--clock cpu`` this
#: process's CPU time (one thread on a loaded, shared machine: what the step computes, not how long
#: it waited for a core)
_clock = time.perf_counter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, micro: int) -> float:
    """The accumulation loop one writes by hand (nanoGPT's, with an exact share per micro-batch)."""
    optimizer.zero_grad(set_to_none=True)
    n = batch.shape[0]
    loss_sum = torch.zeros((), device=batch.device)
    for part in batch.split(micro):
        loss = token_loss(model, part)
        (loss * (part.shape[0] / n)).backward()  # each .backward() adds to .grad: weight by the share
        loss_sum += loss.detach() * part.shape[0]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss_sum.item()) / n


def _time_block(step: Callable[[torch.Tensor], float], batches: list[torch.Tensor], device: torch.device) -> float:
    """Seconds per step over the batches, synchronised at both ends."""
    _sync(device)
    started = _clock()
    for batch in batches:
        step(batch)
    _sync(device)
    return (_clock() - started) / len(batches)


def overhead(args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(0)
    base = TinyGPT(vocab_size=256, seq_len=args.seq_len, dim=args.dim, layers=args.layers, heads=args.heads).to(device)
    hand_model = base
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-4)
    guards: dict[str, OOMGuard] = {}
    for name, options in {"guard": {}, "guard_unchecked": {"nonfinite": None},
                          "guard_clip": {"max_grad_norm": 1.0},
                          "guard_clip_unchecked": {"max_grad_norm": 1.0, "nonfinite": None}}.items():
        model = copy.deepcopy(base)
        guards[name] = OOMGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-4), target_batch=args.target,
                                micro_batch=args.micro, **options)
    guard = guards["guard"]
    batches = [synthetic_tokens(args.target, seq_len=args.seq_len, seed=i).to(device) for i in range(args.steps)]
    variants: dict[str, Callable[[torch.Tensor], float]] = {
        "hand": lambda b: hand_step(hand_model, hand_opt, b, args.micro),
        **{name: (lambda g: lambda b: g.step(b, token_loss).loss)(g) for name, g in guards.items()},
    }
    for step in variants.values():  # warm-up: lazy optimizer state, allocator, kernels
        _time_block(step, batches[: args.warmup], device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(_time_block(variants[name], batches, device))
    ratios = [g / h for g, h in zip(times["guard"], times["hand"])]
    hand_med, guard_med = statistics.median(times["hand"]), statistics.median(times["guard"])

    def paired(a: str, b: str) -> dict:
        r = [x / y for x, y in zip(times[a], times[b])]
        return {"paired_ratio_median": statistics.median(r), "paired_ratios": r,
                "ratio_of_medians": statistics.median(times[a]) / statistics.median(times[b])}

    return {
        "hand_step_s": times["hand"], "guard_step_s": times["guard"],
        "hand_median_s": hand_med, "guard_median_s": guard_med,
        "ratio_of_medians": guard_med / hand_med, "paired_ratio_median": statistics.median(ratios),
        "paired_ratios": ratios, "plan": guard.plan.describe(),
        "step_s": times, "medians_s": {name: statistics.median(t) for name, t in times.items()},
        "check": {"no_clip": paired("guard", "guard_unchecked"), "clip": paired("guard_clip", "guard_clip_unchecked"),
                  **check_alone(guard, batches[0], device, guard_med)},
    }


def check_alone(guard: OOMGuard, batch: torch.Tensor, device: torch.device, step_s: float, calls: int = 200) -> dict:
    """The check by itself, as the guard runs it (one fused reduction over the gradients and the loss, one
    read on the host), on the gradients of a real accumulated step; its share of a median step."""
    totals = guard._accumulate(batch, token_loss, False)[0]
    out = {}
    for name, clip in (("check_s", None), ("check_clip_s", 1.0)):
        _check_finite(guard.params, totals.loss_total, clip, guard.sync)  # warm-up
        _sync(device)
        started = _clock()
        for _ in range(calls):
            _check_finite(guard.params, totals.loss_total, clip, guard.sync)
        _sync(device)
        out[name] = (_clock() - started) / calls
    guard._zero_grad()
    out["check_share_of_step"] = out["check_s"] / step_s
    out["params"] = sum(p.numel() for p in guard.params)
    return out
def _timed(step: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``step()``, synchronised at both ends."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def _meters(device: torch.device) -> dict[str, Callable[..., Meter] | None]:
    """The meter variants of the recovery measurement: with a meter that reads memory (the guard
    then collects nothing when the live bytes came back) and without one."""
    if device.type == "cuda":
        return {"CUDA meter (default)": None, "no meter": lambda *track: NullMeter(),
                "no meter, full gc (before issue 15)": lambda *track: NullMeter()}
    return {"tracked meter": lambda *track: TrackedMemory().track(*track), "no meter (default)": None,
            "no meter, full gc (before issue 15)": None}


def _full_release(device: torch.device, *args: object, **kwargs: object) -> str:
    """Recovery before issue 15 where no meter says memory came back: a full collection every time."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return "full"


def recovery(args: argparse.Namespace, device: torch.device) -> dict:
    """Wall and CPU time of a step with one injected OOM, against normal steps at micro and micro / 2,
    with and without a meter, and with the full collection every recovery made before issue 15."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, seq_len=args.seq_len, dim=args.dim, layers=args.layers, heads=args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = synthetic_tokens(args.target, seq_len=args.seq_len, seed=0).to(device)
    accum = Plan.for_target(args.target, args.micro).accum_steps
    guard_module = importlib.import_module("autoaccum.step.guard")
    release = guard_module.release_memory  # autoaccum.recovery's, as the guard calls it
    released: list[tuple[str, float, str]] = []  # (variant, seconds, what was collected)
    variant = [""]

    def timed_release(*a: object, **kw: object) -> str:
        _sync(device)
        started = time.perf_counter()
        what = (_full_release(device) if variant[0].endswith("(before issue 15)") else release(*a, **kw))
        _sync(device)
        released.append((variant[0], time.perf_counter() - started, what))
        return what

    guard_module.release_memory = timed_release

    def failing_loss(fail_at: int) -> Callable:
        calls = [0]

        def loss_fn(m: torch.nn.Module, part: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            loss = token_loss(m, part)
            if calls[0] == fail_at:
                raise torch.OutOfMemoryError("benchmark: injected OOM")
            return loss
        return loss_fn

    meters = _meters(device)
    cases = {"first micro-batch": 1, "last micro-batch": accum}

    def run(name: str, micro: int, fail_at: int | None) -> tuple[float, float]:
        variant[0] = name
        make = meters[name]
        meter = make(model, optimizer) if make is not None else None
        guard = OOMGuard(model, optimizer, target_batch=args.target, micro_batch=micro, meter=meter)
        loss_fn = token_loss if fail_at is None else failing_loss(fail_at)
        with meter if isinstance(meter, TrackedMemory) else contextlib.nullcontext():
            t = _timed(lambda: guard.step(batch, loss_fn), device)
        if isinstance(meter, TrackedMemory):
            meter.close()
        if fail_at is not None:
            assert guard.plan.micro_batch == micro // 2 and guard.ooms == 1, guard.changes
        return t

    for name in meters:  # warm-up
        for micro in (args.micro, args.micro // 2):
            run(name, micro, None)
    released.clear()
    keys = ["normal_micro", "normal_half"] + [f"oom_{case}" for case in cases]
    samples = {name: {k: {"wall": [], "cpu": []} for k in keys} for name in meters}
    for r in range(args.repeats):
        names = list(meters) if r % 2 == 0 else list(reversed(meters))
        for name in names:  # interleaved: each variant's normal steps next to its OOM steps
            measured = [("normal_micro", args.micro, None), ("normal_half", args.micro // 2, None)]
            measured += [(f"oom_{case}", args.micro, at) for case, at in cases.items()]
            for key, micro, at in measured:
                wall, cpu = run(name, micro, at)
                samples[name][key]["wall"].append(wall)
                samples[name][key]["cpu"].append(cpu)
    guard_module.release_memory = release
    out: dict = {"samples": samples, "variants": {}}
    for name in meters:
        med = {k: {c: statistics.median(v[c]) for c in ("wall", "cpu")} for k, v in samples[name].items()}
        mine = [(t, what) for v, t, what in released if v == name]
        entry: dict = {"medians_s": med, "release_median_s": statistics.median(t for t, _ in mine),
                       "collected": sorted({what for _, what in mine}), "cases": {}}
        for case in cases:
            t = med[f"oom_{case}"]
            entry["cases"][case] = {
                "step_s": t["wall"], "x_normal_step": t["wall"] / med["normal_micro"]["wall"],
                "extra_step_times": t["wall"] / med["normal_micro"]["wall"] - 1,
                "extra_step_times_cpu": t["cpu"] / med["normal_micro"]["cpu"] - 1,
                "extra_over_half_step_s": t["wall"] - med["normal_half"]["wall"]}
        out["variants"][name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", type=int, default=32, help="global batch")
    parser.add_argument("--micro", type=int, default=8, help="micro-batch of both variants")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time the overhead blocks by wall clock or by this process's CPU time (CPU device)")
    parser.add_argument("--parts", nargs="+", choices=("overhead", "recovery"), default=["overhead", "recovery"],
                        help="what to measure (default both; recovery alone fits a short GPU call)")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args(argv)
    global _clock
    if args.clock == "cpu":
        if args.device != "cpu":
            parser.error("--clock cpu measures the CPU device only (a GPU's work is not this process's CPU time)")
        _clock = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("autoaccum.step.guard").setLevel(logging.ERROR)  # the injected OOMs are expected
    device = torch.device(args.device)
    ov = overhead(args, device) if "overhead" in args.parts else None
    rec = recovery(args, device) if "recovery" in args.parts else None
    result = {
        "benchmark": "guard", "autoaccum": autoaccum.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(), "clock": args.clock,
        "model": {"name": "TinyGPT", "dim": args.dim, "layers": args.layers, "heads": args.heads,
                  "seq_len": args.seq_len},
        "target_batch": args.target, "micro_batch": args.micro, "steps_per_block": args.steps,
        "repeats": args.repeats, "overhead": ov, "recovery": rec,
    }
    if not args.json_only:
        ms = 1e3
        print(f"guard benchmark on {result['device_name']} ({device}, {result['threads']} threads), torch "
              f"{torch.__version__}, {args.clock} clock; TinyGPT dim {args.dim} x {args.layers} layers, seq {args.seq_len}; "
              f"{Plan.for_target(args.target, args.micro).describe()}; AdamW; {args.repeats} repeats x {args.steps} steps")
        if ov is not None:
            print(f"{'':34}{'median ms/step':>16}{'min':>10}{'max':>10}")
            for name, label in (("hand", "hand-written accumulation loop"), ("guard", "guard.step")):
                t = ov[f"{name}_step_s"]
                print(f"{label:34}{statistics.median(t) * ms:16.2f}{min(t) * ms:10.2f}{max(t) * ms:10.2f}")
            print(f"{'guard / hand':34}{ov['ratio_of_medians']:16.4f}   paired median {ov['paired_ratio_median']:.4f}"
                  f" (range {min(ov['paired_ratios']):.4f} .. {max(ov['paired_ratios']):.4f})")
            for name, label in (("guard_unchecked", "guard.step, inf/NaN check off"),
                                ("guard_clip", "guard.step, clip 1.0"),
                                ("guard_clip_unchecked", "guard.step, clip 1.0, check off")):
                t = ov["step_s"][name]
                print(f"{label:34}{statistics.median(t) * ms:16.2f}{min(t) * ms:10.2f}{max(t) * ms:10.2f}")
            c = ov["check"]
            for key, label in (("no_clip", "check on / off"), ("clip", "check on / off, clipping")):
                r = c[key]
                print(f"{label:34}{r['ratio_of_medians']:16.4f}   paired median {r['paired_ratio_median']:.4f}"
                      f" (range {min(r['paired_ratios']):.4f} .. {max(r['paired_ratios']):.4f})")
            print(f"the check alone: {c['check_s'] * 1e6:.1f} us ({c['check_share_of_step'] * 100:.3f}% of a step), with "
                  f"clipping's norm {c['check_clip_s'] * 1e6:.1f} us; {c['params']:,} parameters")
        if rec is not None:
            print(f"OOM recovery, micro {args.micro} -> {args.micro // 2}: the step with one injected OOM, in extra "
                  f"step-times over a normal step at micro {args.micro} (median wall time; CPU time in brackets)")
            print(f"{'':38}{'normal ms':>10}{'half ms':>9}{'OOM at first':>16}{'OOM at last':>16}{'release ms':>12}"
                  f"  collected")
            for name, v in rec["variants"].items():
                m, c = v["medians_s"], v["cases"]
                first, last = c["first micro-batch"], c["last micro-batch"]
                print(f"{name:38}{m['normal_micro']['wall'] * ms:10.2f}{m['normal_half']['wall'] * ms:9.2f}"
                      f"{first['extra_step_times']:+8.2f} ({first['extra_step_times_cpu']:+.2f})"
                      f"{last['extra_step_times']:+8.2f} ({last['extra_step_times_cpu']:+.2f})"
                      f"{v['release_median_s'] * ms:12.2f}  {', '.join(v['collected'])}")
    print(json.dumps(result, indent=None if args.json_only else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
