"""Which samples reached each optimizer step: an audit the integration tests share.

Each forward names its micro-batch (its sample ids); a post-accumulate-grad hook on every parameter
notes which micro-batches reached that parameter's gradient; ``zero_grad`` on the optimizer forgets
them (a replay after an OOM clears the failed attempt through it); the framework's own hook before
its optimizer step (``on_pre_optimizer_step``, ``on_before_optimizer_step``, or the loop itself)
calls :meth:`IdAudit.step`, which takes the union and checks that every parameter agrees. A probe's
passes never reach a step: the guard clears their gradients before the first one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch


class IdAudit:
    def __init__(self, model: torch.nn.Module) -> None:
        self.micro: list[list[int]] = []
        self.current: int | None = None
        self.pending: dict[int, set[int]] = {}
        self.steps: list[list[int]] = []
        self.inconsistent = 0
        self._watched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        for index, p in enumerate(q for q in model.parameters() if q.requires_grad):
            p.register_post_accumulate_grad_hook(lambda _p, index=index: self._reached(index))

    def _reached(self, index: int) -> None:
        if self.current is not None:
            self.pending.setdefault(index, set()).add(self.current)

    def forward(self, ids: Iterable[int]) -> None:
        """A forward on the samples ``ids`` starts (call it from the loss or a forward hook)."""
        self.current = len(self.micro)
        self.micro.append([int(i) for i in ids])

    def hook_forward(self, module: torch.nn.Module, ids_of: Callable[[tuple, dict], Iterable[int]]) -> None:
        """Name micro-batches from ``module``'s inputs: ``ids_of(args, kwargs)``."""
        module.register_forward_pre_hook(lambda _m, args, kwargs: self.forward(ids_of(args, kwargs)), with_kwargs=True)

    def watch(self, optimizer: Any) -> None:
        """``optimizer.zero_grad`` (of the torch optimizer inside a framework's wrapper) also forgets."""
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        if optimizer in self._watched:
            return
        self._watched.add(optimizer)
        zero_grad = type(optimizer).zero_grad
        ref = weakref.ref(optimizer)

        def forgetting_zero_grad(*args: Any, **kwargs: Any) -> None:
            self.pending = {}
            zero_grad(ref(), *args, **kwargs)

        optimizer.zero_grad = forgetting_zero_grad

    def step(self) -> None:
        """The optimizer is about to step: record the samples whose gradients it holds."""
        sets = list(self.pending.values())
        union = set().union(*sets) if sets else set()
        self.inconsistent += not all(s == union for s in sets)
        self.steps.append(sorted(i for m in union for i in self.micro[m]))
        self.pending = {}

    def check(self) -> dict[str, int]:
        """Repeated samples, and inconsistent steps (parameters whose gradients came from other micro-batches)."""
        seen = [i for s in self.steps for i in s]
        return {"steps": len(self.steps), "repeated": len(seen) - len(set(seen)), "inconsistent": self.inconsistent}
