"""Exit-time aborts after 2-rank gloo runs (issue 14): autoaccum's fit against a plain DDP script.

The defect: a process that finished all its work aborts while the interpreter shuts down
("terminate called without an active exception", SIGABRT), because a gloo worker thread frees a
finished collective's tensor then and cannot take the GIL. It shows under load. This runs N
consecutive 2-rank runs of each variant, ``--parallel`` runs at a time (each run is two processes
launched the way torchrun launches them: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
variants interleaved so that they share the load, and counts per process:

- ``aborts``: exit code -6/134 or "terminate called" on stderr;
- ``failures``: any other non-zero exit; ``hangs``: still running at ``--timeout`` (killed).

Variants (the same model, data and final check of the weights across ranks):

- ``autoaccum``: ``autoaccum.fit`` creates the process group from the environment, then the script's
  own collectives (rank 0's weights broadcast and compared, as ``examples/ddp.py``), then
  ``destroy_process_group()``: what the README asks of a script;
- ``autoaccum_no_destroy``: ``fit``, nothing after it, no ``destroy_process_group()``: the group and
  its worker threads live into interpreter shutdown, and the last collectives are autoaccum's own;
- ``plain_ddp``: the baseline without autoaccum: ``init_process_group``, DDP, a hand-written loop,
  the same collectives of its own, ``destroy_process_group()`` (DDP still alive, as in most scripts);
- ``unfixed`` (``--unfixed``): ``autoaccum_no_destroy`` with this fix undone in the process
  (collectives do not wait for the worker; torch.distributed.nn re-imported after the group exists):
  how often the load of this run triggers the defect at all.

``--overhead`` measures instead what the wait costs: all-reduces of a small tensor on 2 ranks, with
and without ``settled``, alternating blocks.

    python tests/stress/exit_aborts.py [--runs 100] [--parallel 4] [--unfixed] [--json-only]
    python tests/stress/exit_aborts.py --overhead
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("autoaccum", "autoaccum_no_destroy", "plain_ddp")


# -- one process of a run ------------------------------------------------------------------------------
def _weights_agree(model: Any) -> bool:
    """The script's own collectives after training: rank 0's weights broadcast, compared on every rank."""
    import torch
    import torch.distributed as dist

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = weights.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor([int(torch.equal(reference, weights))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def _worker(variant: str) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(1024, 20)
    y = (x @ torch.randn(20, 4)).argmax(dim=1)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    if variant == "plain_ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        rank, world = dist.get_rank(), dist.get_world_size()
        for start in range(0, len(x), 128):  # global batch 128, each rank its half
            xb, yb = x[start:start + 128][rank::world], y[start:start + 128][rank::world]
            nn.functional.cross_entropy(ddp(xb), yb).backward()
            opt.step()
            opt.zero_grad()
        assert _weights_agree(model)
        dist.destroy_process_group()
        return
    import torch.distributed as dist

    import autoaccum

    if variant == "unfixed":
        _undo_fix()
    autoaccum.fit(model, (x, y), target_batch=128, budget="256KiB", epochs=1, lr=3e-3, progress=False,
                  verbose=False)
    if variant == "autoaccum":
        assert _weights_agree(model)
        dist.destroy_process_group()


def _undo_fix() -> None:
    """The code before issue 14, in this process: no wait after a collective, and torch.distributed.nn's
    default arguments bound to the live group once it exists (as when it is first imported by DDP)."""
    import importlib

    import torch.distributed as dist
    import torch.distributed.nn.functional as functional

    import autoaccum.distributed.settle as settle

    settle._wait = lambda noted, timeout_s: None
    real_init = dist.init_process_group

    def init_then_import(*args: Any, **kwargs: Any) -> None:
        real_init(*args, **kwargs)
        importlib.reload(functional)

    dist.init_process_group = init_then_import


# -- the driver ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_run(variant: str, timeout_s: float) -> list[dict[str, Any]]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", variant], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout_s
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            hang = False
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            hang = True
        code = p.returncode
        abort = not hang and (code in (-6, 134) or "terminate called" in err)
        out.append({"variant": variant, "code": code, "hang": hang, "abort": abort,
                    "failure": not hang and not abort and code != 0, "stderr_tail": err[-600:]})
    return out


def _upper95(k: int, n: int) -> float:
    """One-sided 95% upper bound of a rate seen k times in n (Clopper-Pearson, by bisection)."""
    if n == 0:
        return 1.0
    if k == n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        cdf = sum(math.comb(n, i) * mid ** i * (1 - mid) ** (n - i) for i in range(k + 1))
        lo, hi = (mid, hi) if cdf > 0.05 else (lo, mid)
    return hi


def measure(runs: int, parallel: int, timeout_s: float, variants: tuple[str, ...]) -> dict[str, Any]:
    jobs = [v for _ in range(runs) for v in variants]  # interleaved: every variant under the same load
    started = time.monotonic()
    with ThreadPoolExecutor(parallel) as pool:
        results = [r for run in pool.map(lambda v: _one_run(v, timeout_s), jobs) for r in run]
    rows = {}
    for v in variants:
        procs = [r for r in results if r["variant"] == v]
        aborts = sum(r["abort"] for r in procs)
        rows[v] = {
            "runs": runs, "processes": len(procs), "aborts": aborts,
            "runs_with_abort": sum(any(r["abort"] for r in procs[i:i + 2]) for i in range(0, len(procs), 2)),
            "failures": sum(r["failure"] for r in procs), "hangs": sum(r["hang"] for r in procs),
            "abort_rate": aborts / len(procs), "abort_rate_upper95": _upper95(aborts, len(procs)),
            "examples": [r["stderr_tail"] for r in procs if r["abort"] or r["failure"] or r["hang"]][:3],
        }
    return {"rows": rows, "wall_time_s": time.monotonic() - started}


# -- what the wait costs --------------------------------------------------------------------------------
def _overhead_worker(rank: int, port: int, out: str, count: int) -> None:
    import torch
    import torch.distributed as dist

    from autoaccum.distributed import settled

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times: dict[str, list[float]] = {"plain": [], "settled": []}
    for block in range(20):
        for way in (("plain", "settled") if block % 2 else ("settled", "plain")):
            started = time.perf_counter()
            for _ in range(count // 20):
                t = torch.ones(4)
                if way == "settled":
                    with settled(t):
                        dist.all_reduce(t)
                else:
                    dist.all_reduce(t)
            times[way].append((time.perf_counter() - started) / (count // 20))
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def overhead(count: int) -> dict[str, Any]:
    import multiprocessing
    import statistics
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_overhead_worker, args=(r, port, out, count)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        times = json.loads(Path(out, "rank0.json").read_text())
    plain, settle = statistics.median(times["plain"]), statistics.median(times["settled"])
    return {"collectives": count, "plain_us": plain * 1e6, "settled_us": settle * 1e6,
            "added_us": (settle - plain) * 1e6}


# -- output ----------------------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    head = ("| variant | runs | processes | aborts | runs with an abort | other failures | hangs | abort rate "
            "| 95% upper bound |")
    lines = [head, "|" + "---|" * 9]
    for v, r in result["rows"].items():
        lines.append(f"| {v} | {r['runs']} | {r['processes']} | {r['aborts']} | {r['runs_with_abort']} | "
                     f"{r['failures']} | {r['hangs']} | {100 * r['abort_rate']:.1f}% | "
                     f"{100 * r['abort_rate_upper95']:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=(*VARIANTS, "unfixed"), help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=100, help="2-rank runs per variant")
    parser.add_argument("--parallel", type=int, default=4, help="runs at a time (the load)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as a hang")
    parser.add_argument("--unfixed", action="store_true", help="also run the variant with this fix undone")
    parser.add_argument("--overhead", action="store_true", help="measure the cost of the wait instead")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    import torch

    meta = {"command": "python tests/stress/exit_aborts.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
            "torch": torch.__version__, "python": platform.python_version()}
    if args.overhead:
        result = {**meta, **overhead(4000)}
        if not args.json_only:
            print(f"all-reduce of 4 floats on 2 gloo ranks: {result['plain_us']:.1f} us plain, "
                  f"{result['settled_us']:.1f} us settled ({result['added_us']:+.1f} us)")
        print(json.dumps(result, indent=2))
        return
    variants = VARIANTS + (("unfixed",) if args.unfixed else ())
    result = {**meta, **measure(args.runs, args.parallel, args.timeout, variants)}
    if not args.json_only:
        print(table(result))
        print(f"wall time {result['wall_time_s']:.0f} s\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
