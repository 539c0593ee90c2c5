"""Estimates: a training step run on fake tensors, which carry shapes and no data.

The steps allocate nothing and compute nothing; the tracked counter still counts the bytes every
op would allocate. Fake ``cuda`` tensors cannot run autograd on a CPU build of torch, so an
estimate runs on fake ``cpu``, whose kernels (e.g. attention) can differ from a GPU's: an
estimate is not a measurement, and reports say so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["fake_setup"]


def _fake_copy(model: torch.nn.Module, fake_mode: Any) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake ``cpu`` tensors; ``model`` is untouched.

    Each tensor is converted with ``fake_mode.from_tensor`` (metadata only: no data is copied,
    nothing is allocated on the model's device). A plain ``deepcopy`` under the fake mode fails
    for buffers (``Tensor.__deepcopy__`` copies the real storage, then ``set_`` refuses to put it
    into a fake tensor), and moving the model to cpu first would move the user's model."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        fake = fake_mode.from_tensor(t.detach())
        with fake_mode:
            fake = fake.to("cpu")
        memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def fake_setup(model: torch.nn.Module, optimizer: Any,
               make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> tuple[Any, torch.nn.Module, Callable[..., Any]]:
    """``(fake_mode, fake copy of model, optimizer factory for it)``; ``model`` is untouched.

    An optimizer instance is estimated as itself: a new one of its type and settings is built for
    the fake copy (not the default AdamW); otherwise ``make_optimizer`` is used."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_model = _fake_copy(model, fake_mode)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return fake_mode, fake_model, make_optimizer
    opt_type, opt_defaults = type(optimizer), dict(optimizer.defaults)

    def same_optimizer(params: Any) -> torch.optim.Optimizer:
        try:
            return opt_type(params, **opt_defaults)
        except TypeError as exc:
            raise TypeError(f"estimate=True builds a new {opt_type.__name__} for the fake model from its "
                            f"defaults and could not ({exc}); pass optimizer= a factory instead, e.g. "
                            f"lambda params: {opt_type.__name__}(params, ...)") from None
    return fake_mode, fake_model, same_optimizer
