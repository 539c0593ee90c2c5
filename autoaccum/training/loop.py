"""The training loop of ``fit``: epochs of global batches, one guarded optimizer step each, with
evaluation, checkpoints and progress; it stops on a run of inf/NaN-skipped steps."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoaccum.distributed.sync import GradSync
from autoaccum.errors import AutoAccumError, NonFiniteError
from autoaccum.guard.guard import OOMGuard, StepResult
from autoaccum.log import rank_level
from autoaccum.memory import Meter, TrackedMemory
from autoaccum.plan.data import GlobalBatches
from autoaccum.plan.task import LossFn
from autoaccum.training.config import FitConfig
from autoaccum.training.evaluate import evaluate
from autoaccum.training.progress import Progress
from autoaccum.training.resume import RunPosition, save_run
from autoaccum.units import counted, format_bytes

__all__ = ["MAX_SKIPPED_STEPS", "Run", "train"]

logger = logging.getLogger("autoaccum.fit")  # fit's own logger (OutputConfig.verbose), not this module's name

#: consecutive steps skipped for inf/NaN gradients before fit stops (the fp16 GradScaler skips a few at the
#: start while it finds its scale; under nonfinite="skip" a long streak means every step is broken)
MAX_SKIPPED_STEPS = 25


@dataclass
class Run:
    """The objects one run trains with (built once by ``fit``, used by the loop)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    guard: OOMGuard
    sync: GradSync
    loss_fn: LossFn
    device: torch.device
    config: FitConfig
    target_batch: int
    lr: float
    ckpt_dir: Path | None
    position: RunPosition


@dataclass
class _Tally:
    """What the loop adds up over the run's steps (for its summary)."""

    first_samples: int
    train_time: float = 0.0
    peak: int | None = None
    skipped_streak: int = 0
    micro_steps: list[int] = field(default_factory=list)


@dataclass
class _Evaluation:
    """Evaluation on ``eval_batches`` (at ``eval_every`` and at the end), its micro-batch carried from one
    to the next: no activations are kept for backward, so it usually fits twice the training's."""

    run: Run
    batches: GlobalBatches
    budget: TrackedMemory | None
    micro: int
    loss: float | None = None
    ooms: int = 0
    at: int | None = None  # the step last evaluated after

    def __call__(self, progress: Progress) -> float:
        # the emulated device counts each attempt's forwards, not the host's drawing of the eval batches
        guard = self.run.guard
        result = evaluate(self.run.model, self.batches, self.run.loss_fn, self.micro, sync=self.run.sync,
                          device=self.run.device, autocast_dtype=guard.autocast_dtype, cut=guard.cut,
                          budget=self.budget)
        self.loss, self.micro, self.ooms, self.at = result.loss, result.micro_batch, self.ooms + result.ooms, \
            self.run.position.steps
        progress.say(f"step {self.at}: eval loss {self.loss:.4g}")
        return self.loss


def train(run: Run, batches: GlobalBatches, eval_batches: GlobalBatches | None, progress: Progress,
          meter: Meter | None) -> dict[str, Any]:
    """The loop: epochs of global batches, each one guarded optimizer step; evaluation and checkpoints."""
    pos, cfg, guard = run.position, run.config, run.guard
    tally = _Tally(pos.samples)
    evaluation = None if eval_batches is None else _Evaluation(
        run, eval_batches, meter if isinstance(meter, TrackedMemory) else None, 2 * guard.plan.micro_batch)
    epochs, max_steps, eval_every = cfg.stop.epochs, cfg.stop.max_steps, cfg.output.eval_every
    # Under an emulated budget the meter is entered around each step and evaluation attempt only: a real
    # device holds the micro-batches it is sent (the guard copies them in), not the host's batches.
    device_region = meter if meter is not None else contextlib.nullcontext()
    done = max_steps is not None and pos.steps >= max_steps
    while not done and (epochs is None or pos.epoch < epochs):
        fresh_epoch, drawn = pos.index == 0, False
        for rb in batches.epoch(pos.epoch, pos.index):
            drawn = True
            try:
                with device_region:  # the emulated device counts the step, not the host's drawing of the batch
                    result = guard.step(rb.batch, run.loss_fn, partial=rb.partial or rb.global_size < run.target_batch)
            except NonFiniteError as exc:
                raise _stopped(exc, run, pos, rb.index) from None
            record = _count(result, run, pos, tally, rb.index)
            if evaluation is not None and eval_every is not None and pos.steps % eval_every == 0:
                record["eval_loss"] = evaluation(progress)  # in the step's metrics: each step reported once
            progress.step(record, result.plan)
            if cfg.checkpoint.every is not None and pos.steps % cfg.checkpoint.every == 0:
                _save(run)
            if max_steps is not None and pos.steps >= max_steps:
                done = True
                break
        else:
            if fresh_epoch and not drawn:  # an exhausted iterator (a generator): another pass yields nothing
                if pos.steps:
                    logger.log(rank_level(logging.WARNING, run.sync.rank), "the data yielded no batch in epoch %d; "
                               "stopping after %d steps", pos.epoch, pos.steps)
                break
            pos.epoch, pos.index = pos.epoch + 1, 0
    if evaluation is not None and evaluation.at != pos.steps:  # the end, unless just evaluated
        progress.evaluated(pos.steps, evaluation(progress))
    _save(run)
    return _summary(run, tally, evaluation, progress)


def _count(result: StepResult, run: Run, pos: RunPosition, tally: _Tally, batch_index: int) -> dict[str, Any]:
    """A step done: the run's position and tally moved on; the step's line of the metrics file."""
    pos.steps += 1
    pos.skipped += result.skipped
    pos.samples += result.num_samples
    pos.index = batch_index + 1
    tally.train_time += result.step_time_s
    tally.skipped_streak = _check_step(result, run, pos, tally.skipped_streak)
    pos.losses.append(result.loss)
    pos.last_loss = result.loss
    tally.micro_steps.append(result.micro_steps)
    if result.peak_bytes is not None:
        tally.peak = max(tally.peak or 0, result.peak_bytes)
    return _record(result, pos)


def _save(run: Run) -> None:
    save_run(run.ckpt_dir, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, scaler=run.scaler,
             guard=run.guard, position=run.position, seed=run.config.data.seed, target_batch=run.target_batch,
             lr=run.lr, rank=run.sync.rank)


def _summary(run: Run, tally: _Tally, evaluation: _Evaluation | None, progress: Progress) -> dict[str, Any]:
    """The run's last line and the figures ``fit``'s result takes from the loop."""
    pos, guard = run.position, run.guard
    if pos.last_loss is None:
        raise AutoAccumError("no optimizer step ran: the data yielded no batch")
    rate = (pos.samples - tally.first_samples) / tally.train_time if tally.train_time > 0 else 0.0
    eval_loss = None if evaluation is None else evaluation.loss
    progress.say(f"autoaccum fit done · {counted(pos.steps, 'step')}, {counted(pos.samples, 'sample')} · final loss "
                 f"{pos.last_loss:.4g}" + ("" if eval_loss is None else f" · eval loss {eval_loss:.4g}")
                 + f" · {rate:,.0f} samples/s · {counted(guard.ooms, 'OOM')} recovered · {guard.plan.describe()}"
                 + ("" if tally.peak is None else f" · peak {format_bytes(tally.peak)}"))
    return {"eval_loss": eval_loss, "eval_ooms": 0 if evaluation is None else evaluation.ooms,
            "samples_per_s": rate, "peak_bytes": tally.peak, "micro_steps": tally.micro_steps}


def _stopped(exc: NonFiniteError, run: Run, pos: RunPosition, batch_index: int) -> NonFiniteError:
    """The guard's inf/NaN stop, with where the run stands (nothing of the step reached the weights)."""
    last = "" if run.ckpt_dir is None else f" The last checkpoint in {run.ckpt_dir} is intact."
    step = f"optimizer step {exc.step}"
    return NonFiniteError(str(exc).replace(step, f"{step} (epoch {pos.epoch}, batch {batch_index})", 1) + last,
                          exc.step)


def _check_step(result: StepResult, run: Run, pos: RunPosition, skipped_streak: int) -> int:
    """Stop where every step is skipped for inf/NaN gradients (the guard checked each step before
    ``optimizer.step()``); returns the skip streak."""
    skipped_streak = skipped_streak + 1 if result.skipped else 0
    if skipped_streak >= MAX_SKIPPED_STEPS:
        who = "the fp16 GradScaler" if run.scaler is not None else "nonfinite='skip'"
        fix = "Try precision='bf16' or a lower lr." if run.scaler is not None else \
            "Check the data and the loss for inf/NaN, lower the lr or clip gradients (max_grad_norm=1.0)."
        raise AutoAccumError(f"{skipped_streak} optimizer steps in a row were skipped for inf/NaN gradients (by "
                             f"{who}), the last at step {pos.steps}; stopping. {fix}")
    return skipped_streak


def _record(result: StepResult, pos: RunPosition) -> dict[str, Any]:
    """One line of the metrics file."""
    return {
        "step": pos.steps, "epoch": pos.epoch, "loss": result.loss, "lr": result.lr, "samples": pos.samples,
        "micro_batch": result.plan.micro_batch, "accum_steps": result.plan.accum_steps,
        "micro_steps": result.micro_steps,
        "peak_bytes": result.peak_bytes, "step_time_s": result.step_time_s,
        "samples_per_s": result.num_samples / result.step_time_s if result.step_time_s else 0.0,
        "ooms": len([c for c in result.changes if c.reason == "oom"]), "skipped": result.skipped,
    }
