"""What a small collective costs next to the gradient all-reduce on 2 gloo ranks (issue 15, ranks).

Two measurements, each rank with one intra-op thread and some compute between collectives (as a
training step has):

- ``flag``: a step's tail, ``--blocks`` alternating blocks of ``--iters`` iterations of each way:
  compute, then the gradients (``--grad-mib`` MiB of fp32, one async all-reduce, waited on), then
  - ``separate``: the flag as a small float64 all-reduce of its own after the gradients (the
    overlapped step before the flag moved into the last bucket);
  - ``in_bucket``: the flag as ``--row`` more float32 elements of the gradients' buffer (the
    overlapped step now: no collective after the gradients).
  Per-iteration wall time, median over the iterations; the difference is what the separate
  exchange costs.
- ``enqueue``: how long issuing one small asynchronous all-reduce takes the calling thread while
  the other rank computes, through ``dist.all_reduce(async_op=True)`` and through the process
  group's own ``allreduce`` (no Python wrappers): gloo's worker thread taking the core, not Python.

Prints a table, then one JSON document. Not part of the test run.

    python benchmarks/gloo_cost.py [--iters 100] [--blocks 4] [--grad-mib 4.3] [--row 33] [--json-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_bench import run_two_ranks  # the same directory: benchmarks/ is on the path


def _compute(a: torch.Tensor) -> None:
    for _ in range(10):
        a @ a.T[:, :64]


def _flag_tail(args: argparse.Namespace) -> dict[str, list[float]]:
    numel = int(args.grad_mib * 2**20 / 4)
    grads = torch.randn(numel)
    with_row = torch.zeros(numel + args.row)
    flag = torch.zeros(args.row, dtype=torch.float64)
    a = torch.randn(256, 1024)
    times: dict[str, list[float]] = {"separate": [], "in_bucket": []}
    for _ in range(args.blocks):
        for way in times:
            dist.barrier()
            for _ in range(args.iters):
                started = time.perf_counter()
                _compute(a)
                if way == "separate":
                    dist.all_reduce(grads, async_op=True).wait()
                    dist.all_reduce(flag)
                else:
                    dist.all_reduce(with_row, async_op=True).wait()
                times[way].append(time.perf_counter() - started)
    return times


def _enqueue(args: argparse.Namespace) -> dict[str, list[float]]:
    group = dist.distributed_c10d._get_default_group()
    a = torch.randn(256, 1024)
    times: dict[str, list[float]] = {"dist.all_reduce": [], "ProcessGroup.allreduce": []}
    for _ in range(args.blocks * args.iters):
        for way in times:
            t = torch.zeros(2, 7, dtype=torch.int64)
            started = time.perf_counter()
            work = dist.all_reduce(t, async_op=True) if way == "dist.all_reduce" else group.allreduce([t])
            times[way].append(time.perf_counter() - started)
            _compute(a)
            work.wait()
    return times


def _worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    result = {"flag": _flag_tail(args), "enqueue": _enqueue(args)}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100, help="iterations per block and way")
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per way")
    parser.add_argument("--grad-mib", type=float, default=4.3, help="gradient bytes all-reduced per iteration")
    parser.add_argument("--row", type=int, default=33, help="the flag's elements (ddp_bench's model: 33)")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    for name in ("iters", "blocks", "row"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    measured = run_two_ranks(_worker, args)

    def us(values: list[float]) -> float:
        return statistics.median(values) * 1e6

    flag = {way: us(v) for way, v in measured["flag"].items()}
    enqueue = {way: us(v) for way, v in measured["enqueue"].items()}
    report = {"benchmark": "gloo_cost", "backend": "gloo", "world_size": 2, "grad_mib": args.grad_mib,
              "row": args.row, "iters": args.iters, "blocks": args.blocks, "torch": torch.__version__,
              "python": platform.python_version(), "cpus": os.cpu_count(),
              "flag_tail_median_us": flag, "separate_flag_costs_us": flag["separate"] - flag["in_bucket"],
              "enqueue_median_us": enqueue}
    if not args.json_only:
        print(f"2 gloo ranks, {args.grad_mib} MiB of fp32 gradients, a flag of {args.row} numbers; medians (rank 0)")
        for way, value in flag.items():
            print(f"  step tail, flag {way:<10} {value:9.0f} us")
        print(f"  the separate flag exchange costs {report['separate_flag_costs_us']:.0f} us per step")
        for way, value in enqueue.items():
            print(f"  issuing one async all-reduce via {way:<23} {value:6.0f} us")
        print()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
