"""Knobs that trade memory for speed, and how a trial applies them to a model without keeping them.

- **activation checkpointing**: recompute each layer's activations in backward instead of keeping
  them. Applied through the model's own switch where it has one (Hugging Face style
  ``gradient_checkpointing_enable()`` / ``gradient_checkpointing_disable()``), otherwise generically:
  every child of the model's first non-empty ``nn.ModuleList`` (the transformer blocks of most
  models) runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. The patch is
  an instance attribute on each layer's ``forward``, removed when the trial ends. A model without
  either has no checkpointing knob.
- **autocast dtype**: ``fp32`` (no autocast), ``bf16``, ``fp16``: forward and loss under
  ``torch.autocast``; ``fp16`` steps with a ``GradScaler``, as training in fp16 must.
- **torch.compile**: the trial steps ``torch.compile(model)`` (the same parameters); compile time
  is spent in the warm-up steps, never in the timed ones.

Which knobs apply depends on the device (``available_knobs``): on CUDA bf16 where the device
supports it and fp16; on CPU bf16 only where oneDNN has native bf16; compile only on CUDA by
default (compiling on CPU is slow next to the steps it would speed up; ask for it explicitly).

Process-wide effects of ``apply_knobs``: with ``compile``, dynamo's cache and one config value.
Dynamo's cache of compiled code is the process's, and a trial does not clear it
(``torch._dynamo.reset()`` would clear every compiled function of the process), so each new
combination of knobs or shape class adds an entry; past ``recompile_limit`` (8 by default) a frame
runs eagerly. Inside a trial the limit is raised to ``TRIAL_RECOMPILE_LIMIT``
(``torch._dynamo.config.patch``, for the whole process while it lasts), and restored on exit.
Checkpointing touches only the model's layers, and is removed on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import nn

from autoaccum.precision import AUTOCAST_DTYPES, Precision, autocast_dtype

__all__ = ["Autocast", "Knobs", "apply_knobs", "available_knobs", "checkpoint_layers", "AUTOCAST_DTYPES",
           "TRIAL_RECOMPILE_LIMIT"]

#: the autocast knob's values: the precisions of ``autoaccum.precision``
Autocast = Precision
#: dynamo's ``recompile_limit`` inside a compiled trial (torch's default is 8). Each combination of
#: autocast dtype x checkpointing x grad mode keeps an entry or two per shape class (micro-batch 1
#: is specialised; other sizes share a dynamic one), and entries of earlier trials stay: 64 holds a
#: whole search's with room.
TRIAL_RECOMPILE_LIMIT = 64


@dataclass(frozen=True)
class Knobs:
    """How a training step runs, apart from its plan.

    Attributes:
        checkpointing: recompute activations in backward (activation checkpointing).
        autocast: ``fp32`` (no autocast), ``bf16`` or ``fp16`` (with a GradScaler).
        compile: step a ``torch.compile``-d model.
    """

    checkpointing: bool = False
    autocast: Autocast = "fp32"
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("checkpointing", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Knobs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.autocast not in get_args(Autocast):
            raise ValueError(f"Invalid autocast: {self.autocast!r}. Allowed: {', '.join(get_args(Autocast))}")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype for ``OOMGuard(autocast_dtype=...)``; None for fp32."""
        return autocast_dtype(self.autocast)

    @property
    def saves_memory(self) -> bool:
        return self.checkpointing or self.autocast != "fp32"

    def describe(self) -> str:
        parts = [self.autocast] + (["checkpointing"] if self.checkpointing else []) + \
            (["compile"] if self.compile else [])
        return " + ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpointing": self.checkpointing, "autocast": self.autocast, "compile": self.compile}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Knobs:
        return cls(**{k: data[k] for k in ("checkpointing", "autocast", "compile") if k in data})


def checkpoint_layers(model: nn.Module) -> nn.ModuleList | None:
    """The layers generic checkpointing wraps: the model's first non-empty ``nn.ModuleList``."""
    return next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0), None)


def _has_hf_switch(model: nn.Module) -> bool:
    return callable(getattr(model, "gradient_checkpointing_enable", None)) and \
        callable(getattr(model, "gradient_checkpointing_disable", None))


def _cpu_bf16() -> bool:
    try:  # native bf16 (AVX512-BF16/AMX); elsewhere bf16 on CPU is emulated and only slower
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def available_knobs(model: nn.Module, device: torch.device) -> dict[str, tuple[Any, ...]]:
    """The values of each knob worth trying for ``model`` on ``device``; the first is the default."""
    if device.type == "cuda":
        autocast: tuple[str, ...] = ("fp32", "bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp32", "fp16")
    else:
        autocast = ("fp32", "bf16") if device.type == "cpu" and _cpu_bf16() else ("fp32",)
    checkpointing = (False, True) if _has_hf_switch(model) or checkpoint_layers(model) is not None else (False,)
    return {"checkpointing": checkpointing, "autocast": autocast,
            "compile": (False, True) if device.type == "cuda" else (False,)}


@contextlib.contextmanager
def _checkpointing(model: nn.Module) -> Iterator[None]:
    if _has_hf_switch(model):
        was_on = bool(getattr(model, "is_gradient_checkpointing", False))
        model.gradient_checkpointing_enable()
        try:
            yield
        finally:
            if not was_on:
                model.gradient_checkpointing_disable()
        return
    layers = checkpoint_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers to checkpoint and no "
                         f"gradient_checkpointing_enable(); leave checkpointing out of the search space")
    from torch.utils.checkpoint import checkpoint

    patched: list[tuple[nn.Module, Any]] = []
    try:
        for layer in layers:
            original = layer.forward  # the bound method (or an instance attribute someone set)

            def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return _original(*args, **kwargs)
                # non-reentrant: works with keyword arguments and inputs that need no grad
                return checkpoint(_original, *args, use_reentrant=False, **kwargs)

            patched.append((layer, layer.__dict__.get("forward")))
            layer.forward = forward
        yield
    finally:
        for layer, before in reversed(patched):
            if before is None:
                del layer.forward  # the class's forward shows through again
            else:
                layer.forward = before


@contextlib.contextmanager
def apply_knobs(model: nn.Module, knobs: Knobs) -> Iterator[nn.Module]:
    """Yield the module to step with ``knobs`` applied; on exit ``model`` is as it was.

    Autocast is not applied here: pass ``knobs.autocast_dtype`` to ``OOMGuard(autocast_dtype=...)``.
    """
    with contextlib.ExitStack() as stack:
        if knobs.checkpointing:
            stack.enter_context(_checkpointing(model))
        run = model
        if knobs.compile:
            # No torch._dynamo.reset(): it would clear every compiled function of the process.
            # The limit is dynamo's per code object; max() never lowers one the user raised.
            limit = max(torch._dynamo.config.recompile_limit, TRIAL_RECOMPILE_LIMIT)
            stack.enter_context(torch._dynamo.config.patch(recompile_limit=limit))
            run = torch.compile(model)
        yield run
