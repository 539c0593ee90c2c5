"""``fit``'s options as a few typed config dataclasses, validated in one place.

``fit(model, data, target_batch, **options)`` takes flat keyword options (``lr=``, ``epochs=``,
``budget=`` ...); ``FitConfig.from_options`` sorts them into the groups below, and
``FitConfig.check`` finds every problem before any work is done: one problem is raised as
it is (a ``TypeError`` or ``ValueError`` naming the option, the value and the allowed range),
several as one ``ValueError`` listing each. An unknown option name is a ``TypeError`` that
suggests the closest known one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from autoaccum.guard.growth import DEFAULT_GROW_AFTER, GrowMode, check_growth_options
from autoaccum.memory.savers import check_memory_savers
from autoaccum.plan.data import LastBatch
from autoaccum.precision import Precision, check_precision
from autoaccum.step.optim import NONFINITE_POLICIES, NonFinite
from autoaccum.training.lr import LR_RULES, LrRule, check_scheduler_factory
from autoaccum.training.trackers import check_callbacks, check_report_to
from autoaccum.units import parse_bytes
from autoaccum.validate import (
    check_choice,
    check_headroom,
    check_keywords,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
)

__all__ = ["CheckpointConfig", "DataConfig", "FitConfig", "LRConfig", "MemoryConfig", "OutputConfig", "StopConfig"]


def _option(name: str | None = None, **kwargs: Any) -> Any:
    """A field that ``fit(**options)`` sets by the keyword ``name`` (default: the field's own name)."""
    return field(metadata={"option": name}, **kwargs)


@dataclass(frozen=True)
class LRConfig:
    """The learning rate and the rule that moves it with the global batch (invariant 5).

    Attributes:
        lr: the learning rate tuned for ``base_batch`` (default: the optimizer's, or 1e-3).
        base_batch: the global batch ``lr`` was tuned for; when it differs from ``target_batch``
            the LR is rescaled by ``rule``.
        rule: ``linear``, ``sqrt``, ``adam_sde`` or ``none``.
        warmup_steps: linear LR warmup over this many optimizer steps.
        scheduler: a factory ``scheduler(optimizer, total_steps) -> LRScheduler`` (e.g.
            ``lambda opt, total: CosineAnnealingLR(opt, T_max=total)``), built after the rule set the
            lr and stepped once per optimizer step (not for a skipped one); ``total_steps`` is the
            run's optimizer steps. Not with ``warmup_steps`` (put the warmup in it: ``SequentialLR``).
    """

    lr: float | None = _option(default=None)
    base_batch: int | None = _option(default=None)
    rule: LrRule = _option("lr_rule", default="linear")
    warmup_steps: int = _option(default=0)
    scheduler: Any = _option(default=None)

    def problems(self) -> list[Exception]:
        return _collect(
            lambda: self.lr is None or check_positive_float(self.lr, "lr"),
            lambda: self.base_batch is None or check_positive_int(
                self.base_batch, "base_batch", hint=" (the global batch the lr was tuned for)"),
            lambda: check_choice(self.rule, "lr_rule", LR_RULES),
            lambda: _require(self.base_batch is not None or self.rule in ("linear", "none"),
                             f"lr_rule={self.rule!r} rescales the lr from the batch it was tuned for: give "
                             f"base_batch= (that batch), or leave lr_rule out to train at lr as given"),
            lambda: check_non_negative_int(self.warmup_steps, "warmup_steps"),
            lambda: self.scheduler is None or check_scheduler_factory(self.scheduler, self.warmup_steps),
        )


@dataclass(frozen=True)
class StopConfig:
    """How long to train.

    Attributes:
        epochs: stop after this many passes over the data (or ``max_steps``, whichever first).
        max_steps: stop after this many optimizer steps (or ``epochs``, whichever first).
    """

    epochs: int | None = _option(default=1)
    max_steps: int | None = _option(default=None)

    def problems(self) -> list[Exception]:
        return _collect(
            lambda: _require(self.epochs is not None or self.max_steps is not None,
                             "give epochs= (passes over the data) or max_steps= (optimizer steps), or both"),
            lambda: self.epochs is None or check_positive_int(self.epochs, "epochs"),
            lambda: self.max_steps is None or check_positive_int(self.max_steps, "max_steps"),
        )


@dataclass(frozen=True)
class DataConfig:
    """How the data becomes global batches (see ``autoaccum.plan.data``).

    Attributes:
        seed: the data order's seed.
        collate_fn: batches a list of dataset items (map-style datasets; default ``default_collate``).
        last_batch: the epoch's last, smaller batch: ``"step"`` (an exact smaller step on the samples
            that remain) or ``"drop"`` (not trained on this epoch).
        length_fn: a sample's length, for variable-length data (default: its attention mask's ones,
            or its unpadded ``input_ids``' length; see ``autoaccum.plan.lengths``).
        by_length: plan and cut by tokens (``True``), by samples (``False``), or decide (``None``, the
            default): by tokens where ``length_fn`` is given or the samples' lengths vary.
    """

    seed: int = _option(default=0)
    collate_fn: Any = _option(default=None)
    last_batch: LastBatch = _option(default="step")
    length_fn: Any = _option(default=None)
    by_length: bool | None = _option(default=None)

    def problems(self) -> list[Exception]:
        return _collect(
            lambda: _require_int(self.seed, "seed"),
            lambda: self.collate_fn is None or _require(callable(self.collate_fn), f"collate_fn must be callable, "
                                                                                    f"got {self.collate_fn!r}"),
            lambda: check_choice(self.last_batch, "last_batch", ("step", "drop")),
            lambda: self.length_fn is None or _require(callable(self.length_fn), f"length_fn must be callable, "
                                                                                  f"got {self.length_fn!r}"),
            lambda: check_choice(self.by_length, "by_length", (None, True, False)),
        )


@dataclass(frozen=True)
class MemoryConfig:
    """Where and how a step runs, and the memory it plans for.

    Attributes:
        device: default CUDA if available, else CPU.
        budget: memory budget ("8GiB"): the probe plans for it, and on devices other than CUDA
            training runs under an emulated budget of that size (a real OOM at the crossing).
        headroom: fraction of the budget the plan keeps free.
        plan: skip probing: a Plan, a ProbeReport, or a probe/search JSON file.
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + GradScaler).
        max_grad_norm: clip the global gradient norm once per step.
        nonfinite: a step whose gradients (or loss) hold inf/NaN, found before ``optimizer.step()``:
            ``"stop"`` (default) raises ``NonFiniteError`` with nothing stepped; ``"skip"`` skips and
            counts it (``FitResult.skipped_steps``), as the fp16 GradScaler does. Either way fit
            stops after ``MAX_SKIPPED_STEPS`` (25) skipped steps in a row.
        grow: how the guard grows the micro-batch back after an OOM (``OOMGuard(grow=...)``):
            ``auto`` (default), ``model``, ``double`` or ``off``.
        grow_after: calm steps before the guard grows back (default 2).
        memory_savers: where even the smallest micro-batch does not fit, the next memory saver
            (activation checkpointing, then on CUDA activation offload), each exact: ``auto``
            (default), ``off``, or a tuple of savers (``OOMGuard(memory_savers=...)``).
        probe_cache: reuse a cached probe result with the same fingerprint.
    """

    device: str | torch.device | None = _option(default=None)
    budget: int | str | None = _option(default=None)
    headroom: float = _option(default=0.1)
    plan: Any = _option(default=None)
    precision: Precision = _option(default="fp32")
    max_grad_norm: float | None = _option(default=None)
    nonfinite: NonFinite = _option(default="stop")
    grow: GrowMode = _option(default="auto")
    grow_after: int = _option(default=DEFAULT_GROW_AFTER)
    memory_savers: Any = _option(default="auto")
    probe_cache: bool = _option(default=False)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget is None else parse_bytes(self.budget)

    def problems(self) -> list[Exception]:
        return _collect(
            lambda: self.budget is None or parse_bytes(self.budget),
            lambda: check_headroom(self.headroom),
            lambda: check_precision(self.precision),
            lambda: self.max_grad_norm is None or check_positive_float(
                self.max_grad_norm, "max_grad_norm", hint=", or None for no clipping"),
            lambda: check_choice(self.nonfinite, "nonfinite", NONFINITE_POLICIES),
            lambda: check_growth_options(self.grow, self.grow_after),
            lambda: check_memory_savers(self.memory_savers),
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints and resume.

    Attributes:
        directory: where checkpoints are written atomically (None: no checkpoints).
        every: save every this many optimizer steps (and always at the end).
        resume: ``True``: continue from the checkpoint in ``directory`` (bit-identical to a run
            that was never interrupted, CPU, fp32); a directory without one is an error. ``"auto"``:
            continue where a checkpoint exists, start afresh where none does yet (the first start of
            a job that may be restarted). ``False`` (default): start afresh.
    """

    directory: str | os.PathLike[str] | None = _option("checkpoint_dir", default=None)
    every: int | None = _option("checkpoint_every", default=None)
    resume: bool | Literal["auto"] = _option(default=False)

    def problems(self) -> list[Exception]:
        return _collect(
            lambda: self.every is None or check_positive_int(self.every, "checkpoint_every"),
            lambda: _require(self.every is None or self.directory is not None,
                             f"checkpoint_every={self.every!r} needs checkpoint_dir= (where the checkpoints are "
                             f"written); without it no checkpoint would be written"),
            lambda: _require(isinstance(self.resume, bool) or self.resume == "auto",
                             f"Invalid resume: {self.resume!r}. Allowed values: True, False, 'auto'"),
            lambda: _require(not self.resume or self.directory is not None,
                             f"resume={self.resume!r} needs checkpoint_dir= (where the checkpoint is)"),
        )


@dataclass(frozen=True)
class OutputConfig:
    """What a run reports.

    Attributes:
        progress: a progress bar on a terminal (stderr).
        log_file: append one JSON line of metrics per optimizer step.
        eval_every: evaluate ``eval_data`` every this many optimizer steps (and at the end).
        verbose: log the banner, evaluations and the summary (logger ``autoaccum.fit``, INFO; shown
            on stderr where logging is not configured, see ``autoaccum.log``). Plan changes are
            warnings and show either way.
        report_to: where each step's metrics also go (rank 0): ``"tensorboard"``, ``"wandb"``,
            ``"mlflow"`` (each an extra of its own), a callable receiving each step's metrics dict,
            or a list of these (``autoaccum.training.trackers``).
        report_dir: TensorBoard's log folder (default ``runs/<time>_<host>``, as ``SummaryWriter``'s).
        callbacks: objects with ``on_step(metrics)`` (each step's metrics dict) and/or
            ``on_end(result)`` (the ``FitResult``), called on rank 0.
    """

    progress: bool = _option(default=True)
    log_file: str | os.PathLike[str] | None = _option(default=None)
    eval_every: int | None = _option(default=None)
    verbose: bool = _option(default=True)
    report_to: Any = _option(default=None)
    report_dir: str | os.PathLike[str] | None = _option(default=None)
    callbacks: Any = _option(default=())

    def problems(self) -> list[Exception]:
        return _collect(
            lambda: self.eval_every is None or check_positive_int(self.eval_every, "eval_every"),
            lambda: self.log_file is None or _check_log_file(self.log_file),
            lambda: check_report_to(self.report_to),
            lambda: check_callbacks(self.callbacks),
            lambda: self.report_dir is None or _check_report_dir(self.report_dir),
        )


@dataclass(frozen=True)
class FitConfig:
    """Every option of ``fit``, in groups."""

    lr: LRConfig = field(default_factory=LRConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    data: DataConfig = field(default_factory=DataConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @classmethod
    def from_options(cls, base: FitConfig | None = None, **options: Any) -> FitConfig:
        """``base`` (default: the defaults) with the flat keyword ``options`` of ``fit`` applied.

        Raises:
            TypeError: an unknown option (naming the closest known one).
        """
        if base is not None and not isinstance(base, FitConfig):
            raise TypeError(f"config must be an autoaccum.FitConfig, got {type(base).__name__}")
        config = base if base is not None else cls()
        where = _option_table()
        check_keywords({name: v for name, v in options.items() if name not in where}, where, "fit()")
        groups: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            group, attr = where[name]
            groups.setdefault(group, {})[attr] = value
        return replace(config, **{g: replace(getattr(config, g), **values) for g, values in groups.items()})

    def check(self) -> FitConfig:
        """Raise every problem at once (see the module docstring); returns self when there is none."""
        found = [p for group in (self.lr, self.stop, self.data, self.memory, self.checkpoint, self.output)
                 for p in group.problems()]
        if len(found) == 1:
            raise found[0]
        if found:
            raise ValueError(f"{len(found)} invalid fit options:\n" + "\n".join(f"  - {p}" for p in found))
        return self


def _option_table() -> dict[str, tuple[str, str]]:
    """option name -> (group attribute of FitConfig, field of that group)."""
    table: dict[str, tuple[str, str]] = {}
    for group in fields(FitConfig):
        for f in fields(group.default_factory()):  # type: ignore[misc]
            table[f.metadata.get("option") or f.name] = (group.name, f.name)
    return table


def _require_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _check_log_file(log_file: Any) -> None:
    """A file that can be appended to: in a directory that exists (checked before the probe runs)."""
    if not isinstance(log_file, (str, os.PathLike)):
        raise TypeError(f"log_file must be a str or os.PathLike, got {type(log_file).__name__}")
    path = Path(log_file).expanduser()
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"Invalid log_file {str(log_file)!r}: it is a directory. Allowed: a file path in an existing "
                         f"directory, e.g. {str(path / 'metrics.jsonl')!r}")
    if not folder.is_dir():
        raise ValueError(f"Invalid log_file {str(log_file)!r}: its directory {str(folder)!r} does not exist. Allowed: "
                         f"a file path in an existing directory; create it first (os.makedirs({str(folder)!r}, "
                         f"exist_ok=True)) or choose another path")


def _check_report_dir(value: object) -> None:
    _require_path(value, "report_dir")
    path = Path(value).expanduser()  # type: ignore[arg-type]
    if path.exists() and not path.is_dir():
        raise ValueError(f"Invalid report_dir {str(value)!r}: it is a file, and TensorBoard writes a folder of event "
                         f"files there. Allowed: a folder (made where it does not exist); choose another path, e.g. "
                         f"{str(path.with_suffix('')) + '_runs'!r}")


def _require_path(value: object, name: str) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {value!r} ({type(value).__name__})")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _collect(*checks: Any) -> list[Exception]:
    """The exceptions the checks raise (each check is a callable; a TypeError/ValueError is a problem)."""
    problems: list[Exception] = []
    for check in checks:
        try:
            check()
        except (TypeError, ValueError) as exc:
            problems.append(exc)
    return problems
