"""Many ranks: what autoaccum's guard costs against a hand-written DDP accumulation loop.

Two ways to train the same DDP model, ``accum`` micro-batches a step: ``hand`` (``no_sync`` on all but
the last micro-batch, DDP's reducer during the last backward) and ``autoaccum`` (every micro-batch under
``no_sync``, the OOM flag agreed, then the gradients all-reduced once). One step of each a turn, shuffled,
each after a barrier; reported: the median over turns of hand's step time over autoaccum's, with a 95%
bootstrap interval. With k micro-batches a step, the hand loop's overlap of the all-reduce with the last
backward saves at most T_allreduce / (k * T_fwd_bwd + T_allreduce).

    python benchmarks/ddp_bench.py [--world-size 2] [--accum 8] [--micro 8] [--hidden 1024] [--interleaved 150]
    python benchmarks/ddp_bench.py --backend nccl --device cuda --world-size 1   # one GPU (a world of one)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import bench_main, classify, hand_step, markdown_table, mlp, vectors

MODES = ("hand", "autoaccum")


def _setup(mode: str, rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> Any:
    """One mode's model, optimizer (and guard): returns ``step()``."""
    import autoaccum
    from autoaccum.distributed import DistributedSync

    ids = [device.index] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(mlp(64, args.hidden, act=torch.nn.GELU).to(device),
                                                      device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    share = args.micro * args.accum
    x, y = (t.to(device) for t in vectors(share, 64, seed=rank))
    if mode == "hand":  # nanoGPT's DDP loop: all but the last micro-batch under no_sync, each loss / accum
        parts = list(zip(x.split(args.micro), y.split(args.micro)))
        return lambda: hand_step(model, opt, parts, classify, divide="accum_steps", no_sync=True)
    guard = autoaccum.OOMGuard(model, opt, target_batch=share * world_size, micro_batch=args.micro,
                               sync=DistributedSync(model), grow="off")
    return lambda: guard.step((x, y), classify)


def _worker(rank: int, world_size: int, port: int, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    steps = {mode: _setup(mode, rank, world_size, device, args) for mode in MODES}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    order, shuffle = list(MODES), random.Random(0)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.interleaved):
        shuffle.shuffle(order)
        for mode in order:
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            steps[mode]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[mode].append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    del steps  # every model, optimizer and guard before the group goes: nothing of theirs outlives it
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _run(args: argparse.Namespace) -> dict[str, list[float]]:
    """The worker on ``--world-size`` spawned ranks; rank 0's step times per mode."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "rank0.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(rank, args.world_size, port, str(out), args))
             for rank in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1800)
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return json.loads(out.read_text())


def _median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median of paired per-turn values and its 95% bootstrap interval (1000 draws, a fixed seed)."""
    values, draw = sorted(values), random.Random(1)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(1000))
    return statistics.median(values), medians[25], medians[974]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--accum", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--micro", type=int, default=8, help="samples per micro-batch per rank")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (gradient size ~ hidden^2 floats)")
    parser.add_argument("--interleaved", type=int, default=150, help="turns of one step per mode")
    parser.add_argument("--warmup", type=int, default=3)


def run(args: argparse.Namespace) -> dict:
    for name in ("world_size", "accum", "micro", "hidden", "interleaved", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"ddp_bench.py: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.backend == "nccl" and args.device != "cuda":
        raise SystemExit("ddp_bench.py: --backend nccl needs --device cuda")
    if args.device == "cuda" and args.world_size > torch.cuda.device_count():
        raise SystemExit(f"ddp_bench.py: --world-size {args.world_size} needs as many GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    times = _run(args)
    params = sum(p.numel() for p in mlp(64, args.hidden, act=torch.nn.GELU).parameters())
    results = []
    for mode in MODES:
        ratio, low, high = _median_interval([h / m for h, m in zip(times["hand"], times[mode])])
        results.append({"mode": mode, "median_step_ms": statistics.median(times[mode]) * 1e3,
                        "vs_hand": ratio, "low": low, "high": high})
    return {"benchmark": "ddp_bench", "backend": args.backend, "world_size": args.world_size,
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)",
            "accum_steps": args.accum, "micro_batch": args.micro, "params": params, "grad_bytes": params * 4,
            "turns": args.interleaved, "results": results}


def table(r: dict) -> str:
    return (f"{r['world_size']} rank(s), {r['backend']} on {r['device']}, {r['params']:,} parameters "
            f"({r['grad_bytes'] / 2**20:.1f} MiB of fp32 gradients), {r['accum_steps']} micro-batches of "
            f"{r['micro_batch']} per rank and step; {r['turns']} turns, one step of each mode a turn\n\n"
            + markdown_table([("mode", "median step ms", "vs hand loop", "95% interval"), *(
                (m["mode"], f"{m['median_step_ms']:.2f}", f"{m['vs_hand']:.3f}x", f"{m['low']:.3f}-{m['high']:.3f}")
                for m in r["results"])]))


if __name__ == "__main__":
    sys.exit(bench_main(__doc__, run, table, options))
