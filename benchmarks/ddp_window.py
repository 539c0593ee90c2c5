"""Can host work hide in the all-reduce's window? (issue 15, the ranks row; a diagnostic, not a product setting)

In an overlapped step on 2 gloo ranks the first bucket's all-reduce is started during the last backward,
and the main thread then waits several milliseconds for it after the backward (``ddp_parts.py``:
``_wait_all``). Host work placed in that window (a check of the local gradients, a precomputed row)
would be free only where the CPU is idle while it waits. This script measures whether it is, on the
guard of ``ddp_bench.py``'s ``autoaccum_overlap`` mode (the MLP, 8 micro-batches of 8 per rank, DDP,
SGD, ``overlap="auto"``, ``nonfinite="stop"``), in four variants of the same guards, one step of
each in turn (a shuffled order per turn, each step timed alone after a barrier, rotating over
``--instances`` guards that every variant shares, so that the pairing cancels the instance effect):

- ``default``: the guard as it is;
- ``no_check``: the inf/NaN check before ``optimizer.step()`` answered "finite" without looking
  (unsafe): what the check costs on the step's tail, after the wait;
- ``no_check_sum_in_window``: ``no_check``, plus the check's own work -- a sum of the first bucket's
  local gradients -- done in the window, just after that bucket's all-reduce is started: what a design
  that checked the gradients while they are being reduced would pay;
- ``norm_in_window``: ``default``, plus a larger known amount of work in the window (the 1-norm of
  the same gradients, slow on the CPU: about 0.9 ms alone here).

Each variant against ``default``, paired per turn (median ratio with a 95% bootstrap interval, above 1:
faster than ``default``; and the median difference in ms), and the two works' time alone on rank 0,
timed after the turns on the same tensors. Prints a table, then one JSON document.

    python benchmarks/ddp_window.py [--turns 300] [--instances 4] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import platform
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_bench  # noqa: E402 - benchmarks/ on the path

VARIANTS = ("default", "no_check", "no_check_sum_in_window", "norm_in_window")
WORKS = {"sum": lambda grads: torch.stack([g.sum() for g in grads]).sum(),
         "norm": lambda grads: torch.stack(torch._foreach_norm(grads, 1)).sum()}


def _worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    import autoaccum.distributed.overlap as overlap
    import autoaccum.optim_step as optim_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    now = {"variant": "default"}
    seen: list[list[torch.Tensor]] = []
    launch, check = overlap._OverlappedReduce._launch, optim_step._check_finite

    def launch_then_work(self: Any, index: int, *, copy: bool, during_backward: bool = False) -> None:
        launch(self, index, copy=copy, during_backward=during_backward)
        work = {"no_check_sum_in_window": "sum", "norm_in_window": "norm"}.get(now["variant"])
        if index == 0 and during_backward and work is not None:
            grads = [p.grad for p in self.buckets[0] if p.grad is not None]
            float(WORKS[work](grads))  # done (and read) in the window, before the backward goes on
            if not seen:
                seen.append([g.detach().clone() for g in grads])

    def maybe_check(*a: Any, **k: Any) -> Any:
        return (True, None) if now["variant"].startswith("no_check") else check(*a, **k)

    overlap._OverlappedReduce._launch = launch_then_work
    optim_step._check_finite = maybe_check
    guards = [ddp_bench._setup("autoaccum_overlap", rank, args)[0] for _ in range(args.instances)]
    for step in guards:
        for _ in range(args.warmup):
            step()
    turn = itertools.count()

    def variant(name: str) -> Any:
        def run() -> None:
            now["variant"] = name
            guards[next(turn) // len(VARIANTS) % args.instances]()  # every variant on every guard alike
        return run

    times, _ = ddp_bench._turns({name: variant(name) for name in VARIANTS}, args.turns, before=dist.barrier)
    alone = {name: min(timeit.repeat(lambda w=work: float(w(seen[0])), number=20, repeat=5)) / 20 * 1e3
             for name, work in WORKS.items()} if seen else {}
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "alone_ms": alone}))
    guards.clear()
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    args.accum, args.micro = 8, 8  # ddp_bench's plan
    result = ddp_bench.run_two_ranks(_worker, args)
    times = result["times"]
    rows = {}
    for name in VARIANTS:
        ratio = ddp_bench._per_step_ratio(times, name, "default")
        diffs = [(m - d) * 1e3 for m, d in zip(times[name], times["default"])]
        rows[name] = {**ratio, "minus_default_ms": statistics.median(diffs)}
    report = {"benchmark": "ddp_window", "hidden": args.hidden, "turns": args.turns, "instances": args.instances,
              "variants": rows, "work_alone_ms": result["alone_ms"], "torch": torch.__version__,
              "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if not args.json_only:
        print(f"2 gloo ranks, hidden {args.hidden}, {args.turns} turns over {args.instances} guards; each variant "
              f"against default, paired per turn (above 1: faster than default)")
        print(f"{'variant':<26}{'median ms':>11}{'vs default':>12}{'95% interval':>18}{'minus default':>15}")
        for name, r in rows.items():
            print(f"{name:<26}{r['median_ms']:>11.2f}{r['ratio']:>11.3f}x{r['low']:>10.3f}-{r['high']:.3f}"
                  f"{r['minus_default_ms']:>+13.2f} ms")
        print("the works alone on rank 0 (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in result["alone_ms"].items()))
        print()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
