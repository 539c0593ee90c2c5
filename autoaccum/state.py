"""Snapshots of training state, restored bit for bit (invariant 4: probing leaves no trace)."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import psutil
import torch

__all__ = ["BufferCopies", "BufferSnapshot", "RngState", "TrainingSnapshot", "WeightsCopy", "capture",
           "capture_buffers", "capture_rng", "release_pinned_memory", "restore", "restore_buffers", "restore_rng",
           "state_buffers"]


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


#: page-locked copies only while their blocks take at most this share of the host memory available (torch rounds
#: each block up to a power of two, and page-locked memory cannot be swapped out); pageable copies otherwise
PINNED_SHARE = 0.25


def _pinnable(t: torch.Tensor) -> bool:
    """Whether ``t`` is copied to page-locked memory: a dense CUDA tensor, a parameter too (a plain tensor once
    detached), not a subclass such as DTensor."""
    return t.device.type == "cuda" and _plain(t)


def _plain(t: torch.Tensor) -> bool:
    """``t`` is a plain tensor once detached (a parameter too), not a subclass such as DTensor."""
    return type(t.detach()) is torch.Tensor


def _host_copy(t: torch.Tensor, queued: set[int] | None) -> torch.Tensor:
    """A host copy of ``t``. With ``queued`` (a set), a CUDA tensor goes to page-locked memory without waiting and
    its device is added to ``queued``; the caller synchronises once (``_synchronize``). Page-locked because a
    copy to pageable memory is staged through the driver's buffers and faults in every new page, which is
    slower both ways. Where pinning fails, and for tensor subclasses (DTensor), the copy is pageable and done
    on return."""
    t = t.detach()
    if queued is not None and _pinnable(t):
        try:
            copied = torch.empty_like(t, device="cpu", pin_memory=True).copy_(t, non_blocking=True)
        except RuntimeError:  # no page-locked memory to be had, or a layout that cannot be pinned (sparse)
            pass
        else:
            queued.add(t.device.index)
            return copied
    return t.to("cpu", copy=True)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in nested dicts, lists and tuples (``autoaccum.plan.batch.tensors`` sits a layer above this
    module, which every layer may use)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _room_to_pin(tensors: list[torch.Tensor]) -> bool:
    """Whether page-locked copies of ``tensors`` (each block rounded up to a power of two, as torch allocates
    them) stay within PINNED_SHARE of the host memory available."""
    need = sum(1 << max(0, t.numel() * t.element_size() - 1).bit_length() for t in tensors)
    return need <= PINNED_SHARE * psutil.virtual_memory().available


def _queue(saved: torch.Tensor, device: torch.device, queued: set[int]) -> bool:
    """Whether ``saved`` goes back to ``device`` without waiting (a page-locked copy to a CUDA device, whose
    index is then added to ``queued``)."""
    if device.type != "cuda" or type(saved) is not torch.Tensor or not saved.is_pinned():
        return False
    queued.add(device.index)
    return True


def _synchronize(queued: set[int]) -> None:
    """Wait for the copies in flight to and from the CUDA devices in ``queued``."""
    for index in sorted(queued):
        torch.cuda.synchronize(index)


def release_pinned_memory() -> None:
    """Give the page-locked host memory that snapshots used back to the system: torch keeps freed
    page-locked blocks cached, and a probe's snapshot is the size of the model's weights. Blocks
    still in use (a snapshot that is alive, a loader's pinned batches) stay; free ones that a loader
    cached are pinned again on their next use. A no-op without CUDA."""
    if not torch.cuda.is_initialized():  # (is_available() would start the driver: not in a CPU-only run)
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _to_cpu(obj: Any, queued: set[int] | None) -> Any:
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj, queued)
    if isinstance(obj, dict):
        return {k: _to_cpu(v, queued) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v, queued) for v in obj)
    return copy.deepcopy(obj)


@dataclass(frozen=True)
class TrainingSnapshot:
    """Host copies of parameters (unless captured without them), gradients, buffers, optimizer/scheduler/scaler
    state and RNG."""

    tensors: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    optimizer: dict | None
    scheduler: dict | None
    scaler: dict | None
    rng: RngState
    parameters: bool = True  # whether ``tensors`` holds the parameters' values


def _named_tensors(model: torch.nn.Module, parameters: bool = True) -> dict[str, torch.Tensor]:
    named = {f"param:{n}": p for n, p in model.named_parameters(remove_duplicate=False)} if parameters else {}
    named.update({f"buffer:{n}": b for n, b in model.named_buffers(remove_duplicate=False)})
    return named


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
            scaler: Any = None, *, pinned: bool = True, parameters: bool = True) -> TrainingSnapshot:
    """Copy everything a training step changes to host memory (the device's memory is left as it is).

    ``parameters=False``: the parameters' values are left out (a ``WeightsCopy`` keeps them), and
    ``restore`` leaves them as they are; their gradients are in.

    ``pinned``: CUDA tensors go to page-locked memory (faster both ways; one wait per device), where
    it takes at most PINNED_SHARE of the host memory available. The blocks stay cached in torch after
    the snapshot is gone: ``release_pinned_memory`` gives them back. False: pageable copies (a
    snapshot kept for long, as the search's)."""
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    states = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
    dicts = {k: None if v is None else v.state_dict() for k, v in states.items()}
    named = _named_tensors(model, parameters)
    copied = _tensors([list(named.values()), [g for g in grads.values() if g is not None], list(dicts.values())])
    queued: set[int] | None = set() if pinned and torch.cuda.is_initialized() and _room_to_pin(
        [t for t in copied if _pinnable(t)]) else None
    snapshot = TrainingSnapshot(
        tensors={n: _host_copy(t, queued) for n, t in named.items()},
        grads={n: None if g is None else _host_copy(g, queued) for n, g in grads.items()},
        optimizer=None if dicts["optimizer"] is None else _to_cpu(dicts["optimizer"], queued),
        scheduler=None if dicts["scheduler"] is None else _to_cpu(dicts["scheduler"], queued),
        scaler=None if dicts["scaler"] is None else _to_cpu(dicts["scaler"], queued),
        rng=capture_rng(),
        parameters=parameters,
    )
    if queued:
        _synchronize(queued)  # the copies were queued; the snapshot is whole once they are done
    return snapshot


def restore(snapshot: TrainingSnapshot, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            scheduler: Any = None, scaler: Any = None) -> None:
    """Put back what ``capture`` copied; values come back bit-identical."""
    queued: set[int] = set()
    with torch.no_grad():
        for name, t in _named_tensors(model, snapshot.parameters).items():
            saved = snapshot.tensors[name]
            t.copy_(saved, non_blocking=_queue(saved, t.device, queued))
        for name, p in model.named_parameters(remove_duplicate=False):
            saved = snapshot.grads[name]
            p.grad = None if saved is None else saved.to(p.device, copy=True,
                                                         non_blocking=_queue(saved, p.device, queued))
    _synchronize(queued)  # values in place (and the page-locked copies free to go) on return
    if optimizer is not None and snapshot.optimizer is not None:
        optimizer.state.clear()  # load_state_dict fills what was saved; nothing created since may stay
        optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
    if scheduler is not None and snapshot.scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
    if scaler is not None and snapshot.scaler is not None:
        scaler.load_state_dict(copy.deepcopy(snapshot.scaler))
    restore_rng(snapshot.rng)


class WeightsCopy:
    """A copy of a model's parameters made where they are (on their device), for the probe's warm-up: its two
    optimizer steps change them, and nothing after it should (forward and backward passes only), so the copy
    is put back when the warm-up ends and given up. On a GPU this is a device-to-device copy, so the probe
    need not pin the weights' size of host memory. It takes device memory while it lives, which the probe
    subtracts from its readings (``autoaccum.probe.passes``). Frozen parameters are copied too: a forward
    may write them (``nn.Embedding(max_norm=...)`` renormalises its rows in place), and nothing else holds them.

    A model's forward may write its own parameters (a max-norm constraint, weight clipping). Such writes are
    seen two ways: ``differs`` compares the values with the copy while it is held, bit for bit (writes
    through ``.data`` too), and ``written`` compares every parameter's version counter and storage with
    their readings at the copy or at ``put_back`` (in-place writes and ``.data = ...`` assignments; not
    in-place writes through ``.data``).

    Only for parameters that are plain dense tensors (not DTensor or other subclasses): ``usable`` says so.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        unique = _unique_parameters(model)
        self.names, self.parameters = list(unique), list(unique.values())
        with torch.no_grad():
            self.copies: list[torch.Tensor] | None = [p.detach().clone() for p in self.parameters]
        self.readings = self._readings()

    @staticmethod
    def usable(model: torch.nn.Module) -> bool:
        """Whether every parameter is a plain dense tensor (a copy of each can be made and put back in place)."""
        return all(_plain(p) and p.layout == torch.strided for p in model.parameters())

    @staticmethod
    def nbytes(model: torch.nn.Module) -> int:
        """The bytes a copy of ``model``'s parameters takes (tied weights once)."""
        return sum(p.numel() * p.element_size() for p in _unique_parameters(model).values())

    def _readings(self) -> list[tuple[int, int]]:
        return [(p._version, p.data_ptr()) for p in self.parameters]

    def written(self) -> str | None:
        """The name of a parameter written in place, or given new storage (``p.data = ...``), since the copy was
        made or put back, or None."""
        readings = self._readings()
        if readings == self.readings:
            return None
        return next(n for n, now, then in zip(self.names, readings, self.readings) if now != then)

    def differs(self) -> bool:
        """Whether a parameter's value differs from its copy, bit for bit (a NaN equals the same NaN; -0.0 is not
        0.0), or its dtype or shape does. False once the copy is given up."""
        if self.copies is None:
            return False
        return not all(_same_bits(p.detach(), saved) for p, saved in zip(self.parameters, self.copies))

    @property
    def held(self) -> bool:
        return self.copies is not None

    def put_back(self) -> None:
        """Copy the saved values into the parameters (bit for bit), give the copy up, and watch the version
        counters from here. A second call does nothing."""
        if self.copies is None:
            return
        with torch.no_grad():
            for p, saved in zip(self.parameters, self.copies):
                p.copy_(saved)
        self.copies = None
        self.readings = self._readings()


def _unique_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Each parameter once, by its first name (tied weights once)."""
    return dict(model.named_parameters())  # (remove_duplicate=True by default: a tied weight under its first name)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (same dtype and shape): compared as bytes where their memory is
    laid out alike, by value otherwise (then a NaN differs from itself: reported as changed, the safe side)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_contiguous() and b.is_contiguous() and a.numel():
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


# -- buffers a forward updates (BatchNorm running statistics): a replayed step starts from them -------
BufferSnapshot = list[tuple[torch.nn.Module, str, torch.Tensor]]


def state_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of every persistent buffer: the buffers that are training state.
    Non-persistent buffers (masks, rotary tables) are derived, not state."""
    return [(module, name) for module in model.modules() for name in module._buffers
            if name not in module._non_persistent_buffers_set]


def capture_buffers(slots: list[tuple[torch.nn.Module, str]]) -> BufferSnapshot:
    """Copies of the buffers of ``slots`` (from ``state_buffers``) that a forward in training may
    change: those of modules in training mode (made once: ``BufferCopies`` for a step loop)."""
    return BufferCopies(slots).capture()


class BufferCopies:
    """Copies of the buffers of ``slots`` a forward in training may change, made again at each
    ``capture()`` into the same tensors, in one fused copy per device and dtype
    (``torch._foreach_copy_``) instead of a clone per buffer (on CUDA a clone is a launch each: 159
    for a ResNet-50's BatchNorm statistics). The copies stay allocated between captures."""

    def __init__(self, slots: list[tuple[torch.nn.Module, str]]) -> None:
        self.slots = slots
        self._copies: dict[tuple[int, str], torch.Tensor] = {}

    def capture(self) -> BufferSnapshot:
        snapshot: BufferSnapshot = []
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for module, name in self.slots:
            buffer = module._buffers.get(name)
            if not module.training or buffer is None:
                continue
            if type(buffer) is not torch.Tensor or buffer.layout != torch.strided:  # a subclass, sparse: cloned
                snapshot.append((module, name, buffer.clone()))
                continue
            copy = self._copies.get((id(module), name))
            if copy is None or copy is buffer or copy.shape != buffer.shape or copy.dtype != buffer.dtype \
                    or copy.device != buffer.device:  # (a restore may have made the copy the buffer itself)
                copy = self._copies[(id(module), name)] = torch.empty_like(buffer)
            dst, src = groups.setdefault((buffer.device, buffer.dtype), ([], []))
            dst.append(copy)
            src.append(buffer)
            snapshot.append((module, name, copy))
        with torch.no_grad():
            for dst, src in groups.values():
                torch._foreach_copy_(dst, src)
        return snapshot


def restore_buffers(snapshot: BufferSnapshot) -> None:
    """Put the buffers back as ``capture_buffers`` copied them."""
    with torch.no_grad():
        for module, name, saved in snapshot:
            current = module._buffers.get(name)
            if current is not None and current.shape == saved.shape and current.dtype == saved.dtype:
                current.copy_(saved)
            else:
                module._buffers[name] = saved
