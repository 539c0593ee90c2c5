"""Count live tensor-storage bytes with a TorchDispatchMode; optionally enforce a byte budget.

The counter sees every tensor an ATen op returns while the mode is active (forward, backward
and optimizer step alike) and every tensor handed to ``TrackedMemory.track``. A storage
counts once, from the op that created it until its last reference dies (a ``weakref.finalize``
on the storage). Views and in-place results share an input's storage and count nothing new.
This is the idea behind ``torch.distributed._tools.mem_tracker``, reduced to the two numbers the
probe needs: live bytes now and their peak.

It is exact and repeatable on CPU, and it runs unchanged inside ``FakeTensorMode`` (fake
tensors have storages with sizes, no data), which estimates a step without allocating.

With a budget the counter becomes an emulated device: the op whose result pushes live bytes
past the budget raises ``torch.OutOfMemoryError`` -- mid-forward, mid-backward or inside the
optimizer step, where a real device would fail. Its message reads like a CUDA one ("CUDA out of
memory. Tried to allocate ...") with a marker that it is emulated, so that other libraries' OOM
handlers treat it as real. The result of that op is dropped with the exception, so the count falls
back as the stack unwinds.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoaccum.memory.meter import MemoryReading
from autoaccum.modules import is_compiled
from autoaccum.units import format_bytes, parse_bytes

__all__ = ["TrackedMemory", "active_budget", "emulated_budget", "emulated_device", "iter_tensors", "refuse_compiled",
           "refuse_two_budgets"]


def _storage(t: torch.Tensor) -> Any | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # e.g. subclasses without one storage
        return None


def iter_tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor held by ``obj``: a tensor, a module (parameters, their gradients, buffers, and tensors kept
    as plain attributes of its modules, alone or in a list/tuple/dict: a positional table a forward made and
    cached, which lives on the device as a buffer does), an optimizer (its state), or a list/tuple/dict of
    those."""
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield from iter_tensors(p)
        yield from obj.buffers()
        for module in obj.modules():
            for name, value in vars(module).items():
                if name not in ("_parameters", "_buffers"):  # those above
                    yield from _attribute_tensors(value)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def _attribute_tensors(value: Any) -> Iterable[torch.Tensor]:
    """The tensors of a module attribute: a tensor, or a list/tuple/dict of them (one level)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, torch.Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))


class TrackedMemory(TorchDispatchMode):
    """Live tensor bytes and their peak, counted op by op; raises OOM past ``budget_bytes``.

    Use as a context manager. Tensors that existed before entering (parameters, optimizer
    state) are counted only once handed to ``track``.

    Example::

        with TrackedMemory(budget_bytes=64 * 2**20).track(model, optimizer) as mem:
            loss = model(x).sum(); loss.backward(); optimizer.step()
        print(mem.peak_bytes)
    """

    kind = "tracked"

    def __init__(self, budget_bytes: int | str | None = None) -> None:
        super().__init__()
        self.budget_bytes = None if budget_bytes is None else parse_bytes(budget_bytes)
        self.current_bytes = 0
        self.peak_bytes = 0
        self.oom_count = 0
        #: bytes in use plus the allocation that crossed the budget, at the last emulated OOM
        self.last_oom_needed_bytes: int | None = None
        self._live: dict[int, int] = {}  # id(storage) -> bytes, while the storage is alive
        self._finalizers: dict[int, weakref.finalize] = {}
        self._lock = threading.Lock()

    # -- counting ---------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._live.pop(key, 0)
            self._finalizers.pop(key, None)

    def _add(self, storage: Any) -> int:
        """Count ``storage`` if it is new; returns the bytes added."""
        key = id(storage)
        if key in self._live:
            return 0
        nbytes = int(storage.nbytes())
        with self._lock:
            self._live[key] = nbytes
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self._finalizers[key] = weakref.finalize(storage, self._free, key)
        return nbytes

    def track(self, *objs: Any) -> TrackedMemory:
        """Count tensors that already exist (modules, optimizers, tensors, containers of them).
        Never raises for the budget: what exists already is the device's starting state."""
        for t in (t for obj in objs for t in iter_tensors(obj)):
            storage = _storage(t)
            if storage is not None:
                self._add(storage)
        return self

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        with self._lock:
            self.peak_bytes = self.current_bytes

    def alloc_retries(self) -> int:
        return 0  # an allocator-retry counter exists only on CUDA

    def read(self) -> MemoryReading:
        return MemoryReading(self.current_bytes, self.peak_bytes, None)

    def close(self) -> None:
        """Stop counting frees: drop the finalizers left on storages that outlive this meter
        (parameters, optimizer state), so that repeated meters do not pile them up. The last
        readings stay."""
        with self._lock:
            finalizers, self._finalizers = list(self._finalizers.values()), {}
            self._live.clear()
        for f in finalizers:
            f.detach()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                  for s in (_storage(t),) if s is not None}
        added = 0
        peak_before = self.peak_bytes
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = _storage(t)
                if storage is not None and id(storage) not in inputs:  # views/in-place add nothing
                    added += self._add(storage)
        if added and self.budget_bytes is not None and self.current_bytes > self.budget_bytes:
            self.oom_count += 1
            self.last_oom_needed_bytes = self.current_bytes
            in_use = self.current_bytes - added
            # the refused allocation never happens on a device: it is no part of the peak
            self.peak_bytes = max(peak_before, in_use)
            # Worded as the CUDA allocator words it, so that other libraries' OOM handlers (Accelerate's
            # find_executable_batch_size, Lightning's batch-size finder) treat it as the real thing.
            message = (
                f"CUDA out of memory. Tried to allocate {format_bytes(added)}. [emulated by autoaccum: "
                f"{format_bytes(in_use)} in use of a budget of {format_bytes(self.budget_bytes)}, in {func}]"
            )
            del out, t, storage  # drop the result so its bytes are freed as the error unwinds
            raise torch.OutOfMemoryError(message)
        return out


def emulated_budget(budget: int | str, *track: Any) -> TrackedMemory:
    """A context manager that makes any device behave as if it had only ``budget`` bytes.

    Everything allocated inside counts, plus what ``track`` names (model, optimizer, tensors)
    that exists already. The allocation that crosses the budget raises ``torch.OutOfMemoryError``,
    exactly where a device with that much memory would fail::

        with autoaccum.emulated_budget("256MiB", model, optimizer):
            train_step()   # raises torch.OutOfMemoryError like a small GPU would
    """
    return TrackedMemory(budget_bytes=budget).track(*track)


def active_budget() -> TrackedMemory | None:
    """The innermost ``TrackedMemory`` with a budget active in this thread (an emulated device),
    or None: so that an error can state the budget of an ``emulated_budget(...)`` block it runs in."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, TrackedMemory) and mode.budget_bytes is not None:
            return mode
    return None


def refuse_two_budgets(budget: int | str) -> None:
    """Refuse ``budget=`` while an ``autoaccum.emulated_budget(...)`` block is active: each is a budget for the
    run (off CUDA each an emulated device), and neither could be ignored without surprise.

    Raises:
        TypeError: an emulated budget is active, naming both values and what to give instead.
    """
    active = active_budget()
    if active is None:
        return
    raise TypeError(f"budget={budget!r} and autoaccum.emulated_budget({format_bytes(active.budget_bytes or 0)}) around "
                    f"the training are two budgets for one run: budget= is the memory the probe plans for and, off "
                    f"CUDA, the emulated device each step runs on (in fit and the integrations alike). Give one: "
                    f"budget={budget!r} alone, outside any emulated_budget(...) block, or the emulated_budget(...) "
                    f"block alone, without budget= (the probe then plans for what that device has free)")


def refuse_compiled(model: torch.nn.Module, what: str) -> None:
    """Raise ValueError for a compiled ``model`` that would run under the tracked counter.

    Dynamo compiles no frame while a TorchDispatchMode is active, and marks the frames it saw there
    to be skipped, so the model would run eagerly -- then and afterwards -- while its numbers were
    reported as compiled. Measured on CUDA, a compiled model runs compiled (no dispatch mode)."""
    if is_compiled(model):
        raise ValueError(
            f"cannot {what}: the model is torch.compile'd, and autoaccum's tracked memory counter (used on every "
            f"device but CUDA, and for --estimate / emulated budgets) runs as a TorchDispatchMode, inside which "
            f"torch.compile compiles nothing -- it would run eagerly and be measured as eager. Pass the uncompiled "
            f"module (e.g. model._orig_mod), or measure on CUDA.")


def emulated_device(budget: int | str | None, device: torch.device, model: torch.nn.Module | None, *,
                    skips_probe: str | None = None) -> TrackedMemory | None:
    """What ``budget=`` means for a run (``fit``, the integrations, a search trial), decided in one place:
    the memory the probe plans for and, on every device but CUDA, an emulated device of that size that
    each step runs on (returned; None on CUDA or without a budget).

    Args:
        budget: the run's ``budget=`` (None: no budget).
        device: where the run trains.
        model: the model it trains (a compiled one cannot run under the counter: refused off CUDA); None
            where it is not known yet (only the other rules are checked).
        skips_probe: the option given that skips the probe (``"plan="``, ``"micro_batch="``), if any: on
            CUDA ``budget=`` then means nothing and is refused.

    Raises:
        TypeError: ``budget=`` inside an ``emulated_budget(...)`` block (two budgets), or next to
            ``skips_probe`` on CUDA.
        ValueError: an unreadable budget, or a compiled model off CUDA.
    """
    if budget is None:
        return None
    budget_bytes = parse_bytes(budget)
    refuse_two_budgets(budget)
    if device.type == "cuda":
        if skips_probe is not None:
            raise TypeError(f"budget= is the memory the probe plans for, and {skips_probe} skips the probe; on CUDA no "
                            f"emulated device runs either (that is off CUDA only), so budget= would mean nothing on "
                            f"cuda. Give budget= alone (the probe plans for it) or {skips_probe} alone")
        return None
    if model is not None:
        refuse_compiled(model, "train it under an emulated budget (budget= off CUDA)")
    host = host_memory_bytes()
    if host is not None and budget_bytes > host:
        raise ValueError(f"Invalid budget: {format_bytes(budget_bytes)} is more than this machine's memory "
                         f"({format_bytes(host)}); off CUDA the budget is an emulated device inside the host's memory, "
                         f"which would run out first. Allowed range: up to {format_bytes(host)}; give the memory of "
                         f"the device you plan for, if it is smaller")
    return TrackedMemory(budget_bytes=budget_bytes)


def host_memory_bytes() -> int | None:
    """The machine's physical memory in bytes, None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None
