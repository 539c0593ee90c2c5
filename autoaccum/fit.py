"""``autoaccum.fit``: one call from a model and data to a trained model at an exact global batch.

probe -> plan -> guard, with the LR rule, warmup, evaluation, progress, metrics and resume:

    result = autoaccum.fit(model, (inputs, targets), target_batch=256)

Each optimizer step draws exactly ``target_batch`` samples (see ``autoaccum.data`` for how the
last batch of an epoch is treated) and its gradient equals that of one full-batch step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from autoaccum import checkpoint as ckpt
from autoaccum import distributed
from autoaccum.batch import Batch, batch_size, micro_sizes, split_batch
from autoaccum.data import GlobalBatches
from autoaccum.errors import AutoAccumError, DoesNotFitError, TaskError
from autoaccum.guard import OOMGuard, PlanChange
from autoaccum.lr import LR_RULES, scale_adam_hparams, scale_lr, warmup_lambda
from autoaccum.memory import TrackedMemory
from autoaccum.oom import is_oom
from autoaccum.plan import Plan, check_positive_int, read_plan
from autoaccum.probe import ProbeReport, check_headroom, probe
from autoaccum.state import capture_rng, restore_rng
from autoaccum.sync import GradSync, LocalSync
from autoaccum.task import LossFn, Task, trainable_parameters
from autoaccum.units import format_bytes, parse_bytes

__all__ = ["fit", "FitResult", "Precision", "default_loss", "load_plan"]

logger = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16"]
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINT_FORMAT = "autoaccum.fit/1"
#: consecutive steps the fp16 GradScaler may skip before fit stops (a few are normal at the start)
MAX_SKIPPED_STEPS = 25


@dataclass(frozen=True)
class FitResult:
    """What ``fit`` did.

    Attributes:
        plan: the plan training started with; ``final_plan`` the one in force at the end.
        plan_source: ``probe``, ``cache``, ``given`` or ``checkpoint``.
        plan_changes: every change of plan (OOM shrinks, growth), in order.
        optimizer_steps, samples_seen: counted over the whole run (resumed runs included).
        oom_events: OOMs recovered in training; eval_ooms: in evaluation.
        final_loss: the last step's loss (sample- or token-weighted); losses: every step's loss.
        eval_loss: the last evaluation's loss, None without eval_data.
        lr: the learning rate the rule set (before warmup).
        samples_per_s: samples per second of training steps in this call (probe excluded).
        peak_bytes: the largest step peak (CUDA allocator or emulated budget), None if not measured.
        wall_time_s, probe_time_s: this call's wall time and the part spent probing.
        probe: the probe report, when this call probed.
    """

    plan: Plan
    final_plan: Plan
    plan_source: str
    plan_changes: tuple[PlanChange, ...]
    optimizer_steps: int
    samples_seen: int
    oom_events: int
    eval_ooms: int
    final_loss: float
    losses: tuple[float, ...]
    eval_loss: float | None
    lr: float
    samples_per_s: float
    peak_bytes: int | None
    wall_time_s: float
    probe_time_s: float
    probe: ProbeReport | None = field(default=None, repr=False)


def default_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)`` against ``targets`` for an ``(inputs, targets)`` batch."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TaskError(f"the default loss needs (inputs, targets) batches, got a {type(batch).__name__}"
                        f"{' of ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}; pass "
                        f"loss_fn=lambda model, batch: ... returning a mean loss or (loss_sum, num_items)")
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def load_plan(plan: Any, target_batch: int, world_size: int) -> Plan:
    """:func:`~autoaccum.plan.read_plan`, checked against the run's target and world size."""
    plan = read_plan(plan)
    if plan.target_batch != target_batch:
        raise ValueError(f"the plan is for target_batch {plan.target_batch}, this run's is {target_batch}; the "
                         f"global batch is never changed silently: pass target_batch={plan.target_batch} or re-plan")
    return plan.with_world_size(world_size) if plan.world_size != world_size else plan


def _warn_unapplied_knobs(plan: Any, precision: str) -> None:
    """A search plan file also names knobs (autocast, checkpointing, compile); fit applies only the
    plan and its own ``precision``, so say so rather than train differently from what was measured."""
    doc: Any = plan
    if isinstance(plan, (str, os.PathLike)):
        try:
            doc = json.loads(Path(plan).read_text())
        except (OSError, ValueError):
            return  # load_plan has read it already; nothing more to say
    knobs = doc.get("knobs") if isinstance(doc, dict) else getattr(getattr(doc, "knobs", None), "__dict__", None)
    if not isinstance(knobs, dict):
        return
    autocast = knobs.get("autocast", "fp32")
    extra = [k for k in ("checkpointing", "compile") if knobs.get(k)]
    if extra or autocast != precision:
        warnings.warn(f"the plan was measured with knobs {knobs}; fit applies the plan's micro-batch and "
                      f"precision={precision!r} only. Pass precision={autocast!r}"
                      + (f" and apply {', '.join(extra)} with autoaccum.knobs.apply_knobs(model, ...)" if extra else "")
                      + " to train as measured.", stacklevel=3)


def _make_sync(model: torch.nn.Module) -> tuple[torch.nn.Module, GradSync]:
    """The model to train (wrapped for data parallelism where needed) and how its ranks agree.

    Under torch.distributed with more than one rank: DDP unless the model is already DDP or FSDP2
    (``fully_shard``), and a :class:`~autoaccum.distributed.DistributedSync` (every micro-batch under
    no_sync, the OOM flag exchanged after them, gradients summed once per step)."""
    if not distributed.is_distributed() or distributed.world_info().world_size == 1:
        return model, LocalSync()
    model = distributed.wrap_model(model)
    return model, distributed.DistributedSync(model)


def _check_args(target_batch: int, lr: float | None, base_batch: int | None, lr_rule: str, warmup_steps: int,
                epochs: int | None, max_steps: int | None, headroom: float, precision: str,
                eval_every: int | None, checkpoint_every: int | None) -> None:
    """Every argument problem, found before any work."""
    check_positive_int(target_batch, "target_batch")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)
                           or lr <= 0):
        raise ValueError(f"Invalid lr: {lr!r}. Allowed range: finite and > 0")
    if base_batch is not None:
        check_positive_int(base_batch, "base_batch", hint=" (the global batch the lr was tuned for)")
    if lr_rule not in LR_RULES:
        raise ValueError(f"Invalid lr_rule: {lr_rule!r}. Allowed values: {', '.join(LR_RULES)}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"Invalid warmup_steps: {warmup_steps!r}. Allowed range: 0 ~ any positive int")
    if epochs is None and max_steps is None:
        raise ValueError("give epochs= (passes over the data) or max_steps= (optimizer steps), or both")
    if epochs is not None:
        check_positive_int(epochs, "epochs")
    if max_steps is not None:
        check_positive_int(max_steps, "max_steps")
    check_headroom(headroom)
    if precision not in _AUTOCAST:
        raise ValueError(f"Invalid precision: {precision!r}. Allowed values: {', '.join(get_args(Precision))}")
    if eval_every is not None:
        check_positive_int(eval_every, "eval_every")
    if checkpoint_every is not None:
        check_positive_int(checkpoint_every, "checkpoint_every")


def _shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in model.state_dict().items()}


class _Reporter:
    """Banner, progress bar, metrics file and summary; quiet unless asked and on a terminal."""

    def __init__(self, progress: bool, total: int | None, log_file: str | os.PathLike | None, rank: int) -> None:
        self.rank = rank
        self.interactive = progress and rank == 0 and sys.stderr.isatty()
        self.bar: Any = None
        if self.interactive:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.log = open(log_file, "a") if log_file is not None and rank == 0 else None  # noqa: SIM115

    def say(self, message: str) -> None:
        if self.rank == 0:
            logger.info(message)
        if self.interactive:
            self.bar.write(message, file=sys.stderr)

    def step(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        if self.bar is not None:
            peak = record["peak_bytes"]
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4g} · lr {record['lr']:.3g} · {record['samples_per_s']:,.0f} samples/s · "
                f"micro {record['micro_batch']} x accum {record['accum_steps']}"
                + ("" if peak is None else f" · peak {format_bytes(peak)}"), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()


def _evaluate(model: torch.nn.Module, batches: GlobalBatches, loss_fn: LossFn, micro: int, sync: GradSync,
              device: torch.device, autocast_dtype: torch.dtype | None) -> tuple[float, int, int]:
    """Loss over ``batches`` without gradients. An OOM halves only the evaluation micro-batch.

    Returns ``(loss, micro_batch in force at the end, OOMs)``."""
    from autoaccum.batch import move_to

    was_training = model.training
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)  # loss sum, item or sample count, token-level flag
    ooms = 0
    try:
        for rb in batches.epoch(0):
            n = batch_size(rb.batch)
            done = False
            while not done:
                part_total = torch.zeros(3, dtype=torch.float64)
                failed = False
                try:
                    sizes = micro_sizes(n, micro)
                    with torch.no_grad():
                        for part, size in zip(split_batch(rb.batch, sizes), sizes):
                            with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else \
                                    torch.autocast(device.type, enabled=False):
                                out = loss_fn(model, move_to(part, device))
                            if isinstance(out, (tuple, list)):
                                part_total += torch.tensor([float(out[0]), float(out[1]), 1.0], dtype=torch.float64)
                            else:
                                part_total += torch.tensor([float(out) * size, size, 0.0], dtype=torch.float64)
                    done = True
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    failed = True
                if failed:  # outside the except block: the failed pass's tensors are free now
                    ooms += 1
                    if micro == 1:
                        raise DoesNotFitError(None, None, suggestions=(
                            "evaluate on shorter sequences or a smaller model",
                            "evaluate under bf16 autocast (precision='bf16')",
                            "pass eval_data=None and evaluate separately on a larger device"))
                    old, micro = micro, micro // 2
                    logger.warning("OOM in evaluation: eval micro-batch %d -> %d (training plan unchanged)", old, micro)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                total[0] += part_total[0]
                total[1] += part_total[1]
                total[2] = max(total[2], min(part_total[2], 1))
        total = sync.sum_items(total.to(device)).cpu() if sync.world_size > 1 else total
    finally:
        model.train(was_training)
    return float(total[0] / max(total[1], 1)), micro, ooms


def fit(
    model: torch.nn.Module,
    data: Any,
    target_batch: int = 256,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float | None = None,
    base_batch: int | None = None,
    lr_rule: str = "linear",
    warmup_steps: int = 0,
    epochs: int | None = 1,
    max_steps: int | None = None,
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    headroom: float = 0.1,
    plan: Plan | ProbeReport | dict | str | os.PathLike | None = None,
    max_grad_norm: float | None = None,
    precision: str = "fp32",
    eval_data: Any = None,
    eval_every: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    progress: bool = True,
    log_file: str | os.PathLike | None = None,
    seed: int = 0,
    probe_cache: bool = False,
    grow_after: int | None = None,
) -> FitResult:
    """Train ``model`` on ``data`` with exactly ``target_batch`` samples per optimizer step.

    Args:
        model: the module to train; moved to ``device``.
        data: a tuple of tensors sharing dim 0, a map-style Dataset (collated with
            ``default_collate``), or an iterable/DataLoader yielding global batches (under
            torch.distributed: this rank's share). Indexed data is reshuffled every epoch from
            ``seed``; the last batch of an epoch holds the samples that remain and is a real
            step on them, weighted exactly (its global batch is smaller, never padded or dropped).
        target_batch: samples per optimizer step over all ranks; never changed.
        loss_fn: ``loss_fn(model, batch)`` -> mean loss or ``(loss_sum, num_items)``; default
            cross-entropy of ``model(inputs)`` against ``targets``.
        optimizer: an optimizer over ``model``'s parameters; default AdamW(lr).
        lr: the learning rate tuned for ``base_batch`` (default: the optimizer's, or 1e-3).
        base_batch: the global batch ``lr`` was tuned for; when it differs from ``target_batch``
            the LR is rescaled by ``lr_rule`` (``linear``, ``sqrt``, ``adam_sde``, ``none``).
        warmup_steps: linear LR warmup over this many optimizer steps.
        epochs, max_steps: stop after ``epochs`` passes or ``max_steps`` steps, whichever first.
        device: default CUDA if available, else CPU.
        budget: memory budget ("8GiB"): the probe plans for it, and on devices other than CUDA
            training runs under an emulated budget of that size (a real OOM at the crossing).
        headroom: fraction of the budget the plan keeps free.
        plan: skip probing: a Plan, a ProbeReport, or a probe/search JSON file.
        max_grad_norm: clip the global gradient norm once per step.
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + GradScaler).
        eval_data, eval_every: evaluate without gradients every ``eval_every`` steps and at the end.
        checkpoint_dir, checkpoint_every: save atomically every N steps and at the end.
        resume: continue from the checkpoint in ``checkpoint_dir``; bit-identical to a run that
            was never interrupted (CPU, fp32).
        progress: a progress bar on a terminal (stderr); nothing otherwise but logging.
        log_file: append one JSON line of metrics per optimizer step.
        seed: the data order's seed.
        probe_cache: reuse a cached probe result with the same fingerprint.
        grow_after: let the guard grow the micro-batch back after this many calm steps.

    Returns:
        A :class:`FitResult`.

    Raises:
        ValueError, TypeError: invalid arguments (before any work).
        DoesNotFitError: even a micro-batch of 1 does not fit.
        AutoAccumError: the loss is NaN/inf (stops at once), or the fp16 scaler skips every step.
    """
    started = time.perf_counter()
    _check_args(target_batch, lr, base_batch, lr_rule, warmup_steps, epochs, max_steps, headroom, precision,
                eval_every, checkpoint_every)
    budget_bytes = None if budget is None else parse_bytes(budget)
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir= (where the checkpoint is)")
    ckpt_dir = None if checkpoint_dir is None else ckpt.check_writable(checkpoint_dir)
    distributed.init_from_env()  # under torchrun without a process group: create it (and pick cuda:LOCAL_RANK)
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    trainable_parameters(model)
    model.to(dev)
    model.train()
    model, sync = _make_sync(model)
    inner = getattr(model, "module", model)
    batches = GlobalBatches(data, target_batch, seed=seed, rank=sync.rank, world_size=sync.world_size)
    eval_batches = None if eval_data is None else \
        GlobalBatches(eval_data, target_batch, seed=seed, rank=sync.rank, world_size=sync.world_size)
    if batches.num_samples is not None and batches.is_indexed and batches.num_samples < target_batch:
        raise ValueError(f"data holds {batches.num_samples} samples, fewer than one global batch of {target_batch}; "
                         f"lower target_batch or add data (the global batch is never shrunk silently)")
    loss_fn = loss_fn if loss_fn is not None else default_loss
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")

    # -- optimizer and the LR rule (invariant 5: the LR follows the global batch only) -----------
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=lr if lr is not None else 1e-3)
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    elif lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    # resume=True with no checkpoint yet (a restartable job's first start) is a fresh run: the rule applies
    state = ckpt.load_checkpoint(ckpt_dir) if resume and ckpt_dir is not None else None
    if base_batch is not None and base_batch != target_batch and state is None:
        for group in optimizer.param_groups:
            if lr_rule == "adam_sde" and "betas" in group and "eps" in group:
                # Malladi et al. 2022: lr * sqrt(k), 1 - beta -> k * (1 - beta), eps / sqrt(k)
                group["lr"], group["betas"], group["eps"] = scale_adam_hparams(
                    group["lr"], tuple(group["betas"]), group["eps"], base_batch, target_batch)
            else:
                group["lr"] = scale_lr(group["lr"], base_batch, target_batch, lr_rule)  # type: ignore[arg-type]
    run_lr = float(optimizer.param_groups[0]["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(warmup_steps)) if warmup_steps else None
    autocast_dtype = _AUTOCAST[precision]
    scaler = torch.amp.GradScaler(dev.type) if precision == "fp16" else None

    # -- the plan: checkpoint, given, or probed ----------------------------------------------------
    report: ProbeReport | None = None
    probe_time = 0.0
    if state is not None:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{ckpt_dir} holds a checkpoint of format {state.get('format')!r}, not {CHECKPOINT_FORMAT}")
        if state["shapes"] != _shapes(inner):
            diff = next((k for k in set(state["shapes"]) | set(_shapes(inner))
                         if state["shapes"].get(k) != _shapes(inner).get(k)), "?")
            raise ValueError(f"the checkpoint in {ckpt_dir} was written for a model of other shapes (first difference: "
                             f"{diff!r}: {state['shapes'].get(diff)} vs {_shapes(inner).get(diff)}); resume it with "
                             f"the same model, or use another checkpoint_dir / resume=False")
        if state["target_batch"] != target_batch:
            raise ValueError(f"the checkpoint was written with target_batch {state['target_batch']}, this run asks for "
                             f"{target_batch}; resume with the same global batch")
        if state.get("seed", seed) != seed:  # another order would repeat some samples of the epoch and skip others
            raise ValueError(f"the checkpoint was written with seed {state['seed']}, this run asks for seed {seed}; "
                             f"resume with seed={state['seed']} (the data order of the epoch in progress)")
        start_plan = Plan.from_dict(state["guard"]["plan"]).with_world_size(sync.world_size)
        plan_source = "checkpoint"
    elif plan is not None:
        start_plan, plan_source = load_plan(plan, target_batch, sync.world_size), "given"
        _warn_unapplied_knobs(plan, precision)
    else:
        if isinstance(sync, distributed.DistributedSync) and sync.kind == "fsdp2":
            raise ValueError("fit cannot probe an FSDP2 (fully_shard) model: the probe's steps would run collectives "
                             "whose number depends on each rank's measurements. Pass plan= (e.g. a probe report "
                             "of one unsharded replica, or autoaccum.Plan.for_target(target_batch, micro_batch))")
        sample = batches.sample
        # the module itself, not a DDP wrapper: each rank measures on its own, with no collective
        task = Task(model=inner, loss_fn=loss_fn, make_batch=sample, name="fit")
        report = probe(task, optimizer=optimizer, target_batch=target_batch, world_size=sync.world_size,
                       budget=budget_bytes, headroom=headroom, cache=probe_cache)
        probe_time = report.wall_time_s
        start_plan, plan_source = report.plan, report.source
    if sync.world_size > 1:  # one plan for every rank: the smallest micro-batch any rank can run
        start_plan = distributed.broadcast_plan(start_plan)
    meter = TrackedMemory(budget_bytes=budget_bytes) if budget_bytes is not None and dev.type != "cuda" else None
    guard = OOMGuard(model, optimizer, plan=start_plan, scheduler=scheduler, scaler=scaler,
                     max_grad_norm=max_grad_norm, autocast_dtype=autocast_dtype, sync=sync, meter=meter,
                     grow_after=grow_after)

    epoch, index, steps, samples, losses = 0, 0, 0, 0, []
    if state is not None:
        distributed.load_full_state_dicts(model, optimizer, state["model"], state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
        guard.load_state_dict(state["guard"])
        epoch, index = int(state["position"]["epoch"]), int(state["position"]["index"])
        steps, samples = int(state["counters"]["steps"]), int(state["counters"]["samples"])
        losses = [float(x) for x in state["counters"]["losses"]]
        restore_rng(ckpt.rng_from_plain(state["rng"]))
        run_lr = float(state["lr"])

    def save(position_epoch: int, position_index: int) -> None:
        if ckpt_dir is None:
            return
        model_state, optimizer_state = distributed.full_state_dicts(model, optimizer)  # FSDP2: every rank gathers
        if sync.rank != 0:  # one writer
            return
        ckpt.save_checkpoint(ckpt_dir, {
            "format": CHECKPOINT_FORMAT, "model": model_state, "optimizer": optimizer_state,
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(), "guard": guard.state_dict(),
            "position": {"epoch": position_epoch, "index": position_index}, "seed": seed,
            "target_batch": target_batch, "lr": run_lr, "shapes": _shapes(inner),
            "counters": {"steps": steps, "samples": samples, "losses": list(losses)},
            "rng": ckpt.rng_to_plain(capture_rng()),
        })

    per_epoch = batches.steps_per_epoch
    total = max_steps if epochs is None or per_epoch is None else \
        min(max_steps or epochs * per_epoch, epochs * per_epoch)
    reporter = _Reporter(progress, total, log_file, sync.rank)
    budget_text = "" if budget_bytes is None else \
        f" · budget {format_bytes(budget_bytes)}{' (emulated)' if meter is not None else ''}"
    reporter.say(f"autoaccum fit · {dev}{budget_text} · {start_plan.describe()} (plan from {plan_source}) · "
                 f"lr {run_lr:.4g}" + ("" if base_batch in (None, target_batch) else
                                        f" ({lr_rule} rule from base batch {base_batch})")
                 + (f" · resuming at step {steps}" if state is not None else ""))
    eval_micro = 2 * start_plan.micro_batch  # no activations are kept for backward: usually fits twice as many
    eval_loss: float | None = None
    eval_ooms = 0
    evaluated_at: int | None = None
    first_samples = samples
    peak: int | None = None
    skipped_streak = 0
    train_time = 0.0
    if meter is not None:  # the emulated device: the step's allocations count against the budget
        meter.track(model, optimizer)
        meter.__enter__()
    try:
        done = max_steps is not None and steps >= max_steps
        while not done and (epochs is None or epoch < epochs):
            fresh_epoch, drawn = index == 0, False
            for rb in batches.epoch(epoch, index):
                drawn = True
                result = guard.step(rb.batch, loss_fn, partial=rb.partial or rb.global_size < target_batch)
                steps += 1
                samples += result.num_samples
                train_time += result.step_time_s
                index = rb.index + 1
                if not math.isfinite(result.loss) and scaler is None:
                    raise AutoAccumError(
                        f"the loss is {result.loss} at optimizer step {steps} (epoch {epoch}, batch {rb.index}); "
                        f"stopping. Check the data and the loss for inf/NaN, lower the lr ({run_lr:.3g}), or clip "
                        f"gradients (max_grad_norm=1.0).")
                skipped_streak = skipped_streak + 1 if result.skipped else 0
                if skipped_streak >= MAX_SKIPPED_STEPS:
                    raise AutoAccumError(f"the fp16 GradScaler skipped {skipped_streak} steps in a row (inf/NaN "
                                         f"gradients at every scale); stopping. Try precision='bf16' or a lower lr.")
                losses.append(result.loss)
                if result.peak_bytes is not None:
                    peak = max(peak or 0, result.peak_bytes)
                reporter.step({
                    "step": steps, "epoch": epoch, "loss": result.loss, "lr": result.lr, "samples": samples,
                    "micro_batch": result.plan.micro_batch, "accum_steps": result.plan.accum_steps,
                    "peak_bytes": result.peak_bytes, "step_time_s": result.step_time_s,
                    "samples_per_s": result.num_samples / result.step_time_s if result.step_time_s else 0.0,
                    "ooms": len([c for c in result.changes if c.reason == "oom"]),
                })
                if eval_batches is not None and eval_every is not None and steps % eval_every == 0:
                    eval_loss, eval_micro, n = _evaluate(model, eval_batches, loss_fn, eval_micro, sync, dev,
                                                         autocast_dtype)
                    eval_ooms += n
                    evaluated_at = steps
                    reporter.say(f"step {steps}: eval loss {eval_loss:.4g}")
                if checkpoint_every is not None and steps % checkpoint_every == 0:
                    save(epoch, index)
                if max_steps is not None and steps >= max_steps:
                    done = True
                    break
            else:
                if fresh_epoch and not drawn:  # an exhausted iterator (a generator): another pass yields nothing
                    if steps:
                        logger.warning("the data yielded no batch in epoch %d; stopping after %d steps", epoch, steps)
                    break
                epoch, index = epoch + 1, 0
        if eval_batches is not None and evaluated_at != steps:  # the end, unless just evaluated
            eval_loss, eval_micro, n = _evaluate(model, eval_batches, loss_fn, eval_micro, sync, dev, autocast_dtype)
            eval_ooms += n
        save(epoch, index)
        if losses:
            rate = (samples - first_samples) / train_time if train_time > 0 else 0.0
            reporter.say(f"autoaccum fit done · {steps} steps, {samples:,} samples · final loss {losses[-1]:.4g}"
                         + ("" if eval_loss is None else f" · eval loss {eval_loss:.4g}")
                         + f" · {rate:,.0f} samples/s · {guard.ooms} OOMs · {guard.plan.describe()}"
                         + ("" if peak is None else f" · peak {format_bytes(peak)}"))
    finally:
        if meter is not None:
            meter.__exit__(None, None, None)
            meter.close()
        reporter.close()
    if not losses:
        raise AutoAccumError("no optimizer step ran: the data yielded no batch")
    return FitResult(
        plan=start_plan, final_plan=guard.plan, plan_source=plan_source, plan_changes=tuple(guard.changes),
        optimizer_steps=steps, samples_seen=samples, oom_events=guard.ooms, eval_ooms=eval_ooms,
        final_loss=losses[-1], losses=tuple(losses), eval_loss=eval_loss, lr=run_lr,
        samples_per_s=(samples - first_samples) / train_time if train_time > 0 else 0.0,
        peak_bytes=peak, wall_time_s=time.perf_counter() - started, probe_time_s=probe_time, probe=report,
    )
