"""Cold probe (issue 15, the probe row on a GPU): what the probe adds to the start of training in a fresh
process, against training on the same plan without it, and where the probe's time goes.

The first probe in a process also pays what any first training step pays (CUDA and cuBLAS set-up for new
shapes, the allocator's first blocks, AdamW creating its state). So the question a user has -- how much
later does training get going because of the probe -- is answered by two kinds of fresh process, run in
turn (the order alternating between repeats):

- ``probe``: the model on the device and its AdamW; ``autoaccum.probe`` (the workload's explicit budget,
  squeeze iii of real_gpu.py); then ``--steps`` optimizer steps of a hand-written accumulation loop on the
  probe's plan; then a second probe in the same process (warm) and a snapshot timing (below).
- ``plain``: the same set-up, then the same steps on the same plan (the first ``probe`` process's), no probe.

Each step is timed alone (synchronised). The *steady step* is the median of the steps after the first two
(the first creates AdamW's state). Reported, medians over the repeats:

- the probe's wall time, cold and warm, in steady steps (the issue's step-equivalents);
- plain's start-up: its first two steps less two steady steps (what the first steps pay once);
- **the probe's added time**: probe wall + the first two steps after it - plain's first two steps, in
  steady steps: how much later the third step ends because of the probe;
- where the cold probe's time goes, by wrapping the probe's parts: the snapshot (``state.capture``,
  ``state.restore``, ``state.release_pinned_memory`` and the weights' copy on the device, ``state.WeightsCopy``), the batches (``Stepper._batch``: slicing the data
  and the copy to the device), the forward/backward passes (``Stepper._pass``), the optimizer steps (``Stepper._optimizer_step``) and the
  rest (fitting, planning, the meter);
- the snapshot alone: ``state.capture``, ``state.restore`` and ``state.release_pinned_memory`` of the model
  and its (empty) AdamW, 3 rounds (the first and the fastest), beside pageable host copies (``state``
  before it copied to page-locked memory).

Prints a table, then one JSON document; on CUDA writes the sub-section "### Cold probe on a GPU" of
"## Speed (issue 15)" in benchmarks/RESULTS.md (``--no-write`` to skip). On a CPU it is a smoke run (the
small MLP, an emulated budget) and writes nothing. Not part of the test run (tests/test_real_gpu.py runs
the CPU smoke). benchmarks/gpu_session.sh runs it as its step ``cold_probe``.

    python benchmarks/cold_probe.py [--model mlp] [--repeats 3] [--steps 6] [--no-write] [--json-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCHMARKS = str(Path(__file__).resolve().parent)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402

import autoaccum  # noqa: E402
from autoaccum import state as training_state  # noqa: E402
from autoaccum.batch import map_tensors, move_to  # noqa: E402
from autoaccum.losses import default_loss  # noqa: E402
from autoaccum.plan import Plan  # noqa: E402
from autoaccum.stepper import Stepper  # noqa: E402
from autoaccum.task import Task, check_loss, default_optimizer  # noqa: E402
from realgpu.models import build, fresh_model, workloads  # noqa: E402
from call_timers import time_calls  # noqa: E402
from results_md import markdown_table, write_subsection  # noqa: E402

#: the probe's parts whose time is summed (what each wraps: the module docstring)
_WEIGHTS_COPY = getattr(training_state, "WeightsCopy", None)  # (a checkout before it: host snapshots only)
PARTS = {"snapshot": [(training_state, "capture"), (training_state, "restore"),
                      (training_state, "release_pinned_memory")]
         + [(_WEIGHTS_COPY, name) for name in ("__init__", "put_back") if _WEIGHTS_COPY is not None],
         "batches": [(Stepper, "_batch")], "passes": [(Stepper, "_pass")],
         "optimizer": [(Stepper, "_optimizer_step")]}
FIRST = 2  # the first steps, which pay the start-up (AdamW creates its state in the first)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_parts(device: torch.device) -> dict[str, float]:
    """Wrap the probe's parts (PARTS) to add their wall time into the returned dict (for the process's life)."""
    spent = dict.fromkeys(PARTS, 0.0)
    time_calls(PARTS, spent, sync=lambda: _sync(device))
    return spent


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any, plan: Plan, device: torch.device,
           count: int) -> list[float]:
    """``count`` optimizer steps of a hand-written accumulation loop on ``plan`` (rows of ``data`` in turn),
    each timed alone."""
    times, offset = [], 0
    rows = len(data[0]) if isinstance(data, (tuple, list)) else len(next(iter(data.values())))
    for _ in range(count):
        _sync(device)
        started = time.perf_counter()
        for size in plan.micro_sizes():
            if offset + size > rows:
                offset = 0
            batch = move_to(map_tensors(data, lambda t, a=offset, b=offset + size: t[a:b]), device)
            offset += size
            loss, _ = check_loss(default_loss(model, batch))
            (loss * (size / plan.rank_batch())).backward()
            del loss, batch
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - started)
    return times


def _pageable_capture(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state.capture``'s copies before page-locked ones (to pageable host memory), measured beside it."""
    return {n: t.detach().to("cpu", copy=True) for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def _pageable_restore(saved: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    with torch.no_grad():
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(saved[n])


def _snapshot_times(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """Seconds of each capture, restore and release, 3 rounds: ``state``'s (page-locked copies on CUDA, given
    back after each round as the probe does) and pageable copies (``state`` before page-locked ones)."""
    variants: dict[str, tuple[Callable, Callable, Callable]] = {
        "state": (lambda: training_state.capture(model, optimizer),
                  lambda saved: training_state.restore(saved, model, optimizer),
                  getattr(training_state, "release_pinned_memory", lambda: None)),
        "pageable": (lambda: _pageable_capture(model), lambda saved: _pageable_restore(saved, model), lambda: None)}
    times: dict[str, list[list[float]]] = {k: [] for k in variants}
    for _ in range(3):
        for name, (capture, restore, give_back) in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            saved = capture()
            _sync(device)
            t1 = time.perf_counter()
            restore(saved)
            _sync(device)
            t2 = time.perf_counter()
            del saved  # its memory goes back to torch's cache, and give_back hands the cache back
            give_back()
            _sync(device)
            times[name].append([t1 - t0, t2 - t1, time.perf_counter() - t2])
    return times


def child(mode: str, model_name: str, size: str, device: torch.device, steps: int, plan_doc: str | None) -> dict:
    """One fresh process: ``probe`` or ``plain`` (the module docstring)."""
    w = workloads(size)[model_name]
    built = build(w)
    data = built.data
    model = fresh_model(built, device)
    optimizer = default_optimizer([p for p in model.parameters() if p.requires_grad])
    _sync(device)
    spent = _timed_parts(device)
    task = Task(model=model, loss_fn=default_loss, name=w.name,
                make_batch=lambda b: map_tensors(data, lambda t: t[:b]))
    result: dict[str, Any] = {"mode": mode}
    if mode == "probe":
        report = autoaccum.probe(task, optimizer=optimizer, target_batch=w.target_batch, budget=w.budget_bytes)
        result.update(probe_wall_s=report.wall_time_s, parts_s=dict(spent), probe_passes=report.probe_steps,
                      probe_ooms=report.probe_ooms, plan=report.plan.to_dict(),
                      found=max(c.micro_batch for c in report.candidates if c.status == "ok"))
        plan = report.plan
    else:
        plan = Plan.from_dict(json.loads(plan_doc or "null"))
    result["step_s"] = _steps(model, optimizer, data, plan, device, steps)
    if mode == "probe":  # a second probe, warm, on a fresh copy with an empty AdamW (as the first)
        del task, model, optimizer
        model = fresh_model(built, device)
        optimizer = default_optimizer([p for p in model.parameters() if p.requires_grad])
        task = Task(model=model, loss_fn=default_loss, name=w.name,
                    make_batch=lambda b: map_tensors(data, lambda t: t[:b]))
        spent.update(dict.fromkeys(spent, 0.0))
        warm = autoaccum.probe(task, optimizer=optimizer, target_batch=w.target_batch, budget=w.budget_bytes)
        result.update(warm_probe_wall_s=warm.wall_time_s, warm_parts_s=dict(spent))
        result["snapshot_s"] = _snapshot_times(model, optimizer, device)
    return result


def _spawn(args: argparse.Namespace, mode: str, plan: dict | None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--size", args.size,
           "--device", args.device, "--steps", str(args.steps), "--threads", str(args.threads)]
    if plan is not None:
        cmd += ["--plan", json.dumps(plan)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    probes: list[dict] = []
    plains: list[dict] = []
    for r in range(args.repeats):
        order = ("probe", "plain") if r % 2 == 0 else ("plain", "probe")
        for mode in order:
            if mode == "probe":
                probes.append(_spawn(args, "probe", None))
            else:
                plains.append(_spawn(args, "plain", (probes or [_spawn(args, "probe", None)])[0]["plan"]))
    rows = []
    for p, q in zip(probes, plains):
        steady = statistics.median(p["step_s"][FIRST:] + q["step_s"][FIRST:])
        first_p, first_q = sum(p["step_s"][:FIRST]), sum(q["step_s"][:FIRST])
        rows.append({
            "steady_step_s": steady,
            "cold_probe_step_eq": p["probe_wall_s"] / steady,
            "warm_probe_step_eq": p["warm_probe_wall_s"] / steady,
            "plain_startup_step_eq": (first_q - FIRST * steady) / steady,
            "added_step_eq": (p["probe_wall_s"] + first_p - first_q) / steady,
            "cold_parts_step_eq": {k: v / steady for k, v in p["parts_s"].items()}
            | {"rest": (p["probe_wall_s"] - sum(p["parts_s"].values())) / steady},
            "warm_parts_step_eq": {k: v / steady for k, v in p["warm_parts_s"].items()}
            | {"rest": (p["warm_probe_wall_s"] - sum(p["warm_parts_s"].values())) / steady},
            "snapshot_step_eq": {f"{k} {part} {which}": pick(t[i] for t in rounds) / steady
                                 for k, rounds in p["snapshot_s"].items()
                                 for i, part in enumerate(("capture", "restore", "release"))
                                 for which, pick in (("first", lambda xs: next(iter(xs))), ("fastest", min))},
        })
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if not isinstance(rows[0][k], dict)}
    for k in ("cold_parts_step_eq", "warm_parts_step_eq", "snapshot_step_eq"):
        med[k] = {part: statistics.median(r[k][part] for r in rows) for part in rows[0][k]}
    return {"model": args.model, "size": args.size, "device": args.device,
            "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "repeats": args.repeats,
            "steps": args.steps, "plan": probes[0]["plan"], "found": [p["found"] for p in probes],
            "probe_ooms": [p["probe_ooms"] for p in probes], "medians": med, "per_repeat": rows,
            "processes": {"probe": probes, "plain": plains}}


def table(result: dict[str, Any]) -> str:
    m = result["medians"]
    head = [["measure (median of %d repeats)" % result["repeats"], "step-equivalents"]]
    lines = [["steady step (s)", f"{m['steady_step_s']:.3f}"],
             ["cold probe: wall", f"{m['cold_probe_step_eq']:.2f}"],
             ["warm probe: wall", f"{m['warm_probe_step_eq']:.2f}"],
             ["plain training: its first 2 steps beyond 2 steady ones", f"{m['plain_startup_step_eq']:.2f}"],
             ["**probe's added time** (probe + 2 steps after it - plain's 2 steps)", f"**{m['added_step_eq']:.2f}**"],
             ]
    lines += [[f"snapshot alone: {k}", f"{v:.3f}"] for k, v in m["snapshot_step_eq"].items()]
    for k in ("cold", "warm"):
        lines += [[f"{k} probe: {part}", f"{v:.2f}"] for part, v in m[f"{k}_parts_step_eq"].items()]
    return markdown_table(head + lines)


def _write(result: dict[str, Any], command: str) -> None:
    plan = Plan.from_dict(result["plan"])
    text = (f"### Cold probe on a GPU\n\nCommand: `{command}` · {result['date']} · {result['device_name']}, "
            f"torch {result['torch']}, python {result['python']} · total wall time {result['total_wall_time_s']:.0f} s\n\n"
            f"Model `{result['model']}` of real_gpu.py at its explicit budget; plan {plan.describe()}; limits found "
            f"{result['found']}, probe OOMs {result['probe_ooms']}. Fresh processes, probe and plain in turn "
            f"(method: the docstring of benchmarks/cold_probe.py).\n\n{table(result)}\n")
    write_subsection("### Cold probe on a GPU", text)


def main() -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="a real_gpu.py workload (default mlp)")
    parser.add_argument("--size", choices=("gpu", "cpu"), default="gpu" if cuda else "cpu")
    parser.add_argument("--device", default="cuda:0" if cuda else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps after the probe (at least 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU (default 1)")
    parser.add_argument("--json-only", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", choices=("probe", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= FIRST:
        parser.error(f"--steps {args.steps}: needs at least {FIRST + 1} (the first {FIRST} pay the start-up)")
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.size, torch.device(args.device), args.steps, args.plan)))
        return 0
    started = time.perf_counter()
    result = run(args)
    result["total_wall_time_s"] = time.perf_counter() - started
    result["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if not args.json_only:
        print(table(result))
        print()
    print(json.dumps(result, indent=1))
    if cuda and args.device.startswith("cuda") and not args.no_write:
        _write(result, "python benchmarks/cold_probe.py" + "".join(f" {a}" for a in sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
