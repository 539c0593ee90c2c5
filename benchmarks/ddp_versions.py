"""Two versions of the guard side by side on 2 gloo ranks (issue 15, the ranks row): this checkout's
``autoaccum`` against the package as it was at ``--baseline`` (a git revision), and the hand loop.

A change to the overlapped step's host work is a fraction of a millisecond, less than one
``ddp_bench.py`` run resolves when runs are compared across time on this shared machine. Here both
versions run in the same processes, one step of each in turn: the baseline's ``autoaccum/`` is
exported with ``git archive`` into a temporary folder as the package ``autoaccum_baseline`` (its
imports renamed), so that the two import side by side.

The model, plan and modes are ``ddp_bench.py``'s: the MLP (``--hidden``; ``--depth`` hidden layers,
1 as there, more for more parameter tensors), 8 micro-batches of 8 per rank, DDP, SGD; the guard is the default (``overlap="auto"``, ``nonfinite="stop"``: the
``autoaccum_overlap`` mode), the hand loop ``ddp_no_sync_last``. Every mode is set up ``--instances``
times and the turns rotate over them (``ddp_bench``'s ``--instances``); each step is timed alone after
a barrier, in a shuffled order per turn. Reported: each mode's median step time, each guard against
the hand loop, and the current guard against the baseline (the median per-turn ratio with its 95%
bootstrap interval; above 1: the current one is faster), and rank 0's CPU time per step, paired the same
way (``ddp_bench``'s CPU columns: on this 2-core machine the steadier measure of host work). Prints a
table, then one JSON document.
Not part of the test run.

    python benchmarks/ddp_versions.py --baseline REV [--hidden 16] [--depth 1] [--bucket-bytes N] [--turns 400]
                                      [--instances 4]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import itertools
import json
import platform
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_bench  # noqa: E402 - benchmarks/ on the path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "autoaccum_baseline"
MODES = ("hand_loop", "baseline", "current")


def export_baseline(revision: str, into: Path) -> str:
    """``autoaccum/`` at ``revision`` written under ``into`` as the package :data:`BASELINE`; returns the
    revision's full commit hash."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "autoaccum"], cwd=ROOT, check=True, capture_output=True).stdout
    renamed = re.compile(r"\bautoaccum(?=[.\s]|$)")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            target = into / BASELINE / Path(member.name).relative_to("autoaccum")
            target.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if member.name.endswith(".py"):
                lines = data.decode().splitlines(keepends=True)
                # imports only: `from autoaccum.x import`, `import autoaccum.x`, `from autoaccum import`
                data = "".join(renamed.sub(BASELINE, line) if re.match(r"\s*(from|import)\s+autoaccum\b", line)
                               else line for line in lines).encode()
            target.write_bytes(data)
    return commit


def _ddp(args: argparse.Namespace) -> torch.nn.parallel.DistributedDataParallel:
    """The model in DDP, its buckets capped at ``--bucket-bytes`` where given."""
    caps = {} if args.bucket_bytes is None else {"bucket_cap_mb": args.bucket_bytes / 2**20}
    return torch.nn.parallel.DistributedDataParallel(ddp_bench._model(args.hidden, args.depth), **caps)


def _guard_step(package: str, rank: int, args: argparse.Namespace) -> Any:
    """One guard (``ddp_bench``'s ``autoaccum_overlap``) of ``package``; returns ``step()``."""
    module = __import__(package)
    distributed = __import__(f"{package}.distributed", fromlist=["DistributedSync"])
    model = _ddp(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = ddp_bench._data(rank, args)
    caps = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
    guard = module.OOMGuard(model, opt, target_batch=len(x) * 2, micro_batch=args.micro,
                            sync=distributed.DistributedSync(model, **caps), overlap="auto", nonfinite="stop")
    return lambda: guard.step((x, y), ddp_bench._loss)


def _hand_step(rank: int, args: argparse.Namespace) -> Any:
    """The hand loop (``ddp_bench``'s ``ddp_no_sync_last``) on the same model."""
    model = _ddp(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = ddp_bench._data(rank, args)
    return lambda: ddp_bench._hand_step(model, opt, x, y, args, quiet_but_last=True)


def _worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    sys.path.insert(0, args.baseline_dir)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    build = {"hand_loop": lambda: _hand_step(rank, args), "baseline": lambda: _guard_step(BASELINE, rank, args),
             "current": lambda: _guard_step("autoaccum", rank, args)}
    keys = [(mode, k) for k in range(args.instances) for mode in MODES]
    random.Random(2).shuffle(keys)  # the same order on both ranks
    built = {key: build[key[0]]() for key in keys}
    for step in built.values():
        for _ in range(args.warmup):
            step()

    def rotating(mode: str) -> Any:
        turn = itertools.count()
        return lambda: built[(mode, next(turn) % args.instances)]()

    cpu: dict[str, dict[str, list[float]]] = {}
    times, _ = ddp_bench._turns({mode: rotating(mode) for mode in MODES}, args.turns, before=dist.barrier, cpu=cpu)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "cpu": cpu}))
    built.clear()  # the DDP wrappers go before the group (README, "At exit")
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare this checkout with")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width, as ddp_bench's (16: the fixed cost)")
    parser.add_argument("--depth", type=int, default=1,
                        help="hidden-to-hidden layers (1: ddp_bench's model; more: more parameters per step)")
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="gradient bucket size of both guards and the hand loop's DDP (default: theirs, 25 MiB; "
                             "smaller: more buckets sent during the backward, as a large model has)")
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    for name in ("turns", "instances", "hidden", "depth"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        sys.exit(f"--bucket-bytes must be at least 1, got {args.bucket_bytes}")
    args.accum, args.micro = 8, 8  # ddp_bench's defaults
    with tempfile.TemporaryDirectory() as folder:
        commit = export_baseline(args.baseline, Path(folder))
        args.baseline_dir = folder
        measured = ddp_bench.run_two_ranks(_worker, args)
    times, cpu = measured["times"], measured["cpu"]
    current = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "autoaccum"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    result = {
        "baseline": commit, "current": current + (" (with uncommitted changes)" if dirty else ""),
        "hidden": args.hidden, "depth": args.depth, "bucket_bytes": args.bucket_bytes,
        "parameters": sum(1 for _ in ddp_bench._model(args.hidden, args.depth).parameters()),
        "turns": args.turns, "instances": args.instances,
        "median_step_ms": {mode: ddp_bench._per_step_ratio(times, mode, mode)["median_ms"] for mode in MODES},
        "vs_hand_loop": {mode: ddp_bench._per_step_ratio(times, mode, "hand_loop") for mode in ("baseline", "current")},
        "current_vs_baseline": ddp_bench._per_step_ratio(times, "current", "baseline"),
        "cpu": {"vs_hand_loop": {mode: ddp_bench._cpu_per_step(cpu, mode, "hand_loop")
                                 for mode in ("baseline", "current")},
                "current_vs_baseline": ddp_bench._cpu_per_step(cpu, "current", "baseline")},
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if not args.json_only:
        steps = result["median_step_ms"]
        buckets = "" if args.bucket_bytes is None else f", buckets of {args.bucket_bytes} bytes"
        print(f"2 gloo ranks, hidden {args.hidden}, depth {args.depth} ({result['parameters']} parameter tensors"
              f"{buckets}), {args.turns} turns over {args.instances} instances of each; "
              f"baseline {commit[:9]}, current {result['current'][:9]}")
        print(f"{'mode':<12}{'median step ms':>16}{'vs hand loop':>14}{'95% interval':>16}")
        print(f"{'hand_loop':<12}{steps['hand_loop']:>16.3f}")
        for mode in ("baseline", "current"):
            r = result["vs_hand_loop"][mode]
            print(f"{mode:<12}{steps[mode]:>16.3f}{r['ratio']:>13.3f}x{r['low']:>9.3f}-{r['high']:.3f}")
        r = result["current_vs_baseline"]
        print(f"current vs baseline: {r['ratio']:.3f}x ({r['low']:.3f}-{r['high']:.3f}); median step "
              f"{steps['current'] - steps['baseline']:+.3f} ms")
        print("rank 0's CPU time per step, the first minus the second in the same turn (median, 95% interval), ms:")
        for kind in ("process", "thread"):
            pairs = [("baseline", "hand loop", result["cpu"]["vs_hand_loop"]["baseline"]),
                     ("current", "hand loop", result["cpu"]["vs_hand_loop"]["current"]),
                     ("current", "baseline", result["cpu"]["current_vs_baseline"])]
            print(f"  {'whole process' if kind == 'process' else 'main thread':<14}" + "   ".join(
                f"{a} - {b} {c[kind]['minus_base_ms']:+.3f} ({c[kind]['low']:+.3f} to {c[kind]['high']:+.3f})"
                for a, b, c in pairs))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
