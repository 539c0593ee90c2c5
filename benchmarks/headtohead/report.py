"""The report: one system's runs summarised, the table, versions and machine."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, version_of
from torch import nn

import autoaccum

from .context import RunResult
from .reference import param_diff

BENCHMARKS = Path(__file__).resolve().parents[1]


def summarise(r: RunResult, ref: nn.Module, init: nn.Module, target: int) -> dict[str, Any]:
    rec = r.recorder
    integrity = rec.integrity() if rec else {}
    diff = param_diff(r.model, ref, init) if r.error is None else None
    return {
        "micro_batch": r.micro_batch, "find_steps": r.find_steps, "find_time_s": r.find_time_s,
        "find_ooms": r.find_ooms, "train_ooms": r.train_ooms, "global_batches": integrity.get("global_batches"),
        "target_batch": target, "samples_per_s": rec.steady_rate() if rec and r.error is None else None,
        "samples_per_cpu_s": rec.steady_rate(cpu=True) if rec and r.error is None else None,
        "planned_micro_batch": r.planned_micro, "planned_saver": r.planned_saver, "weighed": r.weighed,
        "optimizer_steps": integrity.get("steps"), "repeated_samples": integrity.get("repeated_samples"),
        "lost_samples": integrity.get("lost_samples"), "inconsistent_steps": integrity.get("inconsistent_steps"),
        "max_rel_diff": None if diff is None else diff[0], "diff_vs_update": None if diff is None else diff[1],
        "error": r.error, "notes": r.notes, "wall_s": r.wall_s, "saver": r.saver, "budget_ooms": r.budget_ooms,
        "all_optimizer_steps": len(rec.steps) if rec else None,  # any phase, any attempt
        "tries": rec.tries() if rec else None,
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
    return "" if value is None else "<0.01 s · " if value < 0.01 else f"{value:.2f} s · "


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
    """The comparison's table; a workload where one sample does not fit gets its own (``savers_table``,
    ``blocks_table``)."""
    plain = [res for res in results if res.get("saver", "none") == "none" and "blocks" not in res]
    return "\n\n".join([_plain_table(plain)] * bool(plain)
                       + [blocks_table(res) if "blocks" in res else savers_table(res) for res in results
                          if res.get("saver", "none") != "none" or "blocks" in res])


def _plain_table(results: list[dict[str, Any]]) -> str:
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


def _tries(tries: list[list[Any]] | None) -> str:
    """``[[phase, size], ...]`` as ``find: 2; train: 1`` (each phase's sizes in order)."""
    parts: list[tuple[str, list[str]]] = []
    for phase, size in tries or []:
        if not parts or parts[-1][0] != phase:
            parts.append((phase, []))
        parts[-1][1].append(str(size))
    return "; ".join(f"{phase}: {', '.join(sizes)}" for phase, sizes in parts) or "–"


def savers_table(res: dict[str, Any]) -> str:
    """Where one sample does not fit: what each system did, then fit against the hand-configured run."""
    title = (f"{res['model']}: {res['describe']}; target {res['target_batch']}; budget "
             f"{autoaccum.format_bytes(res['budget_bytes'])}: micro-batches of up to {res['truly_fits']} fit with "
             f"{res['saver']}, {res['fits_without_savers']} without")
    head = ("| system | tries (micro-batch sizes) | OOMs: finding · training | optimizer steps | ended with | "
            "saver · micro | samples/s: wall · CPU | rel. diff |")
    lines = [title, "", head, "|---|---|---|---|---|---|---|---|"]
    for system, row in res["systems"].items():
        if "micro_batch" not in row:
            lines.append(f"| {system} | {row.get('error', '')} |" + " |" * 6)
            continue
        ended = f"**{row['error']}**" if row["error"] else f"trained: global {_global(row)}"
        saver = "–" if row["error"] or row["micro_batch"] is None else \
            f"{row.get('saver') or 'none'} · {row['micro_batch']}"
        rate = "–" if row["samples_per_s"] is None else \
            f"{row['samples_per_s']:,.2f} · {num(row.get('samples_per_cpu_s'), ',.2f')}"
        lines.append(f"| {system} | {_tries(row.get('tries'))} | {num(row['find_ooms'], 'd')} · {row['train_ooms']} | "
                     f"{row.get('all_optimizer_steps')} | {ended} | {saver} | {rate} | "
                     f"{num(row['max_rel_diff'], '.1e')} |")
    pair = res.get("fit_vs_hand")
    if pair is None or "error" in pair:
        return "\n".join(lines + ([] if pair is None else ["", f"fit against the hand-configured run: {pair['error']}"
                                                             ]))
    rounds = ", ".join(format(r, ".3f") for r in pair["ratios"])
    return "\n".join([*lines, "", f"fit against the hand-configured run, {pair['rounds']} rounds alternating in one "
                       "process:", "", markdown_table([PAIRS_HEAD, _pairs_row(autoaccum.format_bytes(
                           res["budget_bytes"]), pair)]), "", f"fit / hand: {num(pair['ratio_median'], '.3f')} by wall "
                       f"time (median of rounds: {rounds}), {num(pair['cpu_ratio_median'], '.3f')} by CPU time"])


def _pair(saver: str | None, micro: int | None) -> str:
    """``2/8 x 1``: the blocks checkpointed (of all) and the micro-batch."""
    return f"{ {'none': '0', 'checkpointing': 'all'}.get(saver or 'none', (saver or '').partition(':')[2])} x {micro}"


PAIRS_HEAD = ("budget", "fit: plan · samples/s · OOMs in training", "best pair · samples/s",
              "hand: all blocks · samples/s", "fit / best", "fit / hand", "best / hand", "probe: steps eq. · passes",
              "rel. diff: fit · control")


def _pairs_row(head: str, row: dict[str, Any]) -> tuple[str, ...]:
    """fit against the best pair and the hand-configured run (``savers.measure``), one table row."""
    if "error" in row:
        return (head, row["error"], *[""] * 7)
    plans = [_pair(*p[:2]) + ("" if p[:2] == p[2:] else f" → {_pair(*p[2:])}") for p in row["fit_plans"]]
    best, hand = row["pairs"][row["best"]], row["pairs"]["hand"]
    ratio = {k: f"{num(row[f'{k}ratio_median'], '.3f')} ({num(row[f'cpu_{k}ratio_median'], '.3f')})"
             for k in ("best_", "")}
    return (head, f"{', '.join(plans)} · {num(row['fit_samples_per_s'], '.2f')} · {row['fit_train_ooms']}",
            f"{_pair(best['saver'], best['micro'])} · {num(best['samples_per_s'], '.2f')}",
            f"{_pair(hand['saver'], hand['micro'])} · {num(hand['samples_per_s'], '.2f')}", ratio["best_"], ratio[""],
            num(row["best_over_hand"], ".3f"), f"{num(row['probe_steps_equivalent'], '.2f')} · "
            f"{num(row['probe_passes'], '.0f')}", f"{num(row['fit_max_rel_diff'], '.1e')} · "
            f"{num(row['control_max_rel_diff'], '.1e')}")


def blocks_table(res: dict[str, Any]) -> str:
    """fit against the brute force's best pair and the hand-configured run at each budget (``savers.measure``)."""
    micro = res.get("micro_target", 1)
    heads = [f"{autoaccum.format_bytes(row['budget_bytes'])}: {micro} sample{'s' * (micro > 1)} need "
             f"{_pair(row['needed'], 1)[:-4]} of the blocks" for row in res["blocks"]]
    return "\n".join([
        f"{res['model']}: {res['describe']}; target {res['target_batch']}; {res['dtype']}. Pairs: blocks checkpointed "
        "x micro-batch; samples/s by wall time, median of the rounds; ratios: median of the paired rounds by wall "
        "(CPU) time", "", markdown_table([PAIRS_HEAD, *(_pairs_row(h, r) for h, r in zip(heads, res["blocks"]))]), "",
        f"Every pair, samples/s (median of {res['blocks'][0].get('rounds')} rounds):",
        *(f"- {h}: " + ", ".join(f"{_pair(p['saver'], p['micro'])} {num(p['samples_per_s'], '.2f')}"
                                 for p in row.get("pairs", {}).values()) for h, row in zip(heads, res["blocks"]))])


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
    return {"python": platform.python_version(), "torch": torch.__version__,
            "autoaccum": f"{autoaccum.__version__} ({_git_head()})",
            **{name: version_of(name) for name in ("accelerate", "lightning", "transformers")}}


def machine(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    return (f"{platform.system()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {gpu}; torch "
            f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} at the start")
