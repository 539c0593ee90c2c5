"""Distributed benchmark (issues 5 and 15): what skipping gradient sync on the micro-batches saves,
and what overlapping the one all-reduce with the last backward gains.

Two ranks (gloo, CPU), one model, ``accum`` micro-batches per optimizer step, five ways:

- ``autoaccum``: ``OOMGuard(overlap="off")`` + ``DistributedSync`` on a DDP model (today's protocol,
  as where memory is tight): every micro-batch under ``no_sync``, the OOM flag exchanged after them,
  gradients all-reduced once per step (in flat buckets), plus the guard's small exchanges (the
  cut's, with the item and sample counts; flag; presence; loss/items);
- ``autoaccum_overlap``: ``OOMGuard(overlap="auto")`` (the default; on a CPU without an emulated
  budget it overlaps every step): the buckets all-reduced asynchronously during the last
  micro-batch's backward as their gradients become final, the last one after it carrying the flag
  (with the presence bits and the loss sums: no exchange of its own for these fp32 gradients), and
  from the second step on *chained*: no cut exchange either, each rank's cut row in the flag
  (``autoaccum.cut_agreement``);
- ``autoaccum_overlap_nocheck``: the same with ``nonfinite=None``: without the inf/NaN check the
  guard runs before ``optimizer.step()`` by default (the hand loop has none), to show its share;
- ``ddp_sync_every_micro``: plain DDP, no ``no_sync``: DDP all-reduces every micro-batch's
  gradients in its backward (``accum`` gradient all-reduces per step);
- ``ddp_no_sync_last``: the usual hand-written loop, ``no_sync`` on all but the last micro-batch,
  DDP's reducer syncing in the last backward (1 gradient all-reduce per step, overlapped with
  that backward, and the hazard the guard avoids: an OOM there cannot be agreed on safely).

Each rank runs with one intra-op thread. Prints a table, then one JSON document. Not part of the
test run.

    python benchmarks/ddp_bench.py [--accum 8] [--micro 8] [--steps 20] [--hidden 1024] [--repeats 3]
                                   [--interleaved 150] [--single-process] [--cut-cost] [--unchained]
                                   [--control] [--instances 1] [--keep-freed-memory] [--json-only]

Two measurements: rounds (``--steps`` steps of one mode back to back, ``--repeats`` rounds over the
modes; the best round and the median of the per-round ratios are reported), then per step
(``--interleaved`` turns of one step per mode in a shuffled order, each step started by a barrier
and timed alone; the median per-turn ratio with its bootstrap interval). On a shared 2-core machine
the per-step measurement is the steadier one: a slow moment hits neighbouring steps of every mode.
``--single-process`` first times the guard against the hand loop in this process alone (no DDP, no
ranks), per step as above: the guard's own share of the ranks' ratio. ``--cut-cost`` adds the
diagnostic ``autoaccum_overlap_nocut``: ``autoaccum_overlap_nocheck`` with the cut's exchange (the one
small all-reduce per step the hand loop does not have) answered locally on both ranks -- unsafe, never a
product setting, only to price that exchange (a chained step has none to answer). ``--unchained`` adds
``autoaccum_overlap_unchained``: ``autoaccum_overlap`` with chaining switched off on both ranks before
every step (the cut's exchange in every step, as before chained steps): the before/after of chaining
in one run. ``--control`` adds ``ddp_no_sync_last_again``: a second, identical hand loop (its own model
and optimizer, set up first, the reference hand loop last): its ratio to the hand loop is what the
benchmark reads where nothing differs, the resolution of that run (two instances of the same code on
2 shared cores read 0.965-1.05 of each other in single runs; ``--instances K`` averages over K of each),
and every mode is also compared with both hand loops at once (per turn, the mean of their two step times).

Every mode's CPU time per step is reported too (rank 0, per turn: the whole process, gloo's threads
included, and the thread that ran the step), each against the hand loop's in the same turn. On this
2-core machine the two ranks and gloo's threads keep both cores busy through the step, so host work
costs its CPU time whatever it overlaps: the CPU difference is the guard's host work, steadier
than the wall-clock ratio (``benchmarks/RESULTS.md``, "CPU time per step").

Every mode's minor page faults per step are reported too (rank 0, all its threads; the
``--single-process`` part's in the launching process). With glibc's default malloc, memory one step
frees can go back to the system and the next allocation faults it in again, page by page;
interleaving many set-ups in one process makes that depend on what the other modes freed (a loop
run on its own faults next to nothing once warm). ``--keep-freed-memory`` runs the script again
with ``GLIBC_TUNABLES`` set so that malloc keeps freed memory for reuse (0-82 faults a step instead
of up to 839 in the runs so far): it takes most of the page faults out of the comparison
(``benchmarks/RESULTS.md``, "A fixed cost per step, and page faults"). glibc only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import multiprocessing
import os
import platform
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
import torch.nn.functional as F

try:
    import resource
except ImportError:  # Windows: no page-fault counts
    resource = None  # type: ignore[assignment]

#: ``--keep-freed-memory``: glibc's malloc keeps what is freed for the next allocation (no trimming of
#: the heap's top, blocks up to 32 MiB from the heap rather than their own mmap), so that a step does
#: not fault in pages that another mode's step handed back to the system (read at process start:
#: the script runs itself again with it, and its ranks inherit it)
KEEP_FREED_MEMORY = "glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432"

MODES = ("autoaccum", "autoaccum_overlap", "autoaccum_overlap_nocheck", "ddp_sync_every_micro", "ddp_no_sync_last")


def _modes(args: argparse.Namespace) -> tuple[str, ...]:
    """The modes measured: with ``--cut-cost`` also ``autoaccum_overlap_nocut`` (diagnostic), with
    ``--unchained`` also ``autoaccum_overlap_unchained``, with ``--control`` first the control
    ``ddp_no_sync_last_again`` (the hand loop once more)."""
    return (("ddp_no_sync_last_again",) if args.control else ()) + MODES + \
        (("autoaccum_overlap_nocut",) if args.cut_cost else ()) + \
        (("autoaccum_overlap_unchained",) if args.unchained else ())


def _model(hidden: int, depth: int = 1) -> torch.nn.Module:
    """The MLP 64 -> hidden -> ... -> hidden -> 10 with GELUs, ``depth`` hidden-to-hidden layers (1 here;
    ``ddp_versions.py --depth``: more parameter tensors at the same width)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, hidden), torch.nn.GELU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 10))


def _data(rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of one global batch (inputs, class labels), the same every step."""
    share = args.micro * args.accum
    g = torch.Generator().manual_seed(rank)
    return torch.randn(share, 64, generator=g), torch.randint(0, 10, (share,), generator=g)


def _loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(m(batch[0]), batch[1])


def _hand_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               args: argparse.Namespace, quiet_but_last: bool) -> None:
    """The hand-written loop: ``accum`` micro-batches, each loss weighted by its share of the step;
    ``quiet_but_last``: all but the last under DDP's ``no_sync``."""
    opt.zero_grad(set_to_none=True)
    for i in range(args.accum):
        part = slice(i * args.micro, (i + 1) * args.micro)
        quiet = model.no_sync() if quiet_but_last and i < args.accum - 1 else contextlib.nullcontext()
        with quiet:
            # DDP averages over ranks: weight by the rank's share, as the guard does by the global one
            (_loss(model, (x[part], y[part])) / args.accum).backward()
    opt.step()


def _minor_faults() -> int:
    """Minor page faults of this process so far (every thread): pages the kernel mapped in on first
    touch, e.g. memory glibc's malloc gave back to the system and a later allocation took again. 0
    where the platform cannot tell (no ``resource`` module: Windows). A gloo thread's faults after a
    step returned count in the next step timed, which may be another mode's."""
    return 0 if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _turns(steps: dict[str, Any], turns: int, before: Any = None,
           cpu: dict[str, dict[str, list[float]]] | None = None) -> tuple[dict[str, list[float]], dict[str, float]]:
    """``turns`` turns of one step of each in ``steps``, in a shuffled order per turn (the same on
    every rank: a fixed seed), each timed alone (after ``before()``, a barrier across ranks). Returns
    each one's step times and its minor page faults per step. ``cpu``, where given, gets each step's
    CPU time too: ``cpu["process"][mode]`` (every thread of this process: the caller's and gloo's)
    and ``cpu["thread"][mode]`` (the calling thread's alone)."""
    order, shuffle = list(steps), random.Random(0)
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    faults = dict.fromkeys(steps, 0)
    if cpu is not None:
        cpu.update({"process": {mode: [] for mode in steps}, "thread": {mode: [] for mode in steps}})
    for _ in range(turns):
        shuffle.shuffle(order)
        for mode in order:
            if before is not None:
                before()
            touched = _minor_faults()
            process, thread = time.process_time(), time.thread_time()
            started = time.perf_counter()
            steps[mode]()
            times[mode].append(time.perf_counter() - started)
            if cpu is not None:
                cpu["process"][mode].append(time.process_time() - process)
                cpu["thread"][mode].append(time.thread_time() - thread)
            faults[mode] += _minor_faults() - touched
    return times, {mode: count / turns for mode, count in faults.items()}


def _setup(mode: str, rank: int, args: argparse.Namespace) -> tuple[Any, list[bool]]:
    """One mode's model, optimizer (and guard): returns ``step()`` and the list its guard steps' overlap
    flags go to."""
    import autoaccum
    from autoaccum.distributed import DistributedSync

    model = torch.nn.parallel.DistributedDataParallel(_model(args.hidden))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _data(rank, args)
    guard = None
    if mode.startswith("autoaccum"):
        sync = DistributedSync(model)
        if mode == "autoaccum_overlap_nocut":  # diagnostic: the cut's exchange answered locally on both ranks
            sync.gather_async = _local_answer  # type: ignore[method-assign]
        guard = autoaccum.OOMGuard(model, opt, target_batch=len(x) * 2, micro_batch=args.micro,
                                   sync=sync, overlap="off" if mode == "autoaccum" else "auto",
                                   nonfinite="stop" if mode in ("autoaccum", "autoaccum_overlap",
                                                                "autoaccum_overlap_unchained") else None)
    overlapped: list[bool] = []

    def step() -> None:
        if guard is None:
            _hand_step(model, opt, x, y, args, quiet_but_last=mode.startswith("ddp_no_sync_last"))
            return
        if mode == "autoaccum_overlap_unchained":
            guard._chain = False  # what the last step's flag agreed, overruled on both ranks alike
        overlapped.append(guard.step((x, y), _loss).overlapped)

    return step, overlapped


def _local_answer(values: tuple[int, ...]) -> Any:
    """The cut's exchange without the all-reduce (``--cut-cost``): both ranks run the same full steps on the
    same plan, so the rows the exchange would gather are this rank's own, twice. Unsafe anywhere else: never
    a product setting, only to price that one small all-reduce."""
    from types import SimpleNamespace

    return SimpleNamespace(result=lambda: (tuple(values), tuple(values)))


def _run_mode(mode: str, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """A round: ``args.steps`` steps of one mode back to back (throughput, as a training run sees it)."""
    step, overlapped = _setup(mode, rank, args)
    for _ in range(args.warmup):
        step()
    dist.barrier()
    touched = _minor_faults()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - started
    return {"mode": mode, "steps_per_s": args.steps / seconds, "step_time_s": seconds / args.steps,
            "faults_per_step": (_minor_faults() - touched) / args.steps,
            "overlapped_steps": sum(overlapped[args.warmup:]) if overlapped else None}


def _interleaved(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every mode set up at once, then one step of each in turn (a shuffled order per turn, the same on
    both ranks), each step started by a barrier and timed alone: a slow moment of the machine lands
    on neighbouring steps of every mode, not on one mode's round. With ``--instances K`` (K > 1) every
    mode is set up K times (its own model, optimizer and guard), all in one shuffled order (the same
    on both ranks), and turn t runs instance t mod K. How fast one instance of some code runs depends
    on more than the code -- two instances of the hand loop read 0.965-1.05 of each other in single
    runs (``--control``, benchmarks/RESULTS.md); why is not known (where each one's memory landed is a
    candidate) -- and that is then averaged over K instances instead of read as the mode's."""
    keys = [(mode, k) for k in range(args.instances) for mode in _modes(args)]
    if args.instances > 1:
        random.Random(2).shuffle(keys)
    built = {key: _setup(key[0], rank, args) for key in keys}
    for step, _ in built.values():
        for _ in range(args.warmup):
            step()

    def rotating(mode: str) -> Any:
        turn = itertools.count()
        return lambda: built[(mode, next(turn) % args.instances)][0]()

    cpu: dict[str, dict[str, list[float]]] = {}
    times, faults = _turns({mode: rotating(mode) for mode in _modes(args)}, args.interleaved, before=dist.barrier,
                           cpu=cpu)
    overlapped = {mode: sum(sum(built[(mode, k)][1][args.warmup:]) for k in range(args.instances))
                  for mode in _modes(args) if built[(mode, 0)][1]}
    return {"times": times, "overlapped": overlapped,
            "faults_per_step": faults, "cpu": cpu}


def _single_process(args: argparse.Namespace) -> dict[str, Any]:
    """Diagnostic (``--single-process``): the same model and plan in one process, no DDP, no ranks:
    ``OOMGuard(nonfinite=None)`` against the hand loop, one step of each in turn (``--interleaved``
    turns): the guard's own per-step cost on this model, which the ranks' ratio contains. With ``--control``
    also a second hand loop (set up first), against the first: what one process reads where nothing differs."""
    import autoaccum

    torch.set_num_threads(1)
    share = args.micro * args.accum
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(share, 64, generator=g), torch.randint(0, 10, (share,), generator=g)

    def hand() -> Any:
        model = _model(args.hidden)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        return lambda: _hand_step(model, opt, x, y, args, quiet_but_last=False)

    again = hand() if args.control else None  # set up first, as the ranks' control
    reference = hand()  # then the hand loop and the guard, in the order they always were
    guard_model = _model(args.hidden)
    guard = autoaccum.OOMGuard(guard_model, torch.optim.SGD(guard_model.parameters(), lr=0.01),
                               target_batch=share, micro_batch=args.micro, nonfinite=None)
    steps = {"guard_single_process": lambda: guard.step((x, y), _loss), "hand_loop_single_process": reference}
    if again is not None:
        steps["hand_loop_single_process_again"] = again
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times, faults = _turns(steps, args.interleaved)
    report = {"mode": "guard_single_process",
              "per_step": _per_step_ratio(times, "guard_single_process", "hand_loop_single_process"),
              "hand_loop_median_ms": statistics.median(times["hand_loop_single_process"]) * 1e3,
              "faults_per_step": faults}
    if again is not None:
        report["control"] = _per_step_ratio(times, "hand_loop_single_process_again", "hand_loop_single_process")
    return report


def _worker(rank: int, port: int, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    for _ in range(args.repeats):  # interleaved, so that a slow moment of the machine hits every mode
        for mode in _modes(args):
            rows.append(_run_mode(mode, rank, args))
    per_step = _interleaved(rank, args) if args.interleaved else None
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "per_step": per_step}))
    dist.destroy_process_group()


def run_two_ranks(worker: Any, args: argparse.Namespace) -> Any:
    """``worker(rank, port, out, args)`` in two spawned processes (a gloo group on a free local
    port); returns the JSON that rank 0 wrote to ``out``. Exits naming the exit codes if a rank failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "rank0.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, port, str(out), args)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return json.loads(out.read_text())


def _median_ratio(rows: list[dict[str, Any]], mode: str, base: str) -> float:
    """The median over rounds of ``mode``'s steps/s over ``base``'s in the same round (paired: a slow
    moment of the shared machine hits both)."""
    mine = [r["steps_per_s"] for r in rows if r["mode"] == mode]
    theirs = [r["steps_per_s"] for r in rows if r["mode"] == base]
    ratios = sorted(a / b for a, b in zip(mine, theirs))
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def _per_step_ratio(times: dict[str, list[float]], mode: str, base: str) -> dict[str, float]:
    """The median over turns of ``base``'s step time over ``mode``'s in the same turn (above 1: faster
    than ``base``), with a 95% bootstrap interval of that median, and the mode's median step time."""
    ratio, low, high = _median_interval([b / m for m, b in zip(times[mode], times[base])])
    return {"median_ms": statistics.median(times[mode]) * 1e3, "ratio": ratio, "low": low, "high": high}


def _median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median of paired per-turn values and its 95% bootstrap interval (1000 draws, a fixed seed)."""
    values, draw = sorted(values), random.Random(1)  # sorted: the draws do not depend on the turns' order
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(1000))
    return statistics.median(values), medians[25], medians[974]


def _cpu_per_step(cpu: dict[str, dict[str, list[float]]], mode: str, base: str) -> dict[str, Any]:
    """Rank 0's CPU time per step of ``mode``: medians over the turns, for the whole process (every thread:
    the caller's and gloo's) and for the thread that ran the step, and the median over the turns of the
    difference to ``base``'s in the same turn (ms; above 0: ``mode`` used more CPU), with a 95% bootstrap
    interval. On a machine whose cores the ranks and gloo's threads keep busy, CPU time is what a step's
    host work costs, whatever waits overlap it (``benchmarks/RESULTS.md``, "CPU time per step")."""
    report: dict[str, Any] = {}
    for kind in ("process", "thread"):
        mine, theirs = cpu[kind][mode], cpu[kind][base]
        minus, low, high = _median_interval([(m - b) * 1e3 for m, b in zip(mine, theirs)])
        report[kind] = {"median_ms": statistics.median(mine) * 1e3, "minus_base_ms": minus, "low": low, "high": high}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accum", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--micro", type=int, default=8, help="samples per micro-batch per rank")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (gradient size ~ hidden^2 floats)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per mode and repeat")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the modes; the best is reported")
    parser.add_argument("--interleaved", type=int, default=150,
                        help="then this many turns of one step per mode, each timed alone (0: none)")
    parser.add_argument("--single-process", action="store_true",
                        help="first measure the guard against the hand loop in one process (no ranks), per step")
    parser.add_argument("--cut-cost", action="store_true",
                        help="also autoaccum_overlap_nocut: nocheck with the cut's exchange answered locally "
                             "(diagnostic, unsafe: prices that one all-reduce)")
    parser.add_argument("--unchained", action="store_true",
                        help="also autoaccum_overlap_unchained: the default with chained steps switched off "
                             "(the cut's exchange in every step)")
    parser.add_argument("--control", action="store_true",
                        help="also ddp_no_sync_last_again: the hand loop a second time (what the run reads where "
                             "nothing differs)")
    parser.add_argument("--instances", type=int, default=1,
                        help="set every mode up this many times and rotate over them turn by turn (averages how "
                             "fast one instance of the same code happens to run)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="run again with GLIBC_TUNABLES set so that malloc keeps freed memory (far fewer page "
                             "faults from one mode's steps taking pages another handed back; glibc only)")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    if args.instances < 1:
        parser.error(f"--instances must be at least 1, got {args.instances}")
    if args.single_process and not args.interleaved:
        parser.error("--single-process is a per-step measurement: give --interleaved N (N >= 1), not 0")
    if args.keep_freed_memory and platform.libc_ver()[0] != "glibc":
        parser.error(f"--keep-freed-memory sets glibc's malloc tunables; this Python runs on "
                     f"{platform.libc_ver()[0] or 'another C library'}: leave it out")
    if args.keep_freed_memory and KEEP_FREED_MEMORY not in os.environ.get("GLIBC_TUNABLES", ""):
        tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), KEEP_FREED_MEMORY) if t)
        os.environ["GLIBC_TUNABLES"] = tunables  # read when a process starts: this one runs again with it
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    single = _single_process(args) if args.single_process else None

    measured = run_two_ranks(_worker, args)
    rows, per_step = measured["rows"], measured["per_step"]
    modes = _modes(args)
    best = {mode: max(r["steps_per_s"] for r in rows if r["mode"] == mode) for mode in modes}
    params = sum(p.numel() for p in _model(args.hidden).parameters())
    grad_allreduces = {"autoaccum": 1, "autoaccum_overlap": 1, "autoaccum_overlap_nocheck": 1,
                       "autoaccum_overlap_nocut": 1, "autoaccum_overlap_unchained": 1,
                       "ddp_sync_every_micro": args.accum,
                       "ddp_no_sync_last": 1, "ddp_no_sync_last_again": 1}
    overlapped = {m: min((r["overlapped_steps"] for r in rows if r["mode"] == m and r["overlapped_steps"] is not None),
                         default=None) for m in modes}
    report = {
        "benchmark": "ddp_bench", "backend": "gloo", "device": "cpu", "world_size": 2,
        "accum_steps": args.accum, "micro_batch": args.micro, "params": params,
        "grad_bytes": params * 4, "steps": args.steps, "repeats": args.repeats,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "results": [{"mode": m, "steps_per_s": best[m], "grad_allreduces_per_step": grad_allreduces[m],
                     "vs_sync_every_micro": best[m] / best["ddp_sync_every_micro"],
                     "vs_hand_loop": best[m] / best["ddp_no_sync_last"],
                     "median_vs_hand_loop": _median_ratio(rows, m, "ddp_no_sync_last"),
                     "faults_per_step": statistics.mean(r["faults_per_step"] for r in rows if r["mode"] == m),
                     "overlapped_steps_min": overlapped[m]} for m in modes],
        "keep_freed_memory": args.keep_freed_memory, "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }
    if per_step is not None:
        report["interleaved_turns"] = args.interleaved
        report["instances"] = args.instances
        for r in report["results"]:
            r["per_step"] = _per_step_ratio(per_step["times"], r["mode"], "ddp_no_sync_last")
            r["per_step"]["overlapped_steps"] = per_step["overlapped"].get(r["mode"])
            r["per_step"]["faults_per_step"] = per_step["faults_per_step"][r["mode"]]
            r["per_step"]["cpu"] = _cpu_per_step(per_step["cpu"], r["mode"], "ddp_no_sync_last")
        if args.control:  # against both hand loops at once: the mean of their step times in the same turn
            times = dict(per_step["times"])
            times["hand_loops"] = [(a + b) / 2 for a, b in zip(times["ddp_no_sync_last"],
                                                                times["ddp_no_sync_last_again"])]
            for r in report["results"]:
                r["per_step"]["vs_both_hand_loops"] = _per_step_ratio(times, r["mode"], "hand_loops")
        if args.unchained:  # chaining's own gain, paired turn by turn: the unchained step's time over the chained one's
            report["chained_vs_unchained"] = _per_step_ratio(per_step["times"], "autoaccum_overlap",
                                                             "autoaccum_overlap_unchained")
    if single is not None:
        report["single_process"] = single
    if not args.json_only:
        print(f"2 ranks (gloo, CPU), {params:,} parameters ({params * 4 / 2**20:.1f} MiB of fp32 gradients), "
              f"{args.accum} micro-batches of {args.micro} per rank per step; best of {args.repeats}")
        print(f"{'mode':<27}{'steps/s':>10}{'grad all-reduces/step':>24}{'vs sync every micro':>22}"
              f"{'vs hand loop':>14}{'median paired':>15}{'faults/step':>13}")
        for r in report["results"]:
            print(f"{r['mode']:<27}{r['steps_per_s']:>10.2f}{r['grad_allreduces_per_step']:>24}"
                  f"{r['vs_sync_every_micro']:>21.2f}x{r['vs_hand_loop']:>13.3f}x{r['median_vs_hand_loop']:>14.3f}x"
                  f"{r['faults_per_step']:>13.0f}")
        print()
        if per_step is not None:
            over = f", rotating over {args.instances} instances of each mode" if args.instances > 1 else ""
            print(f"one step per mode in turn, {args.interleaved} turns{over}, each step timed alone after a barrier "
                  f"(median over the turns of the hand loop's step time / the mode's, 95% bootstrap interval)")
            both = "  vs both hand loops (mean per turn)" if args.control else ""
            print(f"{'mode':<27}{'median step ms':>16}{'faults/step':>13}{'vs hand loop':>14}"
                  f"{'95% interval':>18}{both}")
            for r in report["results"]:
                ps = r["per_step"]
                vs = ps.get("vs_both_hand_loops")
                extra = f"{vs['ratio']:>10.3f}x {vs['low']:.3f}-{vs['high']:.3f}" if vs else ""
                print(f"{r['mode']:<27}{ps['median_ms']:>16.2f}{ps['faults_per_step']:>13.0f}{ps['ratio']:>13.3f}x"
                      f"{ps['low']:>10.3f}-{ps['high']:.3f}{extra}")
            print("rank 0's CPU time per step (ms; median over the turns, and the mode's minus the hand loop's in the "
                  "same turn, 95% interval)")
            print(f"{'mode':<27}{'process':>10}{'minus hand loop':>28}{'main thread':>13}{'minus hand loop':>28}")
            for r in report["results"]:
                c = r["per_step"]["cpu"]
                print(f"{r['mode']:<27}" + "".join(
                    f"{c[kind]['median_ms']:>10.2f}{c[kind]['minus_base_ms']:>+12.2f} ({c[kind]['low']:+.2f} to "
                    f"{c[kind]['high']:+.2f})" for kind in ("process", "thread")))
            if args.unchained:
                gain = report["chained_vs_unchained"]
                print(f"chained steps against unchained, paired per turn: {gain['ratio']:.3f}x "
                      f"({gain['low']:.3f}-{gain['high']:.3f})")
            print()
        if single is not None:
            ps = single["per_step"]
            print(f"one process, no ranks: the guard {ps['median_ms']:.2f} ms per step, the hand loop "
                  f"{single['hand_loop_median_ms']:.2f} ms: {ps['ratio']:.3f}x ({ps['low']:.3f}-{ps['high']:.3f})")
            if "control" in single:
                c = single["control"]
                print(f"one process, the hand loop set up a second time: {c['ratio']:.3f}x "
                      f"({c['low']:.3f}-{c['high']:.3f})")
            counts = single["faults_per_step"]
            faults = ", ".join(f"{step} {counts[step]:.0f}" for step in sorted(counts))
            print(f"one process, minor page faults per step: {faults}")
            print()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
