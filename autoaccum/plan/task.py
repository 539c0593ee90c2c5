"""A task: what one training step needs -- model, optimizer factory, loss, and a batch of any size.

``loss_fn(model, batch)`` returns either the mean loss over the batch's samples or a pair
``(loss_sum, num_items)`` for token-level losses (sum over items, count of items). A mistake in the pair is
silent -- ``(loss, 5)`` divides every gradient by 5 times the micro-steps -- so what can be told is told: a
step whose counts add up to a fraction or below 0 is a ``TaskError`` (``autoaccum.step.accumulate``); a
Python ``int`` that stays the same while micro-batches of different sizes are cut is warned about once
(``ItemWatch``: only Python ints are read, as reading a tensor would wait for the device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from autoaccum.errors import TaskError
from autoaccum.plan.batch import Batch, batch_size

__all__ = ["ItemWatch", "Task", "LossFn", "LossOutput", "check_loss", "check_loss_fn", "check_optimizer",
           "check_step_args", "trained_params", "default_optimizer",
           "resolve_task", "trainable_parameters"]

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
    """Everything one training step needs (``Task.from_data`` builds one whose batches are your data's).

    Attributes:
        model: the module to train (on the device the step runs on).
        loss_fn: ``loss_fn(model, batch)`` -> mean loss, or ``(loss_sum, num_items)``.
        make_batch: ``make_batch(b)`` -> a batch of exactly ``b`` samples.
        make_optimizer: ``make_optimizer(params)`` -> an optimizer (default AdamW).
        name: shown in reports.
        lengths: for variable-length data, the lengths of the data's samples (all, or a sample of
            them): the probe measures at the shortest, the median and the longest and plans a token
            budget (``autoaccum.plan.plan.TokenBudget``); ``make_batch(b, length)`` then returns ``b``
            samples padded to ``length``. None for data of one shape.
    """

    model: torch.nn.Module
    loss_fn: LossFn
    make_batch: Callable[..., Batch]
    make_optimizer: OptimizerFactory = field(default=default_optimizer)
    name: str = "task"
    lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        trainable_parameters(self.model)
        for name in ("loss_fn", "make_batch", "make_optimizer"):
            if not callable(getattr(self, name)):
                raise TypeError(f"Task.{name} must be callable, got {type(getattr(self, name)).__name__}")
        if self.lengths is not None:
            if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.lengths):
                raise ValueError("Task.lengths must be a non-empty sequence of ints >= 1 (the samples' lengths)")
            object.__setattr__(self, "lengths", tuple(self.lengths))

    @classmethod
    def from_data(cls, model: torch.nn.Module, loss_fn: LossFn, data: Any, *, collate_fn: Any = None,
                  length_fn: Any = None, by_length: bool | None = None,
                  make_optimizer: OptimizerFactory = default_optimizer, name: str = "task", seed: int = 0) -> Task:
        """A task whose batches are drawn from your data, so that the probe measures real samples.

        ``make_batch(b)`` takes ``b`` samples in the order ``fit`` would draw them (epoch 0 of ``seed``),
        collated as ``fit`` collates them; a dataset with fewer samples than a size asks for repeats them.
        Variable-length data (``length_fn``, an attention mask or unpadded ``input_ids`` whose lengths
        vary) also gives the lengths, and the probe measures by length as ``fit`` does.

        Args:
            model: the module to train.
            loss_fn: ``loss_fn(model, batch)`` -> mean loss, or ``(loss_sum, num_items)``.
            data: what ``fit`` takes: a tuple or dict of tensors, a map-style ``Dataset``, or a ``DataLoader``
                (its dataset and ``collate_fn`` are used; a loader over an iterable dataset gives its first batch).
            collate_fn: batches a list of dataset items (default: the loader's, else ``default_collate``).
            length_fn: a sample's length, for variable-length data.
            by_length: measure by length (True), not (False), or decide as ``fit`` does (None).
            make_optimizer: ``make_optimizer(params)`` -> an optimizer (default AdamW).
            name: shown in reports.
            seed: the order samples are drawn in (``fit``'s ``seed``).

        Raises:
            TypeError: data of a kind ``fit`` does not take, or no lengths where ``by_length=True``.
            ValueError: empty data.
        """
        from torch.utils.data import DataLoader, IterableDataset

        from autoaccum.plan.data import GlobalBatches

        if isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
            collate_fn = collate_fn if collate_fn is not None else data.collate_fn
            data = data.dataset  # the loader batches for training; the probe draws any number of samples
        batches = GlobalBatches(data, 1, seed=seed, collate_fn=collate_fn, length_fn=length_fn)
        lengths = None
        if by_length or (by_length is None and length_fn is not None):
            lengths = batches.lengths()[0]
        elif by_length is None:
            try:
                profile = batches.length_profile()
            except TypeError:  # no attention mask, no unpadded input_ids: data of one shape
                profile = None
            lengths = batches.lengths()[0] if profile is not None and profile.varies else None
        if lengths is None:
            return cls(model=model, loss_fn=loss_fn, make_batch=lambda b: _real(batches.sample, b, repeat=True),
                       make_optimizer=make_optimizer, name=name)
        return cls(model=model, loss_fn=loss_fn, make_batch=lambda b, n: _real(batches.sample_at, b, n),
                   make_optimizer=make_optimizer, name=name, lengths=tuple(lengths))

    def batch(self, size: int, length: int | None = None) -> Batch:
        """``make_batch(size)`` (or ``make_batch(size, length)``), checked to hold exactly ``size`` samples.
        For a task with lengths and no ``length`` given: at the longest."""
        if length is None and self.lengths is not None:
            length = max(self.lengths)
        batch = self.make_batch(size) if length is None else self.make_batch(size, length)
        got = batch_size(batch)
        if got != size:
            raise TaskError(f"make_batch({size}{'' if length is None else f', {length}'}) returned a batch of {got} "
                            f"samples; it must return exactly the number of samples asked for")
        return batch


def _real(draw: Callable[..., Batch], *args: Any, **kwargs: Any) -> Batch:
    """``draw(*args, **kwargs)``, drawn on real tensors also inside an estimate's fake-tensor mode (drawing samples
    reads indices' values, which fake tensors do not hold), then copied to fake tensors there (fake ops on a real
    tensor's view would count its storage anew). The samples are a real probe's; only the step is faked."""
    from torch._subclasses import fake_tensor

    from autoaccum.plan.batch import map_tensors

    with getattr(fake_tensor, "unset_fake_temporarily", contextlib.nullcontext)() as fake_mode:
        batch = draw(*args, **kwargs)
    return batch if fake_mode is None else map_tensors(batch, torch.Tensor.clone)


def resolve_task(task: Task | None, *, model: torch.nn.Module | None = None, loss_fn: LossFn | None = None,
                 make_batch: Callable[..., Batch] | None = None, make_optimizer: OptimizerFactory | None = None,
                 caller: str = "probe", lengths: Any = None) -> Task:
    """``task``, or a ``Task`` built from its parts: the one rule for APIs that take either.

    Raises:
        TypeError: neither a task nor all of ``model``, ``loss_fn`` and ``make_batch``; or both.
    """
    parts = (model, loss_fn, make_batch)
    if task is None:
        if any(x is None for x in parts):
            raise TypeError(f"{caller}() needs a Task or model=, loss_fn= and make_batch=")
        return Task(model=model, loss_fn=loss_fn, make_batch=make_batch,  # type: ignore[arg-type]
                    make_optimizer=make_optimizer or default_optimizer, lengths=lengths)
    if any(x is not None for x in parts):
        raise TypeError("pass either a Task or model=/loss_fn=/make_batch=, not both")
    if not isinstance(task, Task):
        raise TypeError(f"task must be an autoaccum.Task, got {type(task).__name__}")
    if lengths is not None and tuple(lengths) != task.lengths:
        return dataclasses.replace(task, lengths=tuple(lengths))
    return task


def check_loss(output: Any, *, requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | int | None]:
    """Split a loss function's output into ``(loss, num_items)``; ``num_items`` is None for a mean loss.

    Args:
        output: what ``loss_fn(model, batch)`` returned.
        requires_grad: the loss must carry a gradient (training); False for evaluation.

    Raises:
        TaskError: the loss is not a scalar floating tensor, or ``num_items`` is not a count.
    """
    num_items = None
    if not isinstance(output, (torch.Tensor, tuple, list)) and getattr(output, "loss", None) is not None:
        raise TaskError(f"loss_fn returned the model's output ({type(output).__name__}), not a loss; return its "
                        f"loss: loss_fn=lambda model, batch: model(**batch).loss")
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
    if not isinstance(output, torch.Tensor) or output.dim() != 0:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise TaskError(f"loss_fn must return a scalar tensor (0 dimensions), got {shape}; reduce the loss "
                        f"(e.g. .mean(), or .squeeze() for a shape (1,)) or return (loss_sum, num_items)")
    if not output.dtype.is_floating_point or (requires_grad and not output.requires_grad):
        raise TaskError(f"the loss must be a floating tensor that requires grad (dtype {output.dtype}, "
                        f"requires_grad={output.requires_grad}); was it computed under torch.no_grad()?")
    return output, num_items


def check_loss_fn(loss_fn: Any, name: str = "loss_fn") -> None:
    """Raise TypeError for a ``loss_fn`` that cannot be called as ``loss_fn(model, batch)``."""
    if not callable(loss_fn):
        hint = " (the arguments look swapped: fit(model, data, target_batch, loss_fn=...))" \
            if isinstance(loss_fn, (tuple, list, dict, torch.Tensor)) else ""
        raise TypeError(f"{name} must be callable as {name}(model, batch), got a {type(loss_fn).__name__}{hint}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError:
        params = ", ".join(signature.parameters) or "no arguments"
        raise TypeError(f"{name} is called as {name}(model, batch), but yours takes ({params}); write it as "
                        f"lambda model, batch: ... (the model comes first, so a DDP-wrapped or compiled model "
                        f"is the one that runs)") from None
    names = [p.name for p in signature.parameters.values()][:2]
    if len(names) == 2 and names[0].lower() in _BATCH_NAMES and names[1].lower() in _MODEL_NAMES:
        raise TypeError(f"{name} takes ({names[0]}, {names[1]}), but it is called as {name}(model, batch): the "
                        f"arguments are swapped. Write it as lambda {names[1]}, {names[0]}: ... "
                        "(the model comes first)")


#: first-parameter names that say "the batch" and second-parameter names that say "the model": a loss_fn whose
#: parameters read (batch, model) has them swapped
_BATCH_NAMES = frozenset({"batch", "micro_batch", "inputs", "data", "sample", "samples", "x", "xy"})
_MODEL_NAMES = frozenset({"model", "module", "net", "network"})


def check_optimizer(model: torch.nn.Module, optimizer: object) -> None:
    """``optimizer`` is a torch optimizer that steps some of ``model``'s trainable parameters.

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ValueError: it steps none of them (nothing would train).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if trainable and not trainable & stepped:
        raise ValueError(f"the optimizer ({type(optimizer).__name__}) steps none of the {len(trainable)} trainable "
                         f"parameters of the {type(model).__name__} being trained, so nothing would train. Build it "
                         f"from this model: {type(optimizer).__name__}(model.parameters(), ...) (after any "
                         f"deepcopy or fully_shard of the model)")


def trained_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters whose gradient a step computes: every trainable parameter of the model and every
    parameter the optimizer steps (e.g. a temperature owned by the loss). Token-level normalisation,
    clipping and clearing cover them all; model parameters outside the optimizer are cleared too, or
    their gradients would carry into the next step (and into its clipping norm)."""
    params = trainable_parameters(model)
    check_optimizer(model, optimizer)
    seen = {id(p) for p in params}
    return params + [p for group in optimizer.param_groups for p in group["params"]
                     if p.requires_grad and id(p) not in seen]


def check_step_args(batch: Any, loss_fn: Any) -> None:
    """``loss_fn`` is a loss function (and the arguments of ``step(batch, loss_fn)`` are not swapped)."""
    if callable(batch) and not callable(loss_fn):
        raise TypeError(f"OOMGuard.step(batch, loss_fn) got a {type(batch).__name__} as batch and a "
                        f"{type(loss_fn).__name__} as loss_fn: the arguments look swapped")
    check_loss_fn(loss_fn)


#: what torch says when a float tensor meets a layer of another float dtype
_DTYPE_MISMATCH = ("expected scalar type", "must have the same dtype", "should be the same", "expected both",
                   "found dtype", "Input type (")


def explain_error(exc: BaseException, model: torch.nn.Module, batch: Any) -> TaskError | None:
    """A one-line explanation of a training step's error where autoaccum can name the fix, else None.

    Two mistakes that torch or Python report deep in the model are recognised: a batch whose floating
    tensors are of another dtype than the model's parameters (an fp16 model fed fp32 inputs), and a
    ``loss_fn`` whose arguments are swapped (``lambda batch, model: ...`` calls the batch: "'tuple'
    object is not callable"). The probe and the guard both raise what this returns."""
    if isinstance(exc, TypeError) and f"'{type(batch).__name__}' object is not callable" in str(exc):
        return TaskError(f"the loss function called the batch ({type(batch).__name__}) as a model ({exc}): its "
                         f"arguments look swapped. loss_fn is called as loss_fn(model, batch); write it as "
                         f"lambda model, batch: ... (the model first)")
    if isinstance(exc, RuntimeError) and "backward through the graph a second time" in str(exc):
        return TaskError(f"the loss function's graph was backpropagated twice ({str(exc).splitlines()[0][:80]}...): "
                         f"loss_fn must return the loss and not call .backward() itself; autoaccum calls backward "
                         f"once per micro-batch, with the weight that makes the step a full-batch step")
    if not isinstance(exc, RuntimeError) or not any(m in str(exc) for m in _DTYPE_MISMATCH):
        return None
    from autoaccum.plan.batch import tensors

    integers = sorted({str(t.dtype) for t in tensors(batch) if not t.dtype.is_floating_point and t.dtype != torch.bool})
    if integers and any(name in str(exc) for name in ("Long", "Int", "Short", "Byte", "Char")):
        return TaskError(f"the batch holds {integers[0] if integers else 'integer'} tensors that reached a layer of "
                         f"floating parameters ({str(exc).splitlines()[0]}): convert features to floats "
                         f"(x.float(), or in the dataset), or, where they are token or category ids, feed them to an "
                         f"nn.Embedding first")

    model_dtypes = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    batch_dtypes = {t.dtype for t in tensors(batch) if t.dtype.is_floating_point}
    if not model_dtypes or not batch_dtypes or batch_dtypes <= model_dtypes:
        return None
    model_dtype, batch_dtype = sorted(map(str, model_dtypes))[0], sorted(map(str, batch_dtypes - model_dtypes))[0]
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return TaskError(f"the model's parameters are {model_dtype} and the batch holds {batch_dtype} tensors "
                     f"({first_line}); convert the data to the model's dtype (x.to({model_dtype})), or keep the model "
                     f"in float32 and train in mixed precision (fit(..., precision='bf16' or 'fp16'), "
                     f"OOMGuard(autocast_dtype=...))")


class ItemWatch:
    """Watches the Python-int ``num_items`` a loss returns; warns once where it is constant across micro-batch sizes.

    Args:
        size_fn: counts a micro-batch's samples (default ``autoaccum.plan.batch.batch_size``).
    """

    def __init__(self, size_fn: Callable[[Batch], int] | None = None) -> None:
        self.size_fn = size_fn
        self.armed = True  # until a count differs, or the warning was given
        self._count: int | None = None  # the one count seen so far
        self._sizes: set[int] = set()  # the micro-batch sizes it was seen with

    def watch(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` with its counts watched (``loss_fn`` itself once the watch has ended)."""
        if not self.armed:
            return loss_fn

        def watched(model: Any, batch: Batch, **kwargs: Any) -> Any:
            output = loss_fn(model, batch, **kwargs)
            if self.armed and isinstance(output, (tuple, list)) and len(output) == 2:
                count = output[1]
                if isinstance(count, int) and not isinstance(count, bool):
                    self.see(batch, count)
            return output

        return watched

    def see(self, batch: Batch, count: int) -> None:
        """One micro-batch's count."""
        if self._count is not None and count != self._count:
            self.armed = False  # it varies: a count
            return
        try:
            size = self.size_fn(batch) if self.size_fn is not None else batch_size(batch)
        except (TypeError, ValueError):  # a batch type only a cutter knows: nothing to compare with
            self.armed = False
            return
        self._count = count
        self._sizes.add(int(size))
        if len(self._sizes) > 1:
            self.armed = False
            sizes = " and ".join(str(s) for s in sorted(self._sizes))
            warnings.warn(
                f"loss_fn returned num_items={count} for micro-batches of {sizes} samples: a (loss_sum, num_items) "
                f"pair is the loss summed over the micro-batch's items (e.g. tokens) and their count, and the step "
                f"divides by the counts' total, so a count that stays {count} while the micro-batch changes is "
                f"likely not a count (the step divides its summed losses by {count} x its micro-steps). Return "
                f"the mean loss alone, or (loss_sum, the number of items it sums over), e.g. "
                f"(F.cross_entropy(logits, labels, reduction='sum', ignore_index=-100), (labels != -100).sum())",
                UserWarning, stacklevel=2)
