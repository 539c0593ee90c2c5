"""An OOM guard whose plan is measured on the first global batch it is given.

A trainer that owns the loop (Hugging Face's ``Trainer``, Lightning, an Accelerate loop) hands
over one global batch at a time and steps the optimizer itself. Its integration holds a
``LazyGuard``: the first call plans -- from a checkpoint's guard state, a plan given, or a
probe of real steps on slices of that first batch (``autoaccum.probe``, which leaves no trace) --
and builds the ``OOMGuard``; every call then runs ``OOMGuard.accumulate`` (or
``step``): the exact gradient of the global batch, with OOM replay.

Why the first batch: it is the first moment the integration holds real data of the run (shapes,
padding, dtypes) and the model, optimizer and wrappers as the framework prepared them; probing on a
batch drawn from the loader beforehand would consume the loader's random state.

``budget=`` means what it means in ``fit``: the memory the probe plans for and, on every device but
CUDA, the memory the run is held to. There each step runs on an emulated device of that size (a
``TrackedMemory`` entered around the guard's step only, as ``fit`` enters its own: weights, gradients,
optimizer state and the micro-batches the guard copies in count; the global batch the framework hands
over, made before the step, does not), whose allocation past the budget raises a real
``torch.OutOfMemoryError`` that the guard replays; the guard reads its step peaks and its growth from it.
The framework's own evaluation runs outside it. On CUDA ``budget=`` is the memory the probe plans for and
nothing more.

Without ``budget=``, under an emulated budget the caller entered (``autoaccum.emulated_budget``), the
probe plans for what that device has left besides the model and optimizer (the global batch the loader put
there counts, as it does in a CUDA probe's free memory), measuring with its own counter while the
emulated device is suspended (its snapshots of the training state stay in host memory, as on a real
device); the guard reports step peaks from the emulated device. ``budget=`` inside such a block is
refused: two budgets for one run.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from autoaccum import distributed
from autoaccum.distributed.sync import GradSync, LocalSync
from autoaccum.guard.growth import DEFAULT_GROW_AFTER, check_growth_options
from autoaccum.guard.guard import AccumulateResult, OOMGuard, StepResult
from autoaccum.log import announce
from autoaccum.memory import TrackedMemory, active_budget, emulated_device, refuse_two_budgets
from autoaccum.memory.savers import check_memory_savers
from autoaccum.plan.batch import Batch, batch_size, split_batch
from autoaccum.plan.plan import Plan
from autoaccum.plan.sources import read_plan, source_words
from autoaccum.plan.task import LossFn
from autoaccum.precision import Precision
from autoaccum.probe.report import ProbeReport, check_made_for
from autoaccum.probe.run import probe
from autoaccum.training.plans import choose_plan
from autoaccum.units import counted, format_bytes, parse_bytes
from autoaccum.validate import check_headroom, check_keywords, check_positive_int

__all__ = ["LazyGuard", "check_guard_keywords", "check_options", "sync_for"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _suspended(emulated: TrackedMemory | None) -> Iterator[None]:
    """The probe runs with an emulated device (innermost dispatch mode) suspended. It keeps snapshots
    of the training state in host memory -- off the device, on a real one; on the emulated CPU device
    they would count against the budget -- and enforces the same budget with its own counter."""
    if emulated is None or _get_current_dispatch_mode() is not emulated:
        yield
        return
    with _pop_mode_temporarily():
        yield


def _free_for_probe(emulated: TrackedMemory, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The budget the probe plans for on an emulated device: its budget less what lives on it besides the
    model and optimizer (which the probe counts itself) -- e.g. the global batch a framework's loader
    placed on the device -- as a CUDA probe sees only the memory still free."""
    own = TrackedMemory().track(model, optimizer)
    other = max(emulated.current_bytes - own.current_bytes, 0)
    own.close()
    return max(emulated.budget_bytes - other, 1)


def sync_for(model: torch.nn.Module) -> GradSync:
    """How the ranks of ``model`` agree: a ``DistributedSync`` under an
    initialised process group of more than one rank, else one process."""
    if distributed.is_distributed() and distributed.world_info().world_size > 1:
        return distributed.DistributedSync(model)
    return LocalSync()


def check_options(*, budget: Any = None, headroom: Any = 0.1, plan: Any = None, micro_batch: Any = None,
                  grow_after: Any = DEFAULT_GROW_AFTER, target_batch: Any = None, model: torch.nn.Module | None = None,
                  device: torch.device | str | None = None, memory_savers: Any = "auto") -> None:
    """An integration's options, checked where it is built (``AutoAccumTrainer(...)``, ``AutoAccum(...)``,
    ``guard_for(...)``), before any work: each value in its range, a plan that can be read and was measured
    on ``model`` (``autoaccum.probe.report.check_made_for``), and no option that would mean nothing.

    ``budget=`` is, as in ``fit``, the memory the probe plans for and, off CUDA, the emulated device the run is
    held to. On ``device`` CUDA, next to ``plan=`` or ``micro_batch=`` (which skip the probe) it would mean
    nothing: refused there (checked where the device is known). Inside an ``autoaccum.emulated_budget(...)``
    block it is refused (``refuse_two_budgets``).

    Raises:
        TypeError: ``plan=`` and ``micro_batch=`` together, ``budget=`` with either on CUDA, ``budget=`` inside
            an emulated budget, or a value of a wrong type.
        ValueError: a value out of its range, an unreadable plan, or a probe report of another model.
    """
    if plan is not None and micro_batch is not None:
        raise TypeError("give plan= or micro_batch=, not both")
    if budget is not None:
        parse_bytes(budget)
        refuse_two_budgets(budget)
        if device is not None:  # the rules of budget= on this device (the emulated device itself is made later)
            emulated_device(budget, torch.device(device), model, skips_probe=_skips_probe(plan, micro_batch))
    check_headroom(headroom)
    check_memory_savers(memory_savers)
    if micro_batch is not None:
        check_positive_int(micro_batch, "micro_batch")
    if target_batch is not None:
        check_positive_int(target_batch, "target_batch")
    check_growth_options("auto", grow_after)
    if plan is not None:
        read_plan(plan)
        if model is not None:
            check_made_for(plan, model)


def _keywords(fn: Callable[..., Any]) -> list[str]:
    """The names ``fn`` takes as keywords."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, p in inspect.signature(fn).parameters.items() if p.kind in kinds]


def check_guard_keywords(given: Mapping[str, Any], where: str, own: Iterable[str] = ()) -> None:
    """Refuse, where the guard is built, a keyword that neither ``where`` (its ``own`` names), ``LazyGuard`` nor
    ``OOMGuard`` takes -- a misspelled ``budgett=`` -- naming the closest known one (``check_keywords``).
    ``OOMGuard`` would refuse it too, but only at the first step, after the probe.

    Raises:
        TypeError: the first such keyword.
    """
    known = {*own, *_keywords(LazyGuard), *_keywords(OOMGuard)}
    check_keywords({name: value for name, value in given.items() if name not in known}, known, where)


def _skips_probe(plan: Any, micro_batch: Any) -> str | None:
    """The option given that skips the probe, as a user wrote it."""
    return "plan=" if plan is not None else "micro_batch=" if micro_batch is not None else None


class LazyGuard:
    """An ``OOMGuard`` built at the first global batch (see the module docstring).

    Args:
        model: what the guard trains (a DDP wrapper as the framework prepared it, or a module).
        optimizer: the torch optimizer (a framework's wrapper unwrapped: the guard only clears its
            gradients in ``accumulate``).
        target_batch: samples per optimizer step over all ranks; default the first batch's size
            times the world size.
        plan: a ``Plan``, probe report or plan file (kept as ``given_plan``; ``.plan`` is the plan in force);
            or ``micro_batch``; else probed.
        sync: how ranks agree (default ``sync_for(model)``).
        probe_model: the module the probe runs (default: ``model`` unwrapped from DDP: a probe runs
            no collective).
        budget: the memory the probe plans for (default: what the device has free) and, off CUDA, the emulated
            device each step runs on (see the module docstring); not inside an ``emulated_budget(...)`` block.
        headroom: the fraction of the budget the probe keeps free.
        precision: the precision the probe measures under (``fp32``, ``bf16``, ``fp16``).
        check: called before every step (e.g. a framework's accumulation setting still 1); raises to refuse it.
        **guard_options: passed to ``OOMGuard`` (``scaler``, ``autocast_dtype``,
            ``grow``, ``grow_after``, ``max_grad_norm``, ``scheduler``, ``size_fn``, ``memory_savers`` -- which
            the probe turns too --, ...; the probe's memory model and ``headroom`` reach its growth after an OOM).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, target_batch: int | None = None,
                 plan: Any = None, micro_batch: int | None = None, sync: GradSync | None = None,
                 probe_model: torch.nn.Module | None = None, budget: int | str | None = None, headroom: float = 0.1,
                 precision: Precision = "fp32", check: Callable[[], None] | None = None, **guard_options: Any) -> None:
        check_guard_keywords(guard_options, "LazyGuard")
        self.probe_model = probe_model if probe_model is not None else distributed.unwrap_model(model)
        device = next((p.device for p in self.probe_model.parameters()), None)
        check_options(budget=budget, headroom=headroom, plan=plan, micro_batch=micro_batch, target_batch=target_batch,
                      grow_after=guard_options.get("grow_after", DEFAULT_GROW_AFTER), model=self.probe_model,
                      memory_savers=guard_options.get("memory_savers", "auto"))
        #: off CUDA, ``budget=``'s emulated device: entered around each step (``_on_device``)
        self.emulated: TrackedMemory | None = None if device is None else \
            emulated_device(budget, device, model, skips_probe=_skips_probe(plan, micro_batch))
        if self.emulated is not None and guard_options.get("meter") is not None:
            raise TypeError("budget= off CUDA is the emulated device each step runs on and is read with; meter= "
                            "would be another: give one")
        self.model, self.optimizer = model, optimizer
        self.sync = sync if sync is not None else sync_for(model)
        self.target_batch, self.given_plan, self.micro_batch = target_batch, plan, micro_batch
        self.budget, self.headroom, self.precision = budget, headroom, precision
        self.guard_options = guard_options
        self.check = check
        self.guard: OOMGuard | None = None
        self.plan_source: str | None = None  # checkpoint, given or probe
        self.report: ProbeReport | None = None  # the probe's, when it probed
        self._saved: dict[str, Any] | None = None
        self._closed = False

    @property
    def plan(self) -> Plan | None:
        """The plan in force: the guard's (``OOMGuard.plan``, which follows every change after an OOM or a regrowth)
        from the first step on; None before it, when no plan is made yet (``plan=`` given is ``given_plan``, and
        the plan made from it may differ: a checkpoint's guard state takes precedence)."""
        return self.guard.plan if self.guard is not None else None

    def accumulate(self, batch: Batch, loss_fn: LossFn, *, partial: bool | None = None) -> AccumulateResult:
        """``autoaccum.guard.guard.OOMGuard.accumulate``, planning first at the first batch. ``partial``
        defaults to "the batch holds fewer samples than this rank's share" (the smaller last batch of
        an epoch, as the framework's loader yields it)."""
        if self.check is not None:
            self.check()
        guard = self.build(batch, loss_fn)
        with self._on_device():
            return guard.accumulate(batch, loss_fn, partial=self._partial(guard, batch) if partial is None else partial)

    def step(self, batch: Batch, loss_fn: LossFn, *, partial: bool | None = None) -> StepResult:
        """``autoaccum.guard.guard.OOMGuard.step``, planning first at the first batch."""
        if self.check is not None:
            self.check()
        guard = self.build(batch, loss_fn)
        with self._on_device():
            return guard.step(batch, loss_fn, partial=self._partial(guard, batch) if partial is None else partial)

    def close(self) -> None:
        """At the end of training: ``budget=``'s emulated device stops counting (the hooks it keeps on the weights
        and optimizer state are dropped; its readings stay). The guard takes no step after it."""
        if self.emulated is not None:
            self.emulated.close()
        self._closed = True

    def state_dict(self) -> dict[str, Any]:
        """The guard's state (plan and counters) for a checkpoint; empty before the first batch."""
        if self.guard is not None:
            return self.guard.state_dict()
        return dict(self._saved) if self._saved is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the plan in ``state`` is used instead of probing (an empty state changes nothing)."""
        if not state:
            return
        if self.guard is not None:
            self.guard.load_state_dict(state)
        else:
            self._saved = dict(state)

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """Where a step runs: ``budget=``'s emulated device (what lives on it at the step's start counted: the
        weights, gradients and optimizer state, which the framework's optimizer step made outside it), else as
        the caller runs it."""
        if self.emulated is None:
            return contextlib.nullcontext()
        if self._closed:  # its counts stopped: a step now would run on no device of that size
            raise RuntimeError("this guard's emulated device was closed at the end of its training; a new run builds "
                               "a new guard")
        return self.emulated.track(self.model, self.optimizer)

    # -- planning ------------------------------------------------------------------------------------
    def _size(self, batch: Batch) -> int:
        size_fn: Callable[[Batch], int] | None = self.guard_options.get("size_fn")
        return size_fn(batch) if size_fn is not None else batch_size(batch)

    def _partial(self, guard: OOMGuard, batch: Batch) -> bool:
        return self._size(batch) < guard.plan.rank_batch(self.sync.rank)

    def build(self, batch: Batch, loss_fn: LossFn) -> OOMGuard:
        """The guard, planned on ``batch`` (this rank's share of the first global batch) the first time."""
        if self.budget is not None:  # at every call, before the probe (an emulated_budget(...) may be entered later)
            refuse_two_budgets(self.budget)
        if self.guard is not None:
            return self.guard
        plan = self._first_plan(batch, loss_fn)
        options = dict(self.guard_options)
        emulated = self.emulated if self.emulated is not None else active_budget()
        if options.get("meter") is None and emulated is not None:
            options["meter"] = emulated  # an emulated device: its counter reports each step's peak
        if self.report is not None and self.report.model is not None:  # growth after an OOM reads it
            options.setdefault("memory_model", self.report.model)
        options.setdefault("headroom", self.headroom)
        self.guard = OOMGuard(self.model, self.optimizer, plan=plan, sync=self.sync, **options)
        if self._saved is not None:
            self.guard.load_state_dict(self._saved)
            self._saved = None
        announce(logger, self.describe(), self.sync.rank)  # once, on the console as fit's banner is
        return self.guard

    def describe(self) -> str:
        """The line the guard's first plan is announced with: the plan (``Plan.describe``) and where it came
        from; from a probe, what fits and what probing took."""
        if self.guard is None:
            return "no plan yet: it is made at the first global batch"
        line = f"autoaccum · {self.guard.plan.describe()}, {source_words(self.plan_source)}"
        report = self.report
        if self.plan_source == "probe" and report is not None:
            line += (f": micro-batches of up to {report.max_fitting_micro_batch} fit in "
                     f"{format_bytes(report.usable_bytes)} ({counted(report.probe_steps, 'pass', 'passes')}, "
                     f"{report.wall_time_s:.1f} s)")
        return line

    def _first_plan(self, batch: Batch, loss_fn: LossFn) -> Plan:
        size, world = self._size(batch), self.sync.world_size
        target = self.target_batch
        if target is None:  # the first batch is this rank's share of a full global batch
            target = int(self.sync.sum_items(torch.tensor(size)).item()) if world > 1 else size
        plan, self.plan_source, self.report = choose_plan(
            saved=self._saved, given=self.given_plan, micro_batch=self.micro_batch, target_batch=target, sync=self.sync,
            model=self.probe_model, precision=self.precision, probe=lambda: self._probe(batch, loss_fn, target, size))
        return plan

    def _probe(self, batch: Batch, loss_fn: LossFn, target: int, size: int) -> ProbeReport:
        """Measure real steps on slices of ``batch`` (this rank's, on its own: no collective)."""
        split_fn = self.guard_options.get("split_fn")

        def make_batch(b: int) -> Batch:
            return batch if b == size else split_batch(batch, [b, size - b], split_fn)[0]

        budget = self.budget
        emulated = active_budget()
        if budget is None and emulated is not None:
            budget = _free_for_probe(emulated, self.probe_model, self.optimizer)
        with _suspended(emulated):
            report = probe(model=self.probe_model, loss_fn=loss_fn, make_batch=make_batch, optimizer=self.optimizer,
                           target_batch=target, world_size=self.sync.world_size, budget=budget,
                           headroom=self.headroom, precision=self.precision, max_micro_batch=size,
                           memory_savers=self.guard_options.get("memory_savers", "auto"))
        return report
