"""Knobs that trade memory for speed, and how a trial applies them to a model without keeping them.

- **saver**: the memory saver (``autoaccum.memory.savers``): ``none``, ``checkpointing``
  (the model's blocks recompute their activations in backward), ``offload`` (CUDA: checkpointing,
  and what the forward saves kept in host memory). The savers the probe and the guard turn to, the same
  exact implementation: a trial's plan carries its saver (``Plan.saver``) and the trial's guard applies
  it for each attempt, as training does. Which savers apply comes from ``memory.savers.savers``.
- **autocast dtype**: ``fp32`` (no autocast), ``bf16``, ``fp16``: forward and loss under
  ``torch.autocast``; ``fp16`` steps with a ``GradScaler``, as training in fp16 must.
- **torch.compile**: the trial steps ``torch.compile(model)`` (the same parameters); compile time
  is spent in the warm-up steps, never in the timed ones. Dynamo cannot trace the savers' exact
  checkpointing (a ``torch.utils.checkpoint`` with a ``context_fn``), so a trial that asks for both
  is recorded as failed without running (``COMPILE_WITH_SAVER``).

Which knobs apply depends on the device (``available_knobs``): on CUDA bf16 where the device
supports it and fp16; on CPU bf16 only where oneDNN has native bf16; compile only on CUDA by
default (compiling on CPU is slow next to the steps it would speed up; ask for it explicitly).

Process-wide effects of ``apply_knobs``: with ``compile``, dynamo's cache and one config value.
Dynamo's cache of compiled code is the process's, and a trial does not clear it
(``torch._dynamo.reset()`` would clear every compiled function of the process), so each new
combination of knobs or shape class adds an entry; past ``recompile_limit`` (8 by default) a frame
runs eagerly. Inside a trial the limit is raised to ``TRIAL_RECOMPILE_LIMIT``
(``torch._dynamo.config.patch``, for the whole process while it lasts), and restored on exit.
A saver touches only the model, for each attempt of the trial's guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import nn

from autoaccum.memory.savers import allowed_savers, check_saver, describe_saver, saver_rank
from autoaccum.precision import AUTOCAST_DTYPES, Precision, autocast_dtype

__all__ = ["Autocast", "COMPILE_WITH_SAVER", "Knobs", "apply_knobs", "available_knobs", "AUTOCAST_DTYPES",
           "TRIAL_RECOMPILE_LIMIT"]

#: the autocast knob's values: the precisions of ``autoaccum.precision``
Autocast = Precision
#: dynamo's ``recompile_limit`` inside a compiled trial (torch's default is 8). Each combination of
#: autocast dtype x grad mode keeps an entry or two per shape class (micro-batch 1 is specialised;
#: other sizes share a dynamic one), and entries of earlier trials stay: 64 holds a whole search's
#: with room.
TRIAL_RECOMPILE_LIMIT = 64
#: why a trial with ``compile`` and a saver above ``none`` is not run
COMPILE_WITH_SAVER = ("torch.compile cannot trace the memory savers' exact checkpointing (torch.utils.checkpoint "
                      "with a context_fn); compile and a saver are not combined")


@dataclass(frozen=True)
class Knobs:
    """How a training step runs, apart from its micro-batch.

    Attributes:
        saver: the memory saver (``none``, ``checkpointing``, ``offload``); the plan a trial
            measures carries it as ``Plan.saver``, and so does the search's result.
        autocast: ``fp32`` (no autocast), ``bf16`` or ``fp16`` (with a GradScaler).
        compile: step a ``torch.compile``-d model.
    """

    saver: str = "none"
    autocast: Autocast = "fp32"
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise TypeError(f"Knobs.compile must be a bool, got {self.compile!r}")
        check_saver(self.saver)
        if self.autocast not in get_args(Autocast):
            raise ValueError(f"Invalid autocast: {self.autocast!r}. Allowed: {', '.join(get_args(Autocast))}")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype for ``OOMGuard(autocast_dtype=...)``; None for fp32."""
        return autocast_dtype(self.autocast)

    @property
    def saves_memory(self) -> bool:
        return self.saver != "none" or self.autocast != "fp32"

    @property
    def switched_on(self) -> float:
        """How far from the step as written: the saver's height (offload is checkpointing and more),
        plus one for autocast and one for compile. A tie between finalists goes to the fewest."""
        return saver_rank(self.saver) + int(self.autocast != "fp32") + int(self.compile)

    def describe(self) -> str:
        parts = [self.autocast] + ([describe_saver(self.saver)] if self.saver != "none" else []) + \
            (["compile"] if self.compile else [])
        return " + ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"saver": self.saver, "autocast": self.autocast, "compile": self.compile}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Knobs:
        """From ``to_dict``'s output; a key it does not write is refused, not dropped."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown knobs {unknown} in a plan file; the knobs are "
                             f"{[f.name for f in dataclasses.fields(cls)]}. "
                             f"Write the file again with this version (autoaccum search or probe --save).")
        return cls(**data)


def _cpu_bf16() -> bool:
    try:  # native bf16 (AVX512-BF16/AMX); elsewhere bf16 on CPU is emulated and only slower
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def available_knobs(model: nn.Module, device: torch.device) -> dict[str, tuple[Any, ...]]:
    """The values of each knob worth trying for ``model`` on ``device``; the first is the default.
    They are ``allowed_savers``'s for them."""
    if device.type == "cuda":
        autocast: tuple[str, ...] = ("fp32", "bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp32", "fp16")
    else:
        autocast = ("fp32", "bf16") if device.type == "cpu" and _cpu_bf16() else ("fp32",)
    return {"saver": allowed_savers(model, device), "autocast": autocast,
            "compile": (False, True) if device.type == "cuda" else (False,)}


@contextlib.contextmanager
def apply_knobs(model: nn.Module, knobs: Knobs) -> Iterator[nn.Module]:
    """Yield the module to step with ``knobs``' compile applied; on exit ``model`` is as it was.

    Neither autocast nor the saver is applied here: pass ``knobs.autocast_dtype`` to
    ``OOMGuard(autocast_dtype=...)`` and a plan on ``knobs.saver`` (``plan.with_saver``), whose guard
    applies the saver for each attempt.
    """
    with contextlib.ExitStack() as stack:
        run = model
        if knobs.compile:
            # No torch._dynamo.reset(): it would clear every compiled function of the process.
            # The limit is dynamo's per code object; max() never lowers one the user raised.
            limit = max(torch._dynamo.config.recompile_limit, TRIAL_RECOMPILE_LIMIT)
            stack.enter_context(torch._dynamo.config.patch(recompile_limit=limit))
            run = torch.compile(model)
        yield run
