"""What a search returns: every trial, the winner, and the plan file that carries the winner to training.

A plan file (``SearchResult.save``, ``autoaccum search --out``) is JSON of kind ``autoaccum.plan``:
the winner's plan (with its memory saver, ``plan.saver``) and knobs, what they measured,
and the fingerprint of the model searched, so that a run of another model refuses the file
(``autoaccum.probe.report.check_made_for``), as it refuses a probe report. ``read_plan_file`` reads
it back -- and a search result or a probe report (``autoaccum probe --json``) -- through
``autoaccum.plan.sources.read_plan_document``, the one reader of plan files, after checking the kind.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from autoaccum.jsonio import write_json_atomic
from autoaccum.memory.savers import describe_saver
from autoaccum.plan.plan import Plan
from autoaccum.plan.sources import read_plan_document
from autoaccum.search.knobs import Knobs
from autoaccum.search.throughput import Status
from autoaccum.units import format_bytes

__all__ = ["FILE_VERSION", "PLAN_FILE_KIND", "SEARCH_KIND", "FinalComparison", "SearchResult", "Stopped",
           "TrialRecord", "format_search", "load_plan_file", "read_plan_file"]

PLAN_FILE_KIND = "autoaccum.plan"
SEARCH_KIND = "autoaccum.search"
FILE_VERSION = 1
Stopped = Literal["n_trials", "timeout", "patience"]


@dataclass(frozen=True)
class TrialRecord:
    """One trial of the study (those of earlier searches on a resumed study included).

    Attributes:
        number: Optuna's trial number.
        plan: the plan for the whole target (micro x accum x world), with the knobs' saver (``plan.saver``).
        knobs: the memory saver, autocast, compile.
        status: ``ok``, ``oom``, ``over_budget``, ``failed`` (see ``Measurement``).
        samples_per_s: samples of one rank's share per second (None unless ok).
        items_per_s: items (e.g. tokens) per second for token-level losses, else None.
        step_time_s: the fastest timed optimizer step (None unless ok).
        peak_bytes: the largest step peak seen.
        note: where an OOM struck, or a knob's error.
        seeded: ``probe`` (the probe's pick) or ``fit`` (the two largest sizes predicted to fit as an
            accumulated step), enqueued before the sampler's trials; ``""`` for the sampler's.
        duplicate_of: the earlier trial whose measurement this one reused, or None.
        earlier: run by an earlier search on the same study (resumed from storage).
    """

    number: int
    plan: Plan
    knobs: Knobs
    status: Status
    samples_per_s: float | None
    items_per_s: float | None
    step_time_s: float | None
    peak_bytes: int | None
    note: str = ""
    seeded: str = ""
    duplicate_of: int | None = None
    earlier: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "plan": self.plan.to_dict(), "knobs": self.knobs.to_dict(),
                "status": self.status, "samples_per_s": self.samples_per_s, "items_per_s": self.items_per_s,
                "step_time_s": self.step_time_s, "peak_bytes": self.peak_bytes, "note": self.note,
                "seeded": self.seeded, "duplicate_of": self.duplicate_of, "earlier": self.earlier}


@dataclass(frozen=True)
class FinalComparison:
    """One finalist of the final comparison (``autoaccum.search.compare``).

    Attributes:
        trial: its trial number.
        median: median samples/s of its readings in the rounds.
        ratio: median over rounds of its reading / the leader's in the same round.
        spread: median absolute deviation of those per-round ratios: how much one round strays.
        noise: the standard error of ``ratio`` (from ``spread`` and the number of rounds).
        within_noise: its gap to the leader is within the tolerance (two standard errors, within
            the floor and the ceiling): a tie, which goes to the simplest.
        leader: it has the best median.
    """

    trial: int
    median: float
    ratio: float
    spread: float
    noise: float
    within_noise: bool
    leader: bool

    def to_dict(self) -> dict[str, Any]:
        return {"trial": self.trial, "median": self.median, "ratio": self.ratio, "spread": self.spread,
                "noise": self.noise, "within_noise": self.within_noise, "leader": self.leader}


@dataclass(frozen=True)
class SearchResult:
    """The fastest configuration found, and every trial.

    Attributes:
        plan: the winner's plan for ``target_batch`` (give it to ``OOMGuard(plan=...)`` / ``fit``), on
            the winner's memory saver (``plan.saver``), which the guard applies.
        knobs: the winner's knobs (``knobs.autocast_dtype`` for ``OOMGuard(autocast_dtype=...)``;
            ``knobs.saver`` is ``plan.saver``).
        samples_per_s: the winner's samples/s on one rank: the median of its readings in the
            final rounds (its trial's reading without them).
        items_per_s: the winner's items/s, likewise (None for losses that count no items).
        peak_bytes: the winner's peak memory.
        trials: every completed trial of the study, in order (samples/s as measured in the trial).
        confirmed: ``(trial number, samples/s readings)`` of the finalists measured again (reading
            ``i``: round ``i``; a finalist out of the race after ``OUT_AFTER_ROUNDS`` has fewer).
        comparison: the finalists' paired comparison with the leader (empty without rounds): the
            winner is the simplest finalist within noise of the leader.
        probe_plan: what the probe picked.
        probe_samples_per_s: the probe's pick's samples/s in this search, read as the winner's
            (None if it did not fit as a guarded, accumulated step).
        budget_bytes: the budget.
        usable_bytes: ``budget * (1 - headroom)``, which every trial had to fit.
        headroom: the fraction of the budget kept free.
        device: where it ran.
        emulated: memory was counted and enforced by the tracked counter.
        study_name: the Optuna study (resume it with the same storage and name).
        n_trials_run: trials run by this call.
        stopped: why it stopped (``n_trials``, ``timeout`` or ``patience``).
        wall_time_s: the whole search, probe included.
        probe_wall_time_s: the probe alone.
        torch_version: the torch that ran the search.
        model_fingerprint: a hash of the model searched (``autoaccum.probe.report.model_fingerprint``):
            ``fit``, ``OOMGuard`` and the integrations refuse the result, or its plan file, for another model.
        model_summary: that model in words.
    """

    plan: Plan
    knobs: Knobs
    samples_per_s: float
    items_per_s: float | None
    peak_bytes: int | None
    trials: tuple[TrialRecord, ...]
    confirmed: tuple[tuple[int, tuple[float, ...]], ...]
    probe_plan: Plan
    probe_samples_per_s: float | None
    budget_bytes: int
    usable_bytes: int
    headroom: float
    device: str
    emulated: bool
    study_name: str
    n_trials_run: int
    stopped: Stopped
    wall_time_s: float
    probe_wall_time_s: float
    comparison: tuple[FinalComparison, ...] = ()
    torch_version: str = field(default_factory=lambda: torch.__version__)
    model_fingerprint: str = ""
    model_summary: str = ""

    @property
    def speedup_over_probe(self) -> float | None:
        return None if not self.probe_samples_per_s else self.samples_per_s / self.probe_samples_per_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": SEARCH_KIND, "version": FILE_VERSION, "plan": self.plan.to_dict(), "knobs": self.knobs.to_dict(),
            "samples_per_s": self.samples_per_s, "items_per_s": self.items_per_s, "peak_bytes": self.peak_bytes,
            "probe_plan": self.probe_plan.to_dict(), "probe_samples_per_s": self.probe_samples_per_s,
            "speedup_over_probe": self.speedup_over_probe,
            "budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes, "headroom": self.headroom,
            "device": self.device, "emulated": self.emulated, "study_name": self.study_name,
            "n_trials_run": self.n_trials_run, "stopped": self.stopped, "wall_time_s": self.wall_time_s,
            "probe_wall_time_s": self.probe_wall_time_s, "torch_version": self.torch_version,
            "trials": [t.to_dict() for t in self.trials],
            "confirmed": [{"trial": n, "samples_per_s": list(runs), "median": statistics.median(runs)}
                          for n, runs in self.confirmed],
            "comparison": [c.to_dict() for c in self.comparison],
            "model_fingerprint": self.model_fingerprint, "model_summary": self.model_summary,
        }

    def plan_file(self) -> dict[str, Any]:
        """The plan file's content: ``Plan.from_dict(content["plan"])`` and the knobs."""
        return {"kind": PLAN_FILE_KIND, "version": FILE_VERSION, "source": "search", "plan": self.plan.to_dict(),
                "knobs": self.knobs.to_dict(), "samples_per_s": self.samples_per_s, "items_per_s": self.items_per_s,
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes,
                "device": self.device, "study_name": self.study_name, "torch_version": self.torch_version,
                "model_fingerprint": self.model_fingerprint, "model_summary": self.model_summary}

    def save(self, path: str | Path) -> Path:
        """Write the plan file (JSON, atomically) to ``path``; read it back with ``load_plan_file``."""
        return write_json_atomic(path, self.plan_file())


def read_plan_file(path: str | Path) -> tuple[Plan, Knobs]:
    """The plan and knobs in a search plan file, a search result or a probe report (knobs: none but the
    plan's memory saver); the file must name its kind (``read_plan_document``).

    Raises:
        ValueError: the file is not JSON or not one of those.
    """
    try:
        document = read_plan_document(Path(path), kinds=(PLAN_FILE_KIND, SEARCH_KIND, "autoaccum.probe"))
        return document.plan, Knobs.from_dict(document.knobs or {"saver": document.plan.saver})
    except TypeError as exc:
        raise ValueError(f"{path}: malformed plan: {exc}") from None


def load_plan_file(path: str | Path) -> Plan:
    """The ``Plan`` in a search plan file (``autoaccum search --out``) or a probe report JSON."""
    return read_plan_file(path)[0]


# -- printing (the CLI prints; this only formats) -------------------------------------------------

def format_search(result: SearchResult) -> str:
    """The trial table, the winner, and how it compares with the probe's pick."""
    rows = [("trial", "micro", "accum", "knobs", "status", "peak", "step s", "samples/s", "")]
    winner = next((t.number for t in result.trials if (t.plan, t.knobs) == (result.plan, result.knobs)), None)
    for t in result.trials:
        seed = {"probe": "probe pick", "fit": "largest fit"}.get(t.seeded, "")
        mark = ", ".join(x for x in (seed, "WINNER" if t.number == winner else "",
                                     f"= #{t.duplicate_of}" if t.duplicate_of is not None else "",
                                     "earlier" if t.earlier else "") if x)
        rows.append((str(t.number), str(t.plan.micro_batch), str(t.plan.accum_steps), t.knobs.describe(), t.status,
                     "-" if t.peak_bytes is None else format_bytes(t.peak_bytes),
                     "-" if t.step_time_s is None else f"{t.step_time_s:.4f}",
                     "-" if t.samples_per_s is None else f"{t.samples_per_s:,.1f}", mark))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"autoaccum search · {result.device} · usable {format_bytes(result.usable_bytes)} of "
             f"{format_bytes(result.budget_bytes)}" + (" (emulated budget)" if result.emulated else "")
             + f" · study {result.study_name}", ""]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    if result.comparison:
        rounds = {n: len(runs) for n, runs in result.confirmed}
        lines.append("final rounds (median samples/s; paired ratio to the leader ± its noise): " + " · ".join(
            f"#{c.trial} {c.median:,.1f} of {rounds.get(c.trial, 0)}, "
            + ("leader" if c.leader else f"{c.ratio:.3f} ± {c.noise:.3f}" + (" tie" if c.within_noise else ""))
            for c in result.comparison))
    elif any(len(runs) > 1 for _, runs in result.confirmed):
        lines.append("measured again: " + " · ".join(
            f"#{n} median {statistics.median(runs):,.1f} of {len(runs)}" for n, runs in result.confirmed))
    speed = f"{result.samples_per_s:,.1f} samples/s" + \
        (f", {result.items_per_s:,.0f} items/s" if result.items_per_s else "")
    knobs = replace(result.knobs, saver="none").describe()  # the plan names the saver
    lines.append(f"winner: {result.plan.describe()} · {knobs} · {speed}"
                 + ("" if result.peak_bytes is None else f" · peak {format_bytes(result.peak_bytes)}"))
    saver = "" if result.probe_plan.saver == "none" else f" with {describe_saver(result.probe_plan.saver)}"
    if result.probe_samples_per_s:
        lines.append(f"probe pick: micro {result.probe_plan.micro_batch}{saver} · {result.probe_samples_per_s:,.1f} "
                     f"samples/s -> winner x{result.speedup_over_probe:.2f}")
    else:
        lines.append(f"probe pick: micro {result.probe_plan.micro_batch}{saver} did not fit as a guarded step")
    lines.append(f"{result.n_trials_run} trials this run (stopped: {result.stopped}), {result.wall_time_s:.1f} s "
                 f"(probe {result.probe_wall_time_s:.1f} s)")
    return "\n".join(lines)
