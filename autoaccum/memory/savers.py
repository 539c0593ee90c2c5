"""Memory savers: what a step does when even its smallest micro-batch does not fit.

Taken cheapest first, each adds to the one before and changes nothing but memory and speed
(invariant 8):

- ``"none"``: the step as written;
- ``"chunked_loss"``: the output head and the cross-entropy a chunk of tokens at a time, recomputed in
  backward, so that the whole logits tensor never exists (``autoaccum.memory.chunked_loss``): offered for
  Hugging Face causal LMs whose loss is their own, and to a ``loss_fn`` that uses ``head_loss`` where
  ``memory_savers`` names it. Where it is on, every saver above it keeps it: ``"checkpointing:2/8+chunked_loss"``;
- ``"checkpointing:k/N"`` (``k`` of the ``N`` blocks of the model's first ``nn.ModuleList``, for ``k``
  = 1, 2, 4, ... below ``N``): the first ``k`` blocks recompute their activations in backward instead
  of keeping them. The first, because backward reaches them last: by the time one is recomputed, the
  activations of every later block have been freed, so the recomputation adds nothing to the step's
  peak (checkpointing the last blocks would recompute one block's activations beside all the others').
  The counts double so that the probe and the guard need at most ``log2(N)`` tries to find how many
  blocks a step needs, not ``N``;
- ``"checkpointing"``: every block recomputes its activations in backward. Through the model's own
  switch where it has one (Hugging Face's ``gradient_checkpointing_enable``, all or nothing: its blocks
  are not wrapped one by one, because a layer that updates a key/value cache in its forward would
  update it again in the recomputation), else every block of its first ``nn.ModuleList`` under
  non-reentrant ``torch.utils.checkpoint``. Dropout draws the same masks in the recomputation (the RNG
  state is kept for it), and the buffers a forward updates (BatchNorm running statistics) are put back
  after the recomputation, so they are updated once per forward, not twice;
- ``"offload"`` (CUDA only): checkpointing, and the tensors the forward saves for backward kept in
  pinned host memory (``torch.autograd.graph.save_on_cpu``) until backward needs them.

A further saver that stays exact (optimizer state or parameters offloaded with FSDP2's
``CPUOffloadPolicy``) is not built: ``DoesNotFitError`` names it as a suggestion.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn

from autoaccum.memory.chunked_loss import chunking, offers_chunked_loss
from autoaccum.modules import forward_replaced, is_compiled, unwrap
from autoaccum.state import capture_buffers, restore_buffers, state_buffers

__all__ = ["SAVERS", "MemorySaver", "MemorySavers", "allowed_savers", "apply_saver", "check_memory_savers",
           "check_saver", "checkpoint_layers", "describe_saver", "has_own_switch", "next_saver", "partial_blocks",
           "saver_code", "saver_from_code", "saver_rank", "split_saver", "suggestions"]

#: the memory savers, cheapest first (the order they are taken in)
MemorySaver = Literal["none", "chunked_loss", "checkpointing", "offload"]
SAVERS: tuple[MemorySaver, ...] = get_args(MemorySaver)
#: ``"auto"``: every saver this model and device have; ``"off"``: none; or the savers allowed, in order
MemorySavers = Literal["auto", "off"] | Sequence[MemorySaver]


_PARTIAL = re.compile(r"checkpointing:(\d+)/(\d+)")
#: the savers below the loss that are not a count of blocks, cheapest first (``checkpointing:k/N`` sits between the
#: first two)
_WHOLE = ("none", "checkpointing", "offload")
CHUNKED = "chunked_loss"
_WITH_CHUNKED = "+" + CHUNKED


def split_saver(saver: str) -> tuple[str, bool]:
    """``(the saver below the loss, whether the loss is chunked)``: ``"checkpointing:2/8+chunked_loss"`` is
    ``("checkpointing:2/8", True)``, ``"chunked_loss"`` ``("none", True)``."""
    if saver == CHUNKED:
        return "none", True
    if saver.endswith(_WITH_CHUNKED):
        return saver[:-len(_WITH_CHUNKED)], True
    return saver, False


def partial_blocks(saver: str) -> tuple[int, int] | None:
    """``(k, N)`` for ``"checkpointing:k/N"`` (with or without the chunked loss); None for the other savers."""
    match = _PARTIAL.fullmatch(split_saver(saver)[0])
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def _checkpointing(saver: str) -> bool:
    blocks = partial_blocks(saver)
    return saver in _WHOLE[1:] or (blocks is not None and 1 <= blocks[0] < blocks[1])


def check_saver(saver: Any) -> str:
    """``saver`` if it names a memory saver: one of ``SAVERS``, ``"checkpointing:k/N"`` (1 <= k < N), or one of
    the checkpointing savers with ``"+chunked_loss"``.

    Raises:
        ValueError: it names none.
    """
    if isinstance(saver, str):
        base, chunked = split_saver(saver)
        if (base == "none" and not saver.endswith(_WITH_CHUNKED)) or _checkpointing(base):
            return saver
    raise ValueError(f"Invalid saver: {saver!r}. Allowed: {', '.join(SAVERS)}, 'checkpointing:k/N' (the first k of N "
                     f"blocks, 1 <= k < N), or a checkpointing saver with '+chunked_loss'")


def _base_code(base: str) -> int:
    blocks = partial_blocks(base)
    if blocks is not None:
        return blocks[0] << 20 | blocks[1]
    return _WHOLE.index(base) << 40


def saver_code(saver: str) -> int:
    """``saver`` as one integer that orders as the ladder does (for a MIN/MAX across ranks, whose models have the
    same blocks): the saver below the loss, then the chunked loss; ``saver_from_code`` reads it back."""
    base, chunked = split_saver(saver)
    return _base_code(base) << 1 | int(chunked)


def saver_from_code(code: int) -> str:
    base_code, chunked = code >> 1, code & 1
    if 0 < base_code < 1 << 40:
        base = f"checkpointing:{base_code >> 20}/{base_code & ((1 << 20) - 1)}"
    else:
        base = _WHOLE[base_code >> 40]
    if not chunked:
        return base
    return CHUNKED if base == "none" else base + _WITH_CHUNKED


def saver_rank(saver: str) -> float:
    """Where ``saver`` stands among the savers, cheapest first: ``none`` 0, the chunked loss just above the
    saver below it, ``k`` of ``N`` blocks ``k/N``, ``checkpointing`` 1, ``offload`` 2."""
    base, chunked = split_saver(saver)
    blocks = partial_blocks(base)
    rank = blocks[0] / blocks[1] if blocks is not None else float(_WHOLE.index(base))
    return rank + (1e-9 if chunked else 0.0)


def describe_saver(saver: str) -> str:
    """In words: ``checkpointing 2 of 8 blocks``, ``checkpointing``, ``offload``, ``the loss in chunks``,
    ``checkpointing 2 of 8 blocks and the loss in chunks``."""
    base, chunked = split_saver(saver)
    blocks = partial_blocks(base)
    said = base if blocks is None else f"checkpointing {blocks[0]} of {blocks[1]} blocks"
    if not chunked:
        return said
    return "the loss in chunks" if base == "none" else f"{said} and the loss in chunks"


def checkpoint_layers(model: nn.Module) -> nn.ModuleList | None:
    """The blocks generic checkpointing wraps: the model's first non-empty ``nn.ModuleList``."""
    return next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0), None)


def _switch(model: nn.Module) -> tuple[str, str, str] | None:
    """A Hugging Face style switch: the names of its enable and disable methods and of its state
    (``activation_checkpointing_*`` from transformers 5.x, else ``gradient_checkpointing_*``)."""
    for prefix in ("activation", "gradient"):
        enable, disable = f"{prefix}_checkpointing_enable", f"{prefix}_checkpointing_disable"
        if callable(getattr(model, enable, None)) and callable(getattr(model, disable, None)):
            return enable, disable, f"is_{prefix}_checkpointing"
    return None


def has_own_switch(model: nn.Module) -> bool:
    """The model turns checkpointing on and off itself (Hugging Face models that support it)."""
    model = unwrap(model)
    return _switch(model) is not None and bool(getattr(model, "supports_gradient_checkpointing", True))


def check_memory_savers(savers: Any) -> tuple[str, ...]:
    """The savers ``memory_savers`` allows, ``"none"`` first (``"checkpointing"`` allows checkpointing
    some of the blocks too; a ``"checkpointing:k/N"`` allows that one; ``"chunked_loss"`` allows the loss in chunks,
    as does a saver with ``"+chunked_loss"``; ``"auto"`` allows each where the model has it).

    Raises:
        ValueError, TypeError: ``savers`` is not ``"auto"``, ``"off"`` or a sequence of saver names.
    """
    if isinstance(savers, str):
        if savers not in ("auto", "off"):
            raise ValueError(f"Invalid memory_savers: {savers!r}. Allowed: 'auto', 'off', or a tuple of savers "
                             f"from {SAVERS} (e.g. ('checkpointing',))")
        return SAVERS if savers == "auto" else ("none",)
    if isinstance(savers, (tuple, list)) and all(isinstance(r, str) for r in savers):
        unknown = []
        for r in savers:
            try:
                check_saver(r)
            except ValueError:
                unknown.append(r)
        if unknown:
            raise ValueError(f"Invalid memory_savers: {tuple(savers)!r}; unknown saver(s) {unknown}. Allowed: "
                             f"{SAVERS}, or 'checkpointing:k/N'")
        return ("none", *savers)
    raise TypeError(f"memory_savers must be 'auto', 'off' or a tuple of saver names from {SAVERS}, got {savers!r}")


def allowed_savers(model: nn.Module, device: torch.device, savers: Any = "auto") -> tuple[str, ...]:
    """The savers a step may turn to for ``model`` on ``device``, cheapest first, starting with ``"none"``
    (``savers`` as ``check_memory_savers`` takes it). The chunked loss comes second where allowed, and then every
    saver above it keeps it: under ``"auto"`` where the model's own loss can be chunked (``offers_chunked_loss``)."""
    wanted = check_memory_savers(savers)
    if savers == "auto":
        chunked = not is_compiled(model) and offers_chunked_loss(model)
    else:
        chunked = any(split_saver(w)[1] for w in wanted)
        wanted = tuple(split_saver(w)[0] for w in wanted)
    ladder = _ladder(model, device, wanted)
    if not chunked:
        return ladder
    return ("none", CHUNKED, *(r + _WITH_CHUNKED for r in ladder[1:]))


def _ladder(model: nn.Module, device: torch.device, wanted: tuple[str, ...]) -> tuple[str, ...]:
    own = has_own_switch(model)
    layers = None if own else checkpoint_layers(unwrap(model))
    # a torch.compile'd model takes no saver: dynamo cannot trace the exact checkpointing's context_fn
    blocks = not is_compiled(model) and (own or layers is not None)
    possible: list[str] = ["none"]
    if blocks:
        n, k = (0, 1) if layers is None else (len(layers), 1)
        while k < n:  # the first k of N blocks, k doubling: the fewest that fit in log2(N) tries
            possible.append(f"checkpointing:{k}/{n}")
            k *= 2
        possible += ["checkpointing", "offload"] if device.type == "cuda" else ["checkpointing"]
    return tuple(r for r in possible if r in wanted or (partial_blocks(r) is not None and "checkpointing" in wanted))


def suggestions(savers: Sequence[str]) -> tuple[str, ...]:
    """What to do where none of ``savers`` fits the smallest micro-batch."""
    bases = {split_saver(r)[0] for r in savers}
    chunks = () if CHUNKED in savers else (
        "where the logits are large (a large vocabulary, long sequences), compute the loss in chunks: "
        "a Hugging Face causal LM's own loss takes it under memory_savers='auto'; a loss_fn of your own through "
        "autoaccum.head_loss(hidden, head, targets) with memory_savers=('chunked_loss', 'checkpointing')",)
    blocks = () if "checkpointing" in bases else (
        "give the model's blocks an nn.ModuleList (or a gradient_checkpointing_enable()) so that they can be "
        "checkpointed, and allow memory_savers (a torch.compile'd model takes no saver: compiling cannot trace their "
        "exact checkpointing)",)
    return (*blocks, *chunks, "use bf16 autocast (precision='bf16'), shorter sequences or a smaller model",
            "offload optimizer state and parameters to host memory (FSDP2's CPUOffloadPolicy), or shard them over "
            "more devices (FSDP)", "free memory held by other processes, or raise the budget")


def next_saver(savers: Sequence[str], saver: str) -> str | None:
    """The saver after ``saver`` in ``savers``, or None at its top."""
    later = [r for r in savers if saver_rank(r) > saver_rank(saver)]
    return later[0] if later else None


@contextlib.contextmanager
def _buffers_kept(modules: Callable[[], nn.Module]) -> Iterator[None]:
    """The buffers a forward updates, put back after the forward inside (a recomputation)."""
    saved = capture_buffers(state_buffers(modules()))
    try:
        yield
    finally:
        restore_buffers(saved)


def _context_fn(module: nn.Module) -> Callable[[], tuple[Any, Any]]:
    """For ``checkpoint(context_fn=...)``: nothing around the forward, the buffers kept around the
    recomputation (otherwise BatchNorm's running statistics would be updated twice)."""
    return lambda: (contextlib.nullcontext(), _buffers_kept(lambda: module))


@contextlib.contextmanager
def _checkpointed(model: nn.Module, blocks: tuple[int, int] | None = None) -> Iterator[None]:
    """Every block checkpointed, or (``blocks``: ``(k, N)``) the first ``k`` of the ``N``."""
    inner = unwrap(model)
    switch = _switch(inner) if has_own_switch(inner) else None
    if switch is not None and blocks is not None:
        raise ValueError(f"{type(inner).__name__} checkpoints through its own switch (gradient_checkpointing_enable): "
                         f"all of its blocks or none, not {blocks[0]} of {blocks[1]}; plan with 'checkpointing'")
    if switch is not None:
        enable, disable, state = switch
        if getattr(inner, state, False):  # the user's own checkpointing: kept as it is
            yield
            return
        getattr(inner, enable)({"use_reentrant": False, "context_fn": _context_fn(inner)})
        try:
            yield
        finally:
            getattr(inner, disable)()
        return
    layers = checkpoint_layers(inner)
    if layers is None:
        raise ValueError(f"{type(inner).__name__} has no nn.ModuleList of blocks to checkpoint and no "
                         f"gradient_checkpointing_enable()")
    if blocks is not None and blocks[1] != len(layers):
        raise ValueError(f"the plan checkpoints {blocks[0]} of {blocks[1]} blocks, but {type(inner).__name__} has "
                         f"{len(layers)}: the plan was made for another model; plan again for this one")
    from torch.utils.checkpoint import checkpoint

    patched: list[tuple[nn.Module, Any]] = []
    try:
        for layer in layers if blocks is None else list(layers)[:blocks[0]]:
            original = layer.forward  # the bound method (or an instance attribute someone set)

            def forward(*args: Any, _original: Any = original, _layer: nn.Module = layer, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return _original(*args, **kwargs)
                # non-reentrant: keyword arguments, inputs that need no grad, frozen and tied weights
                return checkpoint(_original, *args, use_reentrant=False, context_fn=_context_fn(_layer), **kwargs)

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
def _offloaded(model: nn.Module) -> Iterator[None]:
    """Every tensor the model's forward saves for backward goes to pinned host memory meanwhile."""
    def offloading(bound: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return bound(*args, **kwargs)
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return bound(*args, **kwargs)
        return forward

    with forward_replaced(model, offloading):
        yield


@contextlib.contextmanager
def apply_saver(model: nn.Module, saver: str) -> Iterator[None]:
    """``model`` runs with ``saver`` inside the block; as it was afterwards."""
    check_saver(saver)
    base, chunked = split_saver(saver)
    with contextlib.ExitStack() as stack:
        if chunked:
            stack.enter_context(chunking(model))
        if base != "none":
            stack.enter_context(_checkpointed(model, partial_blocks(base)))
        if base == "offload":
            stack.enter_context(_offloaded(model))
        yield
