"""The OOM guard: exact accumulation (``autoaccum.step.accumulate``) with the OOM policy on top.

One attempt, on every rank: the cut's exchange (``autoaccum.step.sync.agree_cut``), the
micro-batches under ``no_sync``, the status agreed (OK < OOM < ERROR), then, after OK, the gradients
reduced once. On an OOM anywhere, every rank replays the step on the same samples with a smaller
micro-batch (invariant 3): outside the ``except`` block, with the gradients cleared, memory released
and the RNG state and the buffers a forward updates put back.

``OOMGuard.step`` adds the optimizer step; ``OOMGuard.accumulate`` stops at the gradient. How the
plan changes is ``autoaccum.step.policy``'s.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, NoReturn

import torch

from autoaccum.errors import AutoAccumError, DoesNotFitError, NonFiniteError
from autoaccum.memory import Meter, TrackedMemory, active_budget, default_meter
from autoaccum.memory.model import MemoryModel
from autoaccum.memory.savers import MemorySavers, apply_rung, suggestions
from autoaccum.memory.recovery import catch_oom, release_memory
from autoaccum.plan.batch import Batch, SplitFn
from autoaccum.plan.cut import Cutter, SampleCut
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import LossFn, explain_error
from autoaccum.validate import check_keywords
from autoaccum.state import BufferCopies, capture_rng, restore_buffers, restore_rng, state_buffers
from autoaccum.step.accumulate import Accumulated, Failed, StepTotals, accumulate, reduce_gradients
from autoaccum.step.checks import (GuardOptions, batchnorm_floor, check_step_args, checked_options, count_items,
                                   guard_ladder, guard_plan, local_size, trained_params)
from autoaccum.step.growth import GrowMode, Growth, Rise, check_growth_meter
from autoaccum.step.optim import NonFinite, step_oom_error, step_optimizer
from autoaccum.step.policy import PlanChange, PlanPolicy
from autoaccum.step.results import AccumulateResult, StepResult
from autoaccum.step.sync import ERROR, OK, Agreed, GradSync, LocalSync, agree_cut

__all__ = ["AccumulateResult", "OOMGuard", "PlanChange", "StepResult"]


@dataclass(frozen=True)
class _Step:
    """What one step's attempts left: the totals and what the step's result reports."""

    totals: StepTotals
    attempts: int
    changes: list[PlanChange]
    micro_steps: int
    thrashing: tuple[int, ...]  # the ranks whose allocator thrashed, from the last attempt's exchange


class OOMGuard:
    """Exact gradient accumulation with out-of-memory recovery, for an existing training loop.

    Example::

        guard = autoaccum.OOMGuard(model, optimizer, target_batch=256, micro_batch=64)
        for batch in loader:                      # each batch holds 256 samples
            stats = guard.step(batch, loss_fn)    # loss_fn(model, micro_batch) -> mean loss
            print(stats.loss, stats.plan.describe())

    Args:
        model: the module being trained.
        optimizer: its optimizer; stepped once per global batch.
        target_batch: samples per optimizer step (over all ranks). With ``micro_batch``, or give ``plan``.
        micro_batch: the largest micro-batch to start with.
        plan: a ``Plan``, a probe report, a search result or a plan file, instead of target/micro.
        scheduler: stepped once per optimizer step, not when the step is skipped.
        scaler: a ``torch.amp.GradScaler`` (fp16); unscaled exactly once per step, before clipping.
        max_grad_norm: clip the total gradient norm once per step, after accumulation.
        autocast_dtype: run forward and loss under ``torch.autocast`` with this dtype.
        split_fn: cut batches of types other than tensors, tuples, lists and dicts.
        size_fn: count the samples of such batches.
        cut: how a batch is cut into micro-batches (default: by samples; ``TokenCut`` by tokens).
        sync: how ranks agree (default: one process; ``autoaccum.distributed.DistributedSync``).
        grow: growing back after an OOM. ``"model"``: to the largest micro-batch predicted to fit in
            what is free now (needs a meter that knows the limit: CUDA or an emulated budget);
            ``"double"``: at most doubling, never to a size that failed; ``"off"``; ``"auto"``
            (default): ``"model"`` where the meter allows it, else ``"double"`` if ``grow_after`` is
            given, else ``"off"``.
        grow_after: calm steps (no OOM since the last plan change) before growing; default 2.
        memory_model: the probe's memory model (default: ``plan``'s, where that is a probe report).
        headroom: the fraction of the limit a size never run keeps free (default: the report's, else 0.1).
        thrash_steps: on CUDA, shrink after this many consecutive steps with rising allocator retries.
        meter: what each step reads memory with (default: the CUDA allocator on CUDA, none elsewhere).
        log_changes: log each plan change as a warning (rank 0; other ranks at debug level).
        nonfinite: inf/NaN in the gradients or loss, checked before ``optimizer.step()``: ``"stop"``
            (default) raises ``NonFiniteError`` with nothing stepped; ``"skip"`` skips the step;
            ``None`` does not check. With a GradScaler its own check applies.
        memory_savers: at an OOM at the smallest micro-batch, the next rung of the memory ladder
            (``autoaccum.memory.savers``), each exact: ``"auto"`` (default), ``"off"``, or a tuple of rungs.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, target_batch: int | None = None,
                 micro_batch: int | None = None, plan: Any = None, scheduler: Any = None,
                 scaler: torch.amp.GradScaler | None = None, max_grad_norm: float | None = None,
                 autocast_dtype: torch.dtype | None = None, split_fn: SplitFn | None = None,
                 size_fn: Callable[[Batch], int] | None = None, cut: Cutter | None = None, sync: GradSync | None = None,
                 grow: GrowMode = "auto", grow_after: int | None = None, memory_model: MemoryModel | None = None,
                 headroom: float | None = None, thrash_steps: int = 2, meter: Meter | None = None,
                 log_changes: bool = True, nonfinite: NonFinite | None = "stop",
                 memory_savers: MemorySavers = "auto", **removed: Any) -> None:
        check_keywords(removed, inspect.signature(OOMGuard).parameters, "OOMGuard")
        self.params, self._outside_optimizer = trained_params(model, optimizer)
        self.sync: GradSync = sync if sync is not None else LocalSync()
        plan_ = guard_plan(model, plan, target_batch=target_batch, micro_batch=micro_batch,
                           world_size=self.sync.world_size)
        memory_model, headroom = checked_options(
            model, optimizer, plan, max_grad_norm=max_grad_norm, grow=grow, grow_after=grow_after,
            memory_model=memory_model, headroom=headroom, thrash_steps=thrash_steps, nonfinite=nonfinite,
            split_fn=split_fn, cut=cut)
        self.model, self.optimizer = model, optimizer
        self.cut: Cutter = cut if cut is not None else SampleCut(split_fn)
        self.device = self.params[0].device
        self.meter: Meter = meter if meter is not None else default_meter(self.device)
        check_growth_meter(grow, self.meter)
        self._options = GuardOptions(scheduler, scaler, max_grad_norm, autocast_dtype, size_fn, nonfinite,
                                     log_changes, isinstance(self.meter, TrackedMemory) and self.meter.budget_bytes is not None)
        rungs = guard_ladder(model, self.device, plan_, memory_savers)
        self._policy = PlanPolicy(plan_, self.sync, Growth(grow, grow_after, memory_model, headroom), thrash_steps,
                                  log_changes=log_changes, model=model, ladder=rungs)
        self._buffer_copies = BufferCopies(state_buffers(model))
        self.steps = 0  # optimizer steps (or accumulations) completed
        self._checked_loss_fn: Any = None
        self._floor_checked = False  # the smallest micro-batch BatchNorm allows, found at the first step

    # -- settings, read-only ------------------------------------------------------------------------
    scheduler = property(lambda self: self._options.scheduler)
    scaler = property(lambda self: self._options.scaler)
    max_grad_norm = property(lambda self: self._options.max_grad_norm)
    autocast_dtype = property(lambda self: self._options.autocast_dtype)
    size_fn = property(lambda self: self._options.size_fn)
    nonfinite = property(lambda self: self._options.nonfinite)
    log_changes = property(lambda self: self._options.log_changes)
    thrash_steps = property(lambda self: self._policy.thrash.steps)
    grow = property(lambda self: self._policy.growth.grow)
    grow_after = property(lambda self: self._policy.growth.grow_after)
    memory_model = property(lambda self: self._policy.growth.memory_model)
    headroom = property(lambda self: self._policy.growth.headroom)
    # -- the plan and its record (``PlanPolicy``), read-only but for the plan itself
    initial_micro_batch = property(lambda self: self._policy.initial_micro_batch)
    ceiling = property(lambda self: self._policy.ceiling)  # the smallest micro-batch that failed
    floor = property(lambda self: self._policy.floor)  # the micro-batch of the last step that succeeded
    ooms = property(lambda self: self._policy.ooms)  # OOMs recovered
    failed_growths = property(lambda self: self._policy.failed_growths)  # growths that ran out of memory
    changes = property(lambda self: self._policy.changes)

    @property
    def plan(self) -> Plan:
        """The plan in force (after every change so far)."""
        return self._policy.plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self._policy.plan = plan

    @property
    def rises(self) -> Mapping[int, Rise]:
        """What clean full steps took, per micro-batch size (read-only; ``autoaccum.step.growth``)."""
        return MappingProxyType(self._policy.growth.rises)

    # -- public ---------------------------------------------------------------------------------
    def step(self, batch: Batch, loss_fn: LossFn, *, partial: bool = False) -> StepResult:
        """Run one optimizer step on ``batch`` (this rank's share of the global batch).

        Args:
            batch: ``plan.rank_batch(rank)`` samples; fewer only with ``partial=True`` (the last
                batch of an epoch), which is then one exact step on the samples it holds.
            loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss over the micro-batch, or
                ``(loss_sum, num_items)`` for token-level losses; its ``begin_attempt()``, where it has
                one, is called before each attempt (to put back side effects: a trainer's metrics).
            partial: the batch is the epoch's smaller last one.

        Returns:
            What the step did: its loss, plan, plan changes, attempts, gradient norm.

        Raises:
            DoesNotFitError: the smallest micro-batch the model trains at ran out of memory.
            OptimizerStepOOMError: out of memory in gradient reduction, clipping or ``optimizer.step()``.
            NonFiniteError: inf/NaN gradients or loss under ``nonfinite="stop"`` (nothing was stepped).
            ValueError: the batch holds the wrong number of samples.
        """
        started = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses (the scheduler moves it after)
        step = self._accumulate(batch, loss_fn, partial)
        options = self._options
        done = step_optimizer(self.optimizer, self.params, scaler=options.scaler, scheduler=options.scheduler,
                              max_grad_norm=options.max_grad_norm, step_number=self.steps + 1,
                              micro_batch=self.plan.micro_batch, check_finite=options.nonfinite is not None,
                              loss=step.totals.loss_total, sync=self.sync)
        if done.loss is not None:  # read with the check's flags: reading it again would wait for the optimizer
            step = replace(step, totals=replace(step.totals, loss_total=done.loss))
        self._clear_grads()
        if done.nonfinite and options.nonfinite == "stop":
            raise NonFiniteError(
                f"inf/NaN in the gradients or the loss (loss {step.totals.loss:.4g}) of optimizer step {self.steps + 1}; "
                f"stopped before optimizer.step(): the weights, optimizer state and scheduler are those after step "
                f"{self.steps}, the step's gradients are cleared. Check the data and the loss for inf/NaN, lower "
                f"the lr ({lr:.3g}) or clip gradients (max_grad_norm=1.0); nonfinite='skip' skips such steps "
                f"instead.", self.steps + 1)
        return StepResult(**self._finish(step, started), grad_norm=None if done.grad_norm is None else float(done.grad_norm),
                          skipped=done.skipped, lr=lr)

    def accumulate(self, batch: Batch, loss_fn: LossFn, *, partial: bool = False) -> AccumulateResult:
        """The exact gradient of one global batch, with OOM replay, and no optimizer step.

        For trainers that clip, step, schedule and zero gradients themselves: afterwards each
        parameter's ``.grad`` holds the gradient of the global batch (token-level losses
        normalised by the step's item count over all ranks). Gradients present before the call are
        cleared first. Arguments and errors as ``step``.
        """
        started = time.perf_counter()
        return AccumulateResult(**self._finish(self._accumulate(batch, loss_fn, partial), started))

    def wrap(self, fn: Callable[[Batch], Any]) -> Callable[..., StepResult]:
        """Turn ``fn(batch) -> loss`` (your forward and loss code) into a guarded step over global batches:
        ``train_step = guard.wrap(fn)``, then ``train_step(global_batch)`` (see ``docs/guard.md``)."""
        def train_step(batch: Batch, *, partial: bool = False) -> StepResult:
            return self.step(batch, lambda _model, micro: fn(micro), partial=partial)

        train_step.__wrapped__ = fn  # type: ignore[attr-defined]
        train_step.__doc__ = fn.__doc__
        return train_step

    def state_dict(self) -> dict[str, Any]:
        """The current plan and counters, so a resumed run does not rediscover its micro-batch."""
        return {**self._policy.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state)
        self.steps = int(state["steps"])

    # -- one global batch, replayed until it fits ------------------------------------------------------
    def _accumulate(self, batch: Batch, loss_fn: LossFn, partial: bool) -> _Step:
        """Accumulate the global batch, replaying smaller on OOM; gradients reduced and normalised."""
        if loss_fn is not self._checked_loss_fn:
            check_step_args(batch, loss_fn)
            self._checked_loss_fn = loss_fn
        if not self._floor_checked:  # with BatchNorm: the smallest micro-batch, by trying one sample
            floored = batchnorm_floor(self.model, self.plan, batch, loss_fn, self._options.size_fn, self.cut, self.device)
            self.plan, self._floor_checked = floored or self.plan, floored is not None
        n = local_size(batch, self.plan, self.sync, self._options.size_fn, partial)
        items = count_items(loss_fn, self.model, batch)
        growth = self._policy.growth
        # memory-guided growth reads the limit once per step (CUDA: two allocator queries), only where it is on
        growth.begin(self.meter, full_step=n == self.plan.rank_batch(self.sync.rank),
                     read_limit=self.plan.tokens is None and growth.guided)
        changes = self._policy.grow_to_fit(self.steps + 1) if growth.guided and growth.limit is not None else []
        rng, buffers = capture_rng(), self._buffer_copies.capture()
        self._zero_grad()  # every step, even with nothing set: wrappers of optimizer.zero_grad see it start
        attempts = 0
        begin = getattr(loss_fn, "begin_attempt", None)  # a loss with side effects puts them back (integrations)
        while True:
            attempts += 1
            if callable(begin):
                begin()
            agreed = self._agree_cut(batch, n, items)
            if agreed.error is not None:
                self._zero_grad()
                raise agreed.error
            micro_batches = self.cut(batch, n, self.plan, agreed.terms.steps)
            with apply_rung(self.model, self.plan.saver):  # the memory ladder's rung, for the attempt only
                result = accumulate(self.model, micro_batches, loss_fn, num_samples=agreed.terms.num_samples,
                                    device=self.device, sync=self.sync, scaler=self._options.scaler,
                                    autocast_dtype=self._options.autocast_dtype,
                                    num_items_in_batch=agreed.terms.num_items, copy_inputs=self._options.emulated)
            micro_batches = None  # type: ignore[assignment]
            status = self.sync.agree(_status(result))
            if status == OK:
                break
            if status == ERROR:
                _raise_error(result, self.model, batch)
            where = result.where if isinstance(result, Failed) else "another rank"
            result = None  # type: ignore[assignment]  # OOM here or elsewhere: replay smaller, from the same start
            self._policy.failed_attempt(self.meter, local=where != "another rank")
            self._zero_grad()
            # a second OOM in one step: a full collection where no meter says whether memory came back
            release_memory(self.device, self.meter, None if growth.start is None else growth.start.current_bytes,
                           thorough=attempts > 1)
            restore_rng(rng)
            restore_buffers(buffers)
            changes.append(self._policy.shrink("oom", where, self.steps + 1, self._does_not_fit,
                                               needed_bytes=self._budget_meter().last_oom_needed_bytes))
        buffers = None  # type: ignore[assignment]
        growth.passes_done(self.meter)
        if not isinstance(result, Accumulated):
            raise RuntimeError(f"internal: the ranks agreed OK on a failed attempt ({result})")
        totals, failed = catch_oom(reduce_gradients, self.params, result, num_samples=agreed.terms.num_samples,
                                   sync=self.sync, num_items_in_batch=agreed.terms.num_items)
        if failed or totals is None:
            self._zero_grad()
            release_memory(self.device)
            raise step_oom_error("gradient reduction", self.steps + 1, self.plan.micro_batch)
        return _Step(totals, attempts, changes, agreed.terms.steps, agreed.thrashing)

    def _agree_cut(self, batch: Batch, n: int, items: int | None) -> Agreed:
        """The attempt's exchange (``autoaccum.step.sync``), before any micro-batch runs."""
        return agree_cut(self.sync, num_samples=n, steps=self.cut.steps(batch, n, self.plan),
                         items=items, thrash=self._policy.thrash.pending)

    def _finish(self, step: _Step, started: float) -> dict[str, Any]:
        """After a successful step: counters, adaptation, and the fields of the result."""
        self.steps += 1
        reading = self.meter.read()
        changes = step.changes + self._policy.after_step(step.attempts, reading, step.thrashing, self.steps + 1,
                                                         self._does_not_fit)
        return {"loss": step.totals.loss, "num_samples": step.totals.num_samples, "num_items": step.totals.num_items,
                "plan": self.plan, "changes": tuple(changes), "attempts": step.attempts,
                "step_time_s": time.perf_counter() - started,
                "peak_bytes": None if reading is None else reading.peak_bytes, "micro_steps": step.micro_steps}

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # through the optimizer: hooks on zero_grad see it
        for p in self._outside_optimizer:
            p.grad = None

    def _clear_grads(self) -> None:
        """After the optimizer step: the step's gradients dropped (their memory is free between steps),
        for the optimizer's groups as they are now and the model's parameters outside it. The next step
        opens with ``optimizer.zero_grad``, which wrappers of it see once a step."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        for p in self._outside_optimizer:
            p.grad = None

    def _budget_meter(self) -> Meter:  # the meter that knows the budget: this guard's, or an emulated budget's
        return self.meter if self.meter.budget_bytes is not None else (active_budget() or self.meter)

    def _does_not_fit(self) -> DoesNotFitError:
        meter = self._budget_meter()
        return DoesNotFitError(meter.last_oom_needed_bytes, meter.budget_bytes, suggestions(self._policy.ladder),
                               at_least=True, micro_batch=self.plan.micro_batch, rungs=self._policy.rungs_tried)


def _status(result: Accumulated | Failed) -> int:
    """An attempt's status for the ranks' flag: OK, OOM, or ERROR (any other exception)."""
    return OK if isinstance(result, Accumulated) else ERROR if result.error else 1


def _raise_error(result: Accumulated | Failed, model: torch.nn.Module, batch: Batch) -> NoReturn:
    """An attempt the ranks agreed was an error: this rank's own exception (explained where a known
    mistake caused it), or, where another rank's caused it, one that says so."""
    if isinstance(result, Failed) and result.error is not None:
        explained = explain_error(result.error, model, batch)
        if explained is None:
            raise result.error  # the original exception, unchanged
        raise explained from result.error
    raise AutoAccumError("another rank failed with an error during this step; see its log")
