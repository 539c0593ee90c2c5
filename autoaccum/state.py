"""Snapshots of training state, restored bit for bit (invariant 4: probing leaves no trace)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BufferSnapshot", "RngState", "TrainingSnapshot", "capture", "capture_buffers", "capture_rng", "restore",
           "restore_buffers", "restore_rng", "state_buffers"]


@dataclass(frozen=True)
class RngState:
    """The generators a training step may draw from: Python, torch CPU, and every CUDA device."""

    python: Any
    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None


def capture_rng() -> RngState:
    # Only read CUDA generators that exist already: reading them must not initialise CUDA.
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
    return RngState(random.getstate(), torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    random.setstate(state.python)
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(list(state.cuda))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass(frozen=True)
class TrainingSnapshot:
    """Host copies of parameters, gradients, buffers, optimizer/scheduler/scaler state and RNG."""

    tensors: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    optimizer: dict | None
    scheduler: dict | None
    scaler: dict | None
    rng: RngState


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = {f"param:{n}": p for n, p in model.named_parameters(remove_duplicate=False)}
    named.update({f"buffer:{n}": b for n, b in model.named_buffers(remove_duplicate=False)})
    return named


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
            scaler: Any = None) -> TrainingSnapshot:
    """Copy everything a training step changes to host memory (the device's memory is left as it is)."""
    return TrainingSnapshot(
        tensors={n: t.detach().to("cpu", copy=True) for n, t in _named_tensors(model).items()},
        grads={n: None if p.grad is None else p.grad.detach().to("cpu", copy=True)
               for n, p in model.named_parameters(remove_duplicate=False)},
        optimizer=None if optimizer is None else _to_cpu(optimizer.state_dict()),
        scheduler=None if scheduler is None else _to_cpu(scheduler.state_dict()),
        scaler=None if scaler is None else _to_cpu(scaler.state_dict()),
        rng=capture_rng(),
    )


def restore(snapshot: TrainingSnapshot, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            scheduler: Any = None, scaler: Any = None) -> None:
    """Put back what :func:`capture` copied; values come back bit-identical."""
    with torch.no_grad():
        for name, t in _named_tensors(model).items():
            t.copy_(snapshot.tensors[name])
        for name, p in model.named_parameters(remove_duplicate=False):
            saved = snapshot.grads[name]
            p.grad = None if saved is None else saved.to(p.device, copy=True)
    if optimizer is not None and snapshot.optimizer is not None:
        optimizer.state.clear()  # load_state_dict fills what was saved; nothing created since may stay
        optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
    if scheduler is not None and snapshot.scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
    if scaler is not None and snapshot.scaler is not None:
        scaler.load_state_dict(copy.deepcopy(snapshot.scaler))
    restore_rng(snapshot.rng)


# -- buffers a forward updates (BatchNorm running statistics): a replayed step starts from them -------
BufferSnapshot = list[tuple[torch.nn.Module, str, torch.Tensor]]


def state_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of every persistent buffer: the buffers that are training state.
    Non-persistent buffers (masks, rotary tables) are derived, not state."""
    return [(module, name) for module in model.modules() for name in module._buffers
            if name not in module._non_persistent_buffers_set]


def capture_buffers(slots: list[tuple[torch.nn.Module, str]]) -> BufferSnapshot:
    """Copies of the buffers of ``slots`` (from :func:`state_buffers`) that a forward in training may
    change: those of modules in training mode."""
    return [(module, name, buffer.clone()) for module, name in slots if module.training
            for buffer in (module._buffers.get(name),) if buffer is not None]


def restore_buffers(snapshot: BufferSnapshot) -> None:
    """Put the buffers back as :func:`capture_buffers` copied them."""
    with torch.no_grad():
        for module, name, saved in snapshot:
            current = module._buffers.get(name)
            if current is not None and current.shape == saved.shape and current.dtype == saved.dtype:
                current.copy_(saved)
            else:
                module._buffers[name] = saved
