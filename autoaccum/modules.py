"""What a model is under its wrappers: the one rule for unwrapping, and whether it is compiled; a module's
forward replaced for a block."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["forward_replaced", "is_compiled", "unwrap"]

#: wrappers whose ``.module`` is the model they run (by class name: no import of torch.distributed here)
_DATA_PARALLEL = ("DistributedDataParallel", "DataParallel")


def unwrap(model: torch.nn.Module, *, compiled: bool = False) -> torch.nn.Module:
    """The module inside DDP and DataParallel wrappers (``.module``) and, with ``compiled``, inside
    ``torch.compile``'s ``OptimizedModule`` (``._orig_mod``), however they nest.

    Without ``compiled`` a compiled model stays compiled: that is the module its steps run. A model's
    own attribute called ``module`` is never followed: only the wrappers' is."""
    while True:
        name = type(model).__name__
        if name in _DATA_PARALLEL and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif compiled and name == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def is_compiled(model: torch.nn.Module) -> bool:
    """``model`` (or a submodule) runs through ``torch.compile``: an ``OptimizedModule`` wrapper, or a
    module compiled in place with ``module.compile()``."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


@contextlib.contextmanager
def forward_replaced(module: torch.nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]
                     ) -> Iterator[None]:
    """``module.forward`` is ``make(its forward)`` inside the block (an instance attribute); as it was afterwards
    (the class's forward showing through again, or the instance attribute someone had set)."""
    original = module.__dict__.get("forward")
    module.forward = make(module.forward)
    try:
        yield
    finally:
        if original is None:
            del module.forward
        else:
            module.forward = original
