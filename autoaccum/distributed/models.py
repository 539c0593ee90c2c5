"""Models under ``torch.distributed``: which kind a model is (DDP, FSDP2 or plain), wrapping and
unwrapping it, and its full state for a checkpoint."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from autoaccum.distributed.process_group import is_distributed
from autoaccum.modules import unwrap as unwrap_model  # the one rule, under the name users know

__all__ = ["full_state_dicts", "is_fsdp2", "load_full_state_dicts", "model_kind", "unwrap_model", "wrap_model"]

ModelKind = Literal["ddp", "fsdp2", "plain"]


def is_fsdp2(model: torch.nn.Module) -> bool:
    """``model`` or one of its submodules was sharded with FSDP2's ``fully_shard``."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _is_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def model_kind(model: torch.nn.Module) -> ModelKind:
    """How a model is data-parallel: DDP-wrapped, FSDP2-sharded, or a plain module.

    Raises:
        TypeError: FSDP1 (``FullyShardedDataParallel``), which autoaccum does not drive.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if not dist.is_available():
        return "plain"
    if is_fsdp2(model):
        return "fsdp2"
    if _is_fsdp1(model):
        raise TypeError("FullyShardedDataParallel (FSDP1) is not supported; shard the model with FSDP2 "
                        "(torch.distributed.fsdp.fully_shard) or wrap it in DistributedDataParallel")
    return "plain"


def wrap_model(model: torch.nn.Module, device: torch.device | str | None = None, **ddp_kwargs: Any) -> torch.nn.Module:
    """``model`` on ``device``, wrapped in DDP; a model already DDP-wrapped or FSDP2-sharded comes back as it is.

    Args:
        model: the module to train.
        device: where it runs (``cuda:LOCAL_RANK`` under torchrun with CUDA); None keeps it where it is.
        ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``broadcast_buffers=False``).

    Raises:
        RuntimeError: no process group is initialised.
    """
    if model_kind(model) != "plain":
        return model  # never wrap twice
    if not is_distributed():
        raise RuntimeError("wrap_model needs an initialised process group: launch with torchrun and call "
                           "autoaccum.distributed.init_from_env() (or torch.distributed.init_process_group)")
    if device is not None:
        model = model.to(device)
    device = next(model.parameters()).device
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device])
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's complete state, as one process would hold it, for rank 0 to write.

    DDP and plain modules: the inner module's ``state_dict()`` and the optimizer's. FSDP2: the shards
    are gathered with ``torch.distributed.checkpoint.state_dict`` (full state, on the CPU); a
    collective, so every rank must call this, and only rank 0 gets the state (the others get empty
    dicts). Loading it back: ``load_full_state_dicts``.
    """
    if model_kind(model) != "fsdp2":
        return unwrap_model(model).state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                          optimizer_state: dict) -> None:
    """Load what ``full_state_dicts`` returned (every rank gives the full state it read from the file)."""
    if model_kind(model) != "fsdp2":
        unwrap_model(model).load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    # strict=False: a parameter that never had a gradient has no optimizer state, in one process too
    # (fit compares the checkpoint's parameter names and shapes with the model's before loading)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True, strict=False))
