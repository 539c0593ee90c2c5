"""``AutoAccum``: a Lightning callback that makes each optimizer step exact and OOM-safe.

::

    from autoaccum.integrations.lightning import AutoAccum

    loader = DataLoader(train, batch_size=256)             # each batch: one global batch (per process)
    trainer = L.Trainer(callbacks=[AutoAccum()], ...)       # the only change
    trainer.fit(module, loader)

The DataLoader yields global batches (under DDP each process's share: ``batch_size x devices``
samples per optimizer step); ``accumulate_grad_batches`` stays 1 (a change during training is
refused: at setup for a ``GradientAccumulationScheduler``, else at the batch where it changed). At
the first batch the callback probes real steps; it then cuts every global batch into micro-batches
that fit, calls the module's own ``training_step`` on each, and replays a step that runs out of
memory on the same samples with a smaller micro-batch. Lightning keeps the rest: the optimizer
step, clipping, schedulers, logging, validation and checkpoints. The last, shorter batch of an
epoch is one exact step on the samples it holds.

A callback cannot own backward, so for the duration of ``fit`` it sets three attributes on the
module instance (its class is not touched; they are removed at the end of training or on an
exception): ``training_step`` runs ``OOMGuard.accumulate`` on the global batch (the original once
per micro-batch) and returns the step's exact loss, detached; ``backward`` and
``optimizer_zero_grad`` do nothing (the guard did every backward and clears gradients itself), so
Lightning's backward hooks see the finished gradient. Under DDP the guard's window is ``no_sync``
and gradients are summed once per step; DDP's reducer is kept out with
``require_backward_grad_sync = False`` while training, as Lightning does for manual optimization.
Lightning's fp16 ``GradScaler`` scales every micro-batch's loss; its autocast wraps them.

What it asks of the module: automatic optimization with one optimizer, and a ``training_step``
that returns the *mean* loss over the batch it is given (a tensor, or a dict with ``"loss"``), from
that batch alone. For a token-level loss pass ``AutoAccum(loss_fn=lambda module, batch: (loss_sum,
num_tokens))``. ``self.log`` inside ``training_step`` runs once per micro-batch (a per-step value is
the last micro-batch's). Lightning moves each global batch to the device before ``training_step``,
so its inputs count against the memory.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from autoaccum.errors import TaskError
from autoaccum.guard.growth import DEFAULT_GROW_AFTER
from autoaccum.guard.guard import AccumulateResult
from autoaccum.integrations.lazy_guard import LazyGuard, check_options
from autoaccum.plan.batch import Batch
from autoaccum.plan.task import LossFn, check_loss_fn
from autoaccum.validate import check_keywords

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("autoaccum.integrations.lightning needs Lightning: pip install 'autoaccum[lightning]'") from exc

__all__ = ["AutoAccum"]

_PATCHED = ("training_step", "backward", "optimizer_zero_grad")

_CHANGING_BATCH = ("The global batch is the DataLoader's batch_size per process, fixed for a fit: drop the change, "
                   "or train each phase with its own Trainer, AutoAccum and DataLoader batch size.")


def _mean_loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TaskError(f"training_step returned {type(output).__name__}; under AutoAccum it must return the mean "
                        f"loss of the batch it is given (a tensor, or a dict with 'loss') for every micro-batch")
    return loss


class AutoAccum(pl.Callback):
    """Exact global batches with OOM replay for an unchanged LightningModule (see the module docstring).

    Args:
        budget: memory the run plans for and, as in ``fit``, on devices other than CUDA is held to ("8GiB",
            bytes): each training step runs on an emulated device of that size, where a step that does not fit
            raises a real OOM that is replayed (``autoaccum.integrations.lazy_guard``). Default what the device
            has free (on CPU under ``autoaccum.emulated_budget``, that budget; not both). On CUDA not with
            ``plan`` or ``micro_batch``, which skip the probe.
        headroom: fraction of the budget kept free, in [0, 1).
        plan: a ``Plan``, probe report or plan file, instead of probing.
        micro_batch: the largest micro-batch to start with, instead of probing.
        grow_after: calm steps before the guard grows the micro-batch back after an OOM (default 2;
            where memory can be read -- CUDA, an emulated budget -- it grows to what is predicted
            to fit; elsewhere giving it asks for blind doubling: ``OOMGuard(grow=...)``).
        loss_fn: ``loss_fn(module, batch)`` -> mean loss or ``(loss_sum, num_items)``, instead of the
            module's ``training_step``.
        memory_savers: where even the smallest micro-batch does not fit, the memory savers the probe
            and the guard may turn to: ``"auto"`` (default), ``"off"``, or a tuple of savers (as in ``fit``).
    """

    def __init__(self, *, budget: int | str | None = None, headroom: float = 0.1, plan: Any = None,
                 micro_batch: int | None = None, grow_after: int = DEFAULT_GROW_AFTER, loss_fn: LossFn | None = None,
                 memory_savers: Any = "auto", **unknown: Any) -> None:
        check_keywords(unknown, inspect.signature(AutoAccum).parameters, "AutoAccum")  # with the closest name
        super().__init__()
        check_options(budget=budget, headroom=headroom, plan=plan, micro_batch=micro_batch, grow_after=grow_after,
                      memory_savers=memory_savers)
        if loss_fn is not None:
            check_loss_fn(loss_fn)
        self.options: dict[str, Any] = {"budget": budget, "headroom": headroom, "plan": plan,
                                        "micro_batch": micro_batch, "grow_after": grow_after,
                                        "memory_savers": memory_savers}
        self.loss_fn = loss_fn
        self.guard: LazyGuard | None = None
        self.last: AccumulateResult | None = None
        self._saved: dict[str, Any] = {}
        self._module: pl.LightningModule | None = None
        self._original_step: Any = None
        self._step_args: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._ddp_sync = True
        # one object per run: the guard checks a loss_fn's signature once
        self._loss: LossFn = self._run_training_step if loss_fn is None else self._run_loss_fn

    # -- Lightning hooks -------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # what budget= means depends on the device (an emulated device off CUDA), known now
        check_options(budget=self.options["budget"], plan=self.options["plan"], micro_batch=self.options["micro_batch"],
                      device=trainer.strategy.root_device)
        problems = []
        if trainer.accumulate_grad_batches != 1:
            problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: give the DataLoader "
                            f"batch_size = the global batch per process and leave accumulate_grad_batches at 1 "
                            f"(AutoAccum accumulates)")
        for callback in trainer.callbacks:
            scheduling = getattr(callback, "scheduling", None)
            if isinstance(callback, pl.callbacks.GradientAccumulationScheduler) and isinstance(scheduling, dict) \
                    and any(k != 1 for k in scheduling.values()):
                problems.append(f"GradientAccumulationScheduler({scheduling}): it sets accumulate_grad_batches "
                                f"at an epoch's start, and AutoAccum takes one optimizer step per DataLoader batch. "
                                f"{_CHANGING_BATCH}")
        if not pl_module.automatic_optimization:
            problems.append("manual optimization (automatic_optimization=False): AutoAccum owns the backward of "
                            "automatic optimization; in a manual loop use OOMGuard.accumulate directly")
        if problems:
            raise ValueError("AutoAccum cannot run with " + "; ".join(problems))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"AutoAccum needs exactly one optimizer, the module configured {len(trainer.optimizers)}")
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # DDP's reducer stays out: the guard syncs once per step (the module docstring says why)
            self._ddp, self._ddp_sync = model, model.require_backward_grad_sync
            model.require_backward_grad_sync = False
        self.guard = LazyGuard(model, trainer.optimizers[0], probe_model=pl_module,
                               scaler=getattr(trainer.precision_plugin, "scaler", None), **self.options)
        self.guard.load_state_dict(self._saved)
        self._patch(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # refused where it changed (a callback may set it during training): Lightning would then step once per
        # k batches while the guard starts every batch from cleared gradients -- each step the last batch's only
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"AutoAccum: accumulate_grad_batches became {trainer.accumulate_grad_batches} at "
                             f"epoch {trainer.current_epoch} (step {trainer.global_step}); it must stay 1: "
                             f"AutoAccum takes one exact optimizer step per DataLoader batch. {_CHANGING_BATCH}")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.last is not None:
            plan = self.last.plan
            pl_module.log_dict({"autoaccum/micro_batch": float(plan.micro_batch),
                                "autoaccum/accum_steps": float(plan.accum_steps)}, on_step=True, on_epoch=False,
                               batch_size=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def state_dict(self) -> dict[str, Any]:
        """The guard's plan and counters, saved in Lightning's checkpoints; a resumed fit does not probe."""
        return self.guard.state_dict() if self.guard is not None else dict(self._saved)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict)

    # -- the module's three attributes ---------------------------------------------------------------------
    def _patch(self, pl_module: pl.LightningModule) -> None:
        self._module, self._original_step = pl_module, pl_module.training_step

        @functools.wraps(self._original_step)  # Lightning reads the signature (batch_idx?) through __wrapped__
        def training_step(batch: Batch, *args: Any, **kwargs: Any) -> torch.Tensor:
            return self._step(pl_module, batch, args, kwargs)

        pl_module.training_step = training_step  # type: ignore[method-assign]
        pl_module.backward = lambda *args, **kwargs: None  # type: ignore[method-assign]
        pl_module.optimizer_zero_grad = lambda *args, **kwargs: None  # type: ignore[method-assign]

    def _restore(self) -> None:
        """The end of training: the module's attributes and DDP's sync put back, the guard closed."""
        if self.guard is not None:
            self.guard.close()
        if self._module is not None:
            for name in _PATCHED:
                self._module.__dict__.pop(name, None)
            self._module = None
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = self._ddp_sync
            self._ddp = None

    def _step(self, pl_module: pl.LightningModule, batch: Batch, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> torch.Tensor:
        assert self.guard is not None
        self._step_args = (args, kwargs)
        if self.guard.guard is None:  # the first batch: plan (probe) with the module's logging muted
            with _muted_logging(pl_module):
                self.guard.build(batch, self._loss)
        self.last = self.guard.accumulate(batch, self._loss)
        # in the parameters' dtype: the loss Lightning logs is then the one its own full-batch step returns
        dtype = next((p.dtype for p in pl_module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        return torch.tensor(self.last.loss, dtype=dtype, device=pl_module.device)

    def _run_training_step(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        args, kwargs = self._step_args
        return _mean_loss(self._original_step(batch, *args, **kwargs))

    def _run_loss_fn(self, model: torch.nn.Module, batch: Batch) -> Any:
        assert self._module is not None and self.loss_fn is not None
        return self.loss_fn(self._module, batch)  # the module itself, never its DDP wrapper


@contextlib.contextmanager
def _muted_logging(module: pl.LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` of the module do nothing inside (the probe's passes are no steps)."""
    module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)
