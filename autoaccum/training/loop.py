"""The training loop of ``fit``: epochs of global batches, one guarded optimizer step each, with
evaluation, checkpoints and progress; it stops on a run of inf/NaN-skipped steps."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
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


def train(run: Run, batches: GlobalBatches, eval_batches: GlobalBatches | None, progress: Progress,
           meter: Meter | None) -> dict[str, Any]:
    """The loop: epochs of global batches, each one guarded optimizer step; evaluation and checkpoints."""
    pos, cfg, guard = run.position, run.config, run.guard
    first_samples, train_time, peak, skipped_streak = pos.samples, 0.0, None, 0
    micro_steps: list[int] = []
    eval_micro = 2 * guard.plan.micro_batch  # no activations are kept for backward: usually fits twice as many
    eval_loss, eval_ooms, evaluated_at = None, 0, None
    epochs, max_steps = cfg.stop.epochs, cfg.stop.max_steps
    # Under an emulated budget the meter is entered around each step and evaluation attempt only: a real
    # device holds the micro-batches it is sent (the guard copies them in), not the host's batches.
    device_region = meter if meter is not None else contextlib.nullcontext()

    def run_eval() -> float:
        nonlocal eval_loss, eval_micro, eval_ooms, evaluated_at
        # the emulated device counts each attempt's forwards, not the host's drawing of the eval batches
        result = evaluate(run.model, eval_batches, run.loss_fn, eval_micro, sync=run.sync,  # type: ignore[arg-type]
                          device=run.device, autocast_dtype=guard.autocast_dtype, cut=guard.cut,
                          budget=meter if isinstance(meter, TrackedMemory) else None)
        eval_loss, eval_micro, eval_ooms, evaluated_at = result.loss, result.micro_batch, eval_ooms + result.ooms, \
            pos.steps
        progress.say(f"step {pos.steps}: eval loss {eval_loss:.4g}")
        return eval_loss

    def save() -> None:
        save_run(run.ckpt_dir, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, scaler=run.scaler,
                 guard=guard, position=pos, seed=cfg.data.seed, target_batch=run.target_batch, lr=run.lr,
                 rank=run.sync.rank)

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
            pos.steps += 1
            pos.skipped += result.skipped
            pos.samples += result.num_samples
            pos.index = rb.index + 1
            train_time += result.step_time_s
            skipped_streak = _check_step(result, run, pos, skipped_streak)
            pos.losses.append(result.loss)
            pos.last_loss = result.loss
            micro_steps.append(result.micro_steps)
            if result.peak_bytes is not None:
                peak = max(peak or 0, result.peak_bytes)
            record = _record(result, pos)
            if (eval_batches is not None and cfg.output.eval_every is not None
                    and pos.steps % cfg.output.eval_every == 0):
                record["eval_loss"] = run_eval()  # in the step's metrics: each step reported once
            progress.step(record, result.plan)
            if cfg.checkpoint.every is not None and pos.steps % cfg.checkpoint.every == 0:
                save()
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
    if eval_batches is not None and evaluated_at != pos.steps:  # the end, unless just evaluated
        progress.evaluated(pos.steps, run_eval())
    save()
    if pos.last_loss is None:
        raise AutoAccumError("no optimizer step ran: the data yielded no batch")
    rate = (pos.samples - first_samples) / train_time if train_time > 0 else 0.0
    progress.say(f"autoaccum fit done · {counted(pos.steps, 'step')}, {counted(pos.samples, 'sample')} · final loss "
                 f"{pos.last_loss:.4g}" + ("" if eval_loss is None else f" · eval loss {eval_loss:.4g}")
                 + f" · {rate:,.0f} samples/s · {counted(guard.ooms, 'OOM')} recovered · {guard.plan.describe()}"
                 + ("" if peak is None else f" · peak {format_bytes(peak)}"))
    return {"eval_loss": eval_loss, "eval_ooms": eval_ooms, "samples_per_s": rate, "peak_bytes": peak,
            "micro_steps": micro_steps}


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
