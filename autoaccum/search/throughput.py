"""Measure one configuration (micro-batch + knobs): real guarded optimizer steps, samples/s and peak memory.

A measurement runs ``warmup_steps`` complete accumulated optimizer steps through an ``OOMGuard``
(the optimizer state appears in the first, so the peak is in the second or later), then times
``measure_steps`` more and reports samples/s from the fastest of them: every step covers the same
global batch, and contention on a shared machine only ever slows a step, so the fastest is the
truest reading (the probe and ``timeit`` do the same).

The guard must not rescue a configuration: the first OOM -- or any shrink of the plan, such as
allocator thrashing on CUDA -- makes it infeasible (status ``oom``) instead of being replayed at a
smaller micro-batch. A run that peaks above the usable budget (``budget * (1 - headroom)``) is
``over_budget``. Memory is read from the CUDA allocator on CUDA, and elsewhere from the tracked
counter with an emulated budget of the usable bytes, which raises an OOM where a small device
would fail. The counter covers the warm-up steps only: its per-op Python hook would slow small
micro-batches more than large ones and bias the timed ranking.

Process-wide effects: after a failed measurement (and after every one on CUDA) memory is released
(``autoaccum.memory.recovery.release_memory``: a full garbage collection and, on CUDA,
``torch.cuda.empty_cache()`` for the whole process); warnings are silenced while the trial's guard
is built (``warnings.catch_warnings``, whose filters the process's threads share). The trial's
guard logs no plan changes (``OOMGuard(log_changes=False)``). Knobs: ``autoaccum.search.knobs``; the
trial's plan is with its knobs' memory saver, which the trial's guard applies for each
attempt (``autoaccum.memory.savers.apply_saver``, exact) and never goes past.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import torch

from autoaccum import state as training_state
from autoaccum.errors import DoesNotFitError, OptimizerStepOOMError
from autoaccum.guard.guard import OOMGuard
from autoaccum.log import user_stacklevel
from autoaccum.memory import emulated_device, resolve_budget
from autoaccum.memory.recovery import is_oom, release_memory
from autoaccum.plan.batch import Batch
from autoaccum.plan.plan import Plan
from autoaccum.plan.task import LossFn, Task, trainable_parameters
from autoaccum.search.knobs import COMPILE_WITH_SAVER, Knobs, apply_knobs
from autoaccum.validate import check_choice, check_positive_int

__all__ = ["Clock", "Measurement", "Status", "Bench", "make_bench", "measure"]

logger = logging.getLogger(__name__)

Status = Literal["ok", "oom", "over_budget", "failed"]
#: ``wall``: elapsed time (what training takes). ``cpu``: CPU time of this process
#: (``time.process_time``), for a CPU shared with other busy processes: time the scheduler gave to
#: others does not count. It equals elapsed time only with one intra-op thread
#: (``torch.set_num_threads(1)``) and never applies to CUDA, whose work is not CPU time.
Clock = Literal["wall", "cpu"]


@dataclass(frozen=True)
class Measurement:
    """What one configuration did.

    Attributes:
        status: ``ok``; ``oom`` (out of memory, or the guard had to shrink the plan);
            ``over_budget`` (ran, but peaked above the usable budget); ``failed`` (a knob raised
            an error, e.g. ``torch.compile`` could not compile the model).
        samples_per_s: samples of one rank's share per second (fastest step), None unless ok.
        items_per_s: items (e.g. tokens) per second for token-level losses, else None.
        step_time_s: time of the fastest timed optimizer step, None unless ok.
        peak_bytes: the largest step peak seen (for ``oom`` the bytes asked for, when known).
        note: where the OOM struck, or the knob's error.
    """

    status: Status
    samples_per_s: float | None = None
    items_per_s: float | None = None
    step_time_s: float | None = None
    peak_bytes: int | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Shrunk(Exception):
    """The guard shrank the plan (an OOM, or thrashing): this configuration does not fit as planned."""


@dataclass(frozen=True)
class Bench:
    """What every measurement of one search shares: the model, its optimizer, one fixed batch,
    the state each measurement starts from, and the budget.

    Attributes:
        model: the module a training step runs.
        optimizer: its optimizer.
        loss_fn: ``loss_fn(model, batch)``.
        batch: one rank's share of the global batch, built once (the same samples for every trial).
        share: the samples in ``batch``.
        device: where steps run.
        usable_bytes: ``budget * (1 - headroom)``; a configuration above it is infeasible.
        snapshot: the state restored after each measurement (every trial starts from it).
        warmup_steps: optimizer steps run before timing.
        measure_steps: optimizer steps timed.
        clock: ``wall`` or ``cpu`` (see ``Clock``).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    batch: Batch
    share: int
    device: torch.device
    usable_bytes: int
    snapshot: training_state.TrainingSnapshot
    warmup_steps: int = 2
    measure_steps: int = 3
    clock: Clock = "wall"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _steps(self, guard: OOMGuard, loss_fn: LossFn, count: int) -> tuple[list[float], int, int | None]:
        times: list[float] = []
        peak = 0
        items: int | None = None
        timer = time.perf_counter if self.clock == "wall" else time.process_time
        for _ in range(count):
            self._sync()
            started = timer()
            result = guard.step(self.batch, loss_fn)
            self._sync()
            if result.changes:  # e.g. a thrash shrink after the step succeeded
                raise _Shrunk(result.changes[0].describe())
            times.append(timer() - started)
            peak = max(peak, result.peak_bytes or 0)
            items = result.num_items
        return times, peak, items

    def run(self, micro_batch: int, knobs: Knobs) -> Measurement:
        """Measure ``micro_batch`` with ``knobs``; afterwards the state is ``snapshot`` again."""
        if knobs.compile and knobs.saver != "none":
            logger.info("micro %d %s: not run: %s", micro_batch, knobs.describe(), COMPILE_WITH_SAVER)
            return Measurement("failed", note=COMPILE_WITH_SAVER)
        # one rank's share: the same micro x accum; with the knobs' saver, which the guard applies
        plan = Plan.for_target(self.share, micro_batch).with_saver(knobs.saver)
        guard: OOMGuard | None = None
        outcome: Measurement | None = None
        failure: BaseException | None = None
        try:
            with apply_knobs(self.model, knobs) as run_model:
                device = emulated_device(self.usable_bytes, self.device, run_model)
                meter = None if device is None else device.track(self.model, self.optimizer)
                guard = self._guard(run_model, plan, knobs, meter)

                def loss_fn(model: torch.nn.Module, micro: Batch, _guard: OOMGuard = guard) -> Any:
                    if _guard.changes:  # the guard caught an OOM and is replaying smaller: stop here
                        raise _Shrunk(_guard.changes[0].describe())
                    return self.loss_fn(model, micro)

                with meter if meter is not None else contextlib.nullcontext():
                    _, peak, _ = self._steps(guard, loss_fn, self.warmup_steps)
                # On CUDA the timed steps report their peaks too; the counter's are the warm-up's.
                times, timed_peak, items = self._steps(guard, loss_fn, self.measure_steps)
                peak = max(peak, timed_peak)
                step_s = min(times)
                outcome = Measurement(
                    "ok" if peak <= self.usable_bytes else "over_budget", self.share / step_s,
                    None if items is None else items / step_s, step_s, peak)
        except (_Shrunk, DoesNotFitError, OptimizerStepOOMError) as exc:
            where = guard.changes[0].describe() if guard is not None and guard.changes else str(exc).splitlines()[0]
            outcome = Measurement("oom", peak_bytes=self._oom_bytes(), note=where)
        # Not recovery.catch_oom: it drops the error, and the trial keeps an OOM's first line as its
        # note and sorts the other errors (a failing knob, the user's bug) here too.
        except Exception as exc:  # noqa: BLE001 - sorted below: OOM, a failing knob, or the user's bug
            if is_oom(exc):
                outcome = Measurement("oom", peak_bytes=self._oom_bytes(), note=str(exc).splitlines()[0][:200])
            elif knobs != Knobs():
                outcome = Measurement("failed", note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                                      if str(exc) else type(exc).__name__)
            else:
                failure = exc
        # Recovery outside the except blocks: the traceback (and the activations it holds) is gone.
        guard = None
        self.restore(collect=outcome is None or not outcome.ok)
        if failure is not None:
            raise failure
        assert outcome is not None
        if outcome.status == "failed":
            warnings.warn(f"knobs {knobs.describe()} failed at micro-batch {micro_batch}: {outcome.note}; "
                          f"recorded as infeasible", stacklevel=user_stacklevel())
        logger.info("micro %d %s: %s %s", micro_batch, knobs.describe(), outcome.status,
                    "" if outcome.samples_per_s is None else f"{outcome.samples_per_s:.1f} samples/s")
        return outcome

    def _guard(self, run_model: torch.nn.Module, plan: Plan, knobs: Knobs, meter: Any) -> OOMGuard:
        """The trial's guard. ``log_changes=False``: the guard's "OOM ... micro 64 -> 32" would read as a
        rescue; here a change ends the trial. Its savers end at the trial's (an OOM with it ends the trial,
        never the next saver), and ``grow_after`` outlasts the trial's steps: no step back to a lower
        saver either (that waits 4 x grow_after calm steps)."""
        scaler = torch.amp.GradScaler(self.device.type) if knobs.autocast == "fp16" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # BatchNorm advice: once from the guard the user builds
            return OOMGuard(run_model, self.optimizer, plan=plan, autocast_dtype=knobs.autocast_dtype, scaler=scaler,
                            meter=meter, log_changes=False,
                            memory_savers="off" if knobs.saver == "none" else (knobs.saver,),
                            grow_after=self.warmup_steps + self.measure_steps)

    def _oom_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None  # the counter of the failed trial is gone with it; its budget says enough

    def restore(self, collect: bool = True) -> None:
        """Back to ``snapshot``. ``collect``: also run the garbage collector (frames of a failed
        attempt may sit in reference cycles; a full collection walks every object of the process,
        so a CPU trial that went well skips it); on CUDA cached blocks are always released."""
        self.optimizer.zero_grad(set_to_none=True)
        training_state.restore(self.snapshot, self.model, self.optimizer)
        if collect or self.device.type == "cuda":
            release_memory(self.device)  # no meter reading: collects, and empties the CUDA cache


def make_bench(task: Task, optimizer: torch.optim.Optimizer | None, share: int, usable_bytes: int,
               warmup_steps: int, measure_steps: int, clock: Clock = "wall") -> Bench:
    """A bench for ``task``: the optimizer given or a fresh one, one batch of ``share`` samples."""
    params = trainable_parameters(task.model)
    device = params[0].device
    if optimizer is None:
        optimizer = task.make_optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    check_positive_int(warmup_steps, "warmup_steps")
    check_positive_int(measure_steps, "measure_steps")
    check_choice(clock, "clock", get_args(Clock))
    if clock == "cpu" and device.type == "cuda":
        raise ValueError("clock='cpu' measures CPU time, and a CUDA step's work is not CPU time; use clock='wall'")
    if warmup_steps < 2:
        raise ValueError(f"Invalid warmup_steps: {warmup_steps}. Allowed range: >= 2 (optimizer state is created "
                         f"in the first step, so the peak is usually in the second)")
    return Bench(model=task.model, optimizer=optimizer, loss_fn=task.loss_fn, batch=task.batch(share), share=share,
                 device=device, usable_bytes=usable_bytes,
                 snapshot=training_state.capture(task.model, optimizer, pinned=False),
                 warmup_steps=warmup_steps, measure_steps=measure_steps, clock=clock)


def measure(task: Task, target_batch: int, micro_batch: int, knobs: Knobs | None = None, *,
            optimizer: torch.optim.Optimizer | None = None, world_size: int = 1, budget: int | str | None = None,
            headroom: float = 0.1, warmup_steps: int = 2, measure_steps: int = 3,
            clock: Clock = "wall") -> Measurement:
    """Measure one configuration as a search trial does; model, optimizer and RNG are unchanged afterwards.

    Args:
        task: the training step.
        target_batch: the global batch over all ranks.
        micro_batch: samples per forward/backward; accumulation covers the share exactly.
        knobs: the memory saver, autocast, compile (default: none).
        optimizer: step this optimizer (restored afterwards) instead of a fresh one from the task.
        world_size: the ranks sharing ``target_batch``; one rank's share is measured.
        budget: infeasible above ``budget * (1 - headroom)`` (default: what the device has free);
            enforced by an emulated OOM on every device but CUDA.
        headroom: the fraction of the budget kept free.
        warmup_steps: optimizer steps before timing (>= 2).
        measure_steps: optimizer steps timed.
        clock: ``wall`` (default) or ``cpu`` time (see ``Clock``).
    """
    share = Plan.for_target(target_batch, 1, world_size).rank_batch(0)
    micro_batch = min(check_positive_int(micro_batch, "micro_batch"), share)
    device = trainable_parameters(task.model)[0].device
    usable = resolve_budget(budget, device, headroom).usable_bytes  # checks headroom
    user = training_state.capture(task.model, optimizer, pinned=False)  # with the bench's: pageable, as a search's
    try:
        bench = make_bench(task, optimizer, share, usable, warmup_steps, measure_steps, clock)
        return bench.run(micro_batch, knobs or Knobs())
    finally:
        training_state.restore(user, task.model, optimizer)

