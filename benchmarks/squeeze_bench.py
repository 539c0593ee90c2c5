"""Transient squeeze benchmark: throughput after the memory comes back, by how the guard grows.

An emulated device: the probe measures an MLP under a budget; each variant trains a fresh copy from the
same plan (``--micro``) under that budget, which drops for ``--squeeze-steps`` steps (room for
``--squeeze`` x the micro-batch, as when another process takes memory) and then returns. Variants:
``grow="auto"`` (the default, memory-guided), ``grow="double", grow_after=2`` (blind doubling) and
``grow="off"``. Reported: samples/s after the squeeze over before it (CPU time, one thread), also divided
by a never-squeezed control's (the machine's drift), the micro-batch of every step, OOMs, failed growths;
medians over ``--repeats`` runs, the variants in lockstep.

    python benchmarks/squeeze_bench.py [--device cpu|cuda] [--repeats 5] [--warmup 5] [--json-only]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from common import bench_main, classify, markdown_table, mlp, vectors
from torch import nn

import autoaccum
from autoaccum import OOMGuard, TrackedMemory, parse_bytes

VARIANTS = {"model": {"grow": "auto"}, "double": {"grow": "double", "grow_after": 2}, "off": {"grow": "off"}}
LABELS = {"model": "grow='auto' (default)", "double": "grow='double', grow_after=2", "off": "grow='off'"}


def make_model(device: torch.device) -> nn.Module:
    """An MLP whose activations, not AdamW's step, set the peak at the micro-batches used here."""
    return mlp(128, 256).to(device)


def make_batch(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = vectors(n, 128, seed)
    return x.to(device), y.to(device)


def _phase(args: argparse.Namespace, i: int) -> str:
    if i < args.warmup:
        return "warmup"
    if i < args.warmup + args.before:
        return "before"
    return "squeeze" if i < args.warmup + args.before + args.squeeze_steps else "after"


def runs_in_lockstep(args: argparse.Namespace, report: autoaccum.ProbeReport,
                     batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, room: int) -> dict:
    """Every variant, and a control that is never squeezed, each with its own model, optimizer, meter
    and guard, stepped in lockstep: step i of each, in an order rotated per step. A shared machine's
    drift then falls on every variant alike, and the control measures it."""
    budget = parse_bytes(args.budget)
    names = [*VARIANTS, "control"]
    state: dict[str, dict] = {}
    for name in names:
        model = make_model(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mem = TrackedMemory(budget_bytes=budget).track(model, optimizer)
        with mem:
            guard = OOMGuard(model, optimizer, target_batch=args.target, micro_batch=args.micro, meter=mem,
                             memory_model=report.model, headroom=report.headroom,
                             **VARIANTS.get(name, VARIANTS["model"]))
        state[name] = {"mem": mem, "guard": guard, "steps": [], "squeeze_bytes": None}
    for i, batch in enumerate(batches):
        phase = _phase(args, i)
        for name in names[i % len(names):] + names[:i % len(names)]:
            st, mem = state[name], state[name]["mem"]
            if phase == "squeeze" and name != "control" and st["squeeze_bytes"] is None:
                st["squeeze_bytes"] = min(mem.current_bytes + room, budget - 1)
            mem.budget_bytes = st["squeeze_bytes"] if phase == "squeeze" and name != "control" else budget
            with mem:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                wall, cpu = time.perf_counter(), time.process_time()
                result = st["guard"].step(batch, classify)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            st["steps"].append({"phase": phase, "wall_s": wall, "cpu_s": cpu, "micro_batch": result.plan.micro_batch,
                                "attempts": result.attempts, "ooms": sum(c.reason == "oom" for c in result.changes)})
    out = {}
    for name, st in state.items():
        st["mem"].close()
        steps, guard = st["steps"], st["guard"]

        def rate(phase: str, key: str, steps: list[dict] = steps) -> float:
            chosen = [x for x in steps if x["phase"] == phase]
            return args.target * len(chosen) / sum(x[key] for x in chosen)

        run = {"steps": steps, "squeeze_budget_bytes": st["squeeze_bytes"], "budget_bytes": budget,
               "ooms": guard.ooms, "failed_growths": guard.failed_growths,
               "ooms_after_squeeze": sum(x["ooms"] for x in steps if x["phase"] == "after"),
               "ooms_in_squeeze": sum(x["ooms"] for x in steps if x["phase"] == "squeeze"),
               "micro_batches": [x["micro_batch"] for x in steps]}
        for kind in ("wall", "cpu"):
            before, after = rate("before", f"{kind}_s"), rate("after", f"{kind}_s")
            run.update({f"before_samples_per_s_{kind}": before, f"after_samples_per_s_{kind}": after,
                        f"ratio_{kind}": after / before})
        out[name] = run
    for name in VARIANTS:  # the machine's drift over the same steps, measured by the control, divided out
        for kind in ("wall", "cpu"):
            out[name][f"ratio_{kind}_vs_control"] = out[name][f"ratio_{kind}"] / out["control"][f"ratio_{kind}"]
    return out


def squeeze_room(args: argparse.Namespace, report: autoaccum.ProbeReport,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> int:
    """The room above the live bytes during the squeeze, for ``--squeeze`` x the plan's micro-batch:
    the forward/backward rise a guard measures at that size (a calibration run of the warm-up steps),
    less the probe's bytes per sample for the samples left out; never less than the optimizer
    step's rise (which no micro-batch changes: an OOM there is not replayed)."""
    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with TrackedMemory(budget_bytes=parse_bytes(args.budget)).track(model, optimizer) as mem:
        guard = OOMGuard(model, optimizer, target_batch=args.target, micro_batch=args.micro, meter=mem,
                         memory_model=report.model, headroom=report.headroom)
        for batch in batches[:args.warmup]:
            guard.step(batch, classify)
    mem.close()
    micro = guard.plan.micro_batch
    measured = guard.policy.rises[micro]  # the guard's record of its clean steps at this size
    slope = report.model.per_sample_bytes if report.model is not None else measured.fwd_bwd_bytes / micro
    opt_rise = measured.step_bytes if measured.step_bytes > measured.fwd_bwd_bytes else 0
    return int(max(measured.fwd_bwd_bytes - slope * micro * (1 - args.squeeze), opt_rise))


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", default="4MiB", help="the emulated device's memory")
    parser.add_argument("--target", type=int, default=2048, help="global batch")
    parser.add_argument("--micro", type=int, default=512, help="the plan's micro-batch (it must fit the budget)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps first (the first ones run slower in every variant)")
    parser.add_argument("--before", type=int, default=10, help="timed steps before the squeeze")
    parser.add_argument("--squeeze-steps", type=int, default=5)
    parser.add_argument("--squeeze", type=float, default=0.6,
                        help="room during the squeeze: for this fraction of the plan's micro-batch")
    parser.add_argument("--after", type=int, default=20, help="timed steps after the squeeze")
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    logging.getLogger("autoaccum.guard").setLevel(logging.ERROR)  # the squeeze's OOMs are expected
    device = torch.device(args.device)
    probe_model = make_model(device)
    report = autoaccum.probe(model=probe_model, loss_fn=classify, make_batch=lambda b: make_batch(b, b, device),
                             optimizer=torch.optim.AdamW(probe_model.parameters(), lr=1e-3),
                             target_batch=args.target, budget=args.budget)
    total = args.warmup + args.before + args.squeeze_steps + args.after
    batches = [make_batch(args.target, 1000 + i, device) for i in range(total)]
    room = squeeze_room(args, report, batches, device)
    runs: dict[str, list[dict]] = {v: [] for v in [*VARIANTS, "control"]}
    for _ in range(args.repeats):
        for name, variant_run in runs_in_lockstep(args, report, batches, device, room).items():
            runs[name].append(variant_run)
    med = statistics.median
    summary = {variant: {
        **{f"ratio_{k}_median": med(r[f"ratio_{k}"] for r in runs[variant])
           for k in ("cpu", "wall", "cpu_vs_control", "wall_vs_control")},
        **{k: max(r[k] for r in runs[variant]) for k in ("ooms", "ooms_in_squeeze", "ooms_after_squeeze",
                                                          "failed_growths")},
        "micro_batches": runs[variant][0]["micro_batches"]} for variant in VARIANTS}
    return {
        "benchmark": "squeeze", "autoaccum": autoaccum.__version__, "device": str(device),
        "model": "MLP 128-256-256-10 (fp32), AdamW", "target_batch": args.target, "budget": args.budget,
        "plan": autoaccum.Plan.for_target(args.target, args.micro).describe(), "probe_plan": report.plan.describe(),
        "squeeze": args.squeeze, "squeeze_budget_bytes": runs["model"][0]["squeeze_budget_bytes"],
        "steps": {"warmup": args.warmup, "before": args.before, "squeeze": args.squeeze_steps, "after": args.after},
        "repeats": args.repeats, "summary": summary, "runs": runs,
    }


def table(result: dict) -> str:
    head = ("", "after/before: CPU", "wall", "CPU vs control", "OOMs", "in squeeze", "after", "failed grows")
    rows = [(LABELS[variant], f"{v['ratio_cpu_median']:.3f}", f"{v['ratio_wall_median']:.3f}",
             f"{v['ratio_cpu_vs_control_median']:.3f}", *(str(v[k]) for k in (
                 "ooms", "ooms_in_squeeze", "ooms_after_squeeze", "failed_growths")))
            for variant, v in result["summary"].items()]
    return "\n".join([
        f"transient squeeze on {result['device']} ({result['threads']} thread(s)), torch {result['torch']}; "
        f"{result['model']}; budget {result['budget']}, plan {result['plan']}; the budget drops to "
        f"{result['squeeze_budget_bytes'] / 2**20:.2f} MiB for {result['steps']['squeeze']} steps (room for "
        f"{result['squeeze']:g} x the micro-batch); {result['repeats']} repeats, medians (OOMs: the most in a repeat)",
        "", markdown_table([head, *rows]), "",
        *(f"micro-batch per step, {variant}: {v['micro_batches']}" for variant, v in result["summary"].items())])


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table, options))
