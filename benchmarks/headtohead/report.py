"""The report: one system's runs summarised, the table, versions and machine, and RESULTS.md's section.

The section "## Head-to-head (issue 7)" of benchmarks/RESULTS.md is rewritten by :func:`write_section`:
the reading guide and the columns below, then its subsections. The "### Method" subsection (the prose
on how the benchmark works) and other devices' result subsections are kept as they are.
"""

from __future__ import annotations

import importlib
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoaccum

from .context import RunResult
from .reference import param_diff

SECTION = "## Head-to-head (issue 7)"
METHOD = "### Method"  # kept by write_section, first in the section
BENCHMARKS = Path(__file__).resolve().parents[1]
RESULTS = BENCHMARKS / "RESULTS.md"


def summarise(r: RunResult, ref: nn.Module, init: nn.Module, target: int) -> dict[str, Any]:
    rec = r.recorder
    integrity = rec.integrity() if rec else {}
    diff = param_diff(r.model, ref, init) if r.error is None else None
    return {
        "micro_batch": r.micro_batch, "find_steps": r.find_steps, "find_time_s": r.find_time_s,
        "find_ooms": r.find_ooms, "train_ooms": r.train_ooms, "global_batches": integrity.get("global_batches"),
        "target_batch": target, "samples_per_s": rec.steady_rate() if rec and r.error is None else None,
        "samples_per_cpu_s": rec.steady_rate(cpu=True) if rec and r.error is None else None,
        "planned_micro_batch": r.planned_micro,
        "optimizer_steps": integrity.get("steps"), "repeated_samples": integrity.get("repeated_samples"),
        "lost_samples": integrity.get("lost_samples"), "inconsistent_steps": integrity.get("inconsistent_steps"),
        "max_rel_diff": None if diff is None else diff[0], "diff_vs_update": None if diff is None else diff[1],
        "error": r.error, "notes": r.notes, "wall_s": r.wall_s,
    }


def summarise_drop(r: RunResult, ref: nn.Module, init: nn.Module, after: int) -> dict[str, Any]:
    """Run B: the budget dropped after ``after`` optimizer steps; what did the OOM cost?"""
    rec = r.recorder
    assert rec is not None
    integrity = rec.integrity()
    recovery = None
    oom_after_drop = rec.drop_time is not None and (r.train_ooms > 0 or rec.attempt > 1)
    if oom_after_drop and r.error is None:
        final = [s for s in rec.steps if s.phase == "train" and s.attempt == rec.attempt]
        if len(final) > after:
            back = final[after].t  # the final attempt completes the step the OOM struck
            later = [b.t - a.t for a, b in zip(final[after:], final[after + 1:])]
            recovery = back - rec.drop_time - (statistics.median(later) if later else 0.0)
    if r.error is not None:
        outcome = "training stopped (" + r.error.split(":")[0] + ")" + \
            ("" if rec.drop_time is not None else " before the drop")
    elif rec.drop_time is None:
        outcome = "no drop reached"
    elif not oom_after_drop:
        outcome = "no OOM (micro fits the lower budget)"
    else:
        lost, rep, bad = integrity["lost_samples"], integrity["repeated_samples"], integrity["inconsistent_steps"]
        redone = len([s for s in rec.steps if s.phase == "train" and s.attempt < rec.attempt])
        parts = [f"{lost} lost" if lost else "", f"{rep} repeated" if rep else "",
                 f"{bad} steps mixed partial grads" if bad else "",
                 f"restarted, {redone} steps redone" if rec.attempt > 1 else "replayed in place",
                 f"micro -> {r.micro_batch}"]
        outcome = ", ".join(p for p in parts if p) if (lost or rep or bad) else \
            "none lost/repeated; " + ", ".join(p for p in parts if p)
    diff = param_diff(r.model, ref, init) if r.error is None else None
    return {
        "recovery_s": recovery, "outcome": outcome, "micro_batch_after": r.micro_batch, "error": r.error,
        "attempts": rec.attempt, "train_ooms": r.train_ooms, **{k: integrity[k] for k in integrity},
        "max_rel_diff": None if diff is None else diff[0], "diff_vs_update": None if diff is None else diff[1],
        "notes": r.notes,
    }


def num(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _seconds(value: float | None) -> str:
    """Time lost to the OOM; differences under 10 ms are within the noise of one step."""
    if value is None:
        return ""
    return "<0.01 s · " if value < 0.01 else f"{value:.2f} s · "


def _global(row: dict[str, Any]) -> str:
    sizes = row.get("global_batches")
    if not sizes:
        return "–"
    shown = "/".join(str(s) for s in sizes)
    shown = shown if sizes == [row["target_batch"]] else f"**{shown}** (≠ {row['target_batch']})"
    flaws = [f"{row[k]} {label}" for k, label in (("repeated_samples", "samples repeated"),
                                                  ("lost_samples", "samples lost"),
                                                  ("inconsistent_steps", "steps with partial gradients"))
             if row.get(k)]
    return shown + ("; **" + ", ".join(flaws) + "**" if flaws else "")


def table(results: list[dict[str, Any]]) -> str:
    head = ("| model | system | find: steps · s · OOMs | micro (truly fits: accum; alone) | global / target | "
            "samples/s: wall · CPU | runtime OOM: time lost · samples | rel. diff (A) | Δ/update (A) | "
            "rel. diff after OOM (B) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for res in results:
        for system, row in res["systems"].items():
            if "micro_batch" not in row:
                lines.append(f"| {res['model']} | {system} | {row.get('error', '')} |" + " |" * 7)
                continue
            b = row.get("runtime_oom", {})
            find = "–" if row["find_steps"] is None else \
                f"{row['find_steps']} · {num(row['find_time_s'], '.2f')} · {row['find_ooms']}"
            if system == "hand":
                find = "0 (picked by hand)"
            if row.get("train_ooms"):
                find += f" (+{row['train_ooms']} OOM in training)"
            planned = row.get("planned_micro_batch")
            micro = f"{planned} → {row['micro_batch']}" if planned not in (None, row["micro_batch"]) \
                else str(row["micro_batch"])
            error = ": ".join(row["error"].split(": ")[:2]) if row["error"] else ""
            rate = "–" if row["samples_per_s"] is None else \
                f"{row['samples_per_s']:,.0f} · {num(row.get('samples_per_cpu_s'), ',.0f')}"
            lines.append(
                f"| {res['model']} | {system} | {find} | {micro} ({res['truly_fits']}; "
                f"{res['fits_without_accumulation']}) | "
                f"{_global(row) if not error else '**' + error + '**'} | {rate} | "
                f"{_seconds(b.get('recovery_s'))}"
                f"{b.get('outcome', '–')} | {num(row['max_rel_diff'], '.1e')} | "
                f"{num(row['diff_vs_update'], '.1e')} | {num(b.get('max_rel_diff'), '.1e')} |")
    return "\n".join(lines)


def _git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=BENCHMARKS, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "autoaccum"],
                               capture_output=True, text=True, cwd=BENCHMARKS).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes to autoaccum/" if dirty else "")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "autoaccum": f"{autoaccum.__version__} ({_git_head()})"}
    for name in ("accelerate", "lightning", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = "not installed"
    return out


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        import psutil

        cores = f"{psutil.cpu_count(logical=False)} cores / {psutil.cpu_count()} threads"
        mem = f", {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except Exception:  # noqa: BLE001
        cores, mem = "", ""
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ", no GPU"
    load = f"; load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    return f"{platform.system()} {cpu}, {cores}{mem}{gpu}; torch threads {torch.get_num_threads()}{load}"


READING = """\
Each system trains the same seeded model on the same samples in the same order, at the same target
global batch and memory budget, with AdamW (lr 1e-3, no weight decay, no clipping). Run A is clean;
run B lowers the budget after 2 optimizer steps (to what fits about 45% of the truly-fitting
micro-batch, as when another process takes memory). The *Method* subsection below has the details;
every number is also in the JSON that `benchmarks/compare.py` prints.

How each system behaves, by construction (the numbers below show it):
- **autoaccum**: the probe measures real steps per candidate size and plans micro x accum covering
  the target exactly (weighted last micro-batch); the guard replays a step that ran out of memory on
  the same samples with half the micro-batch. A size that will accumulate is probed as an
  accumulation step (later micro-batches run with the earlier ones' gradients alive), so the plan
  fits as trained; it keeps 10% headroom, spreads the target evenly over the micro-steps, and picks
  among fitting sizes by measured samples/s (ties within 5% to the larger), so its micro-batch is
  below the brute-force limit. After an OOM, halving overshoots to about half the size that fits.
- **accelerate**: `find_executable_batch_size(starting_batch_size=target)` multiplies the batch by
  0.9 after every OOM and restarts the whole training function; with `gradient_accumulation_steps =
  target // micro` the global batch is `micro x accum`, not the target, unless micro divides it.
  `accelerator.backward` divides each micro-batch's *mean* loss by the accumulation steps: exact for
  equal micro-batches of a per-sample loss, not for a token-level loss on padded sequences.
- **lightning**: the tuner's binsearch runs 3 lone steps per trial (accumulation 1), keeps 95% of the
  largest success, and the accumulation must be fixed in a second Trainer; Lightning also divides mean
  losses by `accumulate_grad_batches`. An OOM during `fit` ends training.
- **transformers**: `auto_find_batch_size` multiplies `per_device_train_batch_size` by 0.9 per OOM with
  `gradient_accumulation_steps` fixed, so the global batch becomes the micro-batch. A retry restarts
  the inner loop from the first sample but keeps the model's weights and the optimizer from the failed
  attempt (samples repeated); an OOM inside the first `optimizer.step()` leaves AdamW's state half
  created, and the retry dies with `KeyError: 'exp_avg_sq'`. Its token-count path (`num_items_in_batch`)
  is exact but only ever sees one micro-batch per step here.
- **autoaccum_trainer / autoaccum_lightning / autoaccum_accelerate**: the same probe and guard inside
  each framework (`AutoAccumTrainer`, the `AutoAccum` callback, `guard_for`): the framework steps, the
  guard accumulates the exact global batch and replays an OOM in place, where that framework's own
  mechanism (the row above each) changes the global batch, restarts, or stops.
- **hand**: a nanoGPT-style loop (`loss / accum_steps`) with the largest power-of-two micro-batch that
  divides the target and truly fits (an informed user's pick; its cost is not counted). No OOM handling.
- **BatchNorm (cnn)**: each micro-batch normalises with its own statistics, so no system that
  accumulates can match the full-batch reference there (autoaccum warns about it); the differences in
  that column measure micro-batch size and global batch, not exactness.
"""

COLUMNS = (
    "Columns: *find* = training steps started, wall seconds and OOMs spent finding the micro-batch "
    "(accelerate/transformers: every failed attempt of the training run; a step that ran out of memory counts "
    "as one); *micro* = the micro-batch trained with (planned → final where an OOM changed it); *truly fits* = "
    "brute force under the same budget: a plain loop accumulating two micro-batches per AdamW step, and a lone "
    "step of that size (no accumulation); *global* = samples per optimizer step actually trained (bold where it "
    "is not the target), with samples the final model saw twice; *samples/s* = optimizer steps 2..N of the final "
    "run, per second of wall time and of process CPU time (one thread: on a shared machine CPU time is the "
    "steadier cost), the emulated device's per-op cost included; *runtime OOM* = run B: wall time lost beyond a "
    "normal step until the step that failed is done, and what happened to the samples (ids recorded per "
    "optimizer step from post-accumulate-grad hooks on every parameter); *rel. diff* = max over tensors of "
    "|p - ref|∞ / |ref|∞ against full-batch training on the same samples (fp64); *Δ/update* = the same "
    "difference relative to the reference's own change from the initial weights (1.0 = as large as the "
    "training itself)."
)


def _subsection_key(doc: dict[str, Any]) -> str:
    device = doc["config"]["device"]
    return "### CPU, emulated budget" if device == "cpu" else f"### {doc['machine'].split(', ')[-1]} ({device})"


def write_section(doc: dict[str, Any], command: str, path: Path = RESULTS) -> None:
    """Replace (or add) this benchmark's section of RESULTS.md, and in it the subsection of this
    device (a GPU run's table goes beside the CPU one); other sections stay as they are, and so do the
    other subsections of this one: the "### Method" prose (first) and other devices' tables."""
    v = doc["versions"]
    key = _subsection_key(doc)
    sub = "\n".join([
        key, "",
        f"Command: `{command}` · {doc['date']} · {doc['machine']}",
        f"Versions: python {v['python']}, torch {v['torch']}, autoaccum {v['autoaccum']}, accelerate "
        f"{v['accelerate']}, lightning {v['lightning']}, transformers {v['transformers']} · "
        f"{doc['config']['dtype']} · {doc['config']['steps']} optimizer steps per run · wall time "
        f"{doc['wall_time_s']:.0f} s", "",
        "Models and budgets (on CPU the peers see `CUDA out of memory.` at the front of the emulated OOM's "
        "message): " + "; ".join(
            f"{r['model']}: {r['describe']}, target {r['target_batch']}, budget "
            f"{autoaccum.format_bytes(r['budget_bytes'])}, dropping to "
            f"{autoaccum.format_bytes(r['runtime_drop']['budget_bytes'])} after {r['runtime_drop']['after_steps']} "
            f"steps" for r in doc["results"]), "",
        table(doc["results"]), "",
    ])
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find(SECTION)
    subsections: dict[str, str] = {}
    if start != -1:
        nxt = text.find("\n## ", start + len(SECTION))
        body = text[start:nxt + 1 if nxt != -1 else len(text)]
        before, after = text[:start], text[nxt + 1:] if nxt != -1 else ""
        for part in body.split("\n### ")[1:]:
            subsections["### " + part.split("\n", 1)[0]] = "### " + part.rstrip("\n") + "\n"
    else:
        before, after = text.rstrip("\n") + "\n\n", ""
    subsections[key] = sub
    ordered = sorted(subsections, key=lambda k: (k != METHOD, not k.startswith("### CPU"), k))
    section = "\n".join([SECTION, "", READING, COLUMNS, ""] + [subsections[k].rstrip("\n") + "\n" for k in ordered])
    text = before + section + ("\n" + after if after else "")
    path.write_text(text.rstrip("\n") + "\n")
