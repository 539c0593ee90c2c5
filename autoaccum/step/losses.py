"""``fit``'s default loss: cross-entropy for ``(inputs, targets)``, the model's own loss for dict batches.

A dict batch (a tokenizer's ``BatchEncoding``, a collator's output) runs as ``model(**batch)``, as
Hugging Face models are called, and its output's ``.loss`` is used (the batch must hold ``labels``).
How that loss is weighted across micro-batches follows what it averages over:

- **per-token losses** (``labels`` with a sequence dimension: causal and masked LMs, token
  classification) are token-exact: the step's summed token losses are divided once by the tokens of
  the whole global batch over all ranks, as one full-batch forward would (a mean of micro-batch
  means would over-weight short micro-batches). The guard counts the step's predicted tokens up
  front (``DefaultLoss.count_items``) and each micro-batch runs ``model(**batch,
  num_items_in_batch=N)``: Hugging Face's own path, so each token's loss is computed with the same
  arithmetic as in a full-batch forward. A model that takes no loss keywords gets
  ``loss * count / N``; called without a count (the probe, the evaluation) the loss returns
  ``(loss_sum, count)``. Tokens are counted as the model counts them: labels other than -100, after
  the causal-LM shift by one where the model's ``loss_function`` shifts (``loss_shifts_labels`` asks
  the function itself), or ``shift_labels`` where the batch carries them.
- **per-sample losses** (one label per sample: sequence or image classification) are means over the
  micro-batch, weighted by its share of the samples.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from autoaccum.errors import TaskError
from autoaccum.memory.chunked_loss import IGNORE_INDEX, is_causal_lm_loss, loss_only
from autoaccum.plan.batch import Batch
from autoaccum.plan.task import LossOutput

__all__ = ["IGNORE_INDEX", "DefaultLoss", "check_targets", "default_loss", "loss_shifts_labels", "model_loss",
           "predicted_tokens"]



class DefaultLoss:
    """``fit``'s default loss (see the module docstring): ``loss(model, batch)``, and for per-token
    dict batches ``loss(model, batch, num_items_in_batch=N)`` with ``count_items`` giving N.

    For ``(inputs, targets)`` it is cross-entropy, and targets it cannot mean are refused with what to
    pass instead (``check_targets``): regression targets, a model with one output, labels out of the
    model's range. The range is read where that costs no device synchronisation (targets on the CPU),
    or everywhere with ``check_range=True`` (the probe's passes, before training: on CUDA a label out
    of range is otherwise a device-side assert that ends the process).
    """

    def __init__(self, check_range: bool = False) -> None:
        self.check_range = check_range

    def __call__(self, model: torch.nn.Module, batch: Batch, num_items_in_batch: int | None = None) -> LossOutput:
        if isinstance(batch, Mapping):
            return model_loss(model, batch, num_items_in_batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TaskError(f"the default loss needs (inputs, targets) batches or dict batches with 'labels', got a "
                            f"{type(batch).__name__}"
                            f"{' of ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}; pass "
                            f"loss_fn=lambda model, batch: ... returning a mean loss or (loss_sum, num_items)")
        inputs, targets = batch
        output = model(inputs)
        if not isinstance(output, torch.Tensor):
            raise TaskError(_not_scores(output))
        check_targets(output, targets, check_range=self.check_range or
                      (isinstance(targets, torch.Tensor) and targets.device.type == "cpu"))
        return F.cross_entropy(output, targets)

    def count_items(self, model: torch.nn.Module, batch: Batch) -> int | None:
        """The predicted tokens of a per-token dict batch (None: the loss is a per-sample mean)."""
        if not isinstance(batch, Mapping) or not _per_token(batch):
            return None
        return int(predicted_tokens(model, batch))

    def __repr__(self) -> str:
        return "autoaccum.step.losses.default_loss"


default_loss = DefaultLoss()


def _not_scores(output: Any) -> str:
    """Why a model output that is not a tensor is no input to the default cross-entropy, and what to pass: a tuple's
    first element is not taken on a guess (it may be hidden states, the scores second)."""
    if isinstance(output, (tuple, list)):
        shapes = ", ".join(str(tuple(o.shape)) if isinstance(o, torch.Tensor) else type(o).__name__ for o in output)
        return (f"the model returned a {type(output).__name__} of {len(output)} ({shapes}), and the default loss is "
                f"cross-entropy of one tensor of class scores against the targets; which element holds the scores is "
                f"the model's to say: pass loss_fn=lambda model, batch: F.cross_entropy(model(batch[0])[0], batch[1]) "
                f"(with the element that holds them)")
    return (f"the model returned a {type(output).__name__}, and the default loss is cross-entropy of a tensor of class "
            f"scores against the targets: return the scores, or pass loss_fn=lambda model, batch: ... returning a mean "
            f"loss or (loss_sum, num_items)")


def check_targets(output: Any, targets: Any, *, check_range: bool = True) -> None:
    """What cross-entropy of ``output`` against ``targets`` could not mean, as a ``TaskError`` that says
    what to pass instead: class indices ``(N, ...)`` in ``0 ~ classes - 1`` (or -100, skipped), or class
    probabilities shaped like the output; never a single class, whose cross-entropy is 0 whatever
    the model predicts. ``check_range``: read the labels' range (one device synchronisation on CUDA)."""
    if not isinstance(output, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return  # torch says what is wrong with those
    mse = "loss_fn=lambda model, batch: F.mse_loss(model(batch[0]), batch[1])"
    regression = f"for regression pass {mse}"
    if output.dim() < 2:
        raise TaskError(f"the default loss is cross-entropy over classes, and the model's output has shape "
                        f"{tuple(output.shape)}: expected (N, classes, ...), one score per class; {regression}, "
                        f"or give the model one output per class")
    classes = output.shape[1]
    if classes == 1:
        raise TaskError(f"the model gives 1 output per sample (output shape {tuple(output.shape)}), and cross-entropy "
                        f"over a single class is 0 whatever it predicts, so nothing would train. For regression pass "
                        f"{mse}; for two classes give the model 2 outputs, or pass loss_fn= with "
                        f"F.binary_cross_entropy_with_logits")
    if targets.dtype.is_floating_point:
        if targets.shape != output.shape:
            raise TaskError(f"the default loss is cross-entropy over the model's {classes} outputs, and the targets "
                            f"are {targets.dtype} of shape {tuple(targets.shape)} (regression values?): expected class "
                            f"indices (an integer tensor of shape {(output.shape[0], *output.shape[2:])}) or class "
                            f"probabilities of the output's shape {tuple(output.shape)}; {regression}")
        return
    if targets.dtype == torch.bool or targets.is_complex():
        raise TaskError(f"the default loss needs class indices (an integer tensor), got {targets.dtype} targets; "
                        f"convert them (targets.long()) or pass loss_fn=")
    expected = (output.shape[0], *output.shape[2:])
    if tuple(targets.shape) != expected:
        raise TaskError(f"the default loss is cross-entropy over the model's {classes} outputs (output shape "
                        f"{tuple(output.shape)}), and the targets have shape {tuple(targets.shape)}: expected class "
                        f"indices of shape {expected}; reshape the targets or pass loss_fn=")
    if not check_range or targets.numel() == 0:
        return
    try:  # skipped labels read as 0, which is in range; no boolean indexing (fake tensors cannot size it)
        filled = targets.masked_fill(targets == IGNORE_INDEX, 0)
        low, high = int(filled.min()), int(filled.max())
    except (RuntimeError, NotImplementedError):  # fake or meta tensors (an estimate): no values to read
        return
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise TaskError(f"Invalid target {bad}: the default loss is cross-entropy over the model's {classes} outputs, "
                        f"so targets are class indices in 0 ~ {classes - 1} (or {IGNORE_INDEX}, skipped). Give the "
                        f"model one output per class (at least {high + 1}), or map the labels to 0 ~ {classes - 1}")


def _per_token(batch: Mapping[str, Any]) -> bool:
    labels = batch.get("labels")
    return isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.dtype.is_floating_point


def _shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's loss shifts labels by one (a causal LM): decided by what its ``loss_function``
    does (``loss_shifts_labels``), not by which function it is."""
    inner = getattr(model, "module", model)  # a DDP wrapper: the model inside
    if bool(getattr(getattr(inner, "config", None), "is_encoder_decoder", False)):
        return False  # decoder labels are aligned with right-shifted decoder inputs: every label is a target
    loss_function = getattr(inner, "loss_function", None)
    return callable(loss_function) and loss_shifts_labels(loss_function, _device_of(inner))


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


#: verdicts of ``loss_shifts_labels``, per loss function (weakly: a function that goes is forgotten)
_SHIFTS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def loss_shifts_labels(loss_function: Any, device: torch.device | str = "cpu") -> bool:
    """Whether ``loss_function(logits=..., labels=..., vocab_size=...)`` (Hugging Face's calling
    convention) never counts a row's first label, as a causal-LM loss that shifts labels by one.

    Asked of the function itself, on one row of two positions with uniform logits (every target's
    cross-entropy is ``log 2``): with only the first label kept, a shifting loss has no target
    (NaN from a mean over none, or 0), one that does not shift has one (``log 2``); with only the
    second kept, both have one, which checks that the function is such a loss at all. Where it is
    not (it raises, or the second call is not ``log 2`` up to float32 rounding), the answer is
    Hugging Face's own rule: it is ``ForCausalLMLoss``.
    """
    try:
        return _SHIFTS[loss_function]
    except (KeyError, TypeError):  # not asked yet, or a function that cannot be weakly referenced
        pass
    verdict = _ask_loss(loss_function, torch.device(device))
    if verdict is None:
        verdict = is_causal_lm_loss(loss_function)
    with contextlib.suppress(TypeError):
        _SHIFTS[loss_function] = verdict
    return verdict


def _ask_loss(loss_function: Any, device: torch.device) -> bool | None:
    logits = torch.zeros(1, 2, 2, device=device)
    log2 = math.log(2.0)

    def loss_with(labels: list[int]) -> float:
        value = loss_function(logits=logits, labels=torch.tensor([labels], device=device), vocab_size=2)
        return float(value.detach().float()) if isinstance(value, torch.Tensor) and value.numel() == 1 else math.nan

    try:
        with torch.no_grad():
            second, first = loss_with([IGNORE_INDEX, 1]), loss_with([1, IGNORE_INDEX])
    except Exception:  # noqa: BLE001 -- any failure means: not a loss this test can read
        return None
    if not math.isclose(second, log2, rel_tol=1e-5):
        return None
    if math.isclose(first, log2, rel_tol=1e-5):
        return False
    if math.isnan(first) or first == 0.0:
        return True
    return None


def predicted_tokens(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """How many labels of ``batch`` the model's loss averages over (see the module docstring)."""
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    else:
        labels = batch["labels"]
        if _shifts_labels(model):
            labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


def _accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    inner = getattr(model, "module", model)
    try:
        params = inspect.signature(inner.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _check_keys(model: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    inner = getattr(model, "module", model)
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in batch if k not in params]
    if unknown:
        raise TaskError(f"the default loss calls model(**batch) for dict batches, and {type(inner).__name__}.forward "
                        f"takes no {', '.join(map(repr, unknown))}; pass loss_fn=lambda model, batch: ... (e.g. "
                        f"F.cross_entropy(model(batch['x']), batch['y']))")


def model_loss(model: torch.nn.Module, batch: Mapping[str, Any], num_items_in_batch: int | None = None) -> LossOutput:
    """The model's own loss for a dict batch (``_model_loss``), its output read for the loss alone (so that the
    memory saver ``chunked_loss`` may chunk a causal LM's)."""
    with loss_only():
        return _model_loss(model, batch, num_items_in_batch)


def _model_loss(model: torch.nn.Module, batch: Mapping[str, Any], num_items_in_batch: int | None = None) -> LossOutput:
    """The model's own loss for a dict batch: ``model(**batch).loss``, token-exact for per-token labels.

    Per-token labels: with ``num_items_in_batch`` (the step's predicted tokens, all micro-batches and
    ranks) the loss divided by it, as Hugging Face computes it; without, ``(loss_sum, num_tokens)``.
    Per-sample labels: the mean loss.

    Raises:
        TaskError: the batch has no ``labels``, the model takes other keywords, or returns no ``.loss``.
    """
    if "labels" not in batch:
        raise TaskError(f"the default loss for dict batches is the model's own (model(**batch).loss), which needs "
                        f"'labels' in the batch (keys: {', '.join(map(repr, batch))}); add them "
                        f"(a data collator does), or pass loss_fn=")
    _check_keys(model, batch)
    if not _per_token(batch):
        return _loss_of(model(**batch), model)
    count = predicted_tokens(model, batch)
    if num_items_in_batch is not None:
        if _accepts_loss_kwargs(model):  # HF's own path: sum / num_items_in_batch, in the model
            return _loss_of(model(**batch, num_items_in_batch=num_items_in_batch), model)
        return _loss_of(model(**batch), model) * (count / num_items_in_batch)
    if _accepts_loss_kwargs(model):
        return _loss_of(model(**batch, num_items_in_batch=1), model), count  # sum / 1: the sum
    return _loss_of(model(**batch), model) * count, count


def _loss_of(output: Any, model: torch.nn.Module) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise TaskError(f"model(**batch) on {type(getattr(model, 'module', model)).__name__} returned no .loss "
                        f"although the batch holds 'labels'; pass loss_fn=lambda model, batch: ... computing the loss")
    return loss
