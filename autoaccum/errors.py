"""The domain errors of autoaccum. Bad arguments raise ValueError/TypeError instead."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["AutoAccumError", "DoesNotFitError", "NonFiniteError", "OptimizerStepOOMError", "TaskError"]


class AutoAccumError(Exception):
    """Base class of every error autoaccum raises for a condition of the run (not of an argument)."""


class TaskError(AutoAccumError, ValueError):
    """A user task (model, loss, batch maker) did something the training step cannot use."""


class DoesNotFitError(AutoAccumError):
    """Even the smallest micro-batch (one sample, or two with BatchNorm) does not fit in the memory
    budget, with any memory saver tried.

    Attributes:
        needed_bytes: the peak the smallest step needed with the last memory saver tried (measured, or a lower
            bound: ``at_least``).
        available_bytes: the budget the step had to fit in (None where no meter could tell).
        suggestions: what the user can do about it.
        micro_batch: the micro-batch that did not fit (the model's smallest).
        savers: each memory saver tried, with the bytes it needed: a lower bound where its step ran
            out of memory before its peak (None where unknown).
    """

    def __init__(self, needed_bytes: int | None, available_bytes: int | None, suggestions: Sequence[str] = (),
                 *, at_least: bool = False, micro_batch: int = 1,
                 savers: Sequence[tuple[str, int | None]] = ()) -> None:
        from autoaccum.units import format_bytes

        self.micro_batch = micro_batch
        self.needed_bytes = needed_bytes
        self.available_bytes = None if available_bytes is None else int(available_bytes)
        self.savers = tuple(savers)
        self.suggestions = tuple(suggestions) or (
            "use a smaller model or shorter sequences",
            "enable activation checkpointing or bf16 autocast",
            "shard the model over more devices (FSDP)",
            "free memory held by other processes, or raise the budget",
        )
        self.at_least = at_least
        needed = "more than the budget" if needed_bytes is None else \
            ("at least " if at_least else "") + format_bytes(needed_bytes)
        available = 'unknown (no memory meter)' if self.available_bytes is None else format_bytes(self.available_bytes)
        lines = [f"a micro-batch of {micro_batch} does not fit: needs {needed}, available {available}."]
        if len(self.savers) > 1 or (self.savers and self.savers[0][0] != "none"):
            tried = ", ".join(f"{saver} {'?' if b is None else format_bytes(b)}" for saver, b in self.savers)
            lines.append(f"Memory savers tried (at least the bytes each needed): {tried}.")
        lines += ["What to do:"] + [f"  - {s}" for s in self.suggestions]
        super().__init__("\n".join(lines))


class OptimizerStepOOMError(AutoAccumError):
    """Out of memory after the micro-batches: in gradient clipping or inside ``optimizer.step()``.

    That memory does not depend on the micro-batch, so shrinking it cannot help, and an OOM
    inside ``optimizer.step()`` may leave some parameters updated and others not: the guard
    stops rather than replay a step on half-updated weights.
    """


class NonFiniteError(AutoAccumError):
    """The gradients (or the loss) of an optimizer step hold inf/NaN, under ``nonfinite="stop"``.

    Raised before ``optimizer.step()``: the weights, the optimizer state and the scheduler are
    those of the previous step, and the step's gradients are cleared. ``step`` is the number of the
    optimizer step that was not taken (1-based).
    """

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
