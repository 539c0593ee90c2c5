"""Estimates: a training step run on fake tensors, which carry shapes and no data.

The steps allocate nothing and compute nothing; the tracked counter still counts the bytes every
op would allocate. A CUDA model is estimated on fake ``cuda`` tensors where this torch can run them
(a CUDA build that sees a device): then attention and the other fused kernels are chosen and sized
as the card runs them (SDPA's flash or memory-efficient kernel keeps only its softmax statistics
where the math path keeps every attention matrix), autocast follows CUDA's op lists, and the
optimizer takes its CUDA implementation. Everywhere else (a CPU model, a CPU build of torch, which
cannot run autograd on fake ``cuda`` tensors) the estimate runs on fake ``cpu``, whose kernels can
differ from a GPU's. Either way an estimate is not a measurement, and reports say so.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any

import torch

from autoaccum.errors import TaskError

__all__ = ["UntraceableError", "cuda_library_bytes", "estimate_device", "fake_setup", "with_offset"]

#: what fake tensors cannot run, by torch's exception (torch._subclasses.fake_tensor), in words
_UNTRACEABLE = {
    "DataDependentOutputException": "reads a tensor's value (.item(), float(t), `if t:`, a Python loop over t)",
    "DynamicOutputShapeException": "makes a tensor whose shape depends on the values (nonzero, a boolean mask "
                                   "index, unique, masked_select)",
    "UnsupportedOperatorException": "calls an operator that has no fake-tensor kernel",
}


class UntraceableError(TaskError):
    """An estimate met code that needs the data's values, which fake tensors do not hold; a real probe can run it."""


def estimate_device(device: torch.device) -> torch.device:
    """The device an estimate's fake tensors are on, for a model on ``device``: the model's own CUDA
    device where this torch can run autograd on fake CUDA tensors (a CUDA build that sees a device),
    else ``cpu`` (see the module docstring)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return device
    return torch.device("cpu")


def _fake_copy(model: torch.nn.Module, fake_mode: Any, device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors on ``device``; ``model`` is untouched.

    Each tensor is converted with ``fake_mode.from_tensor`` (metadata only: no data is copied,
    nothing is allocated on the model's device). A plain ``deepcopy`` under the fake mode fails
    for buffers (``Tensor.__deepcopy__`` copies the real storage, then ``set_`` refuses to put it
    into a fake tensor), and moving the model to cpu first would move the user's model."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        fake = fake_mode.from_tensor(t.detach())
        with fake_mode:
            fake = fake.to(device)
        memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def _as_on_device(make_optimizer: Callable[[Any], torch.optim.Optimizer],
                  device: torch.device) -> Callable[[Any], torch.optim.Optimizer]:
    """``make_optimizer`` for fake parameters on ``device``, stepping as it would on the real ones.

    On CUDA, torch's optimizers left at ``foreach=None`` take their foreach implementation, which
    holds a temporary the size of all parameters at once (Adam's ``sqrt(v)`` list: 4 bytes a
    parameter more at the step's peak than the per-parameter loop). They decide from the
    parameters' type, and a fake parameter is no plain ``Tensor``: left alone, the estimate would
    take the per-parameter loop. So a group that leaves ``foreach`` to torch is told what torch
    would choose for real CUDA parameters; a group that sets it (or ``fused``, or
    ``differentiable``, which rule foreach out) is left as it is."""
    if device.type != "cuda":
        return make_optimizer  # a real CPU step takes the per-parameter loop too

    def make(params: Any) -> torch.optim.Optimizer:
        optimizer = make_optimizer(params)
        if isinstance(optimizer, torch.optim.Optimizer):  # (a wrong type is refused by the caller)
            for group in optimizer.param_groups:
                if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                        and not group.get("differentiable"):
                    group["foreach"] = True
        return optimizer
    return make


def fake_setup(model: torch.nn.Module, optimizer: Any, make_optimizer: Callable[[Any], torch.optim.Optimizer],
               device: torch.device | None = None) -> tuple[Any, torch.nn.Module, Callable[..., Any]]:
    """``(fake mode, fake copy of model on device, optimizer factory for it)``; ``model`` is untouched.

    The fake mode is entered once (``with``); inside it, code fake tensors cannot run (it needs the data's
    values) raises ``UntraceableError`` naming the op, the user's line and the fix, not torch's bare exception.

    ``device``: where the fake tensors are (default ``cpu``; ``estimate_device`` says which).
    An optimizer instance is estimated as itself: a new one of its type and settings is built for
    the fake copy (not the default AdamW); otherwise ``make_optimizer`` is used."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cpu") if device is None else device
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_model = _fake_copy(model, fake_mode, device)
    entered = _explaining(fake_mode, type(model).__name__)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return entered, fake_model, _as_on_device(make_optimizer, device)
    opt_type, opt_defaults = type(optimizer), dict(optimizer.defaults)

    def same_optimizer(params: Any) -> torch.optim.Optimizer:
        try:
            return opt_type(params, **opt_defaults)
        except TypeError as exc:
            raise TypeError(f"estimate=True builds a new {opt_type.__name__} for the fake model from its "
                            f"defaults and could not ({exc}); pass optimizer= a factory instead, e.g. "
                            f"lambda params: {opt_type.__name__}(params, ...)") from None
    return entered, fake_model, _as_on_device(same_optimizer, device)


@contextlib.contextmanager
def _explaining(fake_mode: Any, model_name: str) -> Iterator[Any]:
    """``with fake_mode``, with torch's fake-tensor refusals (``_UNTRACEABLE``) raised as an ``UntraceableError``."""
    from torch._subclasses import fake_tensor

    refused = tuple(getattr(fake_tensor, name) for name in _UNTRACEABLE if hasattr(fake_tensor, name))
    try:
        with fake_mode:
            yield fake_mode
    except refused as exc:
        where = _user_line(exc)
        does = next(words for name, words in _UNTRACEABLE.items() if isinstance(exc, getattr(fake_tensor, name)))
        raise UntraceableError(
            f"the estimate cannot trace {model_name}'s training step (make_batch, the model, loss_fn): its code {does}"
            f"{f' at {where}' if where else ''}, and an estimate runs on fake tensors, which hold shapes but no "
            f"values ({type(exc).__name__}: {exc}). Drop --estimate (estimate=True): a real probe runs the step "
            f"and measures it") from exc


def _user_line(exc: BaseException) -> str | None:
    """``file:line`` of the last frame of ``exc``'s traceback outside torch, autoaccum and Python's own library
    (the user's code)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inside = tuple(os.path.join(path, "") for path in (os.path.dirname(torch.__file__), package,
                                                         sysconfig.get_paths()["stdlib"]))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(inside)
              and not f.filename.startswith("<")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


@lru_cache(maxsize=None)
def cuda_library_bytes(device: torch.device) -> int:
    """Bytes the CUDA allocator keeps for the libraries' own use once they have run: cuBLAS's
    workspace (held per handle after the first matmul) and what a first convolution leaves with
    cuDNN. Fake tensors never allocate them, so an estimate for a CUDA model adds them to every
    peak. Measured once per device: run a small matmul and a convolution, forward and backward,
    drop every tensor, and read what the allocator still holds beyond what it held before. (The
    CUDA context itself lives outside the allocator: no budget read from it includes it either.)
    cuBLAS's workspaces are dropped first (they come back at the next matmul), so the reading is the
    same whether or not this process has run a matmul already: measured after a probe's real steps
    it would otherwise read nothing."""
    torch.cuda.synchronize(device)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds
    if clear_workspaces is not None:
        with torch.cuda.device(device):
            clear_workspaces()
    before = torch.cuda.memory_allocated(device)
    x = torch.randn(64, 256, device=device, requires_grad=True)
    (x @ x.t()).sum().backward()
    image = torch.randn(2, 8, 16, 16, device=device, requires_grad=True)
    torch.nn.functional.conv2d(image, torch.randn(8, 8, 3, 3, device=device)).sum().backward()
    del x, image
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.memory_allocated(device) - before))


def with_offset(candidates: Any, offset: int) -> tuple[Any, ...]:
    """The estimate's candidates with ``offset`` bytes added to every peak (see ``cuda_library_bytes``)."""
    return tuple(dataclasses.replace(c, peak_bytes=None if c.peak_bytes is None else c.peak_bytes + offset,
                                     fwd_bwd_peak_bytes=None if c.fwd_bwd_peak_bytes is None
                                     else c.fwd_bwd_peak_bytes + offset,
                                     opt_peak_bytes=None if c.opt_peak_bytes is None else c.opt_peak_bytes + offset)
                 for c in candidates)
