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

import copy
import dataclasses
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

__all__ = ["cuda_library_bytes", "estimate_device", "fake_setup", "with_offset"]


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
    """``(fake_mode, fake copy of model on device, optimizer factory for it)``; ``model`` is untouched.

    ``device``: where the fake tensors are (default ``cpu``; ``estimate_device`` says which).
    An optimizer instance is estimated as itself: a new one of its type and settings is built for
    the fake copy (not the default AdamW); otherwise ``make_optimizer`` is used."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cpu") if device is None else device
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_model = _fake_copy(model, fake_mode, device)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return fake_mode, fake_model, _as_on_device(make_optimizer, device)
    opt_type, opt_defaults = type(optimizer), dict(optimizer.defaults)

    def same_optimizer(params: Any) -> torch.optim.Optimizer:
        try:
            return opt_type(params, **opt_defaults)
        except TypeError as exc:
            raise TypeError(f"estimate=True builds a new {opt_type.__name__} for the fake model from its "
                            f"defaults and could not ({exc}); pass optimizer= a factory instead, e.g. "
                            f"lambda params: {opt_type.__name__}(params, ...)") from None
    return fake_mode, fake_model, _as_on_device(same_optimizer, device)



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
