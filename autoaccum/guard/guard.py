"""The OOM guard: exact accumulation (``autoaccum.step``) with the OOM policy on top.

One attempt, on every rank: the cut's exchange (``autoaccum.distributed.sync.agree_cut``), the
micro-batches under ``no_sync``, the status agreed (OK < OOM < ERROR), then, after OK, the gradients
reduced once. On an OOM anywhere, every rank replays the step on the same samples with a smaller
micro-batch (invariant 3): outside the ``except`` block, with the gradients cleared, memory released
and the RNG state and the buffers a forward updates put back. How the plan changes is
``autoaccum.guard.policy``'s.

``OOMGuard.step`` adds the optimizer step; ``OOMGuard.accumulate`` stops at the gradient; ``OOMGuard.evaluate``
is the loss of a batch without gradients (``autoaccum.guard.evaluate``). With ``budget=`` (off CUDA) each of them
runs on an emulated device of that size (``autoaccum.guard.options``).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from autoaccum.distributed.sync import ERROR, OK, Agreed, CutTerms, GradSync, LocalSync, agree_cut
from autoaccum.errors import DoesNotFitError, NonFiniteError
from autoaccum.guard.evaluate import evaluate_batch
from autoaccum.guard.growth import DEFAULT_GROW_AFTER, GrowMode, StepStart, check_growth_meter
from autoaccum.guard.options import check_options, emulated_for_guard
from autoaccum.guard.policy import PlanChange, PlanPolicy
from autoaccum.guard.results import AccumulateResult, StepResult
from autoaccum.memory import MemoryReading, Meter, TrackedMemory, active_budget, default_meter, refuse_two_budgets
from autoaccum.memory.model import MemoryModel
from autoaccum.memory.recovery import catch_oom, release_memory
from autoaccum.memory.savers import MemorySavers, allowed_savers, apply_saver, suggestions
from autoaccum.modules import unwrap
from autoaccum.plan.batch import Batch, SplitFn, batch_size
from autoaccum.plan.batchnorm import batchnorm_floor
from autoaccum.plan.cut import Cutter, SampleCut
from autoaccum.plan.plan import Plan
from autoaccum.plan.sources import resolve_plan
from autoaccum.plan.task import ItemWatch, LossFn, check_step_args, trained_params
from autoaccum.probe.report import check_made_for
from autoaccum.state import BufferCopies, capture_rng, restore_buffers, restore_rng, state_buffers
from autoaccum.step.accumulate import Accumulated, Failed, StepTotals, accumulate, raise_failure, reduce_gradients
from autoaccum.step.optim import NonFinite, step_oom_error, step_optimizer
from autoaccum.validate import check_keywords

__all__ = ["AccumulateResult", "OOMGuard", "PlanChange", "StepResult"]


@dataclass(frozen=True)
class _Attempts:
    """What a step's attempts left for its end: their count, the plan changes, the micro-steps of the one
    that succeeded, the meter at the start and after the passes, the ranks whose allocator thrashed."""

    attempts: int
    changes: list[PlanChange]
    micro_steps: int
    start: StepStart
    fwd_bwd: MemoryReading | None
    thrashing: tuple[int, ...]


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
        scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` (or an object with ``step()``), stepped once per
            optimizer step, not when the step is skipped.
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
            (default): ``"model"`` where the meter knows its limit, else ``"off"``.
        grow_after: calm steps (no OOM since the last plan change) before growing back.
        memory_model: the probe's memory model (default: ``plan``'s, where that is a probe report).
        headroom: the fraction of the limit a size never run keeps free (default: the report's, else 0.1).
        thrash_steps: on CUDA, shrink after this many consecutive steps with rising allocator retries.
        meter: what each step reads memory with (default: the CUDA allocator on CUDA, none elsewhere).
        log_changes: log each plan change as a warning (rank 0; other ranks at debug level).
        nonfinite: inf/NaN in the gradients or loss, checked before ``optimizer.step()``: ``"stop"``
            (default) raises ``NonFiniteError`` with nothing stepped; ``"skip"`` skips the step;
            ``None`` does not check. With a GradScaler its own check applies.
        memory_savers: at an OOM at the smallest micro-batch, the next memory saver
            (``autoaccum.memory.savers``), each exact: ``"auto"`` (default), ``"off"``, or a tuple of them.
        budget: off CUDA, an emulated device of this size (``"64MiB"``) that ``step``, ``accumulate`` and
            ``evaluate`` run on and read memory from: the weights, gradients, optimizer state and the micro-batches
            copied in count, and the allocation past it raises a real ``torch.OutOfMemoryError``. Refused on CUDA
            (only a probe plans for a budget there) and with ``meter=``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, target_batch: int | None = None,
                 micro_batch: int | None = None, plan: Any = None, scheduler: Any = None,
                 scaler: torch.amp.GradScaler | None = None, max_grad_norm: float | None = None,
                 autocast_dtype: torch.dtype | None = None, split_fn: SplitFn | None = None,
                 size_fn: Callable[[Batch], int] | None = None, cut: Cutter | None = None, sync: GradSync | None = None,
                 grow: GrowMode = "auto", grow_after: int = DEFAULT_GROW_AFTER, memory_model: MemoryModel | None = None,
                 headroom: float | None = None, thrash_steps: int = 2, meter: Meter | None = None,
                 log_changes: bool = True, nonfinite: NonFinite | None = "stop", memory_savers: MemorySavers = "auto",
                 budget: int | str | None = None, **unknown: Any) -> None:
        check_keywords(unknown, inspect.signature(OOMGuard).parameters, "OOMGuard")
        self.params = trained_params(model, optimizer)
        self.sync: GradSync = sync if sync is not None else LocalSync()
        if plan is not None:
            check_made_for(plan, model)
        start = resolve_plan(plan, target_batch=target_batch, micro_batch=micro_batch, world_size=self.sync.world_size)
        memory_model, headroom = check_options(plan, scheduler, max_grad_norm, grow, grow_after, memory_model,
                                               headroom, thrash_steps, nonfinite, split_fn, cut)
        #: off CUDA, ``budget=``'s emulated device: entered around each call (``_on_device``)
        self.budget, self.emulated = budget, emulated_for_guard(budget, self.device, model, meter, plan)
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler, self.max_grad_norm, self.nonfinite = scheduler, scaler, max_grad_norm, nonfinite
        self.autocast_dtype, self.size_fn = autocast_dtype, size_fn
        self.cut: Cutter = cut if cut is not None else SampleCut(split_fn)
        self.meter: Meter = meter if meter is not None else self.emulated or default_meter(self.device)
        check_growth_meter(grow, self.meter)
        # an emulated device (a counter with a budget): micro-batches are copied in, as to a GPU
        self._copy_inputs = isinstance(self.meter, TrackedMemory) and self.meter.budget_bytes is not None
        savers = allowed_savers(model, self.device, memory_savers)
        if start.saver not in savers:
            raise ValueError(f"the plan runs with memory saver {start.saver!r}, which this guard may not take: "
                             f"{savers} (memory_savers={memory_savers!r}, device {self.device.type}); allow it, or "
                             f"plan again here")
        self.policy = PlanPolicy(start, self.sync, model=model, savers=savers, grow=grow, grow_after=grow_after,
                                 memory_model=memory_model, headroom=headroom, thrash_steps=thrash_steps,
                                 log_changes=log_changes)
        self._buffer_copies = BufferCopies(state_buffers(model))
        self._floor_checked = False  # BatchNorm's smallest micro-batch, found at the first non-empty step
        self._items = ItemWatch(size_fn)  # (loss_sum, num_items) counts that are likely not counts
        self._eval_micro: int | None = None  # the evaluation micro-batch after an OOM in evaluate
        self.steps = 0  # optimizer steps (or accumulations) completed

    # -- what the run is at (the policy's record) --------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan in force (after every change so far)."""
        return self.policy.plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self.policy.plan = plan

    device = property(lambda self: self.params[0].device, doc="Where the trained parameters live.")
    changes = property(lambda self: self.policy.changes, doc="Every plan change so far (``PlanChange``).")
    ooms = property(lambda self: self.policy.ooms, doc="OOMs recovered.")
    failed_growths = property(lambda self: self.policy.failed_growths,
                              doc="Memory-guided growths that ran out of memory (each also in ``ooms``).")

    # -- public ---------------------------------------------------------------------------------
    def step(self, batch: Batch, loss_fn: LossFn, *, partial: bool = False) -> StepResult:
        """Run one optimizer step on ``batch`` (this rank's share of the global batch).

        Args:
            batch: ``plan.rank_batch(rank)`` samples; fewer only with ``partial=True`` (the last
                batch of an epoch), which is then one exact step on the samples it holds.
            loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss over the micro-batch, or
                ``(loss_sum, num_items)`` for token-level losses (the loss summed over the micro-batch's items
                and their count: see ``wrap``); its ``begin_attempt()``, where it has one, is called before
                each attempt (to put back side effects: a trainer's metrics).
            partial: the batch is the epoch's smaller last one.

        Returns:
            What the step did: its loss, plan, plan changes, attempts, gradient norm.

        Raises:
            DoesNotFitError: the smallest micro-batch the model trains at ran out of memory.
            OptimizerStepOOMError: out of memory in gradient reduction, clipping or ``optimizer.step()``.
            NonFiniteError: inf/NaN gradients or loss under ``nonfinite="stop"`` (nothing was stepped).
            ValueError: the batch holds the wrong number of samples.
            TaskError: the step's ``num_items`` add up to a fraction or below 0 (they are not counts).
        """
        with self._on_device():
            return self._step(batch, loss_fn, partial)

    def _step(self, batch: Batch, loss_fn: LossFn, partial: bool) -> StepResult:
        started = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses (the scheduler moves it after)
        totals, fields = self._accumulate(batch, loss_fn, partial)
        done = step_optimizer(self.optimizer, self.params, scaler=self.scaler, scheduler=self.scheduler,
                              max_grad_norm=self.max_grad_norm, step_number=self.steps + 1,
                              micro_batch=self.plan.micro_batch, check_finite=self.nonfinite is not None,
                              loss=totals.loss_total, sync=self.sync)
        if done.loss is not None:  # read with the check's flags: reading it again would wait for the optimizer
            totals = replace(totals, loss_total=done.loss)
        self._clear_grads()
        if done.nonfinite and self.nonfinite == "stop":
            raise NonFiniteError(
                f"inf/NaN in the gradients or the loss (loss {totals.loss:.4g}) of optimizer step {self.steps + 1}; "
                f"stopped before optimizer.step(): the weights, optimizer state and scheduler are those after step "
                f"{self.steps}, the step's gradients are cleared. Check the data and the loss for inf/NaN, lower "
                f"the lr ({lr:.3g}) or clip gradients (max_grad_norm=1.0); nonfinite='skip' skips such steps "
                f"instead.", self.steps + 1)
        return StepResult(**self._finish(totals, fields, started), lr=lr, skipped=done.skipped,
                          grad_norm=None if done.grad_norm is None else float(done.grad_norm))

    def accumulate(self, batch: Batch, loss_fn: LossFn, *, partial: bool = False) -> AccumulateResult:
        """The exact gradient of one global batch, with OOM replay, and no optimizer step.

        For trainers that clip, step, schedule and zero gradients themselves: afterwards each
        parameter's ``.grad`` holds the gradient of the global batch (token-level losses
        normalised by the step's item count over all ranks). Gradients present before the call are
        cleared first. Arguments and errors as ``step``.
        """
        started = time.perf_counter()
        with self._on_device():
            return AccumulateResult(**self._finish(*self._accumulate(batch, loss_fn, partial), started))

    def evaluate(self, batch: Batch, loss_fn: LossFn) -> float:
        """The loss of ``batch`` without gradients, in eval mode (the model's mode is put back), with OOM recovery.

        In micro-batches of the plan's at most; an OOM halves the evaluation micro-batch (kept for the next call;
        the training plan is unchanged) and evaluates the batch again. The loss is a full-batch evaluation's:
        weighted by samples (or items), over every rank (each calls it and gets the same value).

        Args:
            batch: this rank's samples, any number of them.
            loss_fn: as ``step``'s: ``loss_fn(model, micro_batch)`` -> mean loss, or ``(loss_sum, num_items)``.

        Raises:
            DoesNotFitError: a micro-batch of 1 ran out of memory.
        """
        micro = self.plan.micro_batch if self._eval_micro is None else min(self._eval_micro, self.plan.micro_batch)
        with self._on_device():
            done = evaluate_batch(self.model, batch, loss_fn, micro, sync=self.sync, device=self.device, cut=self.cut,
                                  size_fn=self.size_fn, autocast_dtype=self.autocast_dtype,
                                  copy_inputs=self._copy_inputs, meter=self._budget_meter(),
                                  log_changes=self.policy.log_changes)
        if done.ooms:
            self._eval_micro = done.micro_batch
        return done.loss

    def wrap(self, fn: Callable[[Batch], Any]) -> Callable[..., StepResult]:
        """Turn ``fn(batch) -> loss`` (your forward and loss code) into a guarded step over global batches:
        ``train_step = guard.wrap(fn)``, then ``train_step(global_batch)`` (see ``docs/guard.md``).

        ``fn`` returns the mean loss of its micro-batch, or ``(loss_sum, num_items)``: the loss summed over the
        micro-batch's items (e.g. tokens) and their count, the step dividing once by the counts' total. A pair
        is always read so: ``(loss, 5)`` divides by 5 per micro-batch. Counts that add up to a fraction or
        below 0 raise ``TaskError`` before the optimizer step; a Python ``int`` that stays the same while the
        micro-batch changes (likely not a count) is warned about once.
        """
        def train_step(batch: Batch, *, partial: bool = False) -> StepResult:
            return self.step(batch, lambda _model, micro: fn(micro), partial=partial)

        train_step.__wrapped__ = fn  # type: ignore[attr-defined]
        train_step.__doc__ = fn.__doc__
        return train_step

    def state_dict(self) -> dict[str, Any]:
        """The current plan and counters, so a resumed run does not rediscover its micro-batch."""
        return {**self.policy.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)
        self.steps = int(state["steps"])

    # -- one global batch, replayed until it fits ------------------------------------------------------
    def _accumulate(self, batch: Batch, loss_fn: LossFn, partial: bool) -> tuple[StepTotals, _Attempts]:
        """Accumulate the global batch, replaying smaller on OOM; gradients reduced and normalised."""
        n = self._begin(batch, loss_fn, partial)
        policy, count = self.policy, getattr(loss_fn, "count_items", None)  # a loss that counts items up front
        items = count(self.model, batch) if callable(count) else None
        start, changes = policy.begin(self.meter, full_step=n == self.plan.rank_batch(self.sync.rank),
                                      step=self.steps + 1)
        rng, buffers = capture_rng(), self._buffer_copies.capture()
        self._zero_grad()  # every step, even with nothing set: wrappers of optimizer.zero_grad see it start
        attempts, begin = 0, getattr(loss_fn, "begin_attempt", None)  # side effects put back (integrations)
        while True:
            attempts += 1
            if callable(begin):
                begin()
            agreed, result, status = self._attempt(batch, n, items, loss_fn)
            if status == OK:
                break
            if status == ERROR:
                raise_failure(result, self.model, batch)
            where = result.where if isinstance(result, Failed) else "another rank"
            result = None  # type: ignore[assignment]  # OOM here or elsewhere: replay smaller, from the same start
            policy.failed_attempt(self.meter, start, local=where != "another rank")
            self._zero_grad()
            # a second OOM in one step: a full collection where no meter says whether memory came back
            release_memory(self.device, self.meter, None if start.reading is None else start.reading.current_bytes,
                           thorough=attempts > 1)
            restore_rng(rng)
            restore_buffers(buffers)
            changes.append(policy.shrink("oom", where, self.steps + 1, self._does_not_fit,
                                         needed_bytes=self._budget_meter().last_oom_needed_bytes))
        fwd_bwd = start.after_passes(self.meter)
        totals = self._reduce(result, agreed.terms)
        return totals, _Attempts(attempts, changes, agreed.terms.steps, start, fwd_bwd, agreed.thrashing)

    def _attempt(self, batch: Batch, n: int, items: Any, loss_fn: LossFn) -> tuple[Agreed, Accumulated | Failed, int]:
        """One attempt at the plan in force, on every rank: the cut agreed, the micro-batches accumulated
        with the plan's memory saver, the outcome agreed (OK < OOM < ERROR)."""
        agreed = agree_cut(self.sync, num_samples=n, steps=self.cut.steps(batch, n, self.plan),
                           items=None if items is None else int(items), thrash=self.policy.thrash_pending)
        if agreed.error is not None:
            self._zero_grad()
            raise agreed.error
        with apply_saver(self.model, self.plan.saver):  # the memory saver, for the attempt only
            micro_batches = self.cut(batch, n, self.plan, agreed.terms.steps)
            result = accumulate(self.model, micro_batches, self._items.watch(loss_fn),
                                num_samples=agreed.terms.num_samples, device=self.device, sync=self.sync,
                                scaler=self.scaler, autocast_dtype=self.autocast_dtype,
                                num_items_in_batch=agreed.terms.num_items, copy_inputs=self._copy_inputs)
        status = self.sync.agree(OK if isinstance(result, Accumulated) else ERROR if result.error else 1)
        if status == OK and not isinstance(result, Accumulated):
            raise RuntimeError(f"internal: the ranks agreed OK on a failed attempt ({result})")
        return agreed, result, status

    def _reduce(self, result: Accumulated | Failed, terms: CutTerms) -> StepTotals:
        """The gradients summed over ranks once and normalised; an OOM there is not replayed (``step.optim``)."""
        assert isinstance(result, Accumulated)
        totals, failed = catch_oom(reduce_gradients, self.params, result, num_samples=terms.num_samples,
                                   sync=self.sync, num_items_in_batch=terms.num_items)
        if failed or totals is None:
            self._zero_grad()
            release_memory(self.device)
            raise step_oom_error("gradient reduction", self.steps + 1, self.plan.micro_batch)
        return totals

    def _begin(self, batch: Batch, loss_fn: LossFn, partial: bool) -> int:
        """Before any work on a step: the arguments checked; at the first step of a model with BatchNorm,
        the smallest micro-batch it trains at (one sample tried). Returns this rank's samples of the step."""
        check_step_args(batch, loss_fn)
        n = self.size_fn(batch) if self.size_fn is not None else batch_size(batch)
        if not self._floor_checked:
            floored = batchnorm_floor(unwrap(self.model), self.plan, batch, n, loss_fn,
                                      getattr(self.cut, "split_fn", None), self.device)
            self.plan, self._floor_checked = floored or self.plan, floored is not None
        self.plan.check_rank_batch(n, self.sync.rank, partial=partial)
        return n

    def _finish(self, totals: StepTotals, done: _Attempts, started: float) -> dict[str, Any]:
        """After a successful step: counters, the policy's changes, and the fields of the result."""
        self.steps += 1
        end = self.meter.read()
        changes = done.changes + self.policy.after_step(done.attempts, done.start, done.fwd_bwd, end, done.thrashing,
                                                        self.steps + 1, self._does_not_fit)
        return {"loss": totals.loss, "num_samples": totals.num_samples, "num_items": totals.num_items,
                "plan": self.plan, "changes": tuple(changes), "attempts": done.attempts,
                "step_time_s": time.perf_counter() - started, "peak_bytes": None if end is None else end.peak_bytes,
                "micro_steps": done.micro_steps}

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # through the optimizer: hooks on zero_grad see it
        for p in self.params:  # and the model's parameters outside it
            p.grad = None

    def _clear_grads(self) -> None:
        """After the optimizer step: the step's gradients dropped (their memory is free between steps),
        for the optimizer's groups as they are now and the model's parameters outside it. The next step
        opens with ``optimizer.zero_grad``, which wrappers of it see once a step."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        for p in self.params:
            p.grad = None

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """Where a call runs: ``budget=``'s emulated device (the weights, gradients and optimizer state on it
        counted), else as the caller runs it."""
        if self.emulated is None:
            return contextlib.nullcontext()
        refuse_two_budgets(self.budget)  # an emulated_budget(...) entered around the call: two budgets
        return self.emulated.track(self.model, self.optimizer)

    def _budget_meter(self) -> Meter:  # the meter that knows the budget: this guard's, or an emulated budget's
        return self.meter if self.meter.budget_bytes is not None else (active_budget() or self.meter)

    def _does_not_fit(self) -> DoesNotFitError:
        meter = self._budget_meter()
        return DoesNotFitError(meter.last_oom_needed_bytes, meter.budget_bytes, suggestions(self.policy.savers),
                               at_least=True, micro_batch=self.plan.micro_batch, savers=self.policy.savers_tried)

