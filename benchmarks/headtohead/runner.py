"""The whole comparison: calibrate each model's budget, run every system (each in its own process), and
gather the JSON document."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import quiet
from torch import nn

import autoaccum
from autoaccum.jsonio import write_json_atomic

from .budget import blocks_budget, brute_force, budget_for, make_budget
from .context import Context, RunResult
from .recorder import Recorder
from .reference import reference
from .report import BENCHMARKS, machine, num, summarise, summarise_drop, versions
from .savers import BLOCKS, PAIR, measure
from .systems import REGISTRY, SYSTEMS
from .workloads import Batch, Workload, describe_model, workloads

#: the script a child process runs (``--child``): the one entry point, so a child imports what its parent did
ENTRY = BENCHMARKS / "compare.py"


@dataclass
class Config:
    size: str = "cpu"
    models: tuple[str, ...] = ("mlp", "gpt", "cnn")
    systems: tuple[str, ...] = SYSTEMS
    steps: int = 6
    drop_after: int = 2
    drop_fraction: float = 0.45
    device: str = "cpu"
    dtype: str = "float64"  # exactness is checked to ~1e-12 in fp64; in fp32, Adam turns rounding noise in
    # gradients that are zero in exact arithmetic (e.g. attention key biases) into full-size updates
    runtime_oom: bool = True
    threads: int = 1
    budget_gib: float | None = None  # a fixed budget (e.g. 16, 24, 40 on a GPU) instead of the calibrated one
    isolate: bool = True  # each system in its own process (see run_isolated)
    out: str | None = None  # a folder: each workload's results saved there as it finishes (see run_resumable)
    redo: bool = False  # with ``out``: run workloads again whose results are there
    rounds: int = 5  # where one sample does not fit: rounds of fit against the hand-configured run (savers.py)


@dataclass(frozen=True)
class Setup:
    """What one model's runs share; plain values, so a child process can rebuild the rest from it."""

    size: str
    model: str
    dtype: str
    device: str
    steps: int
    budget_bytes: int
    truly_fits: int
    drop_after: int
    drop_bytes: int
    runtime_oom: bool
    threads: int
    rounds: int = 0  # rounds of fit against the hand-configured run (``savers.measure``)


def available(system: str) -> str | None:
    """None when the system can run, else why not."""
    try:
        if (module := REGISTRY[system].requires) is not None:
            importlib.import_module(module)
    except Exception as exc:
        return f"not installed or not importable ({type(exc).__name__}: {str(exc)[:80]})"
    return None


def _build(setup: Setup) -> tuple[Workload, Batch, nn.Module, torch.device]:
    """The workload, its data and its seeded model (on the CPU: each system moves its own copy)."""
    w = workloads(setup.size)[setup.model]
    dtype = getattr(torch, setup.dtype)
    data = {k: v.to(dtype) if v.is_floating_point() else v
            for k, v in w.make_data(w.target_batch * setup.steps).items()}
    return w, data, w.make_model().to(dtype), torch.device(setup.device)


def run_system(system: str, ctx: Context) -> RunResult:
    budget = make_budget(ctx.budget_bytes, ctx.device)
    recorder = Recorder(budget, ctx.drop)
    started = time.perf_counter()
    gc.collect()
    with quiet():
        torch.manual_seed(0)
        try:
            result = REGISTRY[system].run(ctx, recorder, budget)
        except Exception as exc:
            result = RunResult(error=f"failed: {type(exc).__name__}: {str(exc)[:100]}")
    result.recorder, result.wall_s, result.budget_ooms = recorder, time.perf_counter() - started, budget.ooms
    result.train_ooms = max(result.train_ooms, budget.ooms - (result.find_ooms or 0)) \
        if not system.startswith("autoaccum") else result.train_ooms  # the guard counts its own replays
    return result


def run_pair(system: str, setup: Setup, freeze_gc: bool = False) -> dict[str, Any]:
    """Runs A (clean) and B (budget drop) of one system; the summary row."""
    w, data, base, device = _build(setup)
    ctx = Context(w, data, base, setup.budget_bytes, setup.steps, device, setup.truly_fits)
    ref = reference(ctx)
    if REGISTRY[system].requires is not None:
        importlib.import_module(REGISTRY[system].requires)
    # Every system's recovery calls gc.collect(); on a slow shared CPU one full collection of the objects
    # that torch and the peers create at import costs 0.3-0.6 s, which would swamp what is measured. Those
    # objects are frozen (never collected, as they never die); what training creates is collected as usual.
    gc.collect()
    if freeze_gc:
        gc.freeze()
    gc_started = time.perf_counter()
    gc.collect()
    gc_s = time.perf_counter() - gc_started
    row = summarise(run_system(system, ctx), ref, base, w.target_batch)
    row["gc_collect_s"] = gc_s  # what one gc.collect() costs in this process (recoveries run it)
    if setup.runtime_oom:
        b_ctx = Context(w, data, base, setup.budget_bytes, setup.steps, device, setup.truly_fits,
                        drop=(setup.drop_after, setup.drop_bytes))
        row["runtime_oom"] = summarise_drop(run_system(system, b_ctx), ref, base, setup.drop_after)
    return row


def run_child(system: str, setup: Setup, freeze_gc: bool = False) -> dict[str, Any]:
    """What one process runs: a system's runs A and B, or fit against the hand-configured run (``PAIR``) or
    against every pair a brute force finds (``BLOCKS``)."""
    if system not in (PAIR, BLOCKS):
        return run_pair(system, setup, freeze_gc)
    w, data, base, device = _build(setup)
    gc.collect()
    if freeze_gc:
        gc.freeze()  # as in run_pair: the recoveries' gc.collect() should not walk what the imports made
    ctx = Context(w, data, base, setup.budget_bytes, setup.steps, device, setup.truly_fits)
    return measure(ctx, setup.rounds, every_pair=system == BLOCKS)


def run_isolated(system: str, setup: Setup) -> dict[str, Any]:
    """``run_pair`` in a fresh Python process: no peer's imports, singletons (AcceleratorState), global
    seeds or logging settings leak into another's run, and ``gc.collect()`` costs what it costs with
    that system's own imports."""
    proc = subprocess.run([sys.executable, str(ENTRY), "--child", json.dumps(asdict(setup)), system],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"failed: child exited {proc.returncode}: {tail[:120]}"}
    return json.loads(lines[-1])


def run_workload(name: str, w: Workload, config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device(config.device)
    probe_setup = Setup(config.size, name, config.dtype, config.device, config.steps, 0, 0, 0, 0, False,
                        config.threads)
    _, data, base, _ = _build(probe_setup)
    ctx = Context(w, data, base, 0, config.steps, device, 0)
    if w.block_shares:
        return run_blocks(name, ctx, config, log)
    budget_bytes = int(config.budget_gib * 2**30) if config.budget_gib else budget_for(ctx, w.micro_target)
    t0 = time.perf_counter()
    truly, tried = brute_force(ctx, budget_bytes)
    lone, _ = brute_force(ctx, budget_bytes, accumulate=False)
    bare = brute_force(ctx, budget_bytes, saver="none")[0] if w.saver != "none" else truly
    log(f"{name}: {describe_model(base)}; target {w.target_batch}; budget {autoaccum.format_bytes(budget_bytes)}; "
        f"truly fits {truly} when accumulating, {lone} alone"
        + ("" if w.saver == "none" else f" (with {w.saver}; {bare} without)") + f" ({time.perf_counter() - t0:.1f}s)")
    # Where one sample does not fit, the question is the first step: no budget drop (run B) there.
    runtime_oom = config.runtime_oom and w.saver == "none"
    drop_micro = max(1, round(config.drop_fraction * truly))
    drop_bytes = budget_for(ctx, drop_micro) if runtime_oom else 0
    setup = Setup(config.size, name, config.dtype, config.device, config.steps, budget_bytes, truly,
                  config.drop_after, drop_bytes, runtime_oom, config.threads)
    out: dict[str, Any] = {
        "model": name, "describe": describe_model(base), "target_batch": w.target_batch, "budget_bytes": budget_bytes,
        "truly_fits": truly, "fits_without_accumulation": lone, "brute_force_sizes_tried": tried,
        "token_level": w.token_level, "batchnorm": w.batchnorm,
        "runtime_drop": {"after_steps": config.drop_after, "budget_bytes": drop_bytes, "fits_micro": drop_micro}
        if runtime_oom else None,
        "note": w.note, "saver": w.saver, "fits_without_savers": bare, "systems": {},
    }
    for system in config.systems:
        t0, why = time.perf_counter(), available(system)
        row = out["systems"][system] = {"error": why} if why is not None else \
            run_isolated(system, setup) if config.isolate else run_pair(system, setup)
        if "micro_batch" not in row:
            log(f"  {system}: {row.get('error')}")
            continue
        log(f"  {system} ({time.perf_counter() - t0:.0f}s): micro {row['micro_batch']} · find {row['find_steps']} "
            f"steps {num(row['find_time_s'], '.2f')}s {row['find_ooms']} OOMs · global {row['global_batches']} · "
            f"{num(row['samples_per_s'], ',.0f')} samples/s · rel diff {num(row['max_rel_diff'], '.1e')}"
            + (f" · {row['error']}" if row.get("error") else "")
            + (f" · OOM recovery {num(row['runtime_oom']['recovery_s'], '.2f')}s "
               f"{row['runtime_oom']['outcome']}" if "runtime_oom" in row else ""))
    if w.saver != "none" and config.rounds > 0:
        t0 = time.perf_counter()
        pair_setup = dataclasses.replace(setup, rounds=config.rounds)
        out["fit_vs_hand"] = pair = run_isolated(PAIR, pair_setup) if config.isolate else run_child(PAIR, pair_setup)
        log(f"  fit vs hand ({time.perf_counter() - t0:.0f}s): "
            + (pair["error"] if "error" in pair else
               f"{num(pair['fit_samples_per_s'], '.2f')} against {num(pair['hand_samples_per_s'], '.2f')} samples/s, "
               f"ratio {num(pair['ratio_median'], '.3f')} (median of {len(pair['ratios'])} rounds)"))
    return out


def run_blocks(name: str, ctx: Context, config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """At each of the workload's budgets (``blocks_budget``), fit against the brute force's pairs in one process
    (``measure(every_pair=True)``). No peers: what their finders do where one sample does not fit is ``gpt_long``'s."""
    out = {"model": name, "describe": describe_model(ctx.base), "target_batch": ctx.workload.target_batch,
           "micro_target": ctx.workload.micro_target, "note": ctx.workload.note, "dtype": config.dtype, "blocks": []}
    for share in ctx.workload.block_shares:
        t0, (budget_bytes, needed) = time.perf_counter(), blocks_budget(ctx, share)
        setup = Setup(config.size, name, config.dtype, config.device, config.steps, budget_bytes, 1, 0, 0, False,
                      config.threads, config.rounds)
        row = run_isolated(BLOCKS, setup) if config.isolate else run_child(BLOCKS, setup)
        out["blocks"].append({"share": share, "needed": needed, "budget_bytes": budget_bytes, **row})
        log(f"{name} at {share:.0%} ({autoaccum.format_bytes(budget_bytes)}, {needed}; {time.perf_counter() - t0:.0f}"
            f"s): " + row.get("error", f"fit / best {num(row.get('best_ratio_median'), '.3f')} ({row.get('best')}), "
                                       f"fit / hand {num(row.get('ratio_median'), '.3f')}"))
    return out


#: the fields of a Config that change a workload's results: saved ones are reused only where they agree
RESUME_KEY = ("size", "systems", "steps", "drop_after", "drop_fraction", "device", "dtype", "runtime_oom", "threads",
              "budget_gib", "isolate", "rounds")


def run_resumable(name: str, w: Workload, config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """``run_workload``, with its result saved as ``<out>/<name>.json`` as soon as it is done; a workload whose
    file is there (made under the same settings) is read back instead, unless ``config.redo``. A GPU machine
    is held for a limited time: a run that stops keeps the workloads it finished, and the next one goes on."""
    if config.out is None:
        return run_workload(name, w, config, log)
    path = Path(config.out) / f"{name}.json"
    key = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(config).items() if k in RESUME_KEY}
    device = torch.device(config.device)
    key["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"  # one card's numbers
    if path.exists() and not config.redo:
        saved = json.loads(path.read_text())
        if saved.get("settings") == key:
            log(f"{name}: results read from {path} (--redo runs it again)")
            return saved["result"]
        log(f"{name}: {path} was made under other settings; running it again")
    result = json.loads(json.dumps(run_workload(name, w, config, log), default=str))
    write_json_atomic(path, {"kind": "autoaccum.compare.workload", "settings": key, "result": result})
    return result


def run(config: Config, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The whole comparison; returns the JSON document."""
    started = time.perf_counter()
    all_workloads = workloads(config.size)
    unknown = [m for m in config.models if m not in all_workloads]
    if unknown:
        raise ValueError(f"Invalid models: {unknown}. Allowed values: {', '.join(all_workloads)}")
    bad = [s for s in config.systems if s not in REGISTRY]
    if bad:
        raise ValueError(f"Invalid systems: {bad}. Allowed values: {', '.join(SYSTEMS)}")
    device = torch.device(config.device)
    host = machine(device)
    results = [run_resumable(m, all_workloads[m], config, log) for m in config.models]
    return {
        "kind": "autoaccum.compare", "config": {k: (list(v) if isinstance(v, tuple) else v)
                                                for k, v in vars(config).items()},
        "machine": host, "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_time_s": time.perf_counter() - started, "results": results,
    }
