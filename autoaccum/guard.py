"""The OOM guard: the policy on top of exact accumulation (``autoaccum.accumulate``).

Per global batch the guard cuts this rank's share into the plan's micro-batches (with a cutter it
is given: by samples unless told otherwise), accumulates their exact gradient, and -- in
:meth:`OOMGuard.step` -- unscales, clips and steps the optimizer once. :meth:`OOMGuard.accumulate`
stops before the optimizer step, for trainers that own it.

On an out-of-memory error in a forward, a loss or a backward, on any rank, every rank replays the
step from its start on the same samples with a smaller micro-batch (invariant 3): outside the
``except`` block, the failed attempt's gradients are cleared, memory is released, the RNG state
and the buffers a forward updates (BatchNorm running statistics) are put back as they were at the
start of the step, the micro-batch is halved (accumulation steps follow; the global batch does
not change) and the ranks agree on the smallest. The replayed step equals a run that had planned
the smaller micro-batch. After a successful step the guard may shrink on allocator thrashing
(CUDA). After calm steps it grows back (``autoaccum.policy``): where its meter reads memory and
knows the limit, straight to the largest micro-batch predicted to fit in what is free now, from
the rises it measured and the probe's memory model (``autoaccum.regrow``); elsewhere, if asked,
by doubling.

Components apart: the growth record and its decisions (``autoaccum.growth``), the vote to overlap
the all-reduce (``autoaccum.overlap_vote``), a step's input checks (``autoaccum.step_input``), its
results (``autoaccum.step_result``) and the constructor's checks (``autoaccum.guard_args``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from autoaccum.accumulate import Accumulated, Failed, StepTotals, accumulate, reduce_gradients, step_values
from autoaccum.batch import Batch, SplitFn
from autoaccum.batchnorm import batchnorm_layers, warn_batchnorm
from autoaccum.cut import Cutter, SampleCut
from autoaccum.cut_agreement import Agreed, CutAgreement, agree_cut
from autoaccum.errors import AutoAccumError, DoesNotFitError, NonFiniteError
from autoaccum.growth import GrowMode, Growth, check_growth_meter
from autoaccum.guard_args import checked_options, guard_plan, trained_params
from autoaccum.log import rank_level
from autoaccum.memory import Meter, MemoryReading, TrackedMemory, active_budget, default_meter
from autoaccum.memory_model import MemoryModel
from autoaccum.optim_step import NonFinite, step_oom_error, step_optimizer
from autoaccum.overlap_vote import OverlapMode, overlap_vote
from autoaccum.plan import Plan
from autoaccum.policy import PlanChange, Reason, grown_plan, shrunk_plan
from autoaccum.recovery import catch_oom, release_memory
from autoaccum.regrow import Rise
from autoaccum.state import capture_buffers, capture_rng, restore_buffers, restore_rng, state_buffers
from autoaccum.step_input import check_step_args, count_items, local_size
from autoaccum.step_result import AccumulateResult, StepResult
from autoaccum.sync import ERROR, OK, OOM, GradSync, LocalSync, OverlapSync, StepAgreement
from autoaccum.task import LossFn, explain_error

__all__ = ["AccumulateResult", "GrowMode", "OOMGuard", "OverlapMode", "PlanChange", "StepResult", "batchnorm_layers"]

logger = logging.getLogger(__name__)


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
        plan: a :class:`Plan`, a probe report, a search result or a plan file, instead of target/micro.
        scheduler: stepped once per optimizer step, not when the scaler skips the step.
        scaler: a ``torch.amp.GradScaler`` (fp16); unscaled exactly once per step, before clipping.
        max_grad_norm: clip the total gradient norm once per step, after accumulation.
        autocast_dtype: run forward and loss under ``torch.autocast`` with this dtype.
        split_fn, size_fn: cut and count batches of types other than tensors/tuples/lists/dicts.
        cut: how a batch is cut into micro-batches (default: by samples, :class:`~autoaccum.cut.SampleCut`).
        sync: how ranks agree (default: one process). See ``autoaccum.distributed``.
        grow: how the micro-batch grows back toward the initial one after calm steps:
            ``"model"``: straight to the largest micro-batch predicted to fit in what is free now
            (``autoaccum.regrow``: the rises of the steps it ran, the probe's memory model, the
            limit its meter reads; a size whose growth failed is not retried until more is free);
            needs a meter that reads memory and knows the limit (CUDA, or an emulated budget).
            ``"double"``: blindly, at most doubling, never to a size that once failed.
            ``"off"``: never. ``"auto"`` (default): ``"model"`` where the meter allows it (and the
            plan cuts by samples), else ``"double"`` if ``grow_after`` is given, else ``"off"``.
        grow_after: calm steps (no OOM since the last plan change) before growing; default 2.
            Given without a meter that reads memory (e.g. on the CPU without a budget), it asks for
            blind doubling, as before the memory-guided growth.
        memory_model: the probe's memory model (``report.model``): its bytes per sample predict
            sizes not yet run. Default: the model of ``plan`` where that is a probe report; the
            guard learns from its own steps in any case.
        headroom: the fraction of the limit a predicted (never run) size keeps free; default the
            probe report's, else 0.1.
        thrash_steps: on CUDA, shrink after this many consecutive steps with allocator retries. Across
            ranks, a rank whose retries rose so often says so in the next step's exchange, and every
            rank shrinks together after that step (``autoaccum.cut_agreement``).
        meter: the meter whose readings each step reports and growth reads (default: the CUDA
            allocator on CUDA, none elsewhere).
        log_changes: log each plan change as a warning (the default; on rank 0, other ranks at debug level).
        nonfinite: what a step whose gradients (or loss) hold inf/NaN does, checked after the
            gradients are reduced and before ``optimizer.step()``, so that they never reach the
            weights: ``"stop"`` (the default) raises :class:`~autoaccum.errors.NonFiniteError` with
            the weights, optimizer state and scheduler as they were and the gradients cleared;
            ``"skip"`` skips the optimizer step (and the scheduler) and returns ``skipped=True``, as
            the GradScaler does; ``None`` does not check (no wait for the device before the step).
            With a GradScaler (fp16) the scaler's own check applies.
        overlap: under ``torch.distributed`` (a :class:`~autoaccum.distributed.DistributedSync` on a
            DDP or plain module), whether the gradient all-reduce runs during the last micro-batch's
            backward, bucket by bucket, as DDP's does, instead of after it. ``"auto"`` (default):
            where every rank's measured memory predicts room for the step's peak plus the
            all-reduce buffers (the gradients' bytes) within the usable limit (``headroom``), or
            where no limit can be run into (CPU without an emulated budget); not in a step's
            replay after an OOM, nor for ``grow_after`` (default 2) clean steps after an OOM struck
            an overlapped step. ``"on"``: wherever the sync can. ``"off"``: never (the all-reduce
            after every rank said OK). An OOM in an overlapped micro-batch is recovered like any
            other (see ``autoaccum.distributed.overlap``); FSDP2 never overlaps.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        target_batch: int | None = None,
        micro_batch: int | None = None,
        plan: Any = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        max_grad_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        split_fn: SplitFn | None = None,
        size_fn: Callable[[Batch], int] | None = None,
        cut: Cutter | None = None,
        sync: GradSync | None = None,
        grow: GrowMode = "auto",
        grow_after: int | None = None,
        memory_model: MemoryModel | None = None,
        headroom: float | None = None,
        thrash_steps: int = 2,
        meter: Meter | None = None,
        log_changes: bool = True,
        nonfinite: NonFinite | None = "stop",
        overlap: OverlapMode = "auto",
    ) -> None:
        self.params, self._outside_optimizer = trained_params(model, optimizer)
        self.sync: GradSync = sync if sync is not None else LocalSync()
        # asked once: an isinstance against a runtime-checkable Protocol costs tens of microseconds
        self._overlapper: OverlapSync | None = (
            cast(OverlapSync, self.sync) if self.sync.world_size > 1 and isinstance(self.sync, OverlapSync) else None)
        self.plan = guard_plan(model, plan, target_batch=target_batch, micro_batch=micro_batch,
                               world_size=self.sync.world_size)
        memory_model, headroom = checked_options(
            model, optimizer, plan, max_grad_norm=max_grad_norm, grow=grow, grow_after=grow_after,
            memory_model=memory_model, headroom=headroom, thrash_steps=thrash_steps, nonfinite=nonfinite,
            overlap=overlap, split_fn=split_fn, cut=cut)
        self.nonfinite, self.overlap = nonfinite, overlap
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.max_grad_norm, self.autocast_dtype, self.size_fn = max_grad_norm, autocast_dtype, size_fn
        self.cut: Cutter = cut if cut is not None else SampleCut(split_fn)
        self.thrash_steps, self.log_changes = thrash_steps, log_changes
        self.device = self.params[0].device
        self.meter: Meter = meter if meter is not None else default_meter(self.device)
        check_growth_meter(grow, self.meter)
        # memory-guided growth: what clean steps took per size, what failed, this step's room, calm steps
        self._growth = Growth(grow, grow_after, memory_model, headroom)
        # an emulated device (a counter with a budget): micro-batches are copied in, as a GPU's would be
        self._emulated = isinstance(self.meter, TrackedMemory) and self.meter.budget_bytes is not None
        self.initial_micro_batch = self.plan.micro_batch
        self.ceiling: int | None = None  # smallest micro-batch that failed
        self.floor: int | None = None  # micro-batch of the last step that succeeded
        self._buffer_slots = state_buffers(model)
        self.steps = 0  # optimizer steps (or accumulations) completed
        self.ooms = 0  # OOMs recovered
        self.failed_growths = 0  # growths that ran out of memory in their first step (each also counts in ooms)
        self.voided_attempts = 0  # attempts run again: a rank guessed the cut wrong or sat a chained one out
        self.changes: list[PlanChange] = []
        self._thrash_streak = 0
        self._last_retries: int | None = None
        self._warned_batchnorm = False
        # this rank's thrash streak reached thrash_steps (across ranks): said in the next attempt's row
        self._thrash_pending = False
        self._thrashing: tuple[int, ...] = ()  # the ranks whose rows said so in the step's last attempt
        self._checked_loss_fn: Any = None
        self._last_steps = 0
        self.overlapped_steps = 0  # steps whose gradient all-reduce ran during the last backward
        self.chained_steps = 0  # steps whose first attempt had no cut exchange (autoaccum.cut_agreement)
        self._step_chained = False
        self._overlap_wait = 0  # clean steps to wait before overlapping again, after an OOM struck an overlapped one
        self._overlap_decision: bool | None = None  # the last agreed decision (logged when it changes)
        self._overlapped = False  # the attempt in progress is overlapped
        self._fresh_buffers = False  # the overlap's buffers were allocated or given back in this attempt's vote
        self._last_vote, self._vote_reason = False, ""  # this rank's last overlap vote, and why
        self._arm: Callable[[], None] = lambda: None  # arms the overlapped attempt in progress
        # every rank proposed, in the last step's flag, that the next step skip the cut's exchange
        # (autoaccum.cut_agreement, "Chained steps"); this rank proposes where it guessed the step's
        # terms alone and voted to overlap it
        self._chain = False
        self._warn_batchnorm()

    # -- the growth's settings and record (autoaccum.growth), as attributes of the guard ------------------
    @property
    def grow(self) -> GrowMode:
        return self._growth.grow

    @property
    def grow_after(self) -> int | None:
        return self._growth.grow_after

    @property
    def memory_model(self) -> MemoryModel | None:
        return self._growth.memory_model

    @property
    def headroom(self) -> float:
        return self._growth.headroom

    @property
    def _rises(self) -> dict[int, Rise]:  # read by tests and benchmarks/squeeze_bench.py
        return self._growth.rises

    # -- public ---------------------------------------------------------------------------------
    def step(self, batch: Batch, loss_fn: LossFn, *, partial: bool = False) -> StepResult:
        """Run one optimizer step on ``batch`` (this rank's share of the global batch).

        Args:
            batch: ``plan.rank_batch(rank)`` samples; fewer only with ``partial=True`` (the last
                batch of an epoch), which is then one exact step on the samples it holds.
            loss_fn: ``loss_fn(model, micro_batch)`` -> mean loss over the micro-batch, or
                ``(loss_sum, num_items)`` for token-level losses.

        Raises:
            DoesNotFitError: a micro-batch of 1 ran out of memory.
            OptimizerStepOOMError: out of memory in gradient reduction, clipping or ``optimizer.step()``.
            NonFiniteError: inf/NaN gradients or loss under ``nonfinite="stop"`` (nothing was stepped).
            ValueError: the batch holds the wrong number of samples.
        """
        started = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses (the scheduler moves it after)
        totals, attempts, changes, start = self._accumulate(batch, loss_fn, partial)
        done = step_optimizer(self.optimizer, self.params, scaler=self.scaler, scheduler=self.scheduler,
                              max_grad_norm=self.max_grad_norm, step_number=self.steps + 1,
                              micro_batch=self.plan.micro_batch, check_finite=self.nonfinite is not None,
                              loss=totals.loss_total, sync=self.sync,
                              flat_grads=None if self._overlapper is None else self._overlapper.gradient_buffers())
        self._clear_grads()
        if done.nonfinite and self.nonfinite == "stop":
            raise NonFiniteError(
                f"inf/NaN in the gradients or the loss (loss {totals.loss:.4g}) of optimizer step {self.steps + 1}; "
                f"stopped before optimizer.step(): the weights, optimizer state and scheduler are those after step "
                f"{self.steps}, the step's gradients are cleared. Check the data and the loss for inf/NaN, lower "
                f"the lr ({lr:.3g}) or clip gradients (max_grad_norm=1.0); nonfinite='skip' skips such steps "
                f"instead.", self.steps + 1)
        loss = totals.loss  # after the step's launch (the inf/NaN check, when on, waited for the device before it)
        return StepResult(**self._finish(totals, loss, attempts, changes, start, started),
                          grad_norm=None if done.grad_norm is None else float(done.grad_norm),
                          skipped=done.skipped, lr=lr)

    def accumulate(self, batch: Batch, loss_fn: LossFn, *, partial: bool = False) -> AccumulateResult:
        """The exact gradient of one global batch, with OOM replay, and no optimizer step.

        For trainers that clip, step, schedule and zero gradients themselves: afterwards each
        parameter's ``.grad`` holds the gradient of the global batch (token-level losses
        normalised by the step's item count over all ranks). Gradients present before the call are
        cleared first. Arguments and errors as :meth:`step`.
        """
        started = time.perf_counter()
        totals, attempts, changes, start = self._accumulate(batch, loss_fn, partial)
        return AccumulateResult(**self._finish(totals, totals.loss, attempts, changes, start, started))

    def wrap(self, fn: Callable[[Batch], Any]) -> Callable[..., StepResult]:
        """Turn ``fn(batch) -> loss`` (your forward and loss code) into a guarded step over global batches::

            @guard.wrap
            def train_step(batch):
                x, y = batch
                return F.cross_entropy(model(x), y)

            stats = train_step(global_batch)   # exact accumulation, OOM replay, same global batch
        """
        def train_step(batch: Batch, *, partial: bool = False) -> StepResult:
            return self.step(batch, lambda _model, micro: fn(micro), partial=partial)

        train_step.__wrapped__ = fn  # type: ignore[attr-defined]
        train_step.__doc__ = fn.__doc__
        return train_step

    def state_dict(self) -> dict[str, Any]:
        """The current plan and counters, so a resumed run does not rediscover its micro-batch."""
        return {"plan": self.plan.to_dict(), "initial_micro_batch": self.initial_micro_batch,
                "ceiling": self.ceiling, "floor": self.floor, "steps": self.steps, "ooms": self.ooms,
                "failed_growths": self.failed_growths}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        plan = Plan.from_dict(state["plan"])
        if plan.target_batch != self.plan.target_batch:
            raise ValueError(f"the saved guard state is for target_batch {plan.target_batch}, this guard's is "
                             f"{self.plan.target_batch}")
        self.plan = plan.with_world_size(self.sync.world_size)
        self.initial_micro_batch = int(state["initial_micro_batch"])
        self.ceiling = None if state["ceiling"] is None else int(state["ceiling"])
        self.floor = None if state.get("floor") is None else int(state["floor"])
        self.steps, self.ooms = int(state["steps"]), int(state["ooms"])
        self.failed_growths = int(state.get("failed_growths", 0))
        self._chain = False  # a resumed step opens with the cut's exchange (every rank loads alike)
        self._thrash_pending, self._thrashing, self._thrash_streak = False, (), 0  # nor does a thrash carry over
        self._warn_batchnorm()

    # -- one global batch, replayed until it fits ------------------------------------------------------
    def _check_loss_fn(self, batch: Batch, loss_fn: LossFn) -> None:
        if loss_fn is not self._checked_loss_fn:
            check_step_args(batch, loss_fn)
            self._checked_loss_fn = loss_fn

    def _agree_cut(self, batch: Batch, n: int, attempt: int, items: int | None, may_guess: bool,
                   chained: bool) -> CutAgreement:
        """Start the attempt's exchange (``autoaccum.cut_agreement``): the step's samples over all ranks,
        the micro-steps every rank runs, the overlap votes and the items; one all-reduce, where no
        gradient collective can be in flight. This rank waits for it now unless it may guess.
        ``chained``: no exchange (every rank agreed so in the last step's flag); the attempt is
        overlapped on every rank, and this rank's row goes in its flag."""
        steps = self.cut.steps(batch, n, self.plan)
        vote = changed = False
        if self.sync.world_size > 1:
            vote, reason, changed = overlap_vote(
                self._overlapper, self.params, self.overlap, attempt, self._growth, micro_batch=self.plan.micro_batch,
                wait=self._overlap_wait, device=self.device, meter=self.meter, keep=chained)
            self._last_vote, self._vote_reason = vote, reason
        may_guess = may_guess and bool(getattr(self.sync, "quiet_window", False))
        agreement = agree_cut(self.sync, self.cut, self.plan, num_samples=n, steps=steps, vote=vote, items=items,
                              may_guess=may_guess, chained=chained, thrash=self._thrash_pending)
        if chained:
            # every rank sends this attempt's buckets, whatever it votes (a yes holds them already; a
            # no finds them held since the last step, promised to this one, unless another guard on
            # the same sync rebuilt them)
            if not vote:
                missing = self.sync.overlap_bytes(self.params) != 0  # type: ignore[attr-defined]
                if missing and not self.sync.prepare_overlap(self.params):  # type: ignore[attr-defined]
                    raise AutoAccumError("internal: a chained step's gradient buffers could not be held; the "
                                         "other ranks wait for this rank's buckets")
                changed = changed or missing
            self._arm = self.sync.overlapped(self.params)  # type: ignore[attr-defined]
            self._overlapped = True
        # the buffers were allocated or given back just now: the step's start is read again, so that
        # they count at a step's start (where they are live), never in its measured rise
        self._fresh_buffers = changed
        return agreement

    def _settle_cut(self, agreement: CutAgreement, attempt: int) -> Agreed:
        """The exchange's answer; where every rank voted to overlap, the overlapped attempt started
        (idempotent: before the last micro-step, or after the micro-batches where they stopped early)."""
        agreed = agreement.agreed()
        if agreed.overlap and not self._overlapped:
            self._arm = self.sync.overlapped(self.params)  # type: ignore[attr-defined]
            self._overlapped = True  # only once the attempt has started: the flag exchange follows it
        if attempt == 1 and not agreed.void and agreed.overlap != self._overlap_decision and self.sync.world_size > 1:
            self._overlap_decision = agreed.overlap
            why = self._vote_reason if self._last_vote or not agreed.overlap else "another rank has no room for it"
            logger.log(rank_level(logging.INFO, self.sync.rank), "gradient all-reduce %s: %s",
                       "overlapped with the last backward" if agreed.overlap else "after the backward (not overlapped)",
                       why)
        return agreed

    def _arming(self, micro_batches: Any, steps: int, agreement: CutAgreement, attempt: int) -> Any:
        """The micro-batches, the last one after :meth:`_arm_last` (they stop there where it says so)."""
        for index, micro in enumerate(micro_batches):
            if index == steps - 1 and not self._arm_last(agreement, attempt):
                return
            yield micro

    def _arm_last(self, agreement: CutAgreement, attempt: int) -> bool:
        """Before the last micro-step: the exchange's answer read, the overlapped all-reduce armed where
        every rank voted for it. False where the answer voids the attempt or is an error. A chained
        attempt is overlapped already, and its answer comes after its buckets."""
        if agreement.chained:
            self._arm()
            return True
        agreed = self._settle_cut(agreement, attempt)
        if agreed.void or agreed.error is not None:
            return False
        if self._overlapped:
            self._arm()
        return True

    def _accumulate(self, batch: Batch, loss_fn: LossFn,
                    partial: bool) -> tuple[StepTotals, int, list[PlanChange], MemoryReading | None]:
        """Accumulate the global batch, replaying smaller on OOM; gradients reduced and normalised."""
        self._check_loss_fn(batch, loss_fn)
        n = local_size(batch, self.plan, self.sync, self.size_fn, partial)
        items = count_items(loss_fn, self.model, batch)
        growth = self._growth
        # memory-guided growth and the overlap's room read the limit once per step (CUDA: two allocator
        # queries), only where one of them is on
        overlap_auto = self.overlap == "auto" and self._overlapper is not None
        start = growth.begin(self.meter, full_step=n == self.plan.rank_batch(self.sync.rank),
                             read_limit=self.plan.tokens is None and (growth.guided or overlap_auto))
        changes: list[PlanChange] = []
        chained, self._chain = self._chain and self.overlap != "off", False  # this step skips the cut's exchange
        if growth.limit is not None and start is not None and growth.guided:
            if growth.may_grow(self.plan, self.initial_micro_batch) and self._overlapper is not None:
                # growth first: the overlap's buffers are memory a larger micro-batch may take (the
                # overlap then runs only where room is left after it). Asked on every rank alike (what
                # may_grow reads is shared), so every rank drops the chain here too: the buffers are gone
                self._overlapper.release_overlap(force=True)
                start = growth.restart(self.meter)
                chained = False
            changes.extend(self._grow_to_fit())
        rng = capture_rng()
        buffers = capture_buffers(self._buffer_slots)
        attempts = 0
        may_guess = not partial
        self._zero_grad()  # every step, even with nothing set: wrappers of optimizer.zero_grad see it start
        chain_next, self._step_chained = False, chained
        while True:
            attempts += 1
            self._fresh_buffers, self._overlapped = False, False
            agreement = self._agree_cut(batch, n, attempts, items, may_guess, chained)
            chained = False  # the first attempt only: a replay or a rerun waits for the exchange
            if self._fresh_buffers and start is not None:
                start = growth.restart(self.meter)
            terms = agreement.terms  # guessed, or the answer
            self._last_steps = terms.steps
            result: Accumulated | Failed | None = None
            # a rank that waited for the answer runs nothing where it voids the attempt or is an error
            if agreement.runs:
                micro_batches = self._arming(self.cut(batch, n, self.plan, terms.steps), terms.steps, agreement,
                                             attempts)
                result = accumulate(self.model, micro_batches, loss_fn, num_samples=terms.num_samples,
                                    device=self.device, sync=self.sync, scaler=self.scaler,
                                    autocast_dtype=self.autocast_dtype, num_items_in_batch=terms.num_items,
                                    copy_inputs=self._emulated)
                micro_batches = None  # type: ignore[assignment]
            step_agreement = None
            if agreement.chained:  # its answer comes with the flag, after every bucket
                step_agreement = self._agree_step(result, attempts, agreement)
                agreement.answer_with(step_agreement.cut_rows)
                agreed_cut = agreement.agreed()
            else:
                agreed_cut = self._settle_cut(agreement, attempts)  # every rank, whatever its micro-batches did
            self._thrashing = agreed_cut.thrashing  # the same on every rank; acted on after the step (_adapt)
            if agreed_cut.error is not None:
                self._zero_grad()
                raise agreed_cut.error
            chained_failed = step_agreement is not None and step_agreement.status != OK
            if agreed_cut.void and not chained_failed:
                # a rank guessed the step's terms wrong or sat out: every rank runs it again, waiting first
                result = None  # type: ignore[assignment]
                may_guess = False
                attempts -= 1  # the same attempt, not an OOM replay: its vote, calm streak and count unchanged
                self.voided_attempts += 1
                self._zero_grad()
                restore_rng(rng)
                restore_buffers(buffers)
                continue
            if agreed_cut.void:  # and an OOM or error struck the chained attempt: handled as such, then waiting
                may_guess = False
            num_samples, num_items = terms.num_samples, terms.num_items
            assert result is not None or chained_failed  # a rank that sat out ran nothing
            summed = None
            if step_agreement is None and self._overlapped:
                step_agreement = self._agree_step(result, attempts, agreement)
            if step_agreement is not None:  # the flag carried the step's scalars (no round trip of their own)
                agreed, summed, chain_next = step_agreement.status, step_agreement.sums, step_agreement.chain
            else:
                assert result is not None
                agreed = self.sync.agree(_status(result))
            if agreed == OK:
                break
            if agreed == ERROR:
                if isinstance(result, Failed) and result.error is not None:
                    explained = explain_error(result.error, self.model, batch)
                    if explained is None:
                        raise result.error  # the original exception, unchanged
                    raise explained from result.error
                raise AutoAccumError("another rank failed with an error during this step; see its log")
            where = result.where if isinstance(result, Failed) else "another rank"
            result = None  # type: ignore[assignment]  # OOM here or elsewhere: replay smaller, from the same start
            if self._overlapped:  # the room was not there after all: today's protocol for a while
                self._overlap_wait = self._growth.calm_needed
            if growth.grown:  # the growth did not fit after all: counted, and remembered against the room it had
                self.failed_growths += 1
                growth.failed(self.meter, self.plan.micro_batch, local=where != "another rank")
            self._zero_grad()
            # a second OOM in one step: a full collection where no meter says whether memory came back
            release_memory(self.device, self.meter, None if start is None else start.current_bytes,
                           thorough=attempts > 1)
            restore_rng(rng)
            restore_buffers(buffers)
            changes.append(self._shrink("oom", where))
        buffers = None  # type: ignore[assignment]
        growth.passes_done(self.meter)
        totals, failed = catch_oom(reduce_gradients, self.params, result, num_samples=num_samples, sync=self.sync,
                                   num_items_in_batch=num_items, summed=summed)
        if failed:
            self._zero_grad()
            release_memory(self.device)
            raise step_oom_error("gradient reduction", self.steps + 1, self.plan.micro_batch)
        assert totals is not None
        self._chain = chain_next
        return totals, attempts, changes, start

    def _agree_step(self, result: Accumulated | Failed | None, attempt: int,
                    agreement: CutAgreement) -> StepAgreement:
        """An overlapped attempt's flag: this rank's status (a rank that sat out a chained attempt ran
        nothing: OK, its row voids the attempt), the step's scalars, a chained attempt's cut row,
        and this rank's proposal to chain the next step: a first attempt whose terms it guessed
        alone and voted to overlap."""
        scalars = step_values(result if isinstance(result, Accumulated) else None)
        propose = attempt == 1 and agreement.guessed and self._last_vote
        return self.sync.agree_step(OK if result is None else _status(result), scalars,  # type: ignore[attr-defined]
                                    cut_row=agreement.row if agreement.chained else None, chain_vote=propose)

    def _finish(self, totals: StepTotals, loss: float, attempts: int, changes: list[PlanChange],
                start: MemoryReading | None, started: float) -> dict[str, Any]:
        """After a successful step: counters, adaptation, and the fields of the result."""
        self.steps += 1
        self.floor = self.plan.micro_batch
        reading = self.meter.read()
        self.overlapped_steps += self._overlapped
        self.chained_steps += self._step_chained
        if attempts == 1:
            self._growth.measured(self.plan.micro_batch, reading)
            self._overlap_wait = max(0, self._overlap_wait - 1)
        changes.extend(self._adapt(attempts, reading))
        return {"loss": loss, "num_samples": totals.num_samples, "num_items": totals.num_items, "plan": self.plan,
                "changes": tuple(changes), "attempts": attempts, "step_time_s": time.perf_counter() - started,
                "peak_bytes": None if reading is None else reading.peak_bytes, "micro_steps": self._last_steps,
                "overlapped": self._overlapped, "chained": self._step_chained}

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # through the optimizer: hooks on zero_grad see it
        for p in self._outside_optimizer:
            p.grad = None

    def _clear_grads(self) -> None:
        """After the optimizer step: the step's gradients dropped (their memory is free between steps), as
        ``zero_grad(set_to_none=True)`` does (its parameters: those of the optimizer's groups now, a group
        added since the guard was built included), without the call: the next step opens with
        ``optimizer.zero_grad``, which wrappers of it see once a step, as in a hand-written loop."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        for p in self._outside_optimizer:
            p.grad = None

    # -- the policy ------------------------------------------------------------------------------------
    def _shrink(self, reason: Reason, where: str) -> PlanChange:
        old = self.plan
        self.ooms += reason == "oom"
        if not old.can_shrink:
            raise self._does_not_fit()
        self.ceiling = old.micro_batch if self.ceiling is None else min(self.ceiling, old.micro_batch)
        self.plan = self.sync.agree_plan(shrunk_plan(old, self.floor))
        self._growth.grown = False
        return self._record(reason, where, old)

    def _grow_to_fit(self) -> list[PlanChange]:
        """At a step's start, after calm steps: the plan with the fewest micro-steps predicted to fit
        in what is free now (``autoaccum.growth``); the smallest any rank proposes wins.

        Whether to ask depends only on what every rank shares (the agreed plan, the calm steps), so
        every rank joins the exchange; what each proposes depends on its own memory."""
        if not self._growth.may_grow(self.plan, self.initial_micro_batch):
            return []
        old = self.plan
        proposal = self._growth.fitting(old, self.initial_micro_batch)
        self.plan = self.sync.agree_plan(proposal if proposal is not None else old)
        if self.plan.micro_batch == old.micro_batch:
            return []  # nothing fits yet: the calm steps go on counting, and the next step asks again
        self._growth.grown = True
        return [self._record("grow", "predicted to fit in the free memory", old)]

    def _record(self, reason: Reason, where: str, old: Plan) -> PlanChange:
        change = PlanChange(self.steps + 1, reason, where, old, self.plan)
        self.changes.append(change)
        if self.log_changes:
            logger.log(rank_level(logging.WARNING, self.sync.rank), change.describe())  # agreed: rank 0 says it
        self._growth.calm = 0
        self._warn_batchnorm()
        return change

    def _adapt(self, attempts: int, reading: MemoryReading | None) -> list[PlanChange]:
        """After a successful step: shrink on allocator thrashing, or grow after a calm stretch."""
        if reading is not None and reading.alloc_retries is not None:
            retries = reading.alloc_retries
            # a step that replayed after an OOM retried by definition: that OOM was acted on already
            rising = self._last_retries is not None and retries > self._last_retries and attempts == 1
            self._last_retries = retries
            self._thrash_streak = self._thrash_streak + 1 if rising else 0
            if self._thrash_streak >= self.thrash_steps and self.plan.can_shrink:
                self._thrash_streak = 0
                if self.sync.world_size == 1:
                    self._growth.thrashed(self.plan.micro_batch)  # memory-guided growth: not back to it soon
                    return [self._shrink("thrash", "")]
                # Across ranks a shrink is agreed (agree_plan, a collective), and this streak is this
                # rank's alone: shrinking here would issue a collective the other ranks do not. It is
                # said in the next step's exchange instead, and acted on below by every rank after it.
                self._thrash_pending = True
        if self._thrashing:  # the rows of this step's last attempt: the same on every rank, so is all below
            thrashing, self._thrashing = self._thrashing, ()
            self._thrash_pending, self._thrash_streak = False, 0  # said and heard: a new streak from here
            if attempts == 1 and self.plan.can_shrink:  # a replayed step shrank for its OOM already
                self._growth.thrashed(self.plan.micro_batch)
                ranks = ", ".join(str(r) for r in thrashing)
                return [self._shrink("thrash", f"allocator retries on rank{'s' if len(thrashing) > 1 else ''} {ranks}")]
        growth = self._growth
        growth.count_calm(attempts)
        if not growth.doubles or growth.calm < growth.calm_needed:
            return []
        growth.calm = 0
        old = self.plan
        bigger = grown_plan(old, self.initial_micro_batch, self.ceiling)
        if bigger is None:
            return []
        self.plan = self.sync.agree_plan(bigger)
        return [self._record("grow", "", old)] if self.plan.micro_batch != old.micro_batch else []

    def _does_not_fit(self) -> DoesNotFitError:
        meter = self.meter if self.meter.budget_bytes is not None else (active_budget() or self.meter)
        return DoesNotFitError(meter.last_oom_needed_bytes, meter.budget_bytes, at_least=True,
                               micro_batch=self.plan.micro_batch, suggestions=(
            "enable activation checkpointing or bf16 autocast (autocast_dtype=torch.bfloat16)",
            "use shorter sequences or a smaller model",
            "shard the model and optimizer state over more devices (FSDP)",
            "free memory held by other processes, or run on a device with more memory",
        ))

    def _warn_batchnorm(self) -> None:
        if not self._warned_batchnorm:
            self._warned_batchnorm = warn_batchnorm(self.model, self.plan)


def _status(result: Accumulated | Failed) -> int:
    """An attempt's status for the ranks' flag: OK, OOM, or ERROR (any other exception)."""
    return OK if isinstance(result, Accumulated) else ERROR if result.error else OOM
