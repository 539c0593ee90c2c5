"""Where the overlapped step's time goes on 2 gloo ranks (issue 15, the ranks row): the guard's parts
timed on rank 0, beside the hand loop's step.

The model and plan of ``ddp_bench.py`` (the MLP 64-1024-1024-10, 8 micro-batches of 8 per rank, DDP,
SGD), ``OOMGuard(overlap="auto", nonfinite=None)`` (``ddp_bench``'s ``autoaccum_overlap_nocheck``)
against the hand loop (``ddp_no_sync_last``): one step of each in turn, each after a barrier, timed
alone. The guard's parts are timed by wrapping them (their wall time on the calling thread, summed
per step; nested parts are inside their callers):

- ``guard._agree_cut``: start the cut's exchange (an asynchronous all-reduce the hand loop does not have;
  none in a chained step: then only the vote and the row);
- ``guard._settle_cut``: read its answer before the last micro-batch (not called in a chained step);
- ``overlap._launch``: copy a bucket's gradients into its flat buffer and start its all-reduce;
- ``overlap._wait_all``: wait for every bucket's all-reduce after the backward (the hand loop waits
  for DDP's inside its last backward);
- ``overlap._write_row`` / ``_read_row``: the flag's row in the last bucket, built and read;
- ``overlap.copy_back``: the agreed sums handed to ``.grad`` (views);
- ``settle._wait``: waiting for gloo's worker to let go of the buffers (``autoaccum.distributed.settle``);
- ``ProcessGroup.allreduce``: every all-reduce the guard issues from Python (through ``dist.all_reduce``,
  or sent to the process group directly: the buckets), counted inside its caller too (the hand loop
  issues none from Python: DDP's reducer starts its own in C++);
- with ``--check``, the guard is the default ``autoaccum_overlap`` (the inf/NaN check on) and
  ``optim_step._check_finite`` is timed too.

And each step is split at the moment its first bucket of gradients is ready to leave (the guard's
``_launch`` of bucket 0; in the hand loop, the gradients that close DDP's first bucket): the medians
before and after that moment, for both, show where the guard's extra time lies.

Prints a table, then one JSON document. Not part of the test run.

    python benchmarks/ddp_parts.py [--steps 200] [--check] [--json-only]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_bench  # noqa: E402 - benchmarks/ on the path
from call_timers import time_calls  # noqa: E402

PARTS = {"guard": ("_agree_cut", "_settle_cut"),
         "overlap": ("_launch", "_wait_all", "_write_row", "_read_row", "copy_back"),
         "settle": ("_wait",), "ProcessGroup": ("allreduce",), "optim_step": ("_check_finite",)}


def _worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    import autoaccum.distributed.overlap as overlap
    import autoaccum.distributed.settle as settle
    import autoaccum.guard as guard
    import autoaccum.optim_step as optim_step

    owners = {"guard": guard.OOMGuard, "overlap": overlap._OverlappedReduce, "settle": settle,
              "ProcessGroup": dist.ProcessGroup, "optim_step": optim_step}
    spent: dict[str, float] = {}
    time_calls({f"{key}.{name}": [(owners[key], name)] for key, names in PARTS.items() for name in names}, spent)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    guarded = "autoaccum_overlap" if args.check else "autoaccum_overlap_nocheck"
    launched = {"guard": 0.0, "hand": 0.0}
    steps = {guarded: ddp_bench._setup(guarded, rank, args)[0]}
    with _first_bucket_marked(overlap, launched):  # the hand loop's model only carries the marking hooks
        steps["ddp_no_sync_last"] = ddp_bench._setup("ddp_no_sync_last", rank, args)[0]
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    spent.clear()
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    split: dict[str, list[float]] = {f"{who}_{part}": [] for who in ("guard", "hand") for part in ("before", "after")}
    for _ in range(args.steps):
        for mode, step in steps.items():
            dist.barrier()
            started = time.perf_counter()
            step()
            ended = time.perf_counter()
            times[mode].append(ended - started)
            who = "hand" if mode == "ddp_no_sync_last" else "guard"
            split[f"{who}_before"].append(launched[who] - started)
            split[f"{who}_after"].append(ended - launched[who])
    if rank == 0:
        Path(out).write_text(json.dumps({
            "guard_mode": guarded, "guard_step_ms": statistics.median(times[guarded]) * 1e3,
            "hand_step_ms": statistics.median(times["ddp_no_sync_last"]) * 1e3,
            "first_bucket_split_ms": {k: statistics.median(v) * 1e3 for k, v in split.items()},
            "parts_ms_per_step": {k: v / args.steps * 1e3 for k, v in sorted(spent.items())}}))
    # The DDP wrappers are dropped before the group (README, "At exit"): freed after it, the hand loop's
    # reducer holds the group's last reference and joins gloo's worker threads holding the GIL, while a
    # worker may still need the GIL to free a collective started inside a backward (torch 2.13 puts a
    # Python object in the state such a collective keeps): one hang at exit on 2026-11-26.
    del steps
    gc.collect()
    dist.destroy_process_group()


@contextlib.contextmanager
def _first_bucket_marked(overlap: Any, launched: dict[str, float]) -> Iterator[None]:
    """Note in ``launched`` when each step's first bucket of gradients was ready to leave (``perf_counter``
    time): the guard's when its ``_launch`` of bucket 0 starts (in the last backward; for the rest of the
    process), the hand loop's when the gradients closing DDP's first bucket (the second linear layer's,
    the same 1 MiB-first bucketing) are accumulated -- the last micro-batch's, as the later ones
    overwrite the earlier -- on the models built inside the block (the hand loop's: its hooks cost a
    few Python calls per micro-batch there, none in the guard's model). The step before that point and
    after it are timed apart: what the guard adds before the gradients can leave, and after."""
    inner = overlap._OverlappedReduce._launch

    def launch(self: Any, index: int, **kwargs: Any) -> None:
        if index == 0:
            launched["guard"] = time.perf_counter()
        inner(self, index, **kwargs)

    overlap._OverlappedReduce._launch = launch
    build = ddp_bench._model

    def model(hidden: int) -> torch.nn.Module:
        built = build(hidden)
        for p in built[2].parameters():  # the second linear layer: its gradients close DDP's first bucket
            p.register_post_accumulate_grad_hook(lambda _p: launched.__setitem__("hand", time.perf_counter()))
        return built

    ddp_bench._model = model
    try:
        yield
    finally:
        ddp_bench._model = build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check", action="store_true",
                        help="time the default (inf/NaN check on, autoaccum_overlap) instead of the nocheck mode")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="MLP width, as ddp_bench's (16: the fixed cost per step, with almost no model around it)")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    args.accum, args.micro, args.cut_cost, args.unchained = 8, 8, False, False  # ddp_bench defaults
    result = ddp_bench.run_two_ranks(_worker, args)
    result.update(steps=args.steps, torch=torch.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if not args.json_only:
        print(f"guard ({result['guard_mode']}) {result['guard_step_ms']:.2f} ms per step (median), "
              f"hand loop {result['hand_step_ms']:.2f} ms; rank 0's parts, ms per step (mean over {args.steps}):")
        for key, ms in result["parts_ms_per_step"].items():
            print(f"  {key:<22}{ms:8.3f}")
        split = result["first_bucket_split_ms"]
        print(f"step start -> first bucket ready (medians): guard {split['guard_before']:.3f}, hand loop "
              f"{split['hand_before']:.3f} ms; first bucket -> step end: guard {split['guard_after']:.3f}, hand loop "
              f"{split['hand_after']:.3f} ms")
        print()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
