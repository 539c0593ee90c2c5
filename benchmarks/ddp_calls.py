"""What one overlapped step runs on 2 gloo ranks, counted rather than timed (issue 15, the ranks row).

The guard (``ddp_bench.py``'s ``autoaccum_overlap``: the MLP, 8 micro-batches of 8 per rank, DDP, SGD,
``overlap="auto"``, ``nonfinite="stop"``) against the hand loop (``ddp_no_sync_last``), on rank 0, per step:

- **Python function calls** and **calls into C functions** from Python (``sys.setprofile``'s ``call`` and
  ``c_call`` events), each by the module they are in;
- **tensor operations dispatched** (a ``TorchDispatchMode``; what autograd runs in the backward included).

Counts do not depend on the machine's load, so they show what a change to the step's host work did
where a timing cannot resolve it (a fraction of a millisecond on a 2-core machine). They are not times:
a call into the interpreter and a tensor operation cost different amounts, and on this 2-core machine a
small tensor operation costs several microseconds inside a step against about two alone
(``benchmarks/RESULTS.md``, "CPU time per step, and the all-reduce's window"). The steps counted are
chained and overlapped, as in the benchmark's steady state. Prints a table, then one JSON document.

    python benchmarks/ddp_calls.py [--hidden 16] [--steps 10] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_bench  # noqa: E402 - benchmarks/ on the path

MODES = {"guard": "autoaccum_overlap", "hand_loop": "ddp_no_sync_last"}


class _Ops(TorchDispatchMode):
    """Counts every tensor operation dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _module_of(frame: Any, event: str, arg: Any) -> str:
    """The module a call goes to: the called function's file (a Python call) or the C function's module."""
    if event == "call":
        name = frame.f_code.co_filename
        for root in ("autoaccum", "torch", "benchmarks"):
            if f"/{root}/" in name:
                return root
        return "other"
    module = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__ or "other"
    return module.split(".")[0]


def _count(step: Any, steps: int) -> dict[str, Any]:
    """``steps`` steps of ``step`` with every Python call and C call counted, then ``steps`` more with every
    tensor operation counted (apart: the dispatch mode's own Python calls are not the step's); per step."""
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()  # autoaccum's Python calls, by function

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            module = _module_of(frame, event, arg)
            calls[(event, module)] += 1
            if module == "autoaccum" and event == "call":
                code = frame.f_code
                ours[f"{code.co_filename.rsplit('/autoaccum/', 1)[-1]}:{code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    ops = _Ops()
    with ops:
        for _ in range(steps):
            step()
    by_kind: dict[str, dict[str, float]] = {"python_calls": {}, "c_calls": {}}
    for (event, module), n in calls.items():
        by_kind["python_calls" if event == "call" else "c_calls"][module] = n / steps
    by_kind["python_calls_in_autoaccum"] = {name: n / steps for name, n in ours.items()}
    return {**{kind: {"total": sum(v.values()), "by_module": v} for kind, v in by_kind.items()
               if kind != "python_calls_in_autoaccum"},
            "python_calls_in_autoaccum": by_kind["python_calls_in_autoaccum"],
            "tensor_ops": {"total": sum(ops.counts.values()) / steps,
                           "by_op": {k: v / steps for k, v in ops.counts.items()}}}


def _worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    built = {name: ddp_bench._setup(mode, rank, args) for name, mode in MODES.items()}
    for step, _ in built.values():
        for _ in range(args.warmup):
            step()
    counted = {}
    for name, (step, overlapped) in built.items():
        dist.barrier()
        counted[name] = _count(step, args.steps)
        if name == "guard" and not all(overlapped[-2 * args.steps:]):
            sys.exit("internal: the guard's counted steps were not all overlapped")
    if rank == 0:
        Path(out).write_text(json.dumps(counted))
    built.clear()  # the DDP wrappers go before the group (README, "At exit")
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=16, help="MLP width (ddp_bench's default is 1024; the counts "
                        "of the host work do not depend on it)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="tensor operations listed, by the difference")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 3:
        sys.exit(f"--steps must be at least 1 and --warmup at least 3 (chained steps), got {args.steps}, {args.warmup}")
    args.accum, args.micro = 8, 8  # ddp_bench's plan
    counted = ddp_bench.run_two_ranks(_worker, args)
    report = {"benchmark": "ddp_calls", "hidden": args.hidden, "steps": args.steps, "counts_per_step": counted,
              "torch": torch.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if not args.json_only:
        guard, hand = counted["guard"], counted["hand_loop"]
        print(f"rank 0, per step (2 gloo ranks, hidden {args.hidden}, {args.steps} steps counted)")
        print(f"{'':<24}{'guard':>10}{'hand loop':>12}{'difference':>12}")
        for kind in ("python_calls", "c_calls", "tensor_ops"):
            print(f"{kind:<24}{guard[kind]['total']:>10.1f}{hand[kind]['total']:>12.1f}"
                  f"{guard[kind]['total'] - hand[kind]['total']:>+12.1f}")
            if kind != "tensor_ops":
                modules = sorted(set(guard[kind]["by_module"]) | set(hand[kind]["by_module"]))
                for m in modules:
                    g, h = guard[kind]["by_module"].get(m, 0.0), hand[kind]["by_module"].get(m, 0.0)
                    print(f"  {m:<22}{g:>10.1f}{h:>12.1f}{g - h:>+12.1f}")
        print("the guard's most frequent Python calls in autoaccum (a generator expression or comprehension counts "
              "once per item it yields):")
        for name, n in sorted(guard["python_calls_in_autoaccum"].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {name:<46}{n:>8.1f}")
        g_ops, h_ops = guard["tensor_ops"]["by_op"], hand["tensor_ops"]["by_op"]
        diff = sorted(set(g_ops) | set(h_ops), key=lambda k: -abs(g_ops.get(k, 0.0) - h_ops.get(k, 0.0)))
        print("tensor operations that differ most:")
        for op in diff[:args.top]:
            g, h = g_ops.get(op, 0.0), h_ops.get(op, 0.0)
            if g != h:
                print(f"  {op:<46}{g:>8.1f}{h:>8.1f}{g - h:>+8.1f}")
        print()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
