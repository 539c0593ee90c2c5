"""``AutoAccumTrainer``: Hugging Face's ``Trainer`` with autoaccum's exact, OOM-safe gradient accumulation.

::

    from autoaccum.integrations.transformers import AutoAccumTrainer

    trainer = AutoAccumTrainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()

The global batch is the one the arguments describe (``per_device_train_batch_size x
gradient_accumulation_steps x world size`` samples per optimizer step), and the arguments need no
change. autoaccum probes real steps at the first global batch, cuts each into micro-batches that
fit, and replays a step that runs out of memory on the same samples with a smaller micro-batch.

How: the Trainer runs a copy of the arguments with the whole share in one device batch
(``per_device_train_batch_size x gradient_accumulation_steps``, ``gradient_accumulation_steps = 1``;
``trainer.args``), so HF's loop calls ``training_step`` once per optimizer step -- HF's own run at
``per_device = global``, the reference the tests compare with -- and keeps clipping, the optimizer
step, the scheduler, logging, evaluation, checkpoints and resume. ``training_step`` runs
``OOMGuard.accumulate`` on that batch: HF's ``compute_loss`` on each micro-batch, every backward the
guard's (no loss divided by accumulation steps), the gradient of the global batch left in ``.grad``.
The loader leaves batches in host memory and the guard moves one micro-batch at a time; under DDP
every micro-batch runs under ``no_sync`` and gradients are summed once (``autoaccum.distributed``).

Losses are normalised as HF's full-batch step normalises them. Where the Trainer counts items (the
model takes loss keyword arguments, or ``compute_loss_func`` is given), the step's items are counted
as HF's ``_get_num_items_in_batch`` counts them, over the whole global batch and every rank, and
passed to each micro-batch's ``compute_loss`` as ``num_items_in_batch``; HF's factor of the number
of processes (``average_tokens_across_devices``, for DDP's averaging) is divided out, since the
guard sums. Per-sample labels: mean losses weighted by samples. A model that takes no loss keywords
averages per-token labels itself: each micro-batch's mean is weighted by its share of the step's
tokens; whether that mean skips each row's first label is asked of the model once (one forward
without gradients, RNG and buffers put back), with a warning and weighting by samples where it
cannot be told.

The plan goes to HF's log history (``autoaccum/micro_batch``, ``autoaccum/accum_steps``,
``autoaccum/oom_replays``) at the first step and at every change, as an entry of its own (through
``Trainer.log``: a subclass's ``log`` that adds its per-step metrics, as TRL's do, keeps them for its
own step's entry); the guard's state is saved as ``autoaccum_guard.json`` in each checkpoint folder
and read on resume instead of probing. Refused at construction, with the reason:
``auto_find_batch_size`` (it would shrink the global batch), DataParallel (run one process per GPU
with torchrun), DeepSpeed and FSDP, context or sequence parallelism, and an ``accelerator_config``
that sets ``num_steps``.

Other ``Trainer`` subclasses (TRL's ``SFTTrainer``): list the framework's trainer first,
``class SFT(SFTTrainer, AutoAccumTrainer)``, so that its ``training_step`` (TRL's activation-offload
context) runs around autoaccum's, which takes the place of HF's. autoaccum's options are taken as
keywords all the same (they are taken off before the framework's ``__init__`` sees them); the other
order is refused at construction where it would skip such a ``training_step``. The framework's
``compute_loss`` runs on every micro-batch. Its per-step metric state (TRL's ``_metrics`` and
``_total_train_tokens``: ``num_tokens``, entropy, token accuracy) is put back to the step's start
before each attempt at the step, so the probe's passes and an attempt that ran out of memory leave
nothing in it. A padding-free collator (``padding_free=True``, TRL's default "bfd" packing,
``DataCollatorWithFlattening``) flattens a whole batch into one row, which cannot be cut by rows:
the loader then also keeps each batch's examples, and each micro-batch is collated from whole
examples (packed rows) by the same collator.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from autoaccum.guard.growth import DEFAULT_GROW_AFTER
from autoaccum.guard.guard import AccumulateResult
from autoaccum.integrations.hf_loss import EXAMPLES, STEP_METRICS, KeepExamples, TrainerLoss, flattens
from autoaccum.integrations.lazy_guard import LazyGuard, check_options
from autoaccum.jsonio import write_json_atomic
from autoaccum.precision import Precision
from autoaccum.validate import check_keywords

try:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("autoaccum.integrations.transformers needs Hugging Face transformers: "
                      "pip install 'autoaccum[transformers]'") from exc

__all__ = ["GUARD_FILE", "AutoAccumTrainer"]

#: the guard's state in each checkpoint folder
GUARD_FILE = "autoaccum_guard.json"
#: AutoAccumTrainer's own keyword options
OPTIONS = ("budget", "headroom", "plan", "micro_batch", "grow_after", "memory_savers")


def _one_step_per_global_batch(args: TrainingArguments) -> TrainingArguments:
    """A copy of ``args`` whose per-device batch is the process's whole share of the global batch."""
    grad_kwargs = getattr(args.accelerator_config, "gradient_accumulation_kwargs", None) or {}
    problems = []
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size=True: it shrinks the batch on OOM and with it the global batch; "
                        "AutoAccumTrainer keeps the global batch and replays the step smaller instead. Drop it.")
    if "num_steps" in grad_kwargs:
        problems.append("accelerator_config.gradient_accumulation_kwargs['num_steps']: set "
                        "gradient_accumulation_steps instead (it is part of the global batch)")
    if problems:
        raise ValueError("AutoAccumTrainer cannot run with " + "; ".join(problems))
    internal = copy.copy(args)
    internal.per_device_train_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    internal.gradient_accumulation_steps = 1
    return internal


def _precision(args: TrainingArguments) -> Precision:
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def _check_order(cls: type) -> None:
    """Refuse ``class T(AutoAccumTrainer, SFTTrainer)``: autoaccum's ``training_step`` takes the place of
    HF's, so a subclass's listed after it would never run."""
    mro = cls.__mro__
    skipped = [c for c in mro[mro.index(AutoAccumTrainer) + 1:mro.index(Trainer)] if "training_step" in vars(c)]
    if skipped:
        name, other = cls.__name__, skipped[0].__name__
        raise TypeError(f"{name} lists AutoAccumTrainer before {other}, so AutoAccumTrainer.training_step would "
                        f"replace {other}.training_step (which runs around HF's step, e.g. TRL's activation "
                        f"offloading). List the other trainer first: class {name}({other}, AutoAccumTrainer); "
                        f"autoaccum's options (budget=, micro_batch=, ...) are taken either way.")


def _check_trainer_keywords(init: Any, given: dict[str, Any], options: dict[str, Any]) -> None:
    """A keyword neither the Trainer below nor autoaccum takes (``budgett=``), refused with the closest name of
    both, before the Trainer is built (its own TypeError names no autoaccum option)."""
    params = inspect.signature(init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # the Trainer takes any keyword: its own rules apply
    check_keywords({k: v for k, v in given.items() if k not in params}, [*params, *options], "AutoAccumTrainer")


class AutoAccumTrainer(Trainer):
    """``transformers.Trainer`` whose global batches are exact and survive out-of-memory errors.

    A drop-in replacement: same arguments as ``Trainer``, plus these (keyword only):

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
        memory_savers: where even the smallest micro-batch does not fit, the memory savers the probe
            and the guard may turn to (the model's own ``gradient_checkpointing_enable`` first): ``"auto"``
            (default), ``"off"``, or a tuple of savers (as in ``fit``).

    ``trainer.args`` is the arguments as the Trainer runs them (one global batch per device batch,
    see the module docstring); ``trainer.autoaccum_args`` is the caller's object, unchanged.

    With another ``Trainer`` subclass, list it first: ``class SFT(SFTTrainer, AutoAccumTrainer)``
    (its ``training_step`` then wraps autoaccum's), and pass the options above to ``SFT(...)``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass whose ``__init__`` is another trainer's (``class SFT(SFTTrainer, AutoAccumTrainer)``)
        takes autoaccum's options too: they are taken off before that ``__init__``, which has no place
        for them, and read when the Trainer's construction reaches ``AutoAccumTrainer.__init__``."""
        super().__init_subclass__(**kwargs)
        init = cls.__init__
        if getattr(init, "_takes_autoaccum_options", False):
            return

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            given = {name: kwargs.pop(name) for name in OPTIONS if name in kwargs}
            if given:  # (an outer subclass's wrapper took them first: an inner one finds none)
                vars(self).setdefault("_autoaccum_given", {}).update(given)
            init(self, *args, **kwargs)

        __init__._takes_autoaccum_options = True  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[method-assign]

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *trainer_args: Any,
                 budget: int | str | None = None, headroom: float = 0.1, plan: Any = None,
                 micro_batch: int | None = None, grow_after: int = DEFAULT_GROW_AFTER, memory_savers: Any = "auto",
                 **trainer_kwargs: Any) -> None:
        _check_order(type(self))
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")  # Trainer's own default
        options: dict[str, Any] = {"budget": budget, "headroom": headroom, "plan": plan, "micro_batch": micro_batch,
                                   "grow_after": grow_after, "memory_savers": memory_savers}
        options.update(vars(self).pop("_autoaccum_given", {}))  # given to a subclass listed after another trainer
        # autoaccum's own options first: a mistake there should not cost building the Trainer
        _check_trainer_keywords(super().__init__, trainer_kwargs, options)
        check_options(**options, model=model if isinstance(model, torch.nn.Module) else None)
        self.autoaccum_args = args
        super().__init__(model, _one_step_per_global_batch(args), *trainer_args, **trainer_kwargs)
        self._check_setup()
        # what budget= means depends on the device (an emulated device off CUDA), known now
        check_options(budget=options["budget"], plan=options["plan"], micro_batch=options["micro_batch"],
                      device=self.args.device)
        self._autoaccum_options = options
        self._autoaccum_loss = TrainerLoss(self)
        self._autoaccum: LazyGuard | None = None
        self._autoaccum_state: dict[str, Any] | None = None
        self._autoaccum_logged: tuple[int, int] | None = None
        self._autoaccum_metrics: dict[str, Any] = {}  # the per-step metric state at the current step's start

    __init__._takes_autoaccum_options = True  # type: ignore[attr-defined]

    @property
    def autoaccum_guard(self) -> LazyGuard | None:
        """The guard of the current (or last) ``train()``, None before its first step."""
        return self._autoaccum

    def _check_setup(self) -> None:
        problems = []
        if self.args.n_gpu > 1:
            problems.append(f"DataParallel over {self.args.n_gpu} GPUs (run one process per GPU: torchrun)")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            problems.append(f"{'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'} (the guard drives DDP or a single "
                            f"process; for sharded training, shard the model with FSDP2's fully_shard under torchrun "
                            f"and train it with autoaccum.fit(..., plan=...) or an OOMGuard with "
                            f"sync=autoaccum.distributed.DistributedSync(model): docs/distributed.md)")
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
            problems.append("context or sequence parallelism")
        if problems:
            raise ValueError("AutoAccumTrainer does not support " + "; ".join(problems))

    # -- training ------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        """HF's training loader, its batches left in host memory: a global batch would otherwise be put on
        the device whole; the guard moves one micro-batch at a time (pinned: asynchronously). A padding-free
        collator's batches also keep their examples (see the module docstring)."""
        placement, collator = self.accelerator.device_placement, self.data_collator
        self.accelerator.device_placement = False
        if flattens(collator):
            self.data_collator = KeepExamples(collator)
        try:
            return super().get_train_dataloader()
        finally:
            self.accelerator.device_placement, self.data_collator = placement, collator

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """HF's ``train``; a resumed run takes the guard's plan from the checkpoint instead of probing."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)  # as HF resolves it (HF raises if None)
        path = Path(checkpoint) / GUARD_FILE if isinstance(checkpoint, (str, os.PathLike)) else None
        if path is not None and path.is_file():
            self._autoaccum_state = json.loads(path.read_text())
        elif self._autoaccum is not None:  # train() again on this trainer: keep the plan it found
            self._autoaccum_state = self._autoaccum.state_dict() or None
        self._autoaccum = None  # the model and optimizer are prepared anew by this call
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self._autoaccum is not None:
                self._autoaccum.close()  # the emulated device of budget= (off CUDA) stops counting

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The exact gradient of this process's share of one global batch, left in ``.grad`` for HF's
        optimizer step (``num_items_in_batch``, HF's count, is counted again per rank and summed)."""
        if self.args.gradient_accumulation_steps != 1:  # changed during the run (a callback's args are these)
            raise ValueError(f"AutoAccumTrainer: args.gradient_accumulation_steps became "
                             f"{self.args.gradient_accumulation_steps} at step {self.state.global_step}; it must stay "
                             f"1 in trainer.args (HF would step once per that many global batches, each from the "
                             f"gradients the guard cleared: the last batch's alone). The global batch is fixed for a "
                             f"run: set gradient_accumulation_steps in the arguments the trainer is made with.")
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        # the probe (first step) and each attempt go through compute_loss: its per-step metrics are put back
        self._autoaccum_metrics = {name: copy.deepcopy(getattr(self, name)) for name in STEP_METRICS
                                   if hasattr(self, name)}
        guard = self._guard(model)
        # a padding-free batch is cut by its examples (HF counted its items on the collated batch)
        result = guard.accumulate(inputs.get(EXAMPLES, inputs) if isinstance(inputs, Mapping) else inputs,
                                  self._autoaccum_loss)
        self._log_plan(result)
        return torch.tensor(result.loss, device=self.args.device)

    def _restore_step_metrics(self) -> None:
        for name, value in self._autoaccum_metrics.items():
            setattr(self, name, copy.deepcopy(value))

    def _guard(self, model: torch.nn.Module) -> LazyGuard:
        if self._autoaccum is None or self._autoaccum.model is not model:
            if self._autoaccum is not None:
                self._autoaccum.close()
            options = self._autoaccum_options
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # AcceleratedOptimizer -> torch's
            self._autoaccum = LazyGuard(
                model, optimizer, target_batch=self._global_batch(), plan=options["plan"],
                micro_batch=options["micro_batch"], probe_model=self.accelerator.unwrap_model(model),
                budget=options["budget"], headroom=options["headroom"], precision=_precision(self.args),
                scaler=self.accelerator.scaler, grow_after=options["grow_after"],
                memory_savers=options["memory_savers"])
            if self._autoaccum_state:
                self._autoaccum.load_state_dict(self._autoaccum_state)
            self._autoaccum_logged = None
        return self._autoaccum

    def _global_batch(self) -> int:
        """Samples per optimizer step over all processes: the per-device batch (here the whole share)
        times the data-parallel processes, as HF counts them."""
        if hasattr(self, "get_total_train_batch_size"):  # transformers >= 4.5x: tensor/context parallel aware
            return int(self.get_total_train_batch_size(self.args))
        return self._train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size

    def _log_plan(self, result: AccumulateResult) -> None:
        """The plan into HF's log history at the first step and at every change."""
        plan = (result.plan.micro_batch, result.plan.accum_steps)
        if plan == self._autoaccum_logged:
            return
        guard = self._autoaccum.guard if self._autoaccum is not None else None
        self._autoaccum_logged = plan
        # HF's own log, past a subclass's: TRL's log adds its per-step metrics (and clears them), which belong
        # to the step's own entry
        Trainer.log(self, {"autoaccum/micro_batch": float(plan[0]), "autoaccum/accum_steps": float(plan[1]),
                           "autoaccum/oom_replays": float(guard.ooms if guard is not None else 0)})

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        super()._save_checkpoint(model, trial, *args, **kwargs)
        if self._autoaccum is None or not self.args.should_save:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if folder.is_dir():
            write_json_atomic(folder / GUARD_FILE, self._autoaccum.state_dict())

