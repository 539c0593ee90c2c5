"""The guard for an Accelerate loop: exact global batches, OOM replay, your own optimizer step.

A typical Accelerate loop, changed in two places::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    guard = guard_for(accelerator, model, optimizer)          # + this line
    for batch in loader:                                      # each batch: this process's global share
        guard.accumulate(batch, loss_fn)                      # instead of: with accelerator.accumulate(model):
                                                              #     accelerator.backward(loss_fn(model, batch))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unchanged: Accelerate's own step
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

``loss_fn(model, batch)`` returns the mean loss of the batch it is given, or ``(loss_sum,
num_items)`` for token-level losses. The loader's batch is this process's share of the global batch
(``batch_size x num_processes`` samples per optimizer step); the guard probes real steps at the first
one, cuts every batch into micro-batches that fit, and replays a step that runs out of memory on the
same samples with a smaller micro-batch. Afterwards ``.grad`` holds the global batch's gradient.

What it takes from Accelerate: the model as ``accelerator.prepare`` returned it (with several
processes a DDP wrapper, whose ``no_sync`` is the guard's window; Accelerate's ``GradientState`` is
left as outside ``accelerator.accumulate``, so the ``AcceleratedOptimizer`` steps and zeroes as
usual); the wrapped torch optimizer, whose gradients the guard clears before each step and on a
replay; and ``accelerator.scaler`` (fp16), with which the guard scales every micro-batch's loss as
``accelerator.backward`` does. Autocast is Accelerate's (the prepared model's forward).

``gradient_accumulation_steps`` must be 1 (``accelerator.backward`` would divide each loss by it;
refused at the start and at any step where it changed). Not supported: DeepSpeed, Megatron-LM and
XLA (their engines own backward). A prepared loader puts each global batch on the device whole;
``accelerator.prepare(..., loader, device_placement=[..., False])`` leaves it in host memory, and the
guard moves one micro-batch at a time. The last, shorter batch of an epoch is one exact step on the
samples it holds; with ``even_batches`` (Accelerate's default) it is filled up with samples from the
epoch's start on every process, as in any Accelerate loop (``Accelerator(even_batches=False)`` or a
``drop_last`` loader avoid it).
"""

from __future__ import annotations

from typing import Any

import torch

from autoaccum import distributed
from autoaccum.integrations.lazy_guard import LazyGuard, check_guard_keywords
from autoaccum.precision import Precision

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("autoaccum.integrations.accelerate needs Accelerate: "
                      "pip install 'autoaccum[accelerate]'") from exc

__all__ = ["guard_for"]

_PRECISION: dict[str, Precision] = {"bf16": "bf16", "fp16": "fp16"}
#: distributed types whose engine owns backward (XLA was TPU before Accelerate 0.26)
_OWN_BACKWARD = {getattr(DistributedType, name) for name in ("DEEPSPEED", "MEGATRON_LM", "XLA", "TPU")
                 if hasattr(DistributedType, name)}
#: what works for sharded training, named where a sharding engine is refused
_SHARDED = ("; for sharded training, shard the model with FSDP2's fully_shard under torchrun and train it with "
            "autoaccum.fit(..., plan=...) or OOMGuard(..., sync=autoaccum.distributed.DistributedSync(model)): "
            "docs/distributed.md")


def _processes_differ(accelerator: Accelerator) -> str | None:
    """What is wrong where Accelerate counts other processes than the process group: plain ``torchrun`` on CPU,
    where ``Accelerator()`` reports one (``DistributedType.NO``: no loader sharded, no model wrapped) while the
    guard would take the group and count every rank's share of samples that are in fact the same."""
    world = distributed.world_info().world_size if distributed.is_distributed() else 1
    processes = accelerator.num_processes
    if processes == world:
        return None
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    return (f"accelerator.num_processes={processes} (distributed type {kind}) under a torch.distributed process "
            f"group of {world} ranks: Accelerate did not take the group, so it shards no loader and wraps no model, "
            f"and every rank would train on the same samples while the guard counted {world} ranks' shares. They "
            f"must be equal: launch with `accelerate launch`, or, with torchrun on CPU, set ACCELERATE_USE_CPU=1 "
            f"(or Accelerator(cpu=True)) so that Accelerate takes the group")


def guard_for(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
              target_batch: int | None = None, plan: Any = None, micro_batch: int | None = None,
              budget: int | str | None = None, headroom: float = 0.1, **guard_options: Any) -> LazyGuard:
    """The guard for a model and optimizer that ``accelerator.prepare`` returned (see the module docstring).

    Args:
        accelerator: the ``Accelerator`` that prepared them (``gradient_accumulation_steps`` 1).
        model: as ``accelerator.prepare`` returned it.
        optimizer: as ``accelerator.prepare`` returned it.
        target_batch: samples per optimizer step over all processes; default the first batch's size
            times the number of processes.
        plan: a ``Plan``, probe report or plan file, instead of probing at the first batch.
        micro_batch: the largest micro-batch to start with, instead of probing at the first batch.
        budget: the memory the run plans for and, as in ``fit``, on devices other than CUDA is held to: each
            ``accumulate``/``step`` runs on an emulated device of that size, where a step that does not fit
            raises a real OOM that is replayed (``autoaccum.integrations.lazy_guard``). Default the device's
            free memory (on CPU under ``autoaccum.emulated_budget``, that budget; not both). On CUDA not with
            ``plan`` or ``micro_batch``, which skip the probe.
        headroom: the fraction of the budget the probe keeps free.
        **guard_options: for ``OOMGuard``: ``grow_after``, and for ``guard.step`` (which also steps
            the optimizer) ``scheduler`` and ``max_grad_norm``.

    Returns:
        A ``LazyGuard``: ``accumulate(batch, loss_fn)`` (Accelerate steps) or ``step(batch, loss_fn)``
        (the guard steps).

    Raises:
        ValueError: gradient accumulation configured in Accelerate, a distributed type whose engine owns
            backward (DeepSpeed, Megatron-LM, XLA), or ``accelerator.num_processes`` other than the
            ``torch.distributed`` process group's world size (plain ``torchrun`` on CPU without
            ``ACCELERATE_USE_CPU=1``: Accelerate runs one process and shards nothing).
        TypeError: a keyword neither ``guard_for`` nor the guard takes (named with the closest known one).
    """
    check_guard_keywords(guard_options, "guard_for", own=("accelerator", "model", "optimizer", "target_batch", "plan",
                                                          "micro_batch", "budget", "headroom"))
    problems = []
    if accelerator.gradient_accumulation_steps != 1:
        problems.append(f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps} (the guard "
                        f"accumulates: Accelerator(gradient_accumulation_steps=1), no accelerator.accumulate)")
    if accelerator.distributed_type in _OWN_BACKWARD:
        problems.append(f"distributed type {accelerator.distributed_type} (its engine owns backward{_SHARDED})")
    if accelerator.distributed_type == getattr(DistributedType, "FSDP", None):
        problems.append(f"Accelerate's FSDP plugin (the guard drives DDP or a single process{_SHARDED})")
    mismatch = _processes_differ(accelerator)
    if mismatch is not None:
        problems.append(mismatch)
    if problems:
        raise ValueError("guard_for cannot drive " + "; ".join(problems))
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # AcceleratedOptimizer -> the torch optimizer

    def still_one_step_per_batch() -> None:
        # Accelerate's accumulation set during the run would step once per k batches, each from the gradients the
        # guard cleared at the last batch's start: every optimizer step the last batch's alone. Refused here.
        steps, sync = accelerator.gradient_accumulation_steps, accelerator.sync_gradients
        if steps == 1 and not sync:  # inside accelerator.no_sync / accumulate, or a block an exception left
            raise ValueError("guard_for: Accelerate's sync_gradients is False with gradient_accumulation_steps=1: the "
                             "guard runs inside accelerator.accumulate(...) or no_sync(...), or an earlier accumulate "
                             "block ended with an exception and left Accelerate's shared GradientState at False. Call "
                             "the guard outside those blocks (it accumulates and syncs itself); after an exception, "
                             "accelerator.gradient_state._set_sync_gradients(True) resets it.")
        if steps != 1:
            raise ValueError(f"guard_for: Accelerate's gradient accumulation is on (gradient_accumulation_steps="
                             f"{steps}, sync_gradients={sync}): it must stay 1, outside accelerator.accumulate, "
                             f"while the guard accumulates. The global batch is the loader's batch per process; to "
                             f"change it, make a new loader and a new guard_for (its global batch is fixed).")

    return LazyGuard(model, inner, target_batch=target_batch, plan=plan, micro_batch=micro_batch,
                     probe_model=accelerator.unwrap_model(model), budget=budget, headroom=headroom,
                     precision=_PRECISION.get(str(accelerator.mixed_precision), "fp32"), scaler=accelerator.scaler,
                     check=still_one_step_per_batch, **guard_options)
