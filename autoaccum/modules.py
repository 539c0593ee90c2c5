"""What a model is under its wrappers: the one rule for unwrapping, and whether it is compiled."""

from __future__ import annotations

import torch

__all__ = ["is_compiled", "unwrap"]

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
