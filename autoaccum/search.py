"""Throughput search: the fastest configuration that fits, measured, not just the largest batch.

The probe says which micro-batches fit; this module asks which one -- with which knobs
(activation checkpointing, autocast dtype, ``torch.compile``; see :mod:`autoaccum.knobs`) -- trains
fastest at the exact global batch. Each Optuna trial picks a micro-batch and knobs, runs real
guarded optimizer steps (:mod:`autoaccum.throughput`) and returns measured samples/s.

- **Space**: micro-batches from the probe's memory model: for every accumulation count ``k``
  the balanced size ``ceil(share / k)`` (fewest passes, lowest peak for that ``k``; 86 for a
  share of 256 in 3 passes, not only powers of two), the powers of two and the multiples of 8,
  up to the largest size predicted to fit -- and up to ``beyond_fit`` times that when a
  memory-saving knob (checkpointing, bf16/fp16) is searched, since those sizes may fit with it.
  The sizes are sampled as an ordered index (``micro_batch_index``), so TPE can learn which
  region is fast.
- **Infeasible trials**: a trial that runs out of memory, or whose guard had to shrink the plan,
  or that peaks above the usable budget, completes with value 0 and a positive ``memory``
  constraint (``Trial.set_constraint`` on Optuna >= 5, ``constraints_func`` before). TPE treats
  it as infeasible and learns from it; the study goes on.
- **Seeding and stopping**: the probe's pick is enqueued first (``enqueue_trial``), so the
  winner is at least as fast as it in the same run; then the two largest sizes predicted to fit
  as an accumulated step. A configuration already measured in the study is not run again (its result
  is reused). The search stops after ``n_trials`` trials,
  ``timeout_s`` seconds, or ``patience`` trials in a row without a ``min_improvement`` gain.
- **Confirmation**: a trial is one reading on a possibly busy machine, and the best of many
  readings flatters whoever got a quiet moment. The ``confirm_top`` fastest configurations and
  the probe's pick are measured ``confirm_rounds`` more times, in turn, and judged by the median
  of their readings there. The winner comes from this round-robin.
- **Storage**: in memory by default; any Optuna storage URL (``sqlite:///autoaccum.db`` keeps and
  resumes a study with its trials; an RDB shared by several workers, one per GPU, each calling
  :func:`search` with the same ``storage`` and ``study_name``). The study keeps its space and
  what it measures (target, world size, device, a given budget) in its user attributes: a resumed
  study samples the same space, and one made for another problem is refused.

Afterwards the model, optimizer and RNG are bit-identical to before (invariant 4).
Optuna is imported only when :func:`search` runs (the ``search`` extra).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from autoaccum import state as training_state
from autoaccum.errors import AutoAccumError
from autoaccum.jsonio import write_json_atomic
from autoaccum.knobs import Knobs, available_knobs
from autoaccum.plan import Plan
from autoaccum.probe import probe
from autoaccum.report import ProbeReport
from autoaccum.validate import check_headroom, check_positive_int
from autoaccum.task import LossFn, Task, default_optimizer, trainable_parameters
from autoaccum.throughput import Clock, Measurement, Status, make_bench
from autoaccum.units import format_bytes, parse_bytes

__all__ = ["SearchSpace", "TrialRecord", "SearchResult", "SearchError", "search", "candidate_micro_batches",
           "load_plan_file", "read_plan_file", "format_search", "require_optuna", "PLAN_FILE_KIND"]

logger = logging.getLogger(__name__)

PLAN_FILE_KIND = "autoaccum.plan"
SEARCH_KIND = "autoaccum.search"
FILE_VERSION = 1
Stopped = Literal["n_trials", "timeout", "patience"]
_KNOBS = ("checkpointing", "autocast", "compile")


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
class SearchSpace:
    """What the search may choose. ``None``: the default for the model and device.

    Attributes:
        micro_batches: sizes to try (default: from the probe's memory model, see the module doc).
        checkpointing: e.g. ``(False, True)`` (default where the model has layers to checkpoint).
        autocast: among ``fp32``, ``bf16``, ``fp16`` (default: what the device supports).
        compile: e.g. ``(False, True)`` (default: on CUDA only; compiling on CPU is slow).
        beyond_fit: with a memory-saving knob in the space, sizes up to this multiple of the
            largest that fits without knobs are tried too.
    """

    micro_batches: tuple[int, ...] | None = None
    checkpointing: tuple[bool, ...] | None = None
    autocast: tuple[str, ...] | None = None
    compile: tuple[bool, ...] | None = None
    beyond_fit: float = 4.0

    def __post_init__(self) -> None:
        if self.micro_batches is not None:
            if not self.micro_batches:
                raise ValueError("SearchSpace.micro_batches is empty; give at least one size, or None for the default")
            for b in self.micro_batches:
                check_positive_int(b, "SearchSpace.micro_batches entry")
        for name in _KNOBS:
            values = getattr(self, name)
            if values is not None:
                if not values:
                    raise ValueError(f"SearchSpace.{name} is empty; give at least one value, or None for the default")
                for v in values:
                    Knobs(**{name: v})  # validates the value
        if isinstance(self.beyond_fit, bool) or not isinstance(self.beyond_fit, (int, float)) or self.beyond_fit < 1:
            raise ValueError(f"Invalid beyond_fit: {self.beyond_fit!r}. Allowed range: >= 1")


def candidate_micro_batches(share: int, fit: int, beyond: int | None = None) -> tuple[int, ...]:
    """The sizes worth a trial, up to ``fit`` (or ``beyond``, when larger), capped at ``share``:
    the balanced size ``ceil(share / k)`` of every accumulation count ``k`` (the fewest passes
    and lowest peak for that ``k``), the powers of two, and the multiples of 8 (aligned GEMM
    shapes where the batch is a matrix dimension)."""
    top = max(1, min(share, max(fit, beyond or 0)))
    sizes = {math.ceil(share / k) for k in range(1, share + 1)} | {2**i for i in range(top.bit_length())} | \
        set(range(8, top + 1, 8))
    return tuple(sorted(s for s in sizes if s <= top))


@dataclass(frozen=True)
class TrialRecord:
    """One trial of the study (earlier sessions' included).

    Attributes:
        number: Optuna's trial number.
        plan: the plan for the whole target (micro x accum x world).
        knobs: checkpointing, autocast, compile.
        status: ``ok``, ``oom``, ``over_budget``, ``failed`` (see :class:`~autoaccum.throughput.Measurement`).
        samples_per_s, items_per_s, step_time_s, peak_bytes, note: what was measured.
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
class SearchResult:
    """The fastest configuration found, and every trial.

    Attributes:
        plan: the winner's plan for ``target_batch`` (give it to ``OOMGuard(plan=...)`` / ``fit``).
        knobs: the winner's knobs (``knobs.autocast_dtype`` for ``OOMGuard(autocast_dtype=...)``).
        samples_per_s: the winner's samples/s on one rank: the median of its readings in the
            confirmation round-robin (its trial's reading without one); items_per_s likewise.
        peak_bytes: the winner's peak memory.
        trials: every completed trial of the study, in order (samples/s as measured in the trial).
        confirmed: ``(trial number, samples/s readings)`` of the configurations measured again.
        probe_plan: what the probe picked; probe_samples_per_s: its samples/s in this search, read
            as the winner's (None if it did not fit as a guarded, accumulated step).
        budget_bytes, usable_bytes: the budget and ``budget * (1 - headroom)`` every trial had to fit.
        device: where it ran; emulated: memory counted and enforced by the tracked counter.
        study_name: the Optuna study (resume it with the same storage and name).
        n_trials_run: trials run by this call; stopped: why it stopped.
        wall_time_s: the whole search, probe included; probe_wall_time_s: the probe alone.
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
    torch_version: str = field(default_factory=lambda: torch.__version__)

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
        }

    def plan_file(self) -> dict[str, Any]:
        """The plan file's content: ``Plan.from_dict(content["plan"])`` and the knobs."""
        return {"kind": PLAN_FILE_KIND, "version": FILE_VERSION, "source": "search", "plan": self.plan.to_dict(),
                "knobs": self.knobs.to_dict(), "samples_per_s": self.samples_per_s, "items_per_s": self.items_per_s,
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes,
                "device": self.device, "study_name": self.study_name, "torch_version": self.torch_version}

    def save(self, path: str | Path) -> Path:
        """Write the plan file (JSON, atomically) to ``path``; read it back with :func:`load_plan_file`."""
        return write_json_atomic(path, self.plan_file())


def read_plan_file(path: str | Path) -> tuple[Plan, Knobs]:
    """The plan and knobs in a search plan file, a search result or a probe report (knobs: none).

    Raises:
        ValueError: the file is not JSON or not one of those.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read plan file {path}: {exc}") from None
    kinds = (PLAN_FILE_KIND, SEARCH_KIND, "autoaccum.probe")
    if not isinstance(data, dict) or data.get("kind") not in kinds or not isinstance(data.get("plan"), dict):
        raise ValueError(f"{path} is not an autoaccum plan file: expected JSON with kind one of {', '.join(kinds)} "
                         f"and a 'plan' (write one with `autoaccum search --out` or `autoaccum probe --json`)")
    try:
        return Plan.from_dict(data["plan"]), Knobs.from_dict(data.get("knobs") or {})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed plan: {exc}") from None


def load_plan_file(path: str | Path) -> Plan:
    """The :class:`Plan` in a search plan file (``autoaccum search --out``) or a probe report JSON."""
    return read_plan_file(path)[0]


# -- the search ---------------------------------------------------------------------------------

def _resolve_space(space: SearchSpace, report: ProbeReport, model: torch.nn.Module, device: torch.device,
                   share: int) -> dict[str, Any]:
    """The concrete space: the list of micro-batches and the values of each knob."""
    defaults = available_knobs(model, device)
    knobs = {name: tuple(getattr(space, name) or defaults[name]) for name in _KNOBS}
    if any(knobs["checkpointing"]) and defaults["checkpointing"] == (False,):
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers and no "
                         f"gradient_checkpointing_enable(): activation checkpointing cannot be applied. "
                         f"Leave it out of the space.")
    if space.micro_batches is not None:
        sizes = tuple(sorted({min(b, share) for b in space.micro_batches}))
    else:
        ok = report.max_fitting_micro_batch
        failed = min((c.micro_batch for c in report.candidates if c.status != "ok"), default=share + 1)
        predicted = report.model.max_batch(report.budget_bytes, report.headroom) if report.model is not None else 0
        fit = max(ok, min(predicted, failed - 1))
        saving = any(knobs["checkpointing"]) or any(a != "fp32" for a in knobs["autocast"])
        sizes = candidate_micro_batches(share, fit, int(fit * space.beyond_fit) if saving else None)
    return {"micro_batches": list(sizes), **{k: list(v) for k, v in knobs.items()}}


def _accumulated_fit(report: ProbeReport, share: int, grad_bytes: int) -> int:
    """The largest micro-batch predicted to fit as an *accumulated* step. A probe step starts with
    no gradients; an accumulated step holds the summed gradients while every later micro-batch
    runs forward and backward, so below the full share the prediction adds them."""
    model = report.model
    if model is None:
        return max(report.max_fitting_micro_batch, 1)
    if model.max_batch(report.budget_bytes, report.headroom) >= share:
        return share  # one pass: no accumulation, the probe's reading applies as it is
    if model.per_sample_bytes <= 0:
        return share
    room = report.usable_bytes - model.base_bytes - grad_bytes
    return int(min(share, max(1, room // model.per_sample_bytes)))


def _study_key(target_batch: int, world_size: int, report: ProbeReport) -> dict[str, Any]:
    """What a resumed study must share with this search (its trials are measurements of it)."""
    return {"target_batch": target_batch, "world_size": world_size, "device": report.device_name,
            "budget_bytes": report.budget_bytes if report.budget_source == "given" else None,
            "headroom": report.headroom}


def _trial_params(space: dict[str, Any], micro_batch: int, knobs: Knobs) -> dict[str, Any]:
    sizes = space["micro_batches"]
    index = min(range(len(sizes)), key=lambda i: (abs(sizes[i] - micro_batch), -sizes[i]))
    params: dict[str, Any] = {"micro_batch_index": index} if len(sizes) > 1 else {}
    params.update({k: getattr(knobs, k) for k in _KNOBS if len(space[k]) > 1})
    return params


def _record(trial: Any, target_batch: int, world_size: int, earlier: bool) -> TrialRecord:
    a = trial.user_attrs
    knobs = Knobs.from_dict(a.get("knobs", {}))
    return TrialRecord(
        number=trial.number, plan=Plan.for_target(target_batch, int(a["micro_batch"]), world_size), knobs=knobs,
        status=a.get("status", "failed"), samples_per_s=a.get("samples_per_s"), items_per_s=a.get("items_per_s"),
        step_time_s=a.get("step_time_s"), peak_bytes=a.get("peak_bytes"), note=a.get("note", ""),
        seeded=str(a.get("seeded", "")), duplicate_of=a.get("duplicate_of"), earlier=earlier)


def search(
    task: Task | None = None,
    target_batch: int = 256,
    *,
    model: torch.nn.Module | None = None,
    loss_fn: LossFn | None = None,
    make_batch: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    n_trials: int = 20,
    timeout_s: float | None = None,
    storage: Any = None,
    study_name: str | None = None,
    space: SearchSpace | None = None,
    budget: int | str | None = None,
    headroom: float = 0.1,
    world_size: int = 1,
    warmup_steps: int = 2,
    measure_steps: int = 3,
    patience: int | None = 8,
    min_improvement: float = 0.01,
    seed: int | None = 0,
    confirm_top: int = 3,
    confirm_rounds: int = 3,
    clock: Clock = "wall",
    report: ProbeReport | None = None,
) -> SearchResult:
    """Search micro-batch and knobs for the most samples/s that fit, with an Optuna study.

    Give a :class:`Task` or its parts (``model``, ``loss_fn``, ``make_batch``; ``optimizer`` an
    instance, stepped and restored, default a fresh AdamW from the task). Needs the ``search``
    extra (``pip install 'autoaccum[search]'``).

    Args:
        target_batch: samples per optimizer step over all ranks; every trial covers it exactly.
        n_trials: most trials this call runs (the probe's pick is the first).
        timeout_s: stop starting trials after this many seconds (None: no limit).
        storage: an Optuna storage or URL (None: in memory). ``sqlite:///autoaccum.db`` resumes
            the study ``study_name`` with its earlier trials.
        study_name: default ``autoaccum-<fingerprint>`` of model, device, budget and target.
        space: what to search (default: :class:`SearchSpace` defaults for the model and device).
        budget, headroom: a trial is infeasible above ``budget * (1 - headroom)`` (default budget:
            what the device has free); on every device but CUDA an emulated OOM enforces it.
        world_size: ranks sharing the target; one rank's share is measured.
        warmup_steps, measure_steps: optimizer steps per trial before timing (>= 2), and timed.
        patience: stop after this many trials in a row without a ``min_improvement`` (relative)
            gain in the best samples/s (None: never); the seeds and the sampler's random start
            trials do not count.
        seed: the sampler's seed.
        confirm_top, confirm_rounds: afterwards, measure the ``confirm_top`` fastest configurations
            and the probe's pick ``confirm_rounds`` more times each, in turn; the winner has the
            best median there (0 rounds: the best single trial wins).
        clock: ``wall`` time, or ``cpu`` time of this process for a CPU shared with busy
            processes (with one intra-op thread; see :data:`autoaccum.throughput.Clock`).
        report: a probe report to start from (default: run :func:`~autoaccum.probe`).

    Returns:
        A :class:`SearchResult`; ``result.save(path)`` writes a plan file.

    Raises:
        ImportError: Optuna is missing.
        DoesNotFitError: a micro-batch of 1 does not fit (from the probe).
        SearchError: no trial fitted.
        ValueError, TypeError: invalid arguments, or a stored study made for another target or space.
    """
    optuna = require_optuna()
    started = time.perf_counter()
    if task is None:
        if model is None or loss_fn is None or make_batch is None:
            raise TypeError("search() needs a Task or model=, loss_fn= and make_batch=")
        task = Task(model=model, loss_fn=loss_fn, make_batch=make_batch, make_optimizer=default_optimizer)
    elif any(x is not None for x in (model, loss_fn, make_batch)):
        raise TypeError("pass either a Task or model=/loss_fn=/make_batch=, not both")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
    check_positive_int(target_batch, "target_batch")
    check_positive_int(world_size, "world_size")
    check_positive_int(n_trials, "n_trials")
    check_headroom(headroom)
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or timeout_s <= 0):
        raise ValueError(f"Invalid timeout_s: {timeout_s!r}. Allowed range: > 0 seconds, or None for no limit")
    if patience is not None:
        check_positive_int(patience, "patience")
    check_positive_int(confirm_top, "confirm_top")
    if isinstance(confirm_rounds, bool) or not isinstance(confirm_rounds, int) or confirm_rounds < 0:
        raise ValueError(f"Invalid confirm_rounds: {confirm_rounds!r}. Allowed range: 0 ~ any int")
    if not isinstance(min_improvement, (int, float)) or not 0 <= min_improvement < 1:
        raise ValueError(f"Invalid min_improvement: {min_improvement!r}. Allowed range: 0 <= min_improvement < 1")
    space = SearchSpace() if space is None else space
    if not isinstance(space, SearchSpace):
        raise TypeError(f"space must be an autoaccum.search.SearchSpace, got {type(space).__name__}")

    if report is None:
        report = probe(task, optimizer=optimizer, target_batch=target_batch, world_size=world_size, budget=budget,
                       headroom=headroom)
    elif report.plan.target_batch != target_batch or report.plan.world_size != world_size:
        raise ValueError(f"the probe report is for {report.plan.describe()}; this search is for target_batch "
                         f"{target_batch} x world {world_size}. Probe again, or pass matching values.")
    elif budget is not None and parse_bytes(budget) != report.budget_bytes:
        raise ValueError(f"budget {budget!r} differs from the probe report's {format_bytes(report.budget_bytes)}; "
                         f"give one of them")
    device = trainable_parameters(task.model)[0].device
    share = report.plan.rank_batch(0)
    usable = report.usable_bytes
    concrete = _resolve_space(space, report, task.model, device, share)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable_parameters(task.model))
    largest = _accumulated_fit(report, share, grad_bytes)

    user_state = training_state.capture(task.model, optimizer)
    try:
        bench = make_bench(task, optimizer, share, usable, warmup_steps, measure_steps, clock)
        result = _optimize(optuna, bench, report, concrete, space, target_batch=target_batch, world_size=world_size,
                           n_trials=n_trials, timeout_s=timeout_s, storage=storage, study_name=study_name,
                           patience=patience, min_improvement=min_improvement, seed=seed, started=started,
                           confirm_top=confirm_top, confirm_rounds=confirm_rounds, largest=largest)
    finally:
        training_state.restore(user_state, task.model, optimizer)
    return result


def _optimize(optuna: Any, bench: Any, report: ProbeReport, space: dict[str, Any], requested: SearchSpace, *,
              target_batch: int, world_size: int, n_trials: int, timeout_s: float | None, storage: Any,
              study_name: str | None, patience: int | None, min_improvement: float, seed: int | None,
              started: float, confirm_top: int, confirm_rounds: int, largest: int) -> SearchResult:
    from optuna.trial import TrialState

    new_api = hasattr(optuna.trial.Trial, "set_constraint")  # Optuna >= 5; constraints_func before
    sampler_kwargs: dict[str, Any] = {"seed": seed, "n_startup_trials": max(3, min(10, n_trials // 3))}
    if not new_api:
        sampler_kwargs["constraints_func"] = lambda t: (float(t.user_attrs.get("constraint", 1.0)),)
    sampler = optuna.samplers.TPESampler(**sampler_kwargs)
    n_startup = sampler_kwargs["n_startup_trials"]
    name = study_name or f"autoaccum-{report.fingerprint[:16]}"
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=sampler,
                                load_if_exists=True)

    key = _study_key(target_batch, world_size, report)
    stored = study.user_attrs.get("autoaccum")
    if stored is None:
        study.set_user_attr("autoaccum", {"key": key, "space": space})
    else:
        if stored["key"] != key:
            raise ValueError(f"study {name!r} was made for {stored['key']}, not {key}; its trials measure another "
                             f"problem. Use another study name (--study-name) or storage.")
        requested_space = requested != SearchSpace()
        if requested_space and stored["space"] != space:
            raise ValueError(f"study {name!r} searches {stored['space']}, not {space}; resume it with the default "
                             f"space, or use another study name")
        space = stored["space"]  # the sizes measured before: the index means the same size again
    sizes: list[int] = space["micro_batches"]
    earlier = {t.number for t in study.get_trials(deepcopy=False)}

    # Seeds, before the sampler's trials: the probe's pick (so the search can only improve on
    # it), then the two largest sizes predicted to fit as an accumulated step (speed usually
    # grows with the micro-batch, the sampler's random start may miss the top sizes, and the
    # prediction is a few percent off either way).
    seeds = 0
    if all(v in space[k] for k, v in Knobs().to_dict().items()):
        fitting = [b for b in sizes if b <= largest] or sizes[:1]
        for micro, why in ((min(report.plan.micro_batch, sizes[-1]), "probe"), *((b, "fit") for b in fitting[-2:])):
            study.enqueue_trial(_trial_params(space, micro, Knobs()), user_attrs={"seeded": why},
                                skip_if_exists=True)
            seeds += 1

    def feasible(t: Any) -> bool:
        return t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"

    def objective(trial: Any) -> float:
        index = trial.suggest_int("micro_batch_index", 0, len(sizes) - 1) if len(sizes) > 1 else 0
        values = {k: trial.suggest_categorical(k, space[k]) if len(space[k]) > 1 else space[k][0] for k in _KNOBS}
        knobs = Knobs(**values)
        micro = sizes[index]
        trial.set_user_attr("micro_batch", micro)
        trial.set_user_attr("accum_steps", Plan.for_target(target_batch, micro, world_size).accum_steps)
        trial.set_user_attr("knobs", knobs.to_dict())
        same = next((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if t.user_attrs.get("micro_batch") == micro and t.user_attrs.get("knobs") == knobs.to_dict()
                     and t.number != trial.number and "status" in t.user_attrs), None)
        if same is not None:  # measured already: reuse, do not spend the time again
            m = Measurement(same.user_attrs["status"], same.user_attrs.get("samples_per_s"),
                            same.user_attrs.get("items_per_s"), same.user_attrs.get("step_time_s"),
                            same.user_attrs.get("peak_bytes"), same.user_attrs.get("note", ""))
            trial.set_user_attr("duplicate_of", same.number)
        else:
            m = bench.run(micro, knobs)
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

    best = max((t.value for t in study.get_trials(deepcopy=False) if feasible(t)), default=None)
    stale = 0
    done = 0
    stopped: list[Stopped] = []

    def callback(study: Any, trial: Any) -> None:
        nonlocal best, stale, done
        done += 1
        value = trial.value if feasible(trial) else None
        if value is not None and (best is None or value > best * (1 + min_improvement)):
            stale = 0
        elif done > seeds + n_startup:  # the seeds and the random start explore; patience judges the rest
            stale += 1
        if value is not None:
            best = value if best is None else max(best, value)
        if patience is not None and stale >= patience:
            stopped.append("patience")
            study.stop()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
        study.optimize(objective, n_trials=n_trials, timeout=timeout_s, callbacks=[callback])
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "status" in t.user_attrs]
    records = tuple(_record(t, target_batch, world_size, t.number in earlier) for t in trials)
    run_now = sum(1 for t in study.get_trials(deepcopy=False) if t.number not in earlier)
    ok = [r for r in records if r.status == "ok" and r.samples_per_s is not None]
    if not ok:
        raise SearchError(f"no configuration fitted in {len(records)} trials under {format_bytes(bench.usable_bytes)} "
                          f"usable: " + "; ".join(f"micro {r.plan.micro_batch} {r.knobs.describe()}: {r.status}"
                                                  for r in records[:8]))
    seeded = next((r for r in records if r.seeded == "probe"), None)
    confirmed = _confirm(bench, ok, seeded, confirm_top, confirm_rounds)
    winner, runs = max(confirmed, key=lambda c: statistics.median(c[1]))
    speed = statistics.median(runs)
    probe_runs = next((r for t, r in confirmed if seeded is not None and
                       (t.plan.micro_batch, t.knobs) == (seeded.plan.micro_batch, seeded.knobs)), None)
    if not stopped:
        stopped.append("n_trials" if run_now >= n_trials else "timeout")
    return SearchResult(
        plan=winner.plan, knobs=winner.knobs, samples_per_s=speed,
        items_per_s=None if not winner.items_per_s else winner.items_per_s * speed / (winner.samples_per_s or speed),
        peak_bytes=winner.peak_bytes, trials=records, confirmed=tuple((t.number, tuple(r)) for t, r in confirmed),
        probe_plan=report.plan, probe_samples_per_s=None if probe_runs is None else statistics.median(probe_runs),
        budget_bytes=report.budget_bytes, usable_bytes=bench.usable_bytes, headroom=report.headroom,
        device=str(bench.device), emulated=bench.emulate, study_name=name, n_trials_run=run_now,
        stopped=stopped[0], wall_time_s=time.perf_counter() - started, probe_wall_time_s=report.wall_time_s,
    )


def _confirm(bench: Any, ok: list[TrialRecord], seeded: TrialRecord | None, top: int,
             rounds: int) -> list[tuple[TrialRecord, list[float]]]:
    """Measure the ``top`` fastest configurations and the probe's pick ``rounds`` more times, in
    turn (the order rotating each round), and return each with its readings; each is then judged
    by the median of its readings here. A trial is one reading at one moment: a configuration
    that won a single trial because its rivals' trials met a busy machine loses here, where all
    of them meet the same moments. Without rounds, the trial's reading stands. A configuration
    that no longer fits (e.g. fragmentation on CUDA) drops out."""
    distinct: dict[tuple[int, Knobs], TrialRecord] = {}
    for r in sorted(ok, key=lambda r: -(r.samples_per_s or 0.0)):
        distinct.setdefault((r.plan.micro_batch, r.knobs), r)
    chosen = list(distinct.values())[:top]
    if seeded is not None and seeded.status == "ok" and \
            all((c.plan.micro_batch, c.knobs) != (seeded.plan.micro_batch, seeded.knobs) for c in chosen):
        chosen.append(seeded)
    if rounds == 0:
        return [(r, [float(r.samples_per_s or 0.0)]) for r in chosen]
    runs: dict[int, list[float]] = {r.number: [] for r in chosen}
    dropped: set[int] = set()
    for i in range(rounds):
        for r in chosen[i % len(chosen):] + chosen[:i % len(chosen)]:
            if r.number in dropped:
                continue
            m = bench.run(r.plan.micro_batch, r.knobs)
            if m.ok and m.samples_per_s is not None:
                runs[r.number].append(m.samples_per_s)
            else:
                logger.warning("micro %d %s: %s when measured again; dropped", r.plan.micro_batch,
                               r.knobs.describe(), m.status)
                dropped.add(r.number)
    kept = [(r, runs[r.number]) for r in chosen if r.number not in dropped]
    return kept or [(chosen[0], [float(chosen[0].samples_per_s or 0.0)])]


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
    if any(len(runs) > 1 for _, runs in result.confirmed):
        lines.append("measured again: " + " · ".join(
            f"#{n} median {statistics.median(runs):,.1f} of {len(runs)}" for n, runs in result.confirmed))
    speed = f"{result.samples_per_s:,.1f} samples/s" + \
        (f", {result.items_per_s:,.0f} items/s" if result.items_per_s else "")
    lines.append(f"winner: {result.plan.describe()} · {result.knobs.describe()} · {speed}"
                 + ("" if result.peak_bytes is None else f" · peak {format_bytes(result.peak_bytes)}"))
    if result.probe_samples_per_s:
        lines.append(f"probe pick: micro {result.probe_plan.micro_batch} · {result.probe_samples_per_s:,.1f} "
                     f"samples/s -> winner x{result.speedup_over_probe:.2f}")
    else:
        lines.append(f"probe pick: micro {result.probe_plan.micro_batch} did not fit as a guarded step")
    lines.append(f"{result.n_trials_run} trials this run (stopped: {result.stopped}), {result.wall_time_s:.1f} s "
                 f"(probe {result.probe_wall_time_s:.1f} s)")
    return "\n".join(lines)
