"""Measured training passes for the probe: the peak memory and the time of each phase, per size.

A training step has two peaks (``autoaccum.memory.model``): the forward/backward peak grows with the
micro-batch, the optimizer-step peak does not. So the optimizer phase is measured once, and every
other size runs forward and backward only:

- ``Stepper.warm_up``: two complete training steps at the smallest size (the optimizer creates its
  state in the first), which give the optimizer phase's peak and time. They are the only steps that
  change the weights. A ``WeightsCopy`` made on the device is put back when the warm-up ends, and
  its bytes are subtracted from every reading until then. Where the copy may have changed the
  outcome (an OOM while it was held, or a first pass that wrote the parameters, as later passes
  would after the copy is gone), ``HostSnapshotNeeded`` asks the probe to start again with the
  weights copied to host memory. A write first seen after the copy is gone raises
  ``AutoAccumError`` naming the parameter: nothing could restore it.
- ``Stepper.measure``: ``passes`` forward/backward passes at one size. A size below the rank's
  share runs as an accumulation's later micro-batches do, with summed gradients already in memory
  (after an OOM, a pass at the smallest size makes them first); the share itself runs from no
  gradients, as the guard runs it. One pass gives the size's peak and time; with more, the first
  warms up and the fastest of the others is the time (contention only ever slows a pass).
- ``Stepper.retime``: one more timed pass at a measured size, where the choice hangs on speed.

Each pass runs under the run's precision (autocast; a GradScaler for fp16). An OOM ends the size
(status ``oom``) and is recovered outside the ``except`` block. The caller's optimizer is not
stepped: the warm-up steps a ``StandIn``. The passes and steps are the guard's own (``accumulate``,
``step_optimizer``), so the probe measures what training runs. Gradients are cleared by setting
``.grad`` to None (``zero_grad``, which wrappers and counters of it would see, runs only after an OOM
in the warm-up's optimizer step).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable

import torch

from autoaccum.errors import AutoAccumError, OptimizerStepOOMError
from autoaccum.log import user_stacklevel
from autoaccum.memory import Meter
from autoaccum.memory.recovery import catch_oom, release_memory
from autoaccum.plan.batch import Batch, move_to, own_rows, tensors
from autoaccum.plan.cut import MicroBatch
from autoaccum.plan.task import LossFn
from autoaccum.probe.progress_line import ProbeProgress
from autoaccum.probe.report import Candidate, Status
from autoaccum.state import WeightsCopy
from autoaccum.step.accumulate import Failed, accumulate, raise_failure
from autoaccum.step.optim import step_optimizer
from autoaccum.units import format_bytes

__all__ = ["HostSnapshotNeeded", "StandIn", "Stepper"]

logger = logging.getLogger("autoaccum.probe")


class HostSnapshotNeeded(Exception):
    """The weights' copy on the device did not do (see the module docstring); the message says why. Carries
    the passes and OOMs run so far, which count in the probe's report."""

    def __init__(self, reason: str, steps: int = 0, ooms: int = 0, optimizer_steps: int = 0) -> None:
        super().__init__(reason)
        self.steps, self.ooms, self.optimizer_steps = steps, ooms, optimizer_steps


class StandIn:
    """The probe's optimizer in place of the caller's (invariant 4: the caller's is left untouched).

    ``optimizer`` is a second object of the caller's class, made without its ``__init__``: the
    same parameters and hyperparameters (its own copies of the group dicts), its own ``state`` whose
    per-parameter dicts hold the caller's state tensors (new entries stay in the stand-in), fresh
    hook registries, and the caller's other attributes except instance-level overrides of methods
    (an LR scheduler's wrapper of ``step``, a patched ``zero_grad``). Its steps update the shared state
    tensors in place; ``put_back`` copies their saved values back into the same tensors, bit for
    bit. What still sees the probe's two steps: hooks registered on the class or globally
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``) and class-level patches of ``step``.

    Args:
        optimizer: the caller's optimizer; see ``of`` for which ones can have a stand-in.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        clone = cls.__new__(cls)
        for name, value in vars(optimizer).items():
            if callable(value) and callable(getattr(cls, name, None)):
                continue  # an instance-level override of a method: the class's own runs
            if name.startswith("_optimizer_") and name.endswith("_hooks"):
                value = OrderedDict()  # the instance's hooks are the caller's
            elif isinstance(value, (dict, list)):
                value = value.copy()  # (state and param_groups are made below)
            vars(clone)[name] = value
        clone.param_groups = [dict(group) for group in optimizer.param_groups]
        clone.state = defaultdict(dict, {p: dict(s) for p, s in optimizer.state.items()})
        self.optimizer: torch.optim.Optimizer = clone
        self._saved = [(t, t.detach().to("cpu", copy=True)) for s in optimizer.state.values()
                       for t in tensors(s)]

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> StandIn | None:
        """A stand-in for ``optimizer``, or None where its state may live outside ``state`` and
        ``param_groups`` (a class with its own ``state_dict``/``load_state_dict``, or one that holds
        another optimizer): the probe then steps the caller's optimizer and restores it through its
        ``state_dict``."""
        cls = type(optimizer)
        base = torch.optim.Optimizer
        if cls.state_dict is not base.state_dict or cls.load_state_dict is not base.load_state_dict:
            return None
        if any(isinstance(v, base) for v in vars(optimizer).values()):
            return None
        return StandIn(optimizer)

    def put_back(self) -> None:
        """The caller's state tensors as they were before the probe, bit for bit (in place); the state the
        stand-in's steps created is dropped (its memory free at once, as after a first step undone)."""
        with torch.no_grad():
            for t, saved in self._saved:
                t.copy_(saved)
        self.optimizer.state = defaultdict(dict)


class Stepper:
    """Runs measured passes of one task on one meter (see the module docstring).

    Attributes:
        steps: forward/backward passes run (an OOM counts as one).
        optimizer_steps: optimizer steps run.
        ooms: OOMs the measurements triggered.
        length: the sequence length batches are made at (variable-length data; None otherwise):
            ``make_batch(size, length)``.
        measured: every size measured, by ``(size, length)`` (``current``: those at ``length``).
        opt_peak_bytes: the optimizer phase's peak (after ``warm_up``).
        opt_time_s: the optimizer phase's time (after ``warm_up``).
        start_bytes: bytes live when the last measured pass began (weights, state, gradients, batch).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                 make_batch: Callable[[int], Batch], device: torch.device, meter: Meter, usable_bytes: int, *,
                 share: int, passes: int = 1, autocast_dtype: torch.dtype | None = None,
                 scaler: torch.amp.GradScaler | None = None, own_inputs: bool = False,
                 weights_copy: WeightsCopy | None = None, copy_bytes: int = 0,
                 progress: ProbeProgress | None = None) -> None:
        self.model, self.optimizer, self.loss_fn, self.make_batch = model, optimizer, loss_fn, make_batch
        self.progress = progress  # the terminal line: each size as it starts and ends
        self.device, self.meter, self.usable_bytes, self.passes = device, meter, usable_bytes, passes
        self.share = share  # a micro-batch smaller than this rank's share accumulates
        self.autocast_dtype, self.scaler = autocast_dtype, scaler
        self.own_inputs = own_inputs  # copy inputs that are views into larger tensors to their own rows
        self.steps = 0
        self.optimizer_steps = 0
        self.ooms = 0
        self.length: int | None = None
        self.measured: dict[tuple[int, int | None], Candidate] = {}
        self.opt_peak_bytes = 0
        self.opt_time_s = 0.0
        self.start_bytes = 0
        self.batch_bytes: dict[tuple[int, int | None], int] = {}  # bytes of the inputs of a batch of each size
        self.losses: dict[tuple[int, int | None], float] = {}  # the mean loss of a pass at each size (looks_summed)
        self.smallest = 1  # the size warmed up at: the cheapest pass that makes gradients
        self.holding_grads = False  # gradients of earlier passes are in memory (as in an accumulation)
        self.weights_copy = weights_copy  # put back after the warm-up
        self.copy_bytes = copy_bytes if weights_copy is not None else 0  # what it takes on the meter, while held
        self.watching: WeightsCopy | None = None  # the copy once put back: the weights may not change again

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _peak(self) -> int:
        reading = self.meter.read()
        return 0 if reading is None else reading.peak_bytes - self.copy_bytes

    def _pass(self, batch: Batch, size: int) -> tuple[int, float]:
        """One forward/backward pass of ``size`` samples, as the guard runs one (``accumulate``): (its
        peak, its time). An OOM is raised again for ``_record``; a known mistake is named."""
        self._sync()
        started = time.perf_counter()
        self.meter.reset_peak()
        reading = self.meter.read()
        self.start_bytes = 0 if reading is None else reading.current_bytes - self.copy_bytes
        done = accumulate(self.model, [MicroBatch(batch, size)], self.loss_fn, num_samples=size, device=self.device,
                          scaler=self.scaler, autocast_dtype=self.autocast_dtype)
        if isinstance(done, Failed):  # the failed pass's frames are gone: raising here holds no activation
            if done.oom:
                raise torch.OutOfMemoryError(f"micro-batch {size} ran out of memory in {done.where}")
            raise_failure(done, self.model, batch)  # as the guard explains it
        if done.kind == "mean" and not self.own_inputs:  # (an estimate's fake losses have no value)
            # the pass's mean loss (loss_sum is the mean times the samples); a sync the timing below makes anyway
            self.losses[(size, self.length)] = float(done.loss_sum) / size
        del done
        peak = self._peak()
        self._sync()
        self.steps += 1
        self.holding_grads = True
        elapsed = time.perf_counter() - started
        if self.watching is not None:  # after the timing: the pass's time is the same with or without a copy
            self._check_unwritten(self.watching, size)
        return peak, elapsed

    @staticmethod
    def _check_unwritten(watching: WeightsCopy, size: int) -> None:
        """After the warm-up's copy was put back, no pass may write the weights: nothing could restore them."""
        name = watching.written()
        if name is not None:
            raise AutoAccumError(
                f"the model wrote its parameter {name!r} (in place, or a new .data) during a forward/backward pass "
                f"of the probe (at micro-batch {size}), after the warm-up's copy of the weights was put back, so the "
                f"probe cannot leave the weights as they were. The model's forward changes its own weights on some "
                f"calls but not on the first (a constraint switched on later, or one that depends on the batch): "
                f"apply it after optimizer.step() instead, or make it act from the first call.")

    def looks_summed(self) -> tuple[int, float, int, float] | None:
        """(small, its loss, large, its loss) where the losses of passes at two sizes of one length, the larger at
        least 4x the smaller, grow about as the size does (by at least half the ratio): a loss summed over the
        micro-batch (``reduction="sum"``) returned as a mean, which would weight micro-batches wrongly. A mean
        loss on the same kind of samples barely changes with their number."""
        for length in {length for _, length in self.losses}:
            sizes = sorted((size, loss) for (size, at), loss in self.losses.items() if at == length)
            (small, low), (large, high) = sizes[0], sizes[-1]
            if large >= 4 * small and low > 0 and high > 0 and high / low >= 0.5 * large / small:
                return small, low, large, high
        return None

    def warn_if_summed(self) -> None:
        """Warn where the probe's losses look summed over the micro-batch (``Stepper.looks_summed``)."""
        summed = self.looks_summed()
        if summed is not None:
            small, low, large, high = summed
            warnings.warn(f"loss_fn's loss grew with the micro-batch: {low:.4g} at {small} samples, {high:.4g} at "
                          f"{large} (x{high / low:.2g} for x{large // small} the samples): it looks summed over the "
                          f"micro-batch (reduction='sum'), and a loss returned alone is read as the micro-batch's "
                          f"mean, so the step would weight micro-batches by their size twice and train at another "
                          f"learning rate than a full-batch step. Return the mean (reduction='mean'), or "
                          f"(loss_sum, num_items) for a sum", UserWarning, stacklevel=user_stacklevel())

    def _zero_grad(self) -> None:
        """As ``zero_grad(set_to_none=True)`` does, without the call (which wrappers and counters of it would see)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self.holding_grads = False

    def _start(self, size: int) -> None:
        """The gradients a pass at ``size`` runs with: none for the whole share (it runs alone), the
        summed gradients of earlier micro-batches below it."""
        if size >= self.share:
            self._zero_grad()
        elif not self.holding_grads:  # after an OOM: gradients as an accumulation's later passes hold them
            self._pass(self._batch(self.smallest), self.smallest)

    def _optimizer_step(self) -> None:
        """One optimizer step as the guard takes one (``step_optimizer``); its OOM ends the size."""
        self._sync()
        started = time.perf_counter()
        self.meter.reset_peak()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        try:
            step_optimizer(self.optimizer, params, scaler=self.scaler)
        except OptimizerStepOOMError as exc:
            raise torch.OutOfMemoryError(str(exc)) from None
        self.opt_peak_bytes = max(self.opt_peak_bytes, self._peak())
        self._sync()
        self.opt_time_s = time.perf_counter() - started
        self.optimizer_steps += 1

    @property
    def current(self) -> dict[int, Candidate]:
        """The sizes measured at the current length."""
        return {size: c for (size, length), c in self.measured.items() if length == self.length}

    def _batch(self, size: int) -> Batch:
        made = self.make_batch(size) if self.length is None else self.make_batch(size, self.length)
        batch = move_to(made, self.device)
        if self.own_inputs:  # fake tensors count a view's whole storage: the rows alone, as a transfer copies them
            batch = own_rows(batch)
        self.batch_bytes[(size, self.length)] = sum(t.untyped_storage().nbytes() for t in tensors(batch))
        return batch

    def _warm_up(self, size: int) -> Candidate:
        self.smallest = size
        batch = self._batch(size)
        peaks, times = [], []
        for step in range(2):
            if step == 0 or size >= self.share:
                self._zero_grad()
            peak, seconds = self._pass(batch, size)
            copy = self.weights_copy
            if step == 0 and copy is not None and (copy.written() or copy.differs()):  # before any optimizer step
                raise HostSnapshotNeeded("a forward/backward pass wrote the parameters", self.steps, self.ooms,
                                         self.optimizer_steps)
            peaks.append(peak)
            times.append(seconds)
            self._optimizer_step()
        return self._candidate(size, max(peaks), times[1:])

    def _measure(self, size: int) -> Candidate:
        batch = self._batch(size)
        peaks, times = [], []
        for _ in range(self.passes):
            self._start(size)
            peak, seconds = self._pass(batch, size)
            peaks.append(peak)
            times.append(seconds)
        return self._candidate(size, max(peaks), times[1:] or times)

    def _candidate(self, size: int, fwd_bwd: int, times: list[float]) -> Candidate:
        peak = max(fwd_bwd, self.opt_peak_bytes)
        status: Status = "ok" if peak <= self.usable_bytes else "over_budget"
        micro_time = min(times)
        return Candidate(size, status, peak, fwd_bwd, self.opt_peak_bytes, micro_time + self.opt_time_s, micro_time,
                         self.length)

    def warm_up(self, size: int) -> Candidate:
        """Two complete training steps at ``size``: the optimizer's state and its peak; ``size`` measured too.
        The weights' copy, if any, is put back and given up when it ends."""
        copy = self.weights_copy
        if copy is None and self.watching is not None:  # its steps would change weights no snapshot holds
            raise RuntimeError("Stepper.warm_up ran twice after the weights' copy was put back: one warm-up a stepper")
        try:
            candidate = self._record(size, self._warm_up)
        finally:
            if copy is not None:
                copy.put_back()
                self.weights_copy, self.copy_bytes, self.watching = None, 0, copy
        if copy is not None and candidate.status == "oom":
            raise HostSnapshotNeeded(f"micro-batch {size} ran out of memory beside the weights' copy on the device",
                                     self.steps, self.ooms, self.optimizer_steps)
        return candidate

    def measure(self, size: int) -> Candidate:
        """``passes`` forward/backward passes at ``size`` (once per size: a repeated size returns its result)."""
        if (size, self.length) in self.measured:
            return self.measured[(size, self.length)]
        return self._record(size, self._measure)

    def retime(self, size: int) -> float | None:
        """One more timed pass at a size that fits: the fastest reading so far of its micro-step time.
        None where the pass runs out of memory this time (a CUDA allocator's fragmentation, memory
        another process took): the size is recorded as not fitting, and the probe chooses without it."""
        candidate = self.measured[(size, self.length)]
        self._start(size)
        timed, failed = catch_oom(lambda: self._pass(self._batch(size), size))
        if failed or timed is None:  # outside any except block: the failed pass's activations are gone
            self.steps += 1
            self.ooms += 1
            self._zero_grad()
            release_memory(self.device)
            self.measured[(size, self.length)] = Candidate(size, "oom", self.meter.last_oom_needed_bytes,
                                                           length=self.length)
            return None
        seconds = timed[1]
        micro = min(seconds, candidate.micro_step_time_s or seconds)
        self.measured[(size, self.length)] = Candidate(
            size, candidate.status, candidate.peak_bytes, candidate.fwd_bwd_peak_bytes, candidate.opt_peak_bytes,
            micro + self.opt_time_s, micro, self.length)
        return micro

    def _record(self, size: int, run: Callable[[int], Candidate]) -> Candidate:
        if self.progress is not None:
            self.progress.measuring(size, self.length)
        ran, failed = catch_oom(run, size)
        if failed:  # outside any except block: the failed pass's activations are gone
            self.steps += 1
            self.ooms += 1
            self._zero_grad()
            release_memory(self.device)
            candidate = Candidate(size, "oom", self.meter.last_oom_needed_bytes, length=self.length)
        else:
            candidate = ran  # type: ignore[assignment]
        self.measured[(size, self.length)] = candidate
        at = "" if self.length is None else f" at length {self.length}"
        logger.debug("probe micro-batch %d%s: %s, peak %s", size, at, candidate.status,
                     "?" if candidate.peak_bytes is None else format_bytes(candidate.peak_bytes))
        if self.progress is not None:
            self.progress.measured(candidate)
        return candidate
