"""The Optuna study of a search: sampler, trials, seeds, patience, the confirmation round-robin,
and the checks that let a stored study be resumed.

- **Trials**: each trial picks a micro-batch (an index into the space's sizes) and knobs (the memory
  memory saver, autocast, compile; compile only without a memory saver, see ``autoaccum.search.knobs``),
  runs real guarded optimizer steps (``autoaccum.search.throughput``) and returns measured samples/s.
  Its plan carries its saver (``Plan.saver``). A configuration already measured in the study is not run
  again (its result is reused).
- **Infeasible trials**: a trial that runs out of memory, or whose guard had to shrink the plan,
  or that peaks above the usable budget, completes with value 0 and a positive ``memory``
  constraint (``Trial.set_constraint`` on Optuna >= 5, ``constraints_func`` before). TPE treats
  it as infeasible and learns from it; the study goes on.
- **Seeding and stopping**: the probe's pick (with the probe's saver) is enqueued first
  (``enqueue_trial``), so it is measured and confirmed alongside the best; then the two largest sizes
  predicted to fit as an accumulated step, with the same saver. The search stops after ``n_trials``
  trials, ``timeout_s`` seconds, or ``patience`` trials in a row without a ``min_improvement`` gain.
- **Final comparison**: a trial is one reading on a possibly busy machine, and the best of many
  readings flatters whoever got a quiet moment. So the finalists (the ``confirm_top`` fastest, the
  probe's pick and the simplest feasible configuration) are measured ``confirm_rounds`` more times,
  interleaved, and the winner comes from these rounds (``_confirm``, ``autoaccum.search.compare``).
- **Storage**: in memory by default; any Optuna storage URL (``sqlite:///autoaccum.db`` keeps and
  resumes a study with its trials; an RDB shared by several workers, one per GPU). The study
  keeps its space and what it measures (target, world size, device, a given budget) in its user
  attributes: a resumed study samples the same space, and one made for another problem is refused.

Optuna is imported only when a study runs (the ``search`` extra).
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoaccum.errors import AutoAccumError
from autoaccum.plan.plan import Plan
from autoaccum.probe.report import ProbeReport, model_fingerprint, model_summary
from autoaccum.search.compare import DEFAULT_TIE_CEILING, compare_finalists, paired_ratios
from autoaccum.search.knobs import Knobs
from autoaccum.search.result import FinalComparison, SearchResult, Stopped, TrialRecord
from autoaccum.search.space import KNOBS, SearchSpace
from autoaccum.search.throughput import Bench, Measurement
from autoaccum.units import format_bytes

__all__ = ["SearchError", "StudyOptions", "require_optuna", "run_study", "trial_plan"]

logger = logging.getLogger(__name__)


class SearchError(AutoAccumError):
    """The search found no configuration that fits (every trial ran out of memory or failed)."""


def require_optuna() -> Any:
    """The ``optuna`` module, or an ImportError that names the extra to install."""
    try:
        import optuna
    except ImportError as exc:
        raise ImportError("autoaccum.search needs Optuna, which is not installed. Install the search extra: "
                          "pip install 'autoaccum[search]'") from exc
    return optuna


@dataclass(frozen=True)
class StudyOptions:
    """What one search asks of its study (see ``autoaccum.search.search`` for each)."""

    target_batch: int
    world_size: int
    n_trials: int
    timeout_s: float | None
    storage: Any
    study_name: str | None
    patience: int | None
    min_improvement: float
    seed: int | None
    confirm_top: int
    confirm_rounds: int


def trial_plan(trial: Any, options: StudyOptions) -> Plan:
    """The plan a trial measures: its micro-batch with the fewest accumulation steps that cover
    the target exactly, with its knobs' memory saver. The one way from a trial's
    micro-batch to a plan: the trial's stored ``accum_steps``, its record, the winner and the
    confirmation rounds all come from here."""
    saver = Knobs.from_dict(trial.user_attrs.get("knobs", {})).saver
    return Plan.for_target(options.target_batch, int(trial.user_attrs["micro_batch"]), options.world_size) \
        .with_saver(saver)


def _has_set_constraint(optuna: Any) -> bool:
    """Optuna >= 5 takes constraints from the trial (``Trial.set_constraint``); before, from a
    sampler's ``constraints_func``."""
    return hasattr(optuna.trial.Trial, "set_constraint")


def _study_key(options: StudyOptions, report: ProbeReport) -> dict[str, Any]:
    """What a resumed study must share with this search (its trials are measurements of it)."""
    return {"target_batch": options.target_batch, "world_size": options.world_size, "device": report.device_name,
            "budget_bytes": report.budget_bytes if report.budget_source == "given" else None,
            "headroom": report.headroom}


def _open_study(optuna: Any, report: ProbeReport, space: dict[str, Any], requested: SearchSpace,
                options: StudyOptions) -> tuple[Any, dict[str, Any], int]:
    """The study (created, or loaded from storage and checked), the space it samples and the
    sampler's number of random start trials."""
    sampler_kwargs: dict[str, Any] = {"seed": options.seed, "n_startup_trials": max(3, min(10, options.n_trials // 3))}
    if not _has_set_constraint(optuna):
        sampler_kwargs["constraints_func"] = lambda t: (float(t.user_attrs.get("constraint", 1.0)),)
    sampler = optuna.samplers.TPESampler(**sampler_kwargs)
    name = options.study_name or f"autoaccum-{report.fingerprint[:16]}"
    study = optuna.create_study(storage=options.storage, study_name=name, direction="maximize", sampler=sampler,
                                load_if_exists=True)
    key = _study_key(options, report)
    stored = study.user_attrs.get("autoaccum")
    if stored is None:
        study.set_user_attr("autoaccum", {"key": key, "space": space})
        return study, space, sampler_kwargs["n_startup_trials"]
    stored_space = stored["space"]
    if stored["key"] != key:
        raise ValueError(f"study {name!r} was made for {stored['key']}, not {key}; its trials measure another "
                         f"problem. Use another study name (--study-name) or storage.")
    if requested != SearchSpace() and stored_space != space:
        raise ValueError(f"study {name!r} searches {stored_space}, not {space}; resume it with the default "
                         f"space, or use another study name")
    # the sizes measured before: the index means the same size again
    return study, stored_space, sampler_kwargs["n_startup_trials"]


def _trial_params(space: dict[str, Any], micro_batch: int, knobs: Knobs) -> dict[str, Any]:
    """The parameters that make a trial sample ``micro_batch`` (the nearest size) and ``knobs``."""
    sizes = space["micro_batches"]
    index = min(range(len(sizes)), key=lambda i: (abs(sizes[i] - micro_batch), -sizes[i]))
    params: dict[str, Any] = {"micro_batch_index": index} if len(sizes) > 1 else {}
    params.update({k: getattr(knobs, k) for k in KNOBS if len(space[k]) > 1})
    return params


def _sample_knobs(trial: Any, space: dict[str, Any]) -> Knobs:
    """The trial's knobs; compile is sampled without a memory saver only (dynamo cannot trace the
    savers' exact checkpointing, ``autoaccum.search.knobs``)."""
    def pick(name: str) -> Any:
        return trial.suggest_categorical(name, space[name]) if len(space[name]) > 1 else space[name][0]

    saver, autocast = pick("saver"), pick("autocast")
    # with a saver, compile=False; only a space that allows nothing but compile gets both (recorded as failed)
    compile_ = pick("compile") if saver == "none" or False not in space["compile"] else False
    return Knobs(saver=saver, autocast=autocast, compile=compile_)


def _enqueue_seeds(study: Any, space: dict[str, Any], report: ProbeReport, largest: int) -> int:
    """Seeds, before the sampler's trials: the probe's pick (so it is measured in this study and
    confirmed with the best), then the two largest sizes predicted to fit as an accumulated step
    (speed usually grows with the micro-batch, the sampler's random start may miss the top sizes,
    and the prediction is a few percent off either way). Only where the space has the default
    knobs with the probe's saver. Returns how many were enqueued."""
    knobs = Knobs(saver=report.plan.saver)
    if not all(v in space[k] for k, v in knobs.to_dict().items()):
        return 0
    sizes: list[int] = space["micro_batches"]
    fitting = [b for b in sizes if b <= largest] or sizes[:1]
    seeds = ((min(report.plan.micro_batch, sizes[-1]), "probe"), *((b, "fit") for b in fitting[-2:]))
    for micro, why in seeds:
        study.enqueue_trial(_trial_params(space, micro, knobs), user_attrs={"seeded": why}, skip_if_exists=True)
    return len(seeds)


def _objective(optuna: Any, study: Any, bench: Bench, space: dict[str, Any],
               options: StudyOptions) -> Callable[[Any], float]:
    """Optuna's objective: sample a configuration, measure it (or reuse an earlier trial's
    measurement of it), record it in the trial's user attributes, and return samples/s (0 when
    infeasible, with a positive ``memory`` constraint)."""
    sizes: list[int] = space["micro_batches"]
    complete = optuna.trial.TrialState.COMPLETE
    new_api = _has_set_constraint(optuna)

    def objective(trial: Any) -> float:
        index = trial.suggest_int("micro_batch_index", 0, len(sizes) - 1) if len(sizes) > 1 else 0
        knobs = _sample_knobs(trial, space)
        trial.set_user_attr("micro_batch", sizes[index])
        trial.set_user_attr("knobs", knobs.to_dict())
        plan = trial_plan(trial, options)
        trial.set_user_attr("accum_steps", plan.accum_steps)
        same = next((t for t in study.get_trials(deepcopy=False, states=(complete,))
                     if t.user_attrs.get("micro_batch") == plan.micro_batch
                     and Knobs.from_dict(t.user_attrs.get("knobs", {})) == knobs
                     and t.number != trial.number and "status" in t.user_attrs), None)
        if same is not None:  # measured already: reuse, do not spend the time again
            a = same.user_attrs
            m = Measurement(a["status"], a.get("samples_per_s"), a.get("items_per_s"), a.get("step_time_s"),
                            a.get("peak_bytes"), a.get("note", ""))
            trial.set_user_attr("duplicate_of", same.number)
        else:
            m = bench.run(plan.micro_batch, knobs)
        for attr, value in m.to_dict().items():
            trial.set_user_attr(attr, value)
        # <= 0 feasible: the peak's overshoot of the usable budget as a fraction; 1 for an OOM/failure
        if m.status in ("ok", "over_budget") and m.peak_bytes is not None:
            constraint = (m.peak_bytes - bench.usable_bytes) / bench.usable_bytes
        else:
            constraint = 0.0 if m.ok else 1.0
        trial.set_user_attr("constraint", constraint)
        if new_api:
            trial.set_constraint("memory", constraint)
        return float(m.samples_per_s or 0.0) if m.ok else 0.0

    return objective


def _patience(best: float | None, seeds: int, n_startup: int, options: StudyOptions,
              feasible: Callable[[Any], bool]) -> tuple[Callable[[Any, Any], None], list[Stopped]]:
    """A study callback that stops after ``patience`` trials in a row without a ``min_improvement``
    gain over ``best``, and the list it appends ``"patience"`` to when it does. The seeds and the
    sampler's random start explore; patience judges the trials after them."""
    stale = 0
    done = 0
    stopped: list[Stopped] = []

    def callback(study: Any, trial: Any) -> None:
        nonlocal best, stale, done
        done += 1
        value = trial.value if feasible(trial) else None
        if value is not None and (best is None or value > best * (1 + options.min_improvement)):
            stale = 0
        elif done > seeds + n_startup:
            stale += 1
        if value is not None:
            best = value if best is None else max(best, value)
        if options.patience is not None and stale >= options.patience:
            stopped.append("patience")
            study.stop()

    return callback, stopped


def _record(trial: Any, options: StudyOptions, earlier: bool) -> TrialRecord:
    a = trial.user_attrs
    return TrialRecord(
        number=trial.number, plan=trial_plan(trial, options), knobs=Knobs.from_dict(a.get("knobs", {})),
        status=a.get("status", "failed"), samples_per_s=a.get("samples_per_s"), items_per_s=a.get("items_per_s"),
        step_time_s=a.get("step_time_s"), peak_bytes=a.get("peak_bytes"), note=a.get("note", ""),
        seeded=str(a.get("seeded", "")), duplicate_of=a.get("duplicate_of"), earlier=earlier)


def run_study(optuna: Any, bench: Bench, report: ProbeReport, space: dict[str, Any], requested: SearchSpace,
              options: StudyOptions, *, largest: int, started: float) -> SearchResult:
    """Run the study on ``bench`` over the concrete ``space``, confirm the best, and return the result.

    ``requested``: the space the caller asked for (a resumed study refuses another); ``largest``:
    the largest micro-batch predicted to fit as an accumulated step (seeded); ``started``: when the
    search began (``time.perf_counter``), for its wall time.
    """
    complete = optuna.trial.TrialState.COMPLETE
    study, space, n_startup = _open_study(optuna, report, space, requested, options)
    earlier = {t.number for t in study.get_trials(deepcopy=False)}
    seeds = _enqueue_seeds(study, space, report, largest)

    def feasible(t: Any) -> bool:
        return t.state == complete and t.user_attrs.get("status") == "ok"

    best = max((t.value for t in study.get_trials(deepcopy=False) if feasible(t)), default=None)
    callback, stopped = _patience(best, seeds, n_startup, options, feasible)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
        study.optimize(_objective(optuna, study, bench, space, options), n_trials=options.n_trials,
                       timeout=options.timeout_s, callbacks=[callback])
    trials = [t for t in study.get_trials(deepcopy=False, states=(complete,)) if "status" in t.user_attrs]
    records = tuple(_record(t, options, t.number in earlier) for t in trials)
    waiting = optuna.trial.TrialState.WAITING  # seeds enqueued but never run (n_trials or the timeout came first)
    run_now = sum(1 for t in study.get_trials(deepcopy=False) if t.number not in earlier and t.state != waiting)
    if not stopped:
        stopped.append("n_trials" if run_now >= options.n_trials else "timeout")
    return _result(bench, report, records, options, study_name=study.study_name, run_now=run_now,
                   stopped=stopped[0], started=started)


def _simplicity(record: TrialRecord) -> tuple[int, int]:
    """Sort key among finalists within noise of each other: fewer knobs (a lower saver), then fewer passes."""
    return record.knobs.switched_on, record.plan.accum_steps


def _result(bench: Bench, report: ProbeReport, records: tuple[TrialRecord, ...], options: StudyOptions, *,
            study_name: str, run_now: int, stopped: Stopped, started: float) -> SearchResult:
    """The winner of the final comparison among the feasible trials, and every trial."""
    ok = [r for r in records if r.status == "ok" and r.samples_per_s is not None]
    if not ok:
        raise SearchError(f"no configuration fitted in {len(records)} trials under {format_bytes(bench.usable_bytes)} "
                          f"usable: " + "; ".join(f"micro {r.plan.micro_batch} {r.knobs.describe()}: {r.status}"
                                                  for r in records[:8]))
    seeded = next((r for r in records if r.seeded == "probe"), None)
    confirmed = _confirm(bench, ok, seeded, options.confirm_top, options.confirm_rounds)
    by_number = {r.number: r for r, _ in confirmed}
    if options.confirm_rounds > 0:
        verdict = compare_finalists({r.number: runs for r, runs in confirmed},
                                    lambda n: _simplicity(by_number[n]))
        winner, runs = by_number[verdict.winner], dict((r.number, v) for r, v in confirmed)[verdict.winner]
        comparison = tuple(FinalComparison(f.key, f.median, f.ratio, f.spread, f.noise, f.within_noise,
                                           f.key == verdict.leader) for f in verdict.finalists)
    else:  # no rounds: the best single trial stands
        winner, runs = max(confirmed, key=lambda c: statistics.median(c[1]))
        comparison = ()
    speed = statistics.median(runs)
    probe_runs = next((r for t, r in confirmed if seeded is not None and
                       (t.plan.micro_batch, t.knobs) == (seeded.plan.micro_batch, seeded.knobs)), None)
    return SearchResult(
        plan=winner.plan, knobs=winner.knobs, samples_per_s=speed,
        items_per_s=None if not winner.items_per_s else winner.items_per_s * speed / (winner.samples_per_s or speed),
        peak_bytes=winner.peak_bytes, trials=records, confirmed=tuple((t.number, tuple(r)) for t, r in confirmed),
        probe_plan=report.plan, probe_samples_per_s=None if probe_runs is None else statistics.median(probe_runs),
        budget_bytes=report.budget_bytes, usable_bytes=bench.usable_bytes, headroom=report.headroom,
        device=str(bench.device), emulated=bench.device.type != "cuda", study_name=study_name, n_trials_run=run_now,
        stopped=stopped, wall_time_s=time.perf_counter() - started, probe_wall_time_s=report.wall_time_s,
        comparison=comparison, model_fingerprint=model_fingerprint(bench.model),
        model_summary=model_summary(bench.model),
    )


def _finalists(ok: list[TrialRecord], seeded: TrialRecord | None, top: int) -> list[TrialRecord]:
    """The ``top`` fastest distinct configurations by their trial's reading, the probe's pick, and the
    simplest feasible configuration (fewest knobs, then fewest passes): the one a tie goes to must
    be measured with the others, whatever its own trial met."""
    distinct: dict[tuple[int, Knobs], TrialRecord] = {}
    for r in sorted(ok, key=lambda r: -(r.samples_per_s or 0.0)):
        distinct.setdefault((r.plan.micro_batch, r.knobs), r)
    chosen = list(distinct.values())[:top]
    simplest = min(distinct.values(), key=lambda r: (_simplicity(r), -(r.samples_per_s or 0.0)))
    for extra in (seeded, simplest):
        if extra is not None and extra.status == "ok" and \
                all((c.plan.micro_batch, c.knobs) != (extra.plan.micro_batch, extra.knobs) for c in chosen):
            chosen.append(extra)
    return chosen


#: rounds after which a finalist slower than the leader beyond the tie ceiling in every round so far
#: is measured no more (its readings stay in the comparison)
OUT_AFTER_ROUNDS = 3


def _confirm(bench: Bench, ok: list[TrialRecord], seeded: TrialRecord | None, top: int,
             rounds: int) -> list[tuple[TrialRecord, list[float]]]:
    """Measure the finalists (``_finalists``) ``rounds`` more times, interleaved (each round every
    finalist once, the order rotating); return each with its readings (index ``i``: round ``i``),
    for ``compare_finalists``. After OUT_AFTER_ROUNDS rounds a finalist slower than the leader by
    more than the tie ceiling in every round could neither lead nor tie, and is measured no more.
    Without rounds, the trial's reading stands. A configuration that no longer fits (e.g.
    fragmentation on CUDA) drops out."""
    chosen = _finalists(ok, seeded, top)
    if rounds == 0:
        return [(r, [float(r.samples_per_s or 0.0)]) for r in chosen]
    runs: dict[int, list[float]] = {r.number: [] for r in chosen}
    dropped: set[int] = set()
    out: set[int] = set()
    for i in range(rounds):
        for r in chosen[i % len(chosen):] + chosen[:i % len(chosen)]:
            if r.number in dropped or r.number in out:
                continue
            m = bench.run(r.plan.micro_batch, r.knobs)
            if m.ok and m.samples_per_s is not None:
                runs[r.number].append(m.samples_per_s)
            else:
                logger.warning("micro %d %s: %s when measured again; dropped", r.plan.micro_batch,
                               r.knobs.describe(), m.status)
                dropped.add(r.number)
        if i + 1 >= OUT_AFTER_ROUNDS:
            racing = {n: v for n, v in runs.items() if n not in dropped and v}
            if racing:
                leader = max(racing, key=lambda n: statistics.median(racing[n]))
                out |= {n for n, v in racing.items() if n != leader and n not in out and
                        all(x < 1 - DEFAULT_TIE_CEILING for x in paired_ratios(v, racing[leader]))}
    kept = [(r, runs[r.number]) for r in chosen if r.number not in dropped]
    return kept or [(chosen[0], [float(chosen[0].samples_per_s or 0.0)])]
