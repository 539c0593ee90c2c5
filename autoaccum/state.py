"""Snapshots of training state, restored bit for bit (invariant 4: probing leaves no trace)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BufferSnapshot", "RngState", "TrainingSnapshot", "capture", "capture_buffers", "capture_rng",
           "release_pinned_memory", "restore", "restore_buffers", "restore_rng", "state_buffers"]


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


def _host_copy(t: torch.Tensor, queued: set[int]) -> torch.Tensor:
    """A host copy of ``t``. A CUDA tensor goes to page-locked memory without waiting (the caller
    synchronises once, :func:`_synchronize`): a copy to pageable memory is staged through the driver's
    buffers and faults in every new page, 0.35 s for the 537 MB of a 134M-parameter MLP on an H200
    against 0.21 s page-locked, and its way back 62 ms against 10 ms (benchmarks/RESULTS.md, "Cold
    probe on a GPU"). ``queued`` collects the devices with copies in flight. Where pinning fails (host
    memory, limits), and for tensor subclasses (DTensor), the copy is pageable and done on return."""
    t = t.detach()
    if t.device.type == "cuda" and type(t) is torch.Tensor:
        try:
            copied = torch.empty_like(t, device="cpu", pin_memory=True).copy_(t, non_blocking=True)
        except RuntimeError:
            pass
        else:
            queued.add(t.device.index)
            return copied
    return t.to("cpu", copy=True)


def _pinned(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.is_pinned()


def _synchronize(queued: set[int]) -> None:
    """Wait for the copies in flight to and from the CUDA devices in ``queued``."""
    for index in sorted(queued):
        torch.cuda.synchronize(index)


def release_pinned_memory() -> None:
    """Give the page-locked host memory that snapshots used back to the system: torch keeps freed
    page-locked blocks cached, and a probe's snapshot is the size of the model's weights. Blocks
    still in use (a snapshot that is alive, a loader's pinned batches) stay; free ones that a loader
    cached are pinned again on their next use. A no-op without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _to_cpu(obj: Any, queued: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj, queued)
    if isinstance(obj, dict):
        return {k: _to_cpu(v, queued) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v, queued) for v in obj)
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
    """Copy everything a training step changes to host memory (the device's memory is left as it is;
    CUDA tensors go to page-locked memory, see :func:`release_pinned_memory`)."""
    queued: set[int] = set()
    snapshot = TrainingSnapshot(
        tensors={n: _host_copy(t, queued) for n, t in _named_tensors(model).items()},
        grads={n: None if p.grad is None else _host_copy(p.grad, queued)
               for n, p in model.named_parameters(remove_duplicate=False)},
        optimizer=None if optimizer is None else _to_cpu(optimizer.state_dict(), queued),
        scheduler=None if scheduler is None else _to_cpu(scheduler.state_dict(), queued),
        scaler=None if scaler is None else _to_cpu(scaler.state_dict(), queued),
        rng=capture_rng(),
    )
    _synchronize(queued)  # the copies were queued; the snapshot is whole once they are done
    return snapshot


def restore(snapshot: TrainingSnapshot, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            scheduler: Any = None, scaler: Any = None) -> None:
    """Put back what :func:`capture` copied; values come back bit-identical."""
    queued: set[int] = set()
    with torch.no_grad():
        for name, t in _named_tensors(model).items():
            saved = snapshot.tensors[name]
            t.copy_(saved, non_blocking=_pinned(saved))
            if _pinned(saved) and t.device.type == "cuda":
                queued.add(t.device.index)
        for name, p in model.named_parameters(remove_duplicate=False):
            saved = snapshot.grads[name]
            p.grad = None if saved is None else saved.to(p.device, copy=True, non_blocking=_pinned(saved))
            if saved is not None and _pinned(saved) and p.device.type == "cuda":
                queued.add(p.device.index)
    _synchronize(queued)  # values in place (and the page-locked copies free to go) on return
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
