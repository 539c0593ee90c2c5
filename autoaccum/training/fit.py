"""``autoaccum.fit``: one call from a model and data to a trained model at an exact global batch.

The recipe, over components that live apart (the way torchtune separates recipes from them)::

    options -> FitConfig (training.config)       validated in one place, before any work
    plan    <- checkpoint | given | probe        (training.plans, probe)
    guard   =  OOMGuard(plan)                    exact accumulation, OOM replay (guard.guard)
    loop    :  global batches (plan.data) -> guard.step -> progress (training.loop, training.progress)
               -> evaluation (training.evaluate) -> checkpoint (training.checkpoint, training.resume)

    result = autoaccum.fit(model, (inputs, targets), target_batch=256)

Each optimizer step draws exactly ``target_batch`` samples (see ``autoaccum.plan.data`` for how the
last batch of an epoch is treated) and its gradient equals that of one full-batch step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from autoaccum import distributed
from autoaccum.distributed.sync import GradSync, LocalSync
from autoaccum.guard.guard import OOMGuard, PlanChange
from autoaccum.log import ensure_visible, quiet
from autoaccum.memory import emulated_device
from autoaccum.memory.model import MemoryModel
from autoaccum.plan.batch import move_to
from autoaccum.plan.batchnorm import smallest_micro_batch
from autoaccum.plan.cut import SampleCut, TokenCut
from autoaccum.plan.data import GlobalBatches
from autoaccum.plan.plan import Plan, rank_share
from autoaccum.plan.sources import source_words
from autoaccum.plan.task import LossFn, Task, check_loss_fn, check_optimizer, trainable_parameters
from autoaccum.precision import autocast_dtype, make_scaler
from autoaccum.probe.report import ProbeReport
from autoaccum.probe.run import probe
from autoaccum.step.losses import DefaultLoss, default_loss
from autoaccum.training import checkpoint as ckpt
from autoaccum.training.config import FitConfig
from autoaccum.training.loop import Run, train
from autoaccum.training.lr import apply_lr_rule, build_scheduler, warmup_lambda
from autoaccum.training.plans import choose_plan
from autoaccum.training.progress import Progress
from autoaccum.training.resume import RunPosition, check_resumable, restore_run
from autoaccum.training.trackers import Reporter, check_backends
from autoaccum.units import format_bytes
from autoaccum.validate import check_positive_int, resolve_device

__all__ = ["FitConfig", "FitResult", "default_loss", "fit"]  # default_loss: from autoaccum.step.losses


@dataclass(frozen=True)
class FitResult:
    """What ``fit`` did.

    Attributes:
        plan: the plan training started with.
        final_plan: the plan in force at the end.
        plan_source: ``probe``, ``cache``, ``given`` or ``checkpoint``.
        plan_changes: every change of plan (OOM shrinks, growth), in order.
        optimizer_steps: optimizer steps over the whole run (resumed runs included).
        samples_seen: samples trained on over the whole run (resumed runs included).
        oom_events: OOMs recovered in training.
        eval_ooms: OOMs recovered in evaluation.
        skipped_steps: optimizer steps skipped for inf/NaN gradients (by the fp16 GradScaler, or under
            ``nonfinite="skip"``), counted in ``optimizer_steps`` too (their samples were consumed).
        final_loss: the last step's loss (sample- or token-weighted; after a resume of a finished run,
            the checkpoint's).
        losses: the loss of each step this call ran (after a resume, the steps after the
            checkpoint); ``log_file`` holds every step's loss, each step once across resumes.
        micro_steps: each step's micro-steps, for the steps in ``losses`` (with a token budget they
            follow the step's lengths).
        eval_loss: the last evaluation's loss, None without eval_data.
        lr: the learning rate the rule set (before warmup).
        samples_per_s: samples per second of training steps in this call (probe excluded).
        peak_bytes: the largest step peak (CUDA allocator or emulated budget), None if not measured.
        wall_time_s: this call's wall time.
        probe_time_s: the part of it spent probing.
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
    micro_steps: tuple[int, ...] = ()
    skipped_steps: int = 0


def _placed(model: torch.nn.Module, device: Any) -> tuple[torch.nn.Module, GradSync, torch.device]:
    """The model on its device, in training mode, wrapped for data parallelism where needed, and how
    its ranks agree. Under torchrun without a process group one is created (cuda:LOCAL_RANK on CUDA).

    With more than one rank: DDP unless the model is already DDP or FSDP2 (``fully_shard``), and a
    ``DistributedSync``."""
    dev = resolve_device(device)  # before any process group: a bad device fails before any work
    distributed.init_from_env()
    trainable_parameters(model)
    meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"{type(model).__name__}'s {meta!r} is on the meta device: it has a shape but no values, so "
                         f"there is nothing to train. Load the weights first (model.to_empty(device=...) then "
                         f"load_state_dict(...), or build the model outside torch.device('meta'))")
    model.to(dev)
    model.train()
    if not distributed.is_distributed() or distributed.world_info().world_size == 1:
        return model, LocalSync(), dev
    model = distributed.wrap_model(model)
    return model, distributed.DistributedSync(model), dev


def _optimizer(model: torch.nn.Module, optimizer: Any, lr: float | None) -> torch.optim.Optimizer:
    if optimizer is None:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr if lr is not None else 1e-3)
    check_optimizer(model, optimizer)
    if lr is not None:
        other = next((i for i, group in enumerate(optimizer.param_groups) if group["lr"] != lr), None)
        if other is not None:  # which one was meant is not fit's to guess
            raise ValueError(f"lr={lr!r} and the optimizer's lr {optimizer.param_groups[other]['lr']!r} (param group "
                             f"{other}) disagree; fit would overwrite the optimizer's. Give the learning rate once: "
                             f"build the optimizer with lr={lr!r}, or leave lr= out")
    return optimizer


def fit(model: torch.nn.Module, data: Any, target_batch: int | None = None, *, loss_fn: LossFn | None = None,
        optimizer: torch.optim.Optimizer | None = None, eval_data: Any = None, config: FitConfig | None = None,
        **options: Any) -> FitResult:
    """Train ``model`` on ``data`` with exactly ``target_batch`` samples per optimizer step.

    Args:
        model: the module to train; moved to ``device``.
        data: a tuple or dict of tensors sharing dim 0, a Dataset of samples (map-style, or an
            IterableDataset, batched by fit in its order), or an iterable/DataLoader yielding global
            batches (under torch.distributed: this rank's share). Indexed data is reshuffled every epoch from
            ``seed``; the last batch of an epoch holds the samples that remain and is a real step
            on them, weighted exactly (a smaller global batch, never padded), unless
            ``last_batch="drop"``.
        target_batch: samples per optimizer step over all ranks; never changed.
        loss_fn: ``loss_fn(model, batch)`` -> mean loss or ``(loss_sum, num_items)``; default
            cross-entropy of ``model(inputs)`` against ``targets``.
        optimizer: an optimizer over ``model``'s parameters; default AdamW(lr).
        eval_data: data to evaluate on without gradients (``eval_every`` steps and at the end).
        config: a ``FitConfig``; ``options`` override its fields.
        **options: ``lr``, ``base_batch``, ``lr_rule``, ``warmup_steps``, ``scheduler`` (``LRConfig``); ``epochs``,
            ``max_steps`` (``StopConfig``); ``seed``, ``collate_fn``, ``last_batch``, ``length_fn``,
            ``by_length`` (``DataConfig``); ``device``, ``budget``, ``headroom``, ``plan``,
            ``precision``, ``max_grad_norm``, ``nonfinite``, ``grow``, ``grow_after``,
            ``memory_savers``, ``probe_cache`` (``MemoryConfig``); ``checkpoint_dir``, ``checkpoint_every``, ``resume``
            (``CheckpointConfig``); ``progress``, ``log_file``, ``eval_every``, ``verbose``,
            ``report_to``, ``report_dir``, ``callbacks`` (``OutputConfig``). Each is documented on
            its config class.

    Returns:
        A ``FitResult``.

    Raises:
        ValueError: an argument or option out of its range (before any work).
        TypeError: an argument or option of the wrong type, or an unknown option (before any work).
        ImportError: a ``report_to`` backend whose package is not installed (before any work).
        DoesNotFitError: even the smallest micro-batch the model trains at does not fit.
        NonFiniteError: inf/NaN gradients or loss under ``nonfinite="stop"``, found before the
            optimizer step (the weights, optimizer state and scheduler are those of the step before).
        AutoAccumError: ``MAX_SKIPPED_STEPS`` (25) steps in a row skipped for inf/NaN gradients
            (fp16 GradScaler, or ``nonfinite="skip"``).
    """
    started = time.perf_counter()
    _check_call(data, target_batch, loss_fn)
    cfg = FitConfig.from_options(config, **options).check()
    if cfg.output.eval_every is not None and eval_data is None:
        raise ValueError(f"eval_every={cfg.output.eval_every!r} evaluates eval_data= every that many steps, and no "
                         f"eval_data was given; pass eval_data=..., or leave eval_every out")
    check_backends(cfg.output.report_to)  # a missing extra fails here, not after the probe
    if cfg.output.verbose:
        ensure_visible()  # before the probe: its messages show alike in a process's first run and in later ones
    with quiet(not cfg.output.verbose):  # verbose=False: no INFO line of this run, the probe's included
        return _fit(model, data, target_batch, loss_fn, optimizer, eval_data, cfg, started)


def _fit(model: torch.nn.Module, data: Any, target_batch: int, loss_fn: LossFn | None,
         optimizer: torch.optim.Optimizer | None, eval_data: Any, cfg: FitConfig, started: float) -> FitResult:
    """``fit`` after its arguments and options were checked (see ``fit``)."""
    if cfg.checkpoint.resume is True:  # before the directory is made: resume=True never starts afresh silently
        ckpt.check_resumable_dir(cfg.checkpoint.directory)  # type: ignore[arg-type]
    ckpt_dir = None if cfg.checkpoint.directory is None else ckpt.check_writable(cfg.checkpoint.directory)
    model, sync, dev = _placed(model, cfg.memory.device)
    inner = distributed.unwrap_model(model)
    seed = cfg.data.seed
    batches, eval_batches = _global_batches(data, eval_data, target_batch, cfg, sync)
    loss_fn = loss_fn if loss_fn is not None else default_loss
    _check_model(inner, batches, cfg, dev, loss_fn)
    # off CUDA, budget= is the emulated device every step runs on (weights and state count; entered in train)
    meter = emulated_device(cfg.memory.budget, dev, inner, skips_probe="plan=" if cfg.memory.plan is not None else None)
    optimizer = _optimizer(model, optimizer, cfg.lr.lr)
    # resume="auto" with no checkpoint yet (a restartable job's first start) is a fresh run: the rule applies
    state = ckpt.load_checkpoint(ckpt_dir) if cfg.checkpoint.resume and ckpt_dir is not None else None
    if state is not None:
        check_resumable(state, ckpt_dir, inner, target_batch, seed)  # type: ignore[arg-type]
    run_lr = apply_lr_rule(optimizer, cfg.lr.base_batch, target_batch, cfg.lr.rule) if state is None \
        else float(state["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(cfg.lr.warmup_steps)) \
        if cfg.lr.warmup_steps else None
    if cfg.lr.scheduler is not None:  # after the rule: the scheduler's base lr is the run's
        scheduler = build_scheduler(cfg.lr.scheduler, optimizer, _total_steps(cfg, batches))
    scaler = make_scaler(cfg.memory.precision, dev)
    start_plan, plan_source, report = _start_plan(inner, optimizer, loss_fn, batches, target_batch, cfg, sync, state)
    cut = TokenCut() if batches.by_length else SampleCut()
    # growth after an OOM reads the probe's memory model (a given probe report's too) and plans with its headroom
    given_model = getattr(cfg.memory.plan, "model", None)
    guard = OOMGuard(model, optimizer, plan=start_plan, scheduler=scheduler, scaler=scaler,
                     max_grad_norm=cfg.memory.max_grad_norm, autocast_dtype=autocast_dtype(cfg.memory.precision),
                     sync=sync, meter=meter, grow=cfg.memory.grow, grow_after=cfg.memory.grow_after, cut=cut,
                     memory_model=report.model if report is not None else
                     given_model if isinstance(given_model, MemoryModel) else None, headroom=cfg.memory.headroom,
                     nonfinite=cfg.memory.nonfinite, memory_savers=cfg.memory.memory_savers)
    position = RunPosition() if state is None else restore_run(
        state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, guard=guard, rank=sync.rank,
        world_size=sync.world_size)
    run = Run(model, optimizer, scheduler, scaler, guard, sync, loss_fn, dev, cfg, target_batch, run_lr, ckpt_dir,
               position)
    reporter = Reporter(cfg.output.report_to, cfg.output.callbacks, cfg.output.report_dir,
                        _run_settings(run, start_plan, plan_source), sync.rank)
    progress = Progress(cfg.output.progress, _total_steps(cfg, batches), cfg.output.log_file, sync.rank,
                        cfg.output.verbose, resumed_at=None if state is None else position.steps, reporter=reporter)
    progress.say(_banner(run, start_plan, plan_source, emulated=meter is not None, resumed=state is not None))
    failed = True
    try:
        if meter is not None:  # the emulated device: weights and state count; steps run inside it (train)
            meter.track(model, optimizer)
        summary = train(run, batches, eval_batches, progress, meter)
        if meter is not None:
            meter.close()
            meter = None
        result = _result(run, summary, start_plan, plan_source, report, started)
        reporter.end(result)  # the callbacks' on_end, while a W&B or MLflow run of this fit is still open
        failed = False
    finally:
        if meter is not None:
            meter.close()
        progress.close(failed)
    return result


def _start_plan(inner: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, batches: GlobalBatches,
                target_batch: int, cfg: FitConfig, sync: Any, state: dict[str, Any] | None
                ) -> tuple[Plan, str, ProbeReport | None]:
    """The plan the run starts with (``choose_plan``: the checkpoint's, the one given, or the probe's)."""
    # the module itself, not a DDP wrapper: each rank measures on its own, with no collective
    # the probe's passes also read the labels' range (one device synchronisation each: before training only)
    task = Task(model=inner, loss_fn=DefaultLoss(check_range=True) if loss_fn is default_loss else loss_fn,
                make_batch=batches.sample_at if batches.by_length else batches.sample,
                name="fit")
    lengths = batches.lengths() if batches.by_length else None
    return choose_plan(
        saved=None if state is None else state["guard"], given=cfg.memory.plan, micro_batch=None,
        target_batch=target_batch, sync=sync, model=inner, precision=cfg.memory.precision,
        probe=lambda: probe(task, optimizer=optimizer, target_batch=target_batch, world_size=sync.world_size,
                            budget=cfg.memory.budget, headroom=cfg.memory.headroom, precision=cfg.memory.precision,
                            cache=cfg.memory.probe_cache, lengths=None if lengths is None else lengths[0],
                            lengths_source="" if lengths is None else lengths[2],
                            memory_savers=cfg.memory.memory_savers,
                            progress=cfg.output.progress and cfg.output.verbose and sync.rank == 0))


def _result(run: Run, summary: dict[str, Any], start_plan: Plan, plan_source: str, report: ProbeReport | None,
            started: float) -> FitResult:
    guard, position = run.guard, run.position
    return FitResult(
        plan=start_plan, final_plan=guard.plan, plan_source=plan_source, plan_changes=tuple(guard.changes),
        optimizer_steps=position.steps, samples_seen=position.samples, oom_events=guard.ooms,
        eval_ooms=summary["eval_ooms"], final_loss=position.last_loss, losses=tuple(position.losses),
        eval_loss=summary["eval_loss"], lr=run.lr, samples_per_s=summary["samples_per_s"],
        peak_bytes=summary["peak_bytes"], wall_time_s=time.perf_counter() - started,
        probe_time_s=0.0 if report is None else report.wall_time_s, probe=report,
        micro_steps=tuple(summary["micro_steps"]), skipped_steps=position.skipped,
    )


def _check_call(data: Any, target_batch: Any, loss_fn: Any) -> None:
    """The arguments of ``fit(model, data, target_batch, loss_fn=...)``, in their places, before any work."""
    if callable(data) and not hasattr(data, "__len__") and not hasattr(data, "__iter__"):
        raise TypeError(f"data must be a tuple or dict of tensors, a Dataset or an iterable of batches, got a "
                        f"{type(data).__name__}; the arguments look swapped: fit(model, data, target_batch, "
                        f"loss_fn=...) takes the loss by keyword")
    if target_batch is None:
        raise TypeError("fit needs target_batch: the samples of one optimizer step over all ranks, the batch the "
                        "model learns at (e.g. fit(model, data, target_batch=256)); it is never changed")
    if isinstance(target_batch, bool) or not isinstance(target_batch, int):
        raise TypeError(f"target_batch must be an int (samples per optimizer step), got a {type(target_batch).__name__}"
                        f"; fit's arguments are (model, data, target_batch, loss_fn=..., ...)")
    check_positive_int(target_batch, "target_batch")
    if loss_fn is not None:
        check_loss_fn(loss_fn)


def _global_batches(data: Any, eval_data: Any, target_batch: int, cfg: FitConfig,
                    sync: GradSync) -> tuple[GlobalBatches, GlobalBatches | None]:
    """This rank's global batches of the training data (and of ``eval_data``), checked before any work."""
    kwargs = {"seed": cfg.data.seed, "rank": sync.rank, "world_size": sync.world_size,
              "collate_fn": cfg.data.collate_fn, "length_fn": cfg.data.length_fn}
    batches = GlobalBatches(data, target_batch, last_batch=cfg.data.last_batch, **kwargs)
    if batches.num_samples is not None and batches.is_indexed and batches.num_samples < target_batch:
        raise ValueError(f"data holds {batches.num_samples} samples, fewer than one global batch of {target_batch}; "
                         f"lower target_batch or add data (the global batch is never shrunk silently)")
    batches.check()
    epochs = cfg.stop.epochs
    if batches.one_shot and epochs is not None and epochs > 1:
        raise ValueError(f"data is a one-shot iterator ({type(data).__name__}): it runs out after one pass, so "
                         f"epochs={epochs!r} would train one epoch only. Pass something that can be iterated again "
                         f"(a DataLoader, a list of batches, a Dataset), or epochs=1")
    batches.by_length = _by_length(batches, cfg)
    eval_batches = None if eval_data is None else \
        GlobalBatches(eval_data, target_batch, by_length=batches.by_length, name="eval_data", **kwargs)
    if eval_batches is not None:  # checked, and compared with the training data, before any work
        eval_batches.check_like(batches)
    return batches, eval_batches


def _by_length(batches: GlobalBatches, cfg: FitConfig) -> bool:
    """Whether to plan and cut by tokens: as asked, or where a length_fn is given or the lengths vary."""
    if cfg.data.by_length is not None:
        if cfg.data.by_length:
            batches.length_profile()  # fail before any work where no length can be read
        return cfg.data.by_length
    if cfg.data.length_fn is not None:
        return True
    try:
        return batches.length_profile().varies
    except TypeError:  # no attention mask, no unpadded input_ids: data of one shape
        return False


def _check_model(model: torch.nn.Module, batches: GlobalBatches, cfg: FitConfig, device: torch.device,
                 loss_fn: LossFn) -> None:
    """What the model cannot do with this data and budget, found before any work."""
    if cfg.memory.grow == "model" and cfg.memory.budget is None and device.type != "cuda":
        raise ValueError(f"grow='model' needs memory the guard can read: a CUDA device, or budget= (an emulated "
                         f"budget) on {device.type}. Pass budget=..., or grow='auto' (no growth here), 'double' or "
                         f"'off'.")
    last = batches.last_global_size
    if last is None or last >= 2 * batches.world_size:
        return  # every rank's share of the last batch holds two samples or more: any model trains on it
    smallest = smallest_micro_batch(model, lambda: loss_fn(model, move_to(batches.sample(1), device)))
    if smallest == 1:
        return
    shares = [rank_share(last, r, batches.world_size) for r in range(batches.world_size)]
    short = [(r, s.stop - s.start) for r, s in enumerate(shares) if 0 < s.stop - s.start < smallest]
    if short:
        rank, n = short[0]
        raise ValueError(
            f"the epoch's last global batch holds {last} sample(s) ({batches.num_samples} samples at target_batch "
            f"{batches.target_batch}), {n} of them on rank {rank}: fewer than {smallest}, the smallest micro-batch "
            f"{type(model).__name__} trains at (its BatchNorm gets one value per channel from one sample, and needs "
            f"more). Pass "
            f"last_batch='drop' (those samples skip that epoch; the next epoch's order differs), or change "
            f"target_batch or the number of samples.")


def _total_steps(cfg: FitConfig, batches: GlobalBatches) -> int | None:
    per_epoch, epochs, max_steps = batches.steps_per_epoch, cfg.stop.epochs, cfg.stop.max_steps
    if epochs is None or per_epoch is None:
        return max_steps
    return min(max_steps or epochs * per_epoch, epochs * per_epoch)


def _run_settings(run: Run, plan: Plan, source: str) -> dict[str, Any]:
    """What a W&B or MLflow run that fit starts records as its configuration."""
    cfg = run.config
    return {"target_batch": run.target_batch, "micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps,
            "world_size": plan.world_size, "plan_source": source, "lr": run.lr, "lr_rule": cfg.lr.rule,
            "precision": cfg.memory.precision, "device": str(run.device), "model": type(run.model).__name__}


def _banner(run: Run, plan: Plan, source: str, *, emulated: bool, resumed: bool) -> str:
    """The one line a run starts with: device, budget, plan and where it came from, learning rate."""
    cfg, budget_bytes, base_batch = run.config, run.config.memory.budget_bytes, run.config.lr.base_batch
    budget = ("" if budget_bytes is None
              else f" · budget {format_bytes(budget_bytes)}{' (emulated)' if emulated else ''}")
    rule = "" if base_batch in (None, run.target_batch) else f" ({cfg.lr.rule} rule from base batch {base_batch})"
    return (f"autoaccum fit · {run.device}{budget} · {plan.describe()}, {source_words(source)} · lr {run.lr:.4g}{rule}"
            + (f" · resuming at step {run.position.steps}" if resumed else ""))
