"""The rows' table: one row per model, from the saved parts (nothing is measured here, so a table can be
printed from the files of several sessions): the probe against brute force, the pick against the sweep,
fit's OOMs and samples/s against the hand loop, and the estimate's error against the measured peaks."""

from __future__ import annotations

import statistics
from typing import Any

from common import markdown_table

from autoaccum.memory.model import MemoryModel
from autoaccum.units import format_bytes

from .parts import found

__all__ = ["TARGETS", "row", "table", "targets"]

TARGETS = {"found_vs_brute": 0.95, "pick_vs_sweep": 0.97, "fit_vs_hand": 0.99, "estimate_median": 0.05,
           "estimate_worst": 0.10}


def _pick_vs_sweep(sweep: dict[str, Any], pick: int | None, limit: int) -> dict[str, Any] | None:
    """The pick's samples/s over the sweep's best plan among those under the brute-force limit."""
    if pick is None or "readings" not in sweep:
        return None
    fitting = {int(b): max(r) for b, r in sweep["readings"].items() if int(b) <= limit and r}
    values = sweep["readings"].get(str(pick))
    if not fitting or not values:
        return None
    pick_rate, best = max(values), max(fitting, key=lambda b: fitting[b])
    return {"pick": pick, "pick_samples_per_s": pick_rate, "best": best, "best_samples_per_s": fitting[best],
            "ratio": pick_rate / fitting[best] if fitting[best] else None}


def _estimate_errors(estimate: dict[str, Any], tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The estimate's predicted peak against the peak of every brute-force try that ran to its end
    (allocated; and reserved on CUDA): ``predicted / measured - 1``."""
    if "report" not in estimate:
        return {"skipped": estimate.get("skipped") or estimate.get("error") or "not measured yet"}
    model = estimate["report"].get("model")
    predict = MemoryModel.from_dict(model).predict
    ran = [t for t in tries if not t["oom"] and t["peak_bytes"]]
    out: dict[str, Any] = {"points": len(ran), "seconds": estimate.get("seconds"),
                           "per_sample_bytes": model.get("per_sample_bytes")}
    for key, name in (("peak_bytes", "allocated"), ("reserved_peak_bytes", "reserved")):
        errors = [predict(t["micro_batch"]) / t[key] - 1 for t in ran if t.get(key)]
        out[name] = None if not errors else {
            "median_abs": statistics.median(abs(e) for e in errors), "worst_abs": max(abs(e) for e in errors),
            "median": statistics.median(errors)}
    return out


def row(doc: dict[str, Any]) -> dict[str, Any]:
    """One model's row: the table's numbers (``skipped`` where nothing was measured)."""
    part = doc["parts"].get("squeeze", {})
    out: dict[str, Any] = {"model": doc["model"], "squeeze": part.get("kind"), "describe": doc.get("describe"),
                           "params": doc.get("params"), "target_batch": doc.get("target_batch")}
    if "error" in part:
        return {**out, "skipped": f"error: {part['error']}", "error": part["error"]}
    if "brute_force" not in part:
        return {**out, "skipped": part.get("skipped") or "not measured yet"}
    probe, brute, compared = part["probe"], part["brute_force"], part.get("compare") or {}
    limit, best = brute["limit"], found(probe)
    fit_rate = compared.get("fit_samples_per_s")
    step_s = doc["target_batch"] / fit_rate if fit_rate else None
    fit = {"steps": compared.get("fit_steps"), "ooms": compared.get("fit_ooms"),
           "error": "; ".join(compared.get("fit_errors", ())) or None, "peak_bytes": compared.get("fit_peak_bytes"),
           "step_time_s": step_s} if compared else {}
    return {
        **out, "true_budget_bytes": part["true_budget_bytes"], "usable_bytes": part["usable_bytes"],
        "probe_error": probe.get("error"), "plan": probe.get("plan"), "found": best,
        "brute_force": limit, "brute_tries": [t["micro_batch"] for t in brute["tries"]],
        "brute_capped": brute["capped"],
        "found_vs_brute": best / limit if limit and best else None, "probe_ooms": probe.get("probe_ooms"),
        "probe_wall_s": probe.get("wall_time_s"),
        "probe_step_equivalents": probe["wall_time_s"] / step_s if step_s and "wall_time_s" in probe else None,
        "step_time_s": step_s,
        "pick_vs_sweep": _pick_vs_sweep(doc["parts"].get("sweep", {}), probe.get("plan", {}).get("micro_batch"), limit),
        "fit": fit, "fit_vs_hand": {k: compared.get(k) for k in ("ratio", "ratio_min", "ratio_max",
                                                                 "fit_samples_per_s", "hand_samples_per_s")}
        if compared else None,
        "estimate": _estimate_errors(doc["parts"].get("estimate", {}), [*brute["tries"], *part.get("extra_tries", [])]),
        "timings": part.get("timings"), "build_s": doc.get("build_s"),
        "wall_s": sum(p.get("wall_s", 0.0) for p in doc["parts"].values()),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _errors(e: dict[str, Any], key: str) -> str:
    return "-" if (err := e.get(key)) is None else f"{err['median_abs']:.1%} / {err['worst_abs']:.1%}"


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    if "skipped" in r:
        return (r["model"], r["skipped"].split(" (")[0][:60], *["-"] * 11)
    plan, fit, vs, sweep, est = r["plan"] or {}, r["fit"], r["fit_vs_hand"] or {}, r["pick_vs_sweep"], r["estimate"]
    ratio = "-" if vs.get("ratio") is None else \
        f"{vs['ratio']:.3f} ({vs['ratio_min']:.3f}-{vs['ratio_max']:.3f})"
    rates = "-" if not vs.get("hand_samples_per_s") else \
        f"{vs['fit_samples_per_s']:,.0f} / {vs['hand_samples_per_s']:,.0f}"
    fit_cell = "-" if not fit else (f"{fit.get('ooms')} in {fit.get('steps')}" +
                                    (f", {fit['error'].split(':')[0]}" if fit.get("error") else ""))
    return (r["model"], format_bytes(r["true_budget_bytes"]),
            f"{plan['micro_batch']} x {plan['accum_steps']}" if plan else (r["probe_error"] or "-"),
            f"{r['found']} / {r['brute_force']}" + (" (capped)" if r["brute_capped"] else ""),
            _pct(r["found_vs_brute"]), str(r["probe_ooms"]),
            "-" if r["probe_step_equivalents"] is None else f"{r['probe_step_equivalents']:.1f}",
            "-" if sweep is None else f"{_pct(sweep['ratio'])} ({sweep['pick']} vs {sweep['best']})",
            fit_cell, rates, ratio, *((est["skipped"].split(" (")[0][:40], "-") if "skipped" in est
                                      else (_errors(est, "allocated"), _errors(est, "reserved"))))


HEAD = ("row", "budget (true)", "plan", "found / brute", "found/brute", "probe OOMs", "probe cost (steps)",
        "pick/sweep best", "fit OOMs", "samples/s fit / hand", "fit/hand (min-max)", "est. err alloc (med / worst)",
        "est. err reserved")


def table(all_rows: list[dict[str, Any]]) -> str:
    return markdown_table([HEAD, *(_cells(r) for r in all_rows)])


def targets(all_rows: list[dict[str, Any]]) -> list[str]:
    """One line per target: met on every measured row, or the rows that miss it."""
    measured = [r for r in all_rows if "skipped" not in r]
    misses: dict[str, list[str]] = {k: [f"{r['model']}: {r['error'][:90]}" for r in all_rows if "error" in r]
                                    for k in ("probe", "pick", "fit", "speed", "estimate")}
    for r in measured:
        share = r["found_vs_brute"] or 0
        if share < TARGETS["found_vs_brute"] or share > 1 or r["probe_ooms"]:  # above: a size over the budget
            misses["probe"].append(f"{r['model']}: {_pct(r['found_vs_brute'])}, {r['probe_ooms']} OOMs")
        ratio = (r["pick_vs_sweep"] or {}).get("ratio")
        if ratio is None or ratio < TARGETS["pick_vs_sweep"]:
            misses["pick"].append(f"{r['model']}: {_pct(ratio)}")
        fit = r["fit"]
        if fit.get("ooms") or fit.get("error") or not fit.get("steps"):
            misses["fit"].append(f"{r['model']}: {fit.get('ooms')} OOMs, {fit.get('error')}")
        speed = (r["fit_vs_hand"] or {}).get("ratio")
        if speed is None or speed < TARGETS["fit_vs_hand"]:
            misses["speed"].append(f"{r['model']}: {'-' if speed is None else f'{speed:.3f}'}")
        est = r["estimate"]
        missed = [f"{kind} {_errors(est, kind)}" for kind in ("allocated", "reserved")
                  if (err := est.get(kind)) is not None
                  and (err["median_abs"] > TARGETS["estimate_median"] or err["worst_abs"] > TARGETS["estimate_worst"])]
        if "skipped" in est or missed:
            misses["estimate"].append(f"{r['model']}: {est.get('skipped') or ', '.join(missed)}")
    goals = {"probe": f"probe limit >= {TARGETS['found_vs_brute']:.0%} of brute force (not above) with 0 probe OOMs",
             "pick": f"the pick's throughput >= {TARGETS['pick_vs_sweep']:.0%} of the sweep's best",
             "fit": "fit on the plan: 0 OOMs",
             "speed": f"fit's samples/s >= {TARGETS['fit_vs_hand']} x the hand-written loop's (median of the rounds)",
             "estimate": f"estimate: median error <= {TARGETS['estimate_median']:.0%}, worst <= "
                         f"{TARGETS['estimate_worst']:.0%} (allocated and reserved)"}
    n = len(measured) + sum("error" in r for r in all_rows)
    return [f"- {goal}: " + (f"met on all {n} measured rows." if not misses[key] else
                             f"**missed on {len(misses[key])} of {n}**: " + "; ".join(misses[key]) + ".")
            for key, goal in goals.items()]
