"""A task: what one training step needs -- model, optimizer factory, loss, and a batch of any size.

``loss_fn(model, batch)`` returns either the mean loss over the batch's samples or a pair
``(loss_sum, num_items)`` for token-level losses (sum over items, count of items).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from autoaccum.batch import Batch, batch_size
from autoaccum.errors import TaskError

__all__ = ["Task", "LossFn", "LossOutput", "default_optimizer", "load_task", "check_loss", "resolve_task",
           "trainable_parameters"]

LossOutput = Union[torch.Tensor, tuple[torch.Tensor, Union[torch.Tensor, int]]]
LossFn = Callable[[torch.nn.Module, Batch], LossOutput]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with torch's defaults (lr 1e-3)."""
    return torch.optim.AdamW(params)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train; a TypeError/ValueError when there are none."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (none with requires_grad=True); "
                         f"there is nothing to train. Unfreeze some parameters first.")
    return params


@dataclass(frozen=True)
class Task:
    """Everything one training step needs.

    Attributes:
        model: the module to train (on the device the step runs on).
        loss_fn: ``loss_fn(model, batch)`` -> mean loss, or ``(loss_sum, num_items)``.
        make_batch: ``make_batch(b)`` -> a batch of exactly ``b`` samples.
        make_optimizer: ``make_optimizer(params)`` -> an optimizer (default AdamW).
        name: shown in reports.
    """

    model: torch.nn.Module
    loss_fn: LossFn
    make_batch: Callable[[int], Batch]
    make_optimizer: OptimizerFactory = field(default=default_optimizer)
    name: str = "task"

    def __post_init__(self) -> None:
        trainable_parameters(self.model)
        for name in ("loss_fn", "make_batch", "make_optimizer"):
            if not callable(getattr(self, name)):
                raise TypeError(f"Task.{name} must be callable, got {type(getattr(self, name)).__name__}")

    def batch(self, size: int) -> Batch:
        """``make_batch(size)``, checked to hold exactly ``size`` samples."""
        batch = self.make_batch(size)
        got = batch_size(batch)
        if got != size:
            raise TaskError(f"make_batch({size}) returned a batch of {got} samples; it must return exactly the "
                            f"number of samples asked for")
        return batch


def resolve_task(task: Task | None, *, model: torch.nn.Module | None = None, loss_fn: LossFn | None = None,
                 make_batch: Callable[[int], Batch] | None = None, make_optimizer: OptimizerFactory | None = None,
                 caller: str = "probe") -> Task:
    """``task``, or a :class:`Task` built from its parts: the one rule for APIs that take either.

    Raises:
        TypeError: neither a task nor all of ``model``, ``loss_fn`` and ``make_batch``; or both.
    """
    parts = (model, loss_fn, make_batch)
    if task is None:
        if any(x is None for x in parts):
            raise TypeError(f"{caller}() needs a Task or model=, loss_fn= and make_batch=")
        return Task(model=model, loss_fn=loss_fn, make_batch=make_batch,  # type: ignore[arg-type]
                    make_optimizer=make_optimizer or default_optimizer)
    if any(x is not None for x in parts):
        raise TypeError("pass either a Task or model=/loss_fn=/make_batch=, not both")
    if not isinstance(task, Task):
        raise TypeError(f"task must be an autoaccum.Task, got {type(task).__name__}")
    return task


def check_loss(output: Any, *, requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | int | None]:
    """Split a loss function's output into ``(loss, num_items)``; ``num_items`` is None for a mean loss.

    ``requires_grad``: the loss must carry a gradient (training); False for evaluation.

    Raises:
        TaskError: the loss is not a scalar floating tensor, or ``num_items`` is not a count.
    """
    num_items = None
    if isinstance(output, (tuple, list)):
        if len(output) != 2:
            raise TaskError(f"loss_fn returned a {type(output).__name__} of {len(output)} items; return a scalar mean "
                            f"loss or a pair (loss_sum, num_items)")
        output, num_items = output
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1:
                raise TaskError(f"num_items must be a single count, got a tensor of shape {tuple(num_items.shape)}")
        elif isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
            raise TaskError(f"num_items must be an int or a one-element tensor >= 0, got {num_items!r}")
    if not isinstance(output, torch.Tensor) or output.numel() != 1 or output.dim() > 1:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise TaskError(f"loss_fn must return a scalar tensor, got {shape}; reduce the loss (e.g. .mean()) "
                        f"or return (loss_sum, num_items)")
    if not output.dtype.is_floating_point or (requires_grad and not output.requires_grad):
        raise TaskError(f"the loss must be a floating tensor that requires grad (dtype {output.dtype}, "
                        f"requires_grad={output.requires_grad}); was it computed under torch.no_grad()?")
    return output.reshape(()), num_items


def load_task(spec: str, **kwargs: Any) -> Task:
    """Import ``module:function`` and call it (with ``kwargs``) to get a :class:`Task`.

    Raises:
        ValueError: the spec is not ``module:function``, the module or name is missing, or the
            function returns something other than a Task.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"Invalid task {spec!r}: expected 'module:function', e.g. 'mytasks:make_task'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"Invalid task {spec!r}: cannot import module {module_name!r} ({exc}); is it on "
                         f"PYTHONPATH or in the current directory?") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"Invalid task {spec!r}: module {module_name!r} has no callable {attr!r}")
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise ValueError(f"Invalid task {spec!r}: {attr}() returned {type(task).__name__}, expected autoaccum.Task")
    return task
