"""The default rows' table: one row per model and squeeze, derived from the saved parts (nothing is
measured here, so a table can be printed from the files of several sessions), and the targets."""

from __future__ import annotations

import statistics
from typing import Any

from common import markdown_table

from autoaccum.memory.model import MemoryModel
from autoaccum.units import format_bytes

from .squeeze import SQUEEZES

__all__ = ["TARGETS", "model_lines", "rows", "table", "targets"]

LABEL = {"process": "(i) other process", "fraction": "(ii) memory fraction", "budget": "(iii) --budget"}
#: the targets
TARGETS = {"found_vs_brute": 0.95, "pick_vs_sweep": 0.97, "estimate_median": 0.05, "estimate_worst": 0.10}


def _found(probe: dict[str, Any]) -> int:
    return max((c["micro_batch"] for c in probe.get("candidates", ()) if c["status"] == "ok"), default=0)


def _best(readings: dict[str, list[float]], size: int) -> float | None:
    values = readings.get(str(size))
    return max(values) if values else None


def _pick_vs_sweep(sweep: dict[str, Any], pick: int | None, limit: int) -> dict[str, Any] | None:
    """The pick's samples/s over the sweep's best plan among those under the brute-force limit."""
    if pick is None or "readings" not in sweep:
        return None
    fitting = {int(b): max(r) for b, r in sweep["readings"].items() if int(b) <= limit and r}
    pick_rate = _best(sweep["readings"], pick)
    if not fitting or pick_rate is None:
        return None
    best = max(fitting, key=lambda b: fitting[b])
    return {"pick": pick, "pick_samples_per_s": pick_rate, "best": best, "best_samples_per_s": fitting[best],
            "ratio": pick_rate / fitting[best] if fitting[best] else None}


def _estimate_errors(estimate: dict[str, Any], searches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The estimate's predicted peak against the peaks of every brute-force try that ran to its end
    (allocated; and reserved on CUDA): ``predicted / measured - 1``."""
    model = estimate.get("report", {}).get("model")
    if model is None:
        return None
    predict = MemoryModel.from_dict(model).predict
    tries = [t for s in searches for t in s["tries"] if not t["oom"] and t["peak_bytes"]]
    out: dict[str, Any] = {"points": len(tries)}
    for key, name in (("peak_bytes", "allocated"), ("reserved_peak_bytes", "reserved")):
        errors = [predict(t["micro_batch"]) / t[key] - 1 for t in tries if t.get(key)]
        out[name] = None if not errors else {
            "median_abs": statistics.median(abs(e) for e in errors), "worst_abs": max(abs(e) for e in errors),
            "median": statistics.median(errors)}
    return out


def _row(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    """One model under one squeeze: the table's numbers."""
    part = doc["parts"].get(f"squeeze:{kind}", {})
    row: dict[str, Any] = {"model": doc["model"], "squeeze": kind}
    if "error" in part:  # the part raised: a finding, and a miss of every target
        return {**row, "skipped": f"error: {part['error']}", "error": part["error"]}
    if "brute_force" not in part:
        return {**row, "skipped": part.get("skipped") or "not measured yet"}
    probe, fit, searches = part["probe"], part["fit"] or {}, part["brute_force"]
    limit = min(s["limit"] for s in searches)
    found = _found(probe)
    step_s = fit.get("step_time_s")
    pick = probe.get("plan", {}).get("micro_batch")
    return {
        **row, "true_budget_bytes": part["true_budget_bytes"], "usable_bytes": part["usable_bytes"],
        "probe_budget_bytes": probe.get("budget_bytes"), "probe_budget_source": probe.get("budget_source"),
        "probe_error": probe.get("error"), "plan": probe.get("plan"), "found": found,
        "brute_force": [s["limit"] for s in searches], "brute_capped": any(s["capped"] for s in searches),
        "brute_confirmed": all(s["confirmed"] for s in searches),
        "found_vs_brute": found / limit if limit else None, "probe_ooms": probe.get("probe_ooms"),
        "probe_wall_s": probe.get("wall_time_s"),
        "probe_step_equivalents": probe["wall_time_s"] / step_s if step_s and "wall_time_s" in probe else None,
        "step_time_s": step_s,
        "pick_vs_sweep": _pick_vs_sweep(doc["parts"].get("sweep", {}), pick, limit),
        "fit": fit, "fit_peak_vs_usable": fit["peak_bytes"] / part["usable_bytes"] if fit.get("peak_bytes") else None,
        "estimate": _estimate_errors(doc["parts"].get("estimate", {}), searches),
        "sizes": [(c["micro_batch"], c["status"]) for c in probe.get("candidates", ())],
        "wall_s": part.get("wall_s"),
    }


def rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_row(doc, kind) for doc in docs for kind in SQUEEZES]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _errors(e: dict[str, Any] | None, key: str) -> str:
    err = None if e is None else e.get(key)
    return "-" if err is None else f"{err['median_abs']:.1%} / {err['worst_abs']:.1%}"


def _fit_cell(fit: dict[str, Any]) -> str:
    if not fit:
        return "-"  # no plan to train on (the probe found none)
    if fit.get("error"):
        return f"{fit['ooms']}, then {fit['error'].split(':')[0]}"
    return f"{fit.get('ooms')} in {fit.get('steps')}"


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    head = (r["model"], LABEL[r["squeeze"]])
    if "skipped" in r:
        return (*head, r["skipped"].split(" (")[0], *["-"] * 12)
    plan = r["plan"] or {}
    budget = format_bytes(r["probe_budget_bytes"]) + f" ({r['probe_budget_source']})" if r["probe_budget_bytes"] \
        else (r["probe_error"] or "-")
    brute = " / ".join(map(str, r["brute_force"])) + (" (capped)" if r["brute_capped"] else "")
    sweep = r["pick_vs_sweep"]
    return (*head, format_bytes(r["true_budget_bytes"]), budget,
            f"{plan['micro_batch']} x {plan['accum_steps']}" if plan else "-", str(r["found"]), brute,
            _pct(r["found_vs_brute"]), str(r["probe_ooms"]),
            "-" if r["probe_step_equivalents"] is None else f"{r['probe_step_equivalents']:.1f}",
            "-" if sweep is None else f"{_pct(sweep['ratio'])} ({sweep['pick']} vs {sweep['best']})",
            _fit_cell(r["fit"]), _pct(r["fit_peak_vs_usable"]), _errors(r["estimate"], "allocated"),
            _errors(r["estimate"], "reserved"))


HEAD = ("model", "squeeze", "budget (true)", "autoaccum's budget", "plan", "found", "brute force x2", "found/brute",
        "probe OOMs", "probe cost (steps)", "pick/sweep best", "fit OOMs", "fit peak/usable",
        "est. err alloc (med / worst)", "est. err reserved (med / worst)")


def table(all_rows: list[dict[str, Any]]) -> str:
    return markdown_table([HEAD, *(_cells(r) for r in all_rows)])


def _misses(all_rows: list[dict[str, Any]], fit_steps: int) -> dict[str, list[str]]:
    """Per target, the rows that miss it (an empty list: met on every measured row)."""
    measured = [r for r in all_rows if "skipped" not in r]
    label = {id(r): f"{r['model']} {LABEL[r['squeeze']]}" for r in measured}
    misses: dict[str, list[str]] = {k: [f"{r['model']} {LABEL[r['squeeze']]}: {r['error']}" for r in all_rows
                                        if "error" in r] for k in ("probe", "pick", "fit", "estimate")}
    for r in measured:
        found = r["found_vs_brute"] or 0
        if found < TARGETS["found_vs_brute"] or found > 1 or r["probe_ooms"]:  # above: a size over the budget
            misses["probe"].append(f"{label[id(r)]}: {_pct(r['found_vs_brute'])}, {r['probe_ooms']} OOMs")
        ratio = (r["pick_vs_sweep"] or {}).get("ratio")
        if ratio is None or ratio < TARGETS["pick_vs_sweep"]:
            misses["pick"].append(f"{label[id(r)]}: {_pct(ratio)}")
        fit = r["fit"]
        if fit.get("ooms") or fit.get("error") or fit.get("steps") != fit_steps:
            misses["fit"].append(f"{label[id(r)]}: {_fit_cell(fit)}")
        missed = [f"{kind} {_errors(r['estimate'], kind)}" for kind in ("allocated", "reserved")
                  if (err := (r["estimate"] or {}).get(kind)) is not None
                  and (err["median_abs"] > TARGETS["estimate_median"] or err["worst_abs"] > TARGETS["estimate_worst"])]
        if missed:  # one entry a row, both readings in it: the count is of rows, as the other targets'
            misses["estimate"].append(f"{label[id(r)]}: {', '.join(missed)}")
    return misses


def targets(all_rows: list[dict[str, Any]], fit_steps: int) -> list[str]:
    """One line per done-when target: met on every measured row, or the rows that miss it."""
    measured = sum("skipped" not in r or "error" in r for r in all_rows)
    misses = _misses(all_rows, fit_steps)
    goals = {"probe": f"probe limit >= {TARGETS['found_vs_brute']:.0%} of brute force (and not above it) with 0 "
                      f"probe OOMs",
             "pick": f"the pick's throughput >= {TARGETS['pick_vs_sweep']:.0%} of the sweep's best",
             "fit": f"fit on the plan: 0 OOMs in {fit_steps} steps",
             "estimate": f"estimate: median peak error <= {TARGETS['estimate_median']:.0%}, worst <= "
                         f"{TARGETS['estimate_worst']:.0%} (allocated and reserved)"}
    return [f"- {goal}: " + (f"met on all {measured} measured rows." if not misses[key] else
                             f"**missed on {len(misses[key])} of {measured}**: " + "; ".join(misses[key]) + ".")
            for key, goal in goals.items()]


def model_lines(docs: list[dict[str, Any]]) -> list[str]:
    """Per model: its wall time (all sessions) and the search's speed-up over fp32 at the largest micro-batch."""
    lines = []
    for doc in docs:
        if not doc["parts"]:
            lines.append(f"- {doc['model']}: not measured yet")
            continue
        walls = {k: p.get("wall_s", 0.0) for k, p in doc["parts"].items()}
        search = doc["parts"].get("search", {})
        if "speedup" in search:
            w, base = search["winner"], search["fp32_largest"]
            plan = base["plan"]
            found = (f"search winner {w['plan']['micro_batch']} x {w['plan']['accum_steps']} {w['knobs']}: "
                     f"{w['samples_per_s']:,.1f} samples/s, "
                     + ("-" if search["speedup"] is None else f"{search['speedup']:.2f}x")
                     + f" fp32 at the largest micro-batch that fits ({base['micro_batch']}, cut "
                       f"{plan['micro_batch']} x {plan['accum_steps']}: {'/'.join(base['status'])})")
        else:
            found = "search: " + str(search.get("skipped") or search.get("error") or "not run")
        cards = sorted({p["device_name"] for p in doc["parts"].values() if p.get("device_name")})
        where = " and ".join(cards) + (" (parts on different cards: timings not comparable)" if len(cards) > 1 else "")
        lines.append(f"- {doc['model']} ({doc.get('describe', '')}; {where or 'not measured'}): "
                     f"{sum(walls.values()) / 60:.1f} min ("
                     + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items() if v) + f") · {found}")
    return lines
