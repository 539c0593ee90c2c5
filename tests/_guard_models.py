"""Small deterministic models, losses and reference loops for the guard and batch tests.

The references here are written by hand and share no code with ``autoaccum.guard.guard``: a full-batch
step, a plain accumulation loop with an explicit list of micro-batch sizes, and OOMs injected on
demand (``Trigger``) at a chosen phase and call.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from helpers import InjectedOOM
from torch import nn


class Trigger:
    """Raises ``torch.OutOfMemoryError`` at the ``at``-th call of ``hit(phase)`` after ``arm``.

    ``cap``: additionally raise in ``hit("forward")`` whenever a micro-batch has more than ``cap``
    rows (a device that holds at most ``cap`` samples).
    """

    def __init__(self) -> None:
        self.phase: str | None = None
        self.at = 0
        self.count = 0
        self.fired: list[tuple[str, int]] = []  # (phase, call index) of every injected OOM
        self.cap: int | None = None
        self.sizes: list[int] = []  # rows of every forward, in order

    def arm(self, phase: str, at: int = 1) -> None:
        self.phase, self.at, self.count = phase, at, 0

    def hit(self, phase: str, rows: int) -> None:
        if phase == "forward":
            self.sizes.append(rows)
            if self.cap is not None and rows > self.cap:
                self.fired.append(("cap", rows))
                raise InjectedOOM(f"injected: {rows} rows > cap {self.cap}")
        if self.phase == phase:
            self.count += 1
            if self.count == self.at:
                self.phase = None
                self.fired.append((phase, self.at))
                raise InjectedOOM(f"injected OOM in {phase} at call {self.at}")


class _BackwardProbe(torch.autograd.Function):
    """Identity whose backward calls ``trigger.hit("backward")``: an OOM in the middle of backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, trigger: Trigger) -> torch.Tensor:  # type: ignore[override]
        ctx.trigger = trigger
        ctx.rows = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.trigger.hit("backward", ctx.rows)
        return grad, None


class Net(nn.Module):
    """Linear -> [BatchNorm] -> silu -> dropout -> [backward probe] -> Linear, with weakrefs to activations.

    ``refs`` holds a weakref to every hidden activation made since the last replay; at the first
    forward after ``guard.ooms`` grows (a replay), whether all of them were dead is appended to
    ``dead_at_replay``.
    """

    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 3, p: float = 0.0,
                 dtype: torch.dtype = torch.float64, seed: int = 0, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(d_in, hidden, dtype=dtype)
        self.norm = nn.BatchNorm1d(hidden, dtype=dtype) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(hidden, d_out, dtype=dtype)
        self.drop = nn.Dropout(p)
        self.trigger = Trigger()
        self.refs: list[weakref.ref] = []
        self.guard = None
        self._seen_ooms = 0
        self.dead_at_replay: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.guard is not None and self.guard.ooms != self._seen_ooms:
            self._seen_ooms = self.guard.ooms
            self.dead_at_replay.append(all(r() is None for r in self.refs))
            self.refs = []
        z = self.norm(self.fc1(x))
        # silu saves its input for backward, and a saved input keeps its Python object alive
        # (an op's saved *output*, e.g. tanh's, is a new handle: its weakref would die early)
        self.refs.append(weakref.ref(z))
        h = self.drop(F.silu(z))
        self.trigger.hit("forward", x.shape[0])  # after dropout: the failed attempt drew random numbers
        h = _BackwardProbe.apply(h, self.trigger)
        return self.fc2(h)


def data(n: int, d_in: int = 8, d_out: int = 3, dtype: torch.dtype = torch.float64, seed: int = 1
         ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=dtype), torch.randn(n, d_out, generator=g, dtype=dtype)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    loss = F.mse_loss(model(x), y)
    trigger = getattr(model, "trigger", None)
    if trigger is not None:
        trigger.hit("loss", x.shape[0])
    return loss


def cut(batch, sizes: Sequence[int]):
    """Consecutive slices of a tuple of tensors (the reference's own splitting)."""
    out, start = [], 0
    for s in sizes:
        out.append(tuple(t[start:start + s] for t in batch))
        start += s
    return out


def sizes_for(n: int, micro: int) -> list[int]:
    """``n`` samples in the fewest micro-batches of at most ``micro``, spread evenly (larger first)."""
    count = -(-n // micro)
    base, extra = divmod(n, count)
    return [base + 1] * extra + [base] * (count - extra)


def manual_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, sizes: Sequence[int],
                loss_fn: Callable = mse, *, weighting: str = "share", max_grad_norm: float | None = None,
                clip_each: bool = False) -> tuple[float, float | None]:
    """A hand-written accumulation step.

    weighting: "share" (size / n: exact), "sum" (un-weighted sum of micro means: the naive loop),
    "mean" (mean of micro means: 1 / accum_steps, wrong for uneven sizes).
    clip_each: clip every micro-batch's gradient before adding it (wrong on purpose).
    Returns the step's loss (weighted like its gradient) and the gradient norm before clipping.
    """
    n = sum(sizes)
    optimizer.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    acc = [torch.zeros_like(p) for p in params] if clip_each else None
    total, norm = 0.0, None
    for part, size in zip(cut(batch, sizes), sizes):
        loss = loss_fn(model, part)
        w = {"share": size / n, "sum": 1.0, "mean": 1.0 / len(sizes)}[weighting]
        total += float(loss.detach()) * w
        (loss * w).backward()
        if clip_each:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            for a, p in zip(acc, params):
                a += p.grad
                p.grad = None
    if clip_each:
        for a, p in zip(acc, params):
            p.grad = a
    elif max_grad_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return total, norm


def full_step(model, optimizer, batch, loss_fn: Callable = mse, max_grad_norm: float | None = None
              ) -> tuple[float, float | None]:
    return manual_step(model, optimizer, batch, [len(batch[0])], loss_fn, max_grad_norm=max_grad_norm)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients of every step (and can raise OOM inside step)."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self._reset_record()

    def _reset_record(self) -> None:
        self.grads: list[list[torch.Tensor]] = []
        self.fail_next = False
        self.calls = 0

    def __setstate__(self, state) -> None:  # deepcopy keeps only the optimizer's own state
        super().__setstate__(state)
        self._reset_record()

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        self.calls += 1
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        if self.fail_next:
            self.fail_next = False
            first = self.param_groups[0]["params"][0]
            first.add_(1.0)  # half an update, then the OOM: what a real failure can leave behind
            raise torch.OutOfMemoryError("injected OOM inside optimizer.step()")
        return super().step(closure)


def pair(model: nn.Module, lr: float = 0.1, momentum: float = 0.9):
    """``model`` and an identical deep copy, each with its own RecordingSGD."""
    twin = copy.deepcopy(model)
    return ((model, RecordingSGD(model.parameters(), lr=lr, momentum=momentum)),
            (twin, RecordingSGD(twin.parameters(), lr=lr, momentum=momentum)))


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def phase_peaks(model: nn.Module, optimizer: torch.optim.Optimizer, batch, target: int, micro: int,
                loss_fn: Callable = mse) -> dict:
    """Peak tracked bytes per phase of one guarded step of a copy of ``model`` at ``micro``:
    ``{("forward", i): bytes, ("backward", i): bytes, "step": bytes}`` (i counts micro-batches from 1).

    Runs the real guard under a counting meter, so it sees the same allocations as the run it
    calibrates; the RNG state is left as it was.
    """
    from autoaccum import OOMGuard, TrackedMemory

    class PhaseMemory(TrackedMemory):
        phase: object = "start"
        peaks: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.current_bytes)
            return out

    rng = torch.get_rng_state()
    guard, model.guard = model.guard, None
    try:
        model_copy, opt_copy = copy.deepcopy((model, optimizer))
    finally:
        model.guard = guard
    mem = PhaseMemory()
    mem.peaks = {}
    count = [0]

    def pre_forward(module, args):
        count[0] += 1
        mem.phase = ("forward", count[0])

    def loss_then_backward(m, b):
        loss = loss_fn(m, b)
        mem.phase = ("backward", count[0])
        return loss

    model_copy.register_forward_pre_hook(pre_forward)
    opt_copy.register_step_pre_hook(lambda *a: setattr(mem, "phase", "step"))
    g = OOMGuard(model_copy, opt_copy, target_batch=target, micro_batch=micro)
    with mem.track(model_copy, opt_copy, batch):  # the batch counts: on a device it is in device memory
        g.step(batch, loss_then_backward)
    torch.set_rng_state(rng)
    return mem.peaks


class TokenModel(nn.Module):
    """Embedding -> tanh -> Linear over a vocabulary: logits for every position."""

    def __init__(self, vocab: int = 11, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim, dtype=torch.float64)
        self.out = nn.Linear(dim, vocab, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(tokens)))


def token_batch(n: int = 32, seq_len: int = 12, vocab: int = 11, seed: int = 0) -> dict:
    """Padded sequences whose lengths grow along the batch (so micro-batches hold very different
    token counts); labels are -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(1, seq_len, n).round().long()
    tokens = torch.randint(1, vocab, (n, seq_len), generator=g)
    labels = torch.randint(0, vocab, (n, seq_len), generator=g)
    pad = torch.arange(seq_len)[None, :] >= lengths[:, None]
    return {"inputs": {"tokens": tokens.masked_fill(pad, 0)}, "labels": labels.masked_fill(pad, -100)}


def token_sum(model: nn.Module, batch: dict, scale: torch.Tensor | None = None):
    logits = model(batch["inputs"]["tokens"])
    if scale is not None:
        logits = logits * scale
    labels = batch["labels"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss, (labels != -100).sum()


def token_mean(model: nn.Module, batch: dict, scale: torch.Tensor | None = None) -> torch.Tensor:
    loss, count = token_sum(model, batch, scale)
    return loss / count
