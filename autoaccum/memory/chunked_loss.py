"""The loss in chunks (the memory saver ``"chunked_loss"``): the output head and the cross-entropy a chunk of
positions at a time, so that the step never holds the whole logits tensor.

A language model's logits (positions x vocabulary, upcast to float32 for the loss, and their gradient) are often
the largest tensors of its step: a 50,257-token vocabulary at 1,024 tokens is 196 MiB a sample in float32, and
checkpointing the blocks does not touch them. For an ``nn.Linear`` head (Hugging Face's ``lm_head``, tied or not)
each chunk's gradients are computed in the forward, as the unchunked backward computes them (``softmax -
one_hot`` through the head's two matmuls), and only scaled in the backward: nothing is recomputed, the work is
the unchunked step's, and what waits for the backward is the hidden states' gradient (their size) and the head
weight's (its size). Any other head, and a loss narrower than its logits (a float64 model under HF's float32
loss), recomputes each chunk in backward under non-reentrant ``torch.utils.checkpoint`` (one more pass through
the head).

Exact: every position's loss and gradient are the same operations on the same values as unchunked; the sum
over positions is grouped by chunk, and the gradients are scaled after the head's matmuls instead of before, so
they equal the unchunked ones to rounding (float64: 1e-12; float32: its rounding). The item count is the
unchunked one.

Two ways in:

- a Hugging Face causal LM whose loss is its own, called for its loss alone (``model(**batch)`` with ``labels``
  by autoaccum's default loss or HF Trainer's own ``compute_loss``: ``loss_only``; the model, or one inside it,
  as a PEFT model holds it): while the saver is on,
  its forward runs the base model, then the chunks through its own ``lm_head`` with ``ForCausalLMLoss``'s
  rules (labels shifted by one unless ``shift_labels`` is given, ``ignore_index`` -100, divided by
  ``num_items_in_batch`` where given, else the mean over predicted tokens), and returns the loss without
  logits. Offered where its loss function is ``ForCausalLMLoss``; where first taken, its logits are checked to
  be its head's output (``chunks_own_loss``, on one short row): a model that scales or soft-caps its logits
  is warned about and computes its loss whole;
- any model: a ``loss_fn`` that computes its loss with ``head_loss(hidden, head, targets)``. It chunks while
  the saver is on and computes the plain cross-entropy otherwise; allow the saver with
  ``memory_savers=("chunked_loss", "checkpointing")``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoaccum.modules import forward_replaced, unwrap

__all__ = ["IGNORE_INDEX", "causal_lm", "chunked_cross_entropy", "chunking", "chunks_own_loss", "head_loss",
           "is_causal_lm_loss", "loss_only", "offers_chunked_loss"]

IGNORE_INDEX = -100

#: whether the saver is on (``chunking``): ``head_loss`` reads it
_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("autoaccum_chunked_loss", default=False)
#: the caller of a model's forward reads only its loss (``loss_only``): the chunked forward returns no logits
_LOSS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("autoaccum_loss_only", default=False)
#: the keywords of a forward call the chunked forward leaves to the model's own (TRL's fused head, a slice)
_OWN_PATH = ("fused_lm_head", "logits_to_keep", "return_dict", "output_router_logits")
#: ``chunks_own_loss``'s verdicts, per model
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _vocab(head: nn.Module | torch.Tensor) -> int:
    if isinstance(head, torch.Tensor):
        return int(head.shape[0])
    out = getattr(head, "out_features", None)
    return int(out) if out is not None else int(head.weight.shape[0])  # type: ignore[union-attr]


#: the fewest positions a chunk holds: below it the chunks' own cost shows, above it the peak grows (measured against
#: 16, 256 and 1,024 by ``benchmarks/chunked_loss_bench.py``; today's figures in benchmarks/README.md)
MIN_CHUNK_ROWS = 64


def chunk_rows(rows: int, width: int, vocab: int) -> int:
    """Positions a chunk: as many as make its logits about as large as the hidden states (``rows x width``), and
    at least ``MIN_CHUNK_ROWS``. Smaller chunks save little more (the hidden states and the head's gradient are
    then the larger part of what the loss holds) and add launches; a vocabulary narrower than the hidden states
    is one chunk."""
    return max(1, min(rows, max(MIN_CHUNK_ROWS, math.ceil(rows * width / max(vocab, 1)))))


def _loss_dtype(logits: torch.Tensor, float32: bool) -> torch.Tensor:
    """Logits as the loss takes them: in float32 (``float32``: as Hugging Face's ``ForCausalLMLoss`` does, also for a
    float64 model), else upcast to float32 only from a narrower type."""
    return logits.float() if float32 or logits.dtype.itemsize < 4 else logits


def _logits(head: nn.Module | torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head's output: a module called, a weight (a tied embedding's) as a bias-free linear layer."""
    return F.linear(hidden, head) if isinstance(head, torch.Tensor) else head(hidden)


def _chunk_sum(head: nn.Module | torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int,
               float32: bool) -> torch.Tensor:
    return F.cross_entropy(_loss_dtype(_logits(head, hidden), float32), targets, ignore_index=ignore_index,
                           reduction="sum")


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``linear(hidden, weight, bias)`` a chunk of rows at a time, its gradients
    computed in the forward, chunk by chunk, as the unchunked backward computes them (``softmax - one_hot`` of
    each predicted row, through the head's matmuls): the backward only scales them by its incoming gradient.
    No chunk is recomputed; what waits for the backward is the gradient of the hidden states (their size) and of
    the head's weight (its size), accumulated in float32 or wider."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, ignore_index: int, float32: bool, rows: int) -> torch.Tensor:
        wide = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) if weight.requires_grad else None
        grad_b = torch.zeros(bias.shape, dtype=wide, device=bias.device) \
            if bias is not None and bias.requires_grad else None
        total = hidden.new_zeros((), dtype=wide if float32 or hidden.dtype.itemsize < 4 else hidden.dtype)
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start:start + rows], targets[start:start + rows]
            logits = F.linear(h, weight, bias)
            z = _loss_dtype(logits, float32)
            total += F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")
            # d(sum of cross-entropies) / d(logits): softmax - one_hot, kept rows only (no data-dependent shapes: an
            # estimate runs this on fake tensors)
            kept = (y != ignore_index).unsqueeze(1)
            g = torch.softmax(z, dim=-1) * kept
            g.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -kept.to(g.dtype))
            g = g.to(logits.dtype)
            if grad_h is not None:
                grad_h[start:start + rows] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h).to(wide)
            if grad_b is not None:
                grad_b += g.sum(dim=0).to(wide)
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (grad_h, grad_w, grad_b)))
        ctx.present = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = [(g * grad).to(dtype) if present else None
               for g, present, dtype in zip(ctx.saved_tensors, ctx.present, ctx.dtypes, strict=True)]
        return (*out, None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module | torch.Tensor, targets: torch.Tensor, *,
                          ignore_index: int = IGNORE_INDEX, rows: int | None = None,
                          float32: bool = False) -> torch.Tensor:
    """``cross_entropy(head(hidden), targets, reduction="sum")`` over every position, computed a chunk of ``rows``
    positions at a time (default ``chunk_rows``); the logits in float32 where ``float32``, else upcast to float32
    only from a narrower type. An ``nn.Linear`` head's gradients are computed chunk by chunk in the forward
    (``_LinearCrossEntropy``: nothing recomputed); any other head's chunks, and those of a loss narrower than the
    logits, are recomputed in backward (non-reentrant ``torch.utils.checkpoint``).

    Args:
        hidden: ``(..., width)`` hidden states; targets: ``(...)`` class indices aligned with them
            (``ignore_index`` skipped); head: the output head, ``(..., width) -> (..., vocab)``, or its weight
            ``(vocab, width)`` (a tied embedding's: a linear layer without bias).
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    aligned = targets.reshape(-1).to(flat.device)
    if aligned.shape[0] != flat.shape[0]:
        raise ValueError(f"chunked loss: {tuple(hidden.shape)} hidden states and {tuple(targets.shape)} targets: "
                         f"one target per position")
    step = rows or chunk_rows(flat.shape[0], flat.shape[1], _vocab(head))
    # where the loss narrows the logits (a float64 model under HF's float32 loss), autograd rounds their gradient in
    # float32 after the backward's scaling, which a gradient computed in the forward cannot: recomputed chunks there
    narrows = float32 and flat.dtype.itemsize > 4
    linear = (head, None) if isinstance(head, torch.Tensor) else (head.weight, head.bias) \
        if type(head) is nn.Linear else None
    if linear is not None and torch.is_grad_enabled() and not narrows:
        return _LinearCrossEntropy.apply(flat, *linear, aligned, ignore_index, float32, step)
    from torch.utils.checkpoint import checkpoint

    total: torch.Tensor | None = None
    for start in range(0, flat.shape[0], step):
        part = checkpoint(_chunk_sum, head, flat[start:start + step], aligned[start:start + step], ignore_index,
                          float32, use_reentrant=False)
        total = part if total is None else total + part
    return total if total is not None else flat.sum() * 0.0


def head_loss(hidden: torch.Tensor, head: nn.Module | torch.Tensor, targets: torch.Tensor, *,
              ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss function's cross-entropy through its output head, as ``(loss_sum, num_items)`` (a ``loss_fn`` may
    return it as it is): in chunks while the memory saver ``"chunked_loss"`` is on, whole otherwise.

    ``head``: the output layer (an ``nn.Linear``: nothing recomputed; any other module: each chunk recomputed in
    backward), or its weight ``(vocab, width)`` for a head tied to the embedding. ``targets``: class indices
    aligned with ``hidden``'s positions (shift them yourself for next-token prediction), ``ignore_index`` skipped.
    Call it inside the model's forward where the model is wrapped (DDP runs its gradient hooks from its forward).

    Example::

        def loss_fn(model, batch):
            x, y = batch
            return autoaccum.head_loss(model.body(x), model.head, y)

        fit(model, data, 256, loss_fn=loss_fn, memory_savers=("chunked_loss", "checkpointing"))
    """
    count = (targets != ignore_index).sum()
    if _ON.get() and torch.is_grad_enabled():
        return chunked_cross_entropy(hidden, head, targets, ignore_index=ignore_index), count
    logits = _loss_dtype(_logits(head, hidden), False)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction="sum"), count


def is_causal_lm_loss(loss_function: Any) -> bool:
    """``loss_function`` is Hugging Face's ``ForCausalLMLoss``."""
    if "transformers" not in sys.modules:
        return False
    from transformers.loss.loss_utils import ForCausalLMLoss

    return loss_function is ForCausalLMLoss


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """A Hugging Face causal LM's base model and output head, or None for any other model."""
    body = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(body, nn.Module) or body is model or not isinstance(head, nn.Module):
        return None
    if getattr(model, "config", None) is None or getattr(model.config, "is_encoder_decoder", False):
        return None
    return body, head


def causal_lm(model: nn.Module) -> nn.Module | None:
    """The Hugging Face causal LM whose loss function is ``ForCausalLMLoss`` in ``model``: the model itself, or the
    first such module inside it (a LightningModule's, a PEFT model's); None where there is none."""
    return next((m for m in unwrap(model).modules()
                 if _parts(m) is not None and is_causal_lm_loss(getattr(m, "loss_function", None))), None)


def offers_chunked_loss(model: nn.Module) -> bool:
    """Whether ``model`` holds a causal LM (``causal_lm``) whose own loss the saver chunks (``chunks_own_loss``
    checks its logits where the saver is first taken)."""
    return causal_lm(model) is not None


def chunks_own_loss(model: nn.Module) -> bool:
    """Whether the own loss of the causal LM in ``model`` can be chunked exactly: its logits are its head's output
    and its loss their shifted cross-entropy alone, as checked on one row of 8 tokens (in eval mode, without
    gradients; the mode is put back): the logits equal within 1e-6 of their largest magnitude, the loss within
    1e-5, so that a model that scales or soft-caps its logits, or adds a router's auxiliary loss, is not chunked.
    Asked once per model, where the saver is first taken (not where it is offered: the check runs the model's forward,
    which its hooks see)."""
    lm = causal_lm(model)
    if lm is None:
        return False
    if lm in _VERDICTS:
        return _VERDICTS[lm]
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:  # an estimate: fake tensors hold no values to compare; asked again for real
        return True
    verdict = _logits_are_the_heads(lm, *_parts(lm))  # type: ignore[misc]
    if not verdict:
        warnings.warn(f"{type(lm).__name__}'s logits are not its output head's, or its loss is more than their "
                      f"cross-entropy (it scales or soft-caps them, or adds an auxiliary loss): its loss is computed "
                      f"whole, the saver 'chunked_loss' saves nothing on it. Plan without it: "
                      f"memory_savers=('checkpointing',)", stacklevel=3)
    _VERDICTS[lm] = verdict
    return verdict


def _logits_are_the_heads(model: nn.Module, body: nn.Module, head: nn.Module) -> bool:
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        return False
    ids = torch.arange(8, device=param.device).remainder(_vocab(head)).unsqueeze(0)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            output = model(input_ids=ids, labels=ids)
            ours = head(body(input_ids=ids)[0])
    except Exception:  # noqa: BLE001 -- a model this check cannot run is not chunked
        return False
    finally:
        model.train(was_training)
    own = getattr(output, "logits", None)
    if own is None or own.shape != ours.shape or getattr(output, "loss", None) is None:
        return False
    scale = float(own.detach().float().abs().max()) or 1.0
    if float((own.float() - ours.float()).abs().max()) > 1e-6 * scale:
        return False
    # and its loss is ForCausalLMLoss's of those logits alone (a router's auxiliary loss added to it is not)
    whole = F.cross_entropy(ours.float().reshape(-1, ours.shape[-1]), _shifted(ids, IGNORE_INDEX).reshape(-1))
    return abs(float(output.loss) - float(whole)) <= 1e-5 * abs(float(whole))


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``ForCausalLMLoss``'s targets: each position's next label, the last position's ``ignore_index``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


@contextlib.contextmanager
def _own_loss_chunked(model: nn.Module) -> Iterator[None]:
    """``model``'s forward with ``labels`` (gradients on) computes its loss in chunks and returns it without logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    body, head = _parts(model)  # type: ignore[misc]

    def chunked(bound: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *args, **kwargs: _forward(bound, body, head, CausalLMOutputWithPast, args, kwargs)

    with forward_replaced(model, chunked):
        yield


def _forward(bound: Callable[..., Any], body: nn.Module, head: nn.Module, output: type, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """The chunked forward (``_own_loss_chunked``), or the model's own where it does not apply."""
    if args or kwargs.get("labels") is None or not torch.is_grad_enabled() or not _LOSS_ONLY.get() \
            or any(k in kwargs for k in _OWN_PATH):
        return bound(*args, **kwargs)
    labels, num_items = kwargs.pop("labels"), kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    shift_labels = kwargs.pop("shift_labels", None)
    targets = _shifted(labels, ignore_index) if shift_labels is None else shift_labels
    out = body(**kwargs)
    total = chunked_cross_entropy(out[0], head, targets, ignore_index=ignore_index, float32=True)
    if num_items is None:
        num_items = (targets != ignore_index).sum()
    if torch.is_tensor(num_items):
        num_items = num_items.to(total.device)
    return output(loss=total / num_items, logits=None)


@contextlib.contextmanager
def loss_only() -> Iterator[None]:
    """Inside the block the model's output is read for its loss alone (autoaccum's own loss of a dict batch, HF
    Trainer's own ``compute_loss``): there, and only there, the saver chunks a causal LM's own loss, whose
    output then has no logits. A loop of the user's own that calls the model reads what it likes: it is not
    chunked (its ``loss_fn`` can chunk through ``head_loss``)."""
    token = _LOSS_ONLY.set(True)
    try:
        yield
    finally:
        _LOSS_ONLY.reset(token)


@contextlib.contextmanager
def chunking(model: nn.Module) -> Iterator[None]:
    """The saver on inside the block: ``head_loss`` chunks, and a model with ``chunks_own_loss`` chunks its own."""
    token = _ON.set(True)
    try:
        lm = causal_lm(model)
        with _own_loss_chunked(lm) if lm is not None and chunks_own_loss(lm) else contextlib.nullcontext():
            yield
    finally:
        _ON.reset(token)
