"""What each optimizer step saw: sample ids per step from parameter hooks, and the audit of them."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .workloads import Batch


@dataclass
class StepRecord:
    t: float
    cpu: float  # process CPU time: on a shared machine the wall clock also counts waiting for a core
    phase: str
    attempt: int
    attempt_step: int
    lineage: int
    ids: list[int]
    consistent: bool  # every parameter's gradient came from the same micro-batches


class Recorder:
    """Sample ids per optimizer step, from hooks: each forward names its micro-batch; a
    post-accumulate-grad hook on every parameter notes which micro-batches reached its gradient; the
    optimizer's step hook takes the union (and checks every parameter agrees); ``zero_grad`` clears.

    ``lineage`` changes with every new model object (a restart from scratch); ``attempt`` with every
    call of a peer's retried training function. Optionally lowers the budget after ``drop_after``
    optimizer steps of one attempt (run B)."""

    def __init__(self, budget: Any = None, drop: tuple[int, int] | None = None) -> None:
        self.budget, self.drop = budget, drop
        self.phase = "find"
        self.attempt = 0
        self.attempt_steps = 0
        self.attempt_starts: list[float] = []
        self.lineage = 0
        self.micro: list[list[int]] = []
        self.forwards: list[tuple[str, int, int]] = []  # (phase, attempt, size) of each forward
        self.current: int | None = None
        self.pending: dict[int, set[int]] = {}
        self.steps: list[StepRecord] = []
        self.drop_time: float | None = None
        self._watched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # ids get reused

    def new_attempt(self) -> None:
        self.attempt += 1
        self.attempt_steps = 0
        self.attempt_starts.append(time.perf_counter())

    def watch_model(self, model: nn.Module) -> nn.Module:
        self.lineage += 1
        lineage = self.lineage
        self.pending = {}
        for index, p in enumerate(q for q in model.parameters() if q.requires_grad):
            def hook(_p: torch.Tensor, index: int = index) -> None:
                if lineage == self.lineage and self.current is not None:
                    self.pending.setdefault(index, set()).add(self.current)
            p.register_post_accumulate_grad_hook(hook)
        model.zero_grad = self._clearing(model)  # type: ignore[method-assign]
        return model

    def _clearing(self, obj: Any) -> Callable[..., None]:
        """``obj.zero_grad`` that also forgets the pending micro-batches. It holds ``obj`` weakly: a
        reference cycle would keep a failed attempt's model alive until the next ``gc.collect()``."""
        ref, zero_grad = weakref.ref(obj), type(obj).zero_grad

        def clearing_zero_grad(*args: Any, **kwargs: Any) -> None:
            self.pending = {}
            zero_grad(ref(), *args, **kwargs)
        return clearing_zero_grad

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer  # a peer's wrapper (AcceleratedOptimizer): hook the torch optimizer
        if optimizer in self._watched:
            return
        self._watched.add(optimizer)
        optimizer.register_step_post_hook(lambda *_: self._on_step())
        optimizer.zero_grad = self._clearing(optimizer)  # type: ignore[method-assign]

    def forward(self, batch: Batch) -> None:
        self.current = len(self.micro)
        self.micro.append(batch["ids"].tolist())
        self.forwards.append((self.phase, self.attempt, len(self.micro[-1])))

    def _on_step(self) -> None:
        sets = list(self.pending.values())
        union = set().union(*sets) if sets else set()
        ids = [i for m in sorted(union) for i in self.micro[m]]
        self.attempt_steps += 1
        self.steps.append(StepRecord(time.perf_counter(), time.process_time(), self.phase, self.attempt,
                                     self.attempt_steps,
                                     self.lineage, ids, all(s == union for s in sets)))
        if (self.drop is not None and self.phase == "train" and self.drop_time is None
                and self.attempt_steps == self.drop[0]):
            self.budget.set_budget(self.drop[1])
            self.drop_time = time.perf_counter()

    # -- analysis ---------------------------------------------------------------------------------
    def train_steps(self) -> list[StepRecord]:
        """The optimizer steps that made the final model: its lineage, phase train."""
        train = [s for s in self.steps if s.phase == "train"]
        return [s for s in train if s.lineage == train[-1].lineage] if train else []

    def integrity(self) -> dict[str, Any]:
        steps = self.train_steps()
        seen: dict[int, int] = {}
        for s in steps:
            for i in s.ids:
                seen[i] = seen.get(i, 0) + 1
        repeated = sum(1 for c in seen.values() if c > 1)
        lost = (max(seen) + 1 - len(seen)) if seen else 0
        return {"steps": len(steps), "repeated_samples": repeated, "lost_samples": lost,
                "inconsistent_steps": sum(not s.consistent for s in steps),
                "global_batches": sorted({len(s.ids) for s in steps})}

    def tries(self) -> list[tuple[str, int]]:
        """(phase, micro-batch size) of each try: a forward whose phase, attempt or size differs from the
        one before (a finder's trial, or a retried training run)."""
        keys = [k for i, k in enumerate(self.forwards) if i == 0 or k != self.forwards[i - 1]]
        return [(phase, size) for phase, _, size in keys]

    def steady_rate(self, cpu: bool = False) -> float | None:
        """Samples per second (of wall or of process CPU time) over optimizer steps 2..N of the final
        attempt (step 1 creates the optimizer state)."""
        steps = [s for s in self.train_steps() if s.attempt == self.attempt]
        if len(steps) < 2:
            return None
        elapsed = (steps[-1].cpu - steps[0].cpu) if cpu else (steps[-1].t - steps[0].t)
        return sum(len(s.ids) for s in steps[1:]) / elapsed if elapsed > 0 else None
