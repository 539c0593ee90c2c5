"""The OOM guard: one exact accumulated optimizer step per global batch, replayed on OOM.

Per global batch: cut it into the plan's micro-batches, run forward and backward of each with
its loss weighted by its share of the samples (or summed, for token-level losses, and divided
once by the item count of the whole step), then reduce, unscale, clip and step once.

On an out-of-memory error in a forward, a loss or a backward, the guard leaves the ``except``
block, drops every reference to the failed attempt, clears the partial gradients, resets the
scaler's per-step state, releases cached memory, restores the RNG state captured at the start of
the step, halves the micro-batch (accumulation steps follow, the global batch does not change)
and replays the same step on the same samples. The replayed step equals a run that had planned
the smaller micro-batch (invariant 3). Buffers a forward updates (BatchNorm running statistics)
are put back to their values at the start of the step before the replay.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from autoaccum.batch import Batch, SplitFn, batch_size, micro_sizes, move_to, split_batch
from autoaccum.errors import AutoAccumError, DoesNotFitError, OptimizerStepOOMError, TaskError
from autoaccum.memory import TrackedMemory
from autoaccum.oom import is_oom
from autoaccum.plan import Plan, check_positive_int, read_plan
from autoaccum.state import capture_rng, restore_rng
from autoaccum.sync import ERROR, OK, OOM, GradSync, LocalSync
from autoaccum.task import LossFn, check_loss, trainable_parameters

__all__ = ["OOMGuard", "PlanChange", "StepResult", "batchnorm_layers"]

logger = logging.getLogger(__name__)

Reason = Literal["oom", "thrash", "grow"]


@dataclass(frozen=True)
class PlanChange:
    """One change of plan: why, at which optimizer step, and where the OOM struck."""

    step: int
    reason: Reason
    where: str
    old: Plan
    new: Plan

    def describe(self) -> str:
        what = {"oom": f"OOM in {self.where} at", "thrash": "allocator thrashing at", "grow": "no OOM for a while:"}
        return (f"{what[self.reason]} micro {self.old.micro_batch} -> {self.new.micro_batch}, accum "
                f"{self.old.accum_steps} -> {self.new.accum_steps}, global batch {self.new.target_batch} unchanged")


@dataclass(frozen=True)
class StepResult:
    """What one ``OOMGuard.step`` did.

    Attributes:
        loss: the step's loss, weighted by samples (or items) exactly as a full-batch step's.
        num_samples: samples in the step over all ranks.
        num_items: items (e.g. tokens) over all ranks for token-level losses, else None.
        grad_norm: total gradient norm before clipping (when clipping), else None.
        skipped: the GradScaler found inf/NaN gradients and skipped the optimizer step.
        plan: the plan in force after the step.
        changes: plan changes during the step (OOM replays, thrash, growth).
        attempts: forward/backward passes over the batch (1 + OOM replays).
        step_time_s: wall time of the whole step, replays included.
        peak_bytes: peak memory of the step (CUDA allocator or the given meter), else None.
        lr: learning rate of the first parameter group used by the step.
    """

    loss: float
    num_samples: int
    num_items: int | None
    grad_norm: float | None
    skipped: bool
    plan: Plan
    changes: tuple[PlanChange, ...]
    attempts: int
    step_time_s: float
    peak_bytes: int | None
    lr: float


def batchnorm_layers(model: torch.nn.Module) -> list[str]:
    """Names of the BatchNorm layers of ``model`` (their statistics depend on the micro-batch)."""
    return [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _state_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of every persistent buffer: the buffers that are training state."""
    return [(module, name) for module in model.modules() for name in module._buffers
            if name not in module._non_persistent_buffers_set]


def _reset_scaler_step(scaler: Any) -> None:
    """Forget a GradScaler's per-step record (unscaled or not, inf found or not) of a failed attempt."""
    if scaler is None:
        return
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    # Private, but the only way: without it a replayed step's unscale_() raises "already called".
    scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


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
        plan: a :class:`Plan` (e.g. ``ProbeReport.plan``) instead of target/micro.
        scheduler: stepped once per optimizer step, not when the scaler skips the step.
        scaler: a ``torch.amp.GradScaler`` (fp16); unscaled exactly once per step, before clipping.
        max_grad_norm: clip the total gradient norm once per step, after accumulation.
        autocast_dtype: run forward and loss under ``torch.autocast`` with this dtype.
        split_fn, size_fn: cut and count batches of types other than tensors/tuples/lists/dicts.
        sync: how ranks agree (default: one process). See ``autoaccum.distributed``.
        grow_after: after this many steps without OOM, grow the micro-batch back toward the initial
            one: at most double it, never to a size that failed, and only where that saves micro-steps
            (then the smallest micro-batch with that many steps). An OOM at a grown size goes back to
            the last size that worked. Off by default: growth can cost a failed attempt each time.
        thrash_steps: on CUDA, shrink after this many consecutive steps with allocator retries.
        meter: a meter whose peak each step reports (the CUDA allocator is used on CUDA anyway).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        target_batch: int | None = None,
        micro_batch: int | None = None,
        plan: Plan | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        max_grad_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        split_fn: SplitFn | None = None,
        size_fn: Callable[[Batch], int] | None = None,
        sync: GradSync | None = None,
        grow_after: int | None = None,
        thrash_steps: int = 2,
        meter: TrackedMemory | None = None,
    ) -> None:
        model_params = trainable_parameters(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        # The step's gradient is that of every trainable parameter of the model and of every parameter
        # the optimizer steps (e.g. a temperature owned by the loss): token-level normalisation,
        # clipping and clearing cover them all. Model parameters outside the optimizer are cleared
        # here too, or their gradients would carry into the next step (and into its clipping norm).
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._outside_optimizer = [p for p in model_params if id(p) not in in_optimizer]
        seen = {id(p) for p in model_params}
        self.params = model_params + [p for group in optimizer.param_groups for p in group["params"]
                                      if p.requires_grad and id(p) not in seen]
        self.sync: GradSync = sync if sync is not None else LocalSync()
        if plan is None:
            if target_batch is None or micro_batch is None:
                raise TypeError("OOMGuard needs plan=, or target_batch= and micro_batch=")
            plan = Plan.for_target(target_batch, micro_batch, self.sync.world_size)
        else:
            plan = read_plan(plan)  # a Plan, a probe report, a search result or a plan file
        if target_batch is not None and target_batch != plan.target_batch:
            raise ValueError(f"target_batch {target_batch} differs from plan.target_batch {plan.target_batch}; "
                             f"give one of them")
        if plan.world_size != self.sync.world_size:
            raise ValueError(f"plan.world_size {plan.world_size} differs from the {self.sync.world_size} ranks "
                             f"running; use plan.with_world_size({self.sync.world_size})")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r}. Allowed range: > 0, or None for no clipping")
        if grow_after is not None:
            check_positive_int(grow_after, "grow_after")
        check_positive_int(thrash_steps, "thrash_steps")
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.max_grad_norm = max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.split_fn, self.size_fn = split_fn, size_fn
        self.grow_after, self.thrash_steps, self.meter = grow_after, thrash_steps, meter
        self.device = self.params[0].device
        self.plan = plan
        self.initial_micro_batch = plan.micro_batch
        self.ceiling: int | None = None  # smallest micro-batch that failed
        self.floor: int | None = None  # micro-batch of the last step that succeeded
        self._buffer_slots = _state_buffers(model)
        self.steps = 0  # optimizer steps taken
        self.ooms = 0  # OOMs recovered
        self.changes: list[PlanChange] = []
        self._ok_streak = 0
        self._thrash_streak = 0
        self._last_retries: int | None = None
        self._warned_batchnorm = False
        self._warn_batchnorm()

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
            OptimizerStepOOMError: out of memory in clipping or ``optimizer.step()``.
            ValueError: the batch holds the wrong number of samples.
        """
        n = self.size_fn(batch) if self.size_fn is not None else batch_size(batch)
        expected = self.plan.rank_batch(self.sync.rank)
        # partial: the epoch's last batch; under torch.distributed a rank's share of it may be empty
        if n != expected and not (partial and 0 <= n < expected and (n > 0 or self.sync.world_size > 1)):
            hint = " (pass partial=True for the smaller last batch of an epoch)" if 0 < n < expected else ""
            raise ValueError(f"batch holds {n} samples; this rank's share of target_batch {self.plan.target_batch} "
                             f"is {expected}{hint}. The global batch is never changed silently.")
        started = time.perf_counter()
        self._reset_peak()
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses (the scheduler moves it after)
        rng = capture_rng()
        buffers = self._capture_buffers()
        num_samples = int(self.sync.sum_items(torch.tensor(n, dtype=torch.int64)).item()) \
            if self.sync.world_size > 1 else n
        changes: list[PlanChange] = []
        attempts = 0
        self._zero_grad()
        start_bytes = self._live_bytes()
        while True:
            attempts += 1
            status, where, payload = self._accumulate(batch, n, num_samples, loss_fn)
            agreed = self.sync.agree(status)
            if agreed == OK:
                break
            if agreed == ERROR:
                if status == ERROR:
                    raise payload  # the original exception, unchanged
                raise AutoAccumError("another rank failed with an error during this step; see its log")
            payload = None  # OOM here or on another rank: replay smaller, from the same start
            self._release(start_bytes)
            restore_rng(rng)
            self._restore_buffers(buffers)
            changes.append(self._shrink("oom", where or "another rank"))
        loss_sum, items, mode = payload
        payload = None
        buffers = None
        loss, num_items, grad_norm, skipped = self._finish(loss_sum, items, mode, num_samples)
        self.steps += 1
        self.floor = self.plan.micro_batch
        stats = self._cuda_stats()
        peak_bytes = self._peak(stats)
        changes.extend(self._adapt(attempts, stats))
        return StepResult(
            loss=loss, num_samples=num_samples, num_items=num_items, grad_norm=grad_norm, skipped=skipped,
            plan=self.plan, changes=tuple(changes), attempts=attempts,
            step_time_s=time.perf_counter() - started, peak_bytes=peak_bytes,
            lr=lr,
        )

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
                "ceiling": self.ceiling, "floor": self.floor, "steps": self.steps, "ooms": self.ooms}

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
        self._warn_batchnorm()

    # -- the accumulation -------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _accumulate(self, batch: Batch, n: int, num_samples: int, loss_fn: LossFn) -> tuple[int, str, Any]:
        """Forward and backward of every micro-batch, gradients summed locally.

        Returns ``(status, where, payload)``: OK with ``(loss_sum, items, mode)``, OOM with the
        phase it struck in, or ERROR with the exception. Catching everything here keeps the
        exception (and the activations its traceback holds) inside this frame, which is gone
        once the caller recovers.
        """
        sizes = micro_sizes(n, self.plan.micro_batch)
        where = "forward/loss"
        # summed in fp64 where the device has it (MPS has no float64)
        loss_sum = torch.zeros((), dtype=torch.float32 if self.device.type == "mps" else torch.float64,
                               device=self.device)
        items: torch.Tensor | int = 0
        mode: str | None = None
        try:
            parts = split_batch(batch, sizes, self.split_fn)
            with self.sync.no_sync():
                for i, size in enumerate(sizes):
                    part, parts[i] = move_to(parts[i], self.device), None
                    where = "forward/loss"
                    with self._autocast():
                        loss, num_items = check_loss(loss_fn(self.model, part))
                    kind = "mean" if num_items is None else "sum"
                    if mode is not None and kind != mode:
                        raise TaskError("loss_fn returned a mean loss for one micro-batch and (loss_sum, num_items) "
                                        "for another; return the same kind for every batch")
                    mode = kind
                    if num_items is None:
                        # each .backward() adds to .grad: weight each mean by its share of the samples
                        weighted = loss * (size / num_samples)
                        loss_sum.add_(loss.detach(), alpha=size)  # one kernel, summed in fp64
                    else:
                        # token-level: sum now, divide the whole step by its item count once (_finish)
                        weighted = loss
                        loss_sum.add_(loss.detach())
                        items = items + num_items
                    where = "backward"
                    (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
                    del loss, weighted, part
        except Exception as exc:  # noqa: BLE001 - sorted below, re-raised by step() unless OOM
            if is_oom(exc):
                return OOM, where, None
            return ERROR, where, exc
        return OK, "", (loss_sum, items, mode)

    def _finish(self, loss_sum: torch.Tensor, items: torch.Tensor | int, mode: str | None,
                num_samples: int) -> tuple[float, int | None, float | None, bool]:
        """Reduce over ranks, normalise, unscale, clip and step: once per optimizer step."""
        phase = "gradient reduction"
        failed = False
        try:
            self.sync.reduce_gradients(self.params)
            loss_total: torch.Tensor | float
            if self.sync.world_size == 1:
                # One process: the kind of loss is known here, and no number on the device is needed
                # before the optimizer step. Reading one would wait for the last backward to finish
                # and stall the launch of the step behind it (the hand-written loop does not).
                loss_total, item_total, mean_ranks, sum_ranks = loss_sum, items, mode == "mean", mode == "sum"
            else:
                # One exchange for every scalar of the step: loss sum, item count, and which kind of
                # loss each rank saw (a rank with an empty share of the last batch saw none).
                count = torch.as_tensor(items, dtype=loss_sum.dtype, device=self.device).reshape(())
                local = torch.stack([loss_sum, count, loss_sum.new_tensor(float(mode == "mean")),
                                     loss_sum.new_tensor(float(mode == "sum"))])
                loss_total, item_total, mean_ranks, sum_ranks = self.sync.sum_items(local).tolist()
            if mean_ranks and sum_ranks:
                raise TaskError("loss_fn returned mean losses on some ranks and (loss_sum, num_items) on others")
            num_items: int | None = None
            divisor = num_samples
            if sum_ranks:
                num_items = divisor = int(item_total)  # a count on the device is read here (one sync)
                if num_items == 0:
                    raise TaskError("the step's loss_fn reported 0 items over all micro-batches; nothing to average")
                grads = [p.grad for p in self.params if p.grad is not None]
                if grads:
                    # token-level: the summed gradient divided once by the step's item count
                    torch._foreach_div_(grads, float(num_items))
            if self.scaler is not None:
                phase = "GradScaler.unscale_"
                self.scaler.unscale_(self.optimizer)
            norm: torch.Tensor | None = None
            if self.max_grad_norm is not None:
                phase = "gradient clipping"
                norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)  # read after the step
            phase = "optimizer.step()"
            skipped = False
            if self.scaler is not None:
                scale_before = self.scaler.get_scale()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                skipped = self.scaler.get_scale() < scale_before  # the scale backs off only on inf/NaN
            else:
                self.optimizer.step()
        except Exception as exc:
            if not is_oom(exc):
                raise
            failed = True
        if failed:  # outside the except block: the traceback is gone
            self._release(None)
            partly = " Some parameters may already be updated and others not." if phase == "optimizer.step()" else ""
            raise OptimizerStepOOMError(
                f"out of memory in {phase} at optimizer step {self.steps + 1}.{partly} This memory does not depend "
                f"on the micro-batch (micro {self.plan.micro_batch}), so the step is not replayed. What to do: "
                f"resume from the last checkpoint with more headroom; use a leaner optimizer (foreach=False lowers "
                f"the step's peak; fused=True on CUDA); or shard optimizer state (FSDP).")
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        self._zero_grad()
        loss = float(loss_total) / divisor  # the step's one wait for the device, after the step's launch
        grad_norm = None if norm is None else float(norm)
        return loss, num_items, grad_norm, skipped

    # -- recovery and adaptation -------------------------------------------------------------------
    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._outside_optimizer:
            p.grad = None

    def _capture_buffers(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        """Copies of the buffers a forward may update (BatchNorm running stats), taken at the step's start.

        Only persistent buffers of modules in training mode: what a forward in training changes.
        Non-persistent buffers (masks, rotary tables) are derived and not copied."""
        return [(module, name, buffer.clone()) for module, name in self._buffer_slots if module.training
                for buffer in (module._buffers.get(name),) if buffer is not None]

    @staticmethod
    def _restore_buffers(buffers: list[tuple[torch.nn.Module, str, torch.Tensor]]) -> None:
        """Undo the failed attempt's forwards: a replay starts from the step's running statistics."""
        with torch.no_grad():
            for module, name, saved in buffers:
                current = module._buffers.get(name)
                if current is not None and current.shape == saved.shape and current.dtype == saved.dtype:
                    current.copy_(saved)
                else:
                    module._buffers[name] = saved

    def _release(self, start_bytes: int | None) -> None:
        """Drop everything of a failed attempt: gradients, the scaler's step record, cached blocks."""
        self._zero_grad()
        _reset_scaler_step(self.scaler)
        live = self._live_bytes()
        if live is None or start_bytes is None or live > start_bytes:
            # Frames of the failed attempt sit in reference cycles. A full collection takes from tens
            # of milliseconds to seconds in a big process, so only when memory did not come back.
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _shrink(self, reason: Reason, where: str) -> PlanChange:
        old = self.plan
        self.ooms += reason == "oom"
        if old.micro_batch == 1:
            raise self._does_not_fit()
        self.ceiling = old.micro_batch if self.ceiling is None else min(self.ceiling, old.micro_batch)
        new = old.halved()
        if self.floor is not None and new.micro_batch < self.floor < old.micro_batch:
            # a grown micro-batch failed: go back to the size that worked, not below it
            new = Plan.for_target(old.target_batch, self.floor, old.world_size)
        self.plan = self.sync_plan(new)
        return self._record(reason, where, old)

    def sync_plan(self, plan: Plan) -> Plan:
        """Every rank takes the same (smallest proposed) micro-batch."""
        micro = self.sync.agree_micro_batch(plan.micro_batch)
        return plan if micro == plan.micro_batch else Plan.for_target(plan.target_batch, micro, plan.world_size)

    def _record(self, reason: Reason, where: str, old: Plan) -> PlanChange:
        change = PlanChange(self.steps + 1, reason, where, old, self.plan)
        self.changes.append(change)
        logger.warning(change.describe())
        self._ok_streak = 0
        self._warn_batchnorm()
        return change

    def _adapt(self, attempts: int, stats: dict[str, Any] | None) -> list[PlanChange]:
        """After a successful step: shrink on allocator thrashing, or grow after a calm stretch."""
        changes: list[PlanChange] = []
        if stats is not None:
            retries = int(stats.get("num_alloc_retries", 0))
            # a step that replayed after an OOM retried by definition: that OOM was acted on already
            rising = self._last_retries is not None and retries > self._last_retries and attempts == 1
            self._last_retries = retries
            self._thrash_streak = self._thrash_streak + 1 if rising else 0
            if self._thrash_streak >= self.thrash_steps and self.plan.micro_batch > 1:
                self._thrash_streak = 0
                changes.append(self._shrink("thrash", "allocator retries"))
                return changes
        self._ok_streak = self._ok_streak + 1 if attempts == 1 else 0
        if self.grow_after is not None and self._ok_streak >= self.grow_after:
            self._ok_streak = 0
            old = self.plan
            # at most double, never to a size that failed, and only where it saves micro-steps:
            # a bigger micro-batch with as many passes costs memory and gains nothing
            limit = self.initial_micro_batch if self.ceiling is None else min(self.initial_micro_batch,
                                                                              self.ceiling - 1)
            bigger = Plan.for_target(old.target_batch, min(old.micro_batch * 2, limit), old.world_size)
            if bigger.accum_steps < old.accum_steps:
                # that many passes with the smallest micro-batch that makes them: the lowest peak
                self.plan = self.sync_plan(Plan.balanced(old.target_batch, bigger.micro_batch, old.world_size))
                if self.plan.micro_batch != old.micro_batch:
                    changes.append(self._record("grow", "", old))
        return changes

    def _does_not_fit(self) -> DoesNotFitError:
        needed: int | None = None
        available: int | None = None
        if self.meter is not None:
            needed, available = self.meter.last_oom_needed_bytes, self.meter.budget_bytes
        elif self.device.type == "cuda":
            needed = int(torch.cuda.max_memory_allocated(self.device))
            available = int(torch.cuda.mem_get_info(self.device)[1])
        return DoesNotFitError(needed, available, at_least=True, suggestions=(
            "enable activation checkpointing or bf16 autocast (autocast_dtype=torch.bfloat16)",
            "use shorter sequences or a smaller model",
            "shard the model and optimizer state over more devices (FSDP)",
            "free memory held by other processes, or run on a device with more memory",
        ))

    def _warn_batchnorm(self) -> None:
        if self._warned_batchnorm or (self.plan.accum_steps == 1 and self.plan.world_size == 1):
            return
        layers = batchnorm_layers(self.model)
        if layers:
            self._warned_batchnorm = True
            shown = ", ".join(layers[:5]) + (f" and {len(layers) - 5} more" if len(layers) > 5 else "")
            warnings.warn(
                f"BatchNorm layers ({shown}) normalise each micro-batch of {self.plan.micro_batch} with its own "
                f"statistics, not those of the global batch of {self.plan.target_batch}: gradients and running "
                f"stats differ from a full-batch step. Remedies: SyncBatchNorm across ranks, GroupNorm/LayerNorm, "
                f"or ghost batch norm with a fixed ghost size independent of the micro-batch.", stacklevel=3)

    def _reset_peak(self) -> None:
        if self.meter is not None:
            self.meter.reset_peak()
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _cuda_stats(self) -> dict[str, Any] | None:
        # The nested form: torch.cuda.memory_stats() flattens it in Python, ~0.1 ms per call.
        return torch.cuda.memory_stats_as_nested_dict(self.device) if self.device.type == "cuda" else None

    def _live_bytes(self) -> int | None:
        """Bytes allocated now (the meter's count, or the CUDA allocator's); None where unknown."""
        if self.meter is not None:
            return int(self.meter.current_bytes)
        stats = self._cuda_stats()
        return None if stats is None else int(stats["allocated_bytes"]["all"]["current"])

    def _peak(self, stats: dict[str, Any] | None) -> int | None:
        if self.meter is not None:
            return int(self.meter.peak_bytes)
        return None if stats is None else int(stats["allocated_bytes"]["all"]["peak"])
