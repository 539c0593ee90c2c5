"""Head-to-head (issue 7): autoaccum against the tools users would pick instead, measured in one run.

Every system trains the SAME model (a fresh copy of one seeded model), on the SAME data in the SAME
order, at the SAME target global batch, under the SAME memory budget, with the same optimizer
(AdamW, lr 1e-3, no weight decay, no clipping, constant LR):

- ``autoaccum``: ``autoaccum.probe`` (measures real steps, plans micro x accum), then
  ``autoaccum.fit(plan=report)`` -- what ``fit(budget=...)`` does in one call, split in two so
  that the probe's cost is reported apart and training runs on the benchmark's device.
- ``accelerate``: ``find_executable_batch_size`` around a training function that builds its model
  inside (as Accelerate's example does), ``accelerator.accumulate``, and ``gradient_accumulation_steps
  = target // batch_size`` recomputed on every retry (the careful user).
- ``lightning``: ``Tuner.scale_batch_size(mode="binsearch")`` on a tuning Trainer, then a Trainer
  with ``accumulate_grad_batches = target // found`` (the tuner runs inside a Trainer, so the
  accumulation must be chosen in a second one).
- ``transformers``: ``Trainer`` with ``auto_find_batch_size=True``, ``per_device_train_batch_size =
  target``, ``gradient_accumulation_steps = 1``, and the token-count path (``compute_loss_func`` with
  ``num_items_in_batch``).
- ``hand``: a nanoGPT-style loop (``loss / accum_steps``) with a fixed micro-batch: the largest power
  of two that divides the target and truly fits (an informed user's pick; its cost is not counted).

Memory budget. On CPU (no GPU here) the budget is autoaccum's emulated device: a TorchDispatchMode
that counts live tensor bytes and raises ``torch.OutOfMemoryError`` at the allocation that crosses
the budget. Its own message ("Emulated out of memory in ...") is recognised by autoaccum (it tests
``isinstance``) but not by the peers, which match message text:

- accelerate ``should_reduce_batch_size``: a RuntimeError whose only argument contains " out of memory."
- lightning ``is_oom_error``: a RuntimeError whose only argument contains "CUDA" and "out of memory"
- transformers: Accelerate's ``find_executable_batch_size`` (so the same text as accelerate)

so the benchmark's budget (:class:`PeerVisibleBudget`) re-raises the same ``torch.OutOfMemoryError``
with "CUDA out of memory. " in front, as a real device would say. autoaccum's own message is not
changed. On a GPU (``--device cuda``) the real device is used and
``torch.cuda.set_per_process_memory_fraction`` makes it behave like a smaller card.

The budget for each model is set so that a plain accumulation loop fits exactly ``micro_target``
samples per micro-batch (about a fifth of the target); "truly fits" is then found by brute force
(doubling + bisection over real runs of two accumulated AdamW steps on a fresh copy). Each system
runs twice: A (clean) and B (the budget drops after ``drop_after`` optimizer steps to what fits
about ``drop_fraction`` of the truly-fitting micro-batch, as when another process takes memory).

Columns (per system): training steps, wall time and OOMs spent finding a batch size; micro-batch
chosen vs truly fits; global batch trained vs target; samples/s in steady state (optimizer steps 2..N
of the final run, per second of wall and of process CPU time); time lost to one runtime OOM (run B)
and whether any sample was lost or repeated (sample ids recorded per optimizer step from
post-accumulate-grad hooks on every parameter); final parameters against a full-batch reference
(max over tensors of ``|p - ref|_inf / |ref|_inf``; and of ``|p - ref|_inf / |ref - init|_inf``, the
error relative to the training update).

Measurement choices: on CPU everything runs in float64 (in fp32, Adam turns rounding noise in
gradients that are zero in exact arithmetic, such as attention key biases, into full-size updates,
which would hide whether accumulation is exact) with one intra-op thread; each system runs in its own
Python process (no peer's imports, singletons or global settings leak into another's run), where the
objects created at import are frozen out of the garbage collector (every system's OOM recovery calls
``gc.collect()``, which on a slow shared CPU would otherwise cost 0.3-0.6 s of import-time objects).

Run it::

    python benchmarks/compare.py                 # CPU, all three models, a few minutes
    python benchmarks/compare.py --models mlp --systems autoaccum hand --steps 4
    python benchmarks/compare.py --device cuda --size gpu   # on a GPU machine (real memory)

Prints a table, then one JSON document, and writes the section "## Head-to-head (issue 7)" of
benchmarks/RESULTS.md (``--no-write`` to skip). Not part of the test run (tests/test_compare.py
smoke-tests a tiny configuration).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib
import io
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autoaccum
from autoaccum import TrackedMemory
from autoaccum.demo import TinyGPT

SYSTEMS = ("autoaccum", "accelerate", "lightning", "transformers", "hand")
PEER_MODULES = {"accelerate": "accelerate", "lightning": "lightning", "transformers": "transformers"}
LR = 1e-3
SECTION = "## Head-to-head (issue 7)"
RESULTS = Path(__file__).with_name("RESULTS.md")
#: the text peers look for (see the module docstring); a real CUDA OOM starts with it
PEER_OOM_PREFIX = "CUDA out of memory. "
MIN_STEPS = 4  # optimizer steps per run: 2 before the budget drops in run B, and a steady state after


# -- workloads ----------------------------------------------------------------------------------

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """One model, its data and its loss.

    ``loss_sum(model, batch) -> (sum, count)``: the summed loss and the number of items (samples, or
    non-padding tokens). Every system gets this loss in the form its API takes: autoaccum the pair
    (token-exact), the peers ``sum / count`` (a mean per micro-batch) or Trainer's token count path.
    """

    name: str
    make_model: Callable[[], nn.Module]
    make_data: Callable[[int], Batch]
    target_batch: int
    micro_target: int  # the budget lets a plain accumulation loop fit exactly this micro-batch
    token_level: bool = False
    batchnorm: bool = False
    note: str = ""


class MLP(nn.Module):
    def __init__(self, in_dim: int, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_dim, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvBN(nn.Module):
    def __init__(self, channels: int, side: int) -> None:
        super().__init__()
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * c * (side // 4) ** 2, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _classification_data(shape: tuple[int, ...]) -> Callable[[int], Batch]:
    def make(n: int) -> Batch:
        g = torch.Generator().manual_seed(1234)
        return {"ids": torch.arange(n), "x": torch.randn(n, *shape, generator=g),
                "labels": torch.randint(0, 10, (n,), generator=g)}
    return make


def _token_data(seq_len: int, vocab: int) -> Callable[[int], Batch]:
    """Padded variable-length sequences: inputs padded with token 0, labels -100 past each length."""
    def make(n: int) -> Batch:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab
        lengths = torch.randint(seq_len // 4, seq_len + 1, (n,), generator=g)  # tokens predicted per row
        keep = torch.arange(seq_len) < lengths[:, None]
        return {"ids": torch.arange(n), "x": torch.where(keep, seq[:, :-1], 0),
                "labels": torch.where(keep, seq[:, 1:], -100)}
    return make


def loss_sum(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over the items of ``batch`` and their count (-100 labels excluded)."""
    logits = model(batch["x"])
    labels = batch["labels"]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, labels.ne(-100).sum()


def workloads(size: str) -> dict[str, Workload]:
    """``tiny`` (the smoke test), ``cpu`` (default: a few minutes on 2 cores) or ``gpu`` (real memory)."""
    def seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            torch.manual_seed(0)
            return factory()
        return make

    if size == "tiny":
        return {
            "mlp": Workload("mlp", seeded(lambda: MLP(32, 16, 4)), _classification_data((32,)), 64, 19),
            "gpt": Workload("gpt", seeded(lambda: TinyGPT(vocab_size=32, seq_len=16, dim=16, layers=1, heads=2)),
                            _token_data(16, 32), 32, 7, token_level=True),
            "cnn": Workload("cnn", seeded(lambda: ConvBN(4, 8)), _classification_data((3, 8, 8)), 32, 7,
                            batchnorm=True),
        }
    if size == "cpu":
        return {
            "mlp": Workload("mlp", seeded(lambda: MLP(256, 128, 6)), _classification_data((256,)), 1024, 230,
                            note="256-128x6-10, ReLU"),
            "gpt": Workload("gpt", seeded(lambda: TinyGPT(vocab_size=256, seq_len=32, dim=64, layers=2, heads=4)),
                            _token_data(32, 256), 64, 13, token_level=True,
                            note="TinyGPT 2 layers x 64, 32 tokens, lengths 8..32 padded; token-level loss"),
            "cnn": Workload("cnn", seeded(lambda: ConvBN(16, 16)), _classification_data((3, 16, 16)), 128, 27,
                            batchnorm=True, note="2 conv+BatchNorm blocks, 16x16 images"),
        }
    if size == "gpu":  # not exercised on the CPU-only machines this was written on
        return {
            "mlp": Workload("mlp", seeded(lambda: MLP(4096, 4096, 8)), _classification_data((4096,)), 16384, 3600),
            "gpt": Workload("gpt", seeded(lambda: TinyGPT(vocab_size=32000, seq_len=1024, dim=1024, layers=12,
                                                          heads=16)),
                            _token_data(1024, 32000), 256, 23, token_level=True),
            "cnn": Workload("cnn", seeded(lambda: ConvBN(128, 32)), _classification_data((3, 32, 32)), 4096, 900,
                            batchnorm=True),
        }
    raise ValueError(f"Invalid size: {size!r}. Allowed values: tiny, cpu, gpu")


def describe_model(model: nn.Module) -> str:
    return f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters"


# -- the memory budget ----------------------------------------------------------------------------

class PeerVisibleBudget(TrackedMemory):
    """autoaccum's emulated budget, re-raising its OOM with the text the peers' detectors look for.

    The error is the same ``torch.OutOfMemoryError`` (autoaccum recognises it by type); only the
    message gains a "CUDA out of memory. " prefix. It is raised outside the ``except`` block, so the
    original traceback (and the activations it holds) is gone, as after a real allocator failure."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes=budget_bytes)
        self.oom_times: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except torch.OutOfMemoryError as exc:
            message = str(exc)
        self.oom_times.append(time.perf_counter())
        raise torch.OutOfMemoryError(PEER_OOM_PREFIX + message)

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes

    @property
    def ooms(self) -> int:
        return len(self.oom_times)


class CudaBudget:
    """A real CUDA device made smaller with ``set_per_process_memory_fraction`` (GPU runs only)."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.device = device
        self.total = torch.cuda.get_device_properties(device).total_memory
        self.budget_bytes = budget_bytes
        self._ooms_at_start = 0
        self.oom_times: list[float] = []  # not known on CUDA; ``ooms`` reads the allocator's counter

    def track(self, *objs: Any) -> CudaBudget:
        return self

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        torch.cuda.set_per_process_memory_fraction(min(budget_bytes / self.total, 1.0), self.device)

    def __enter__(self) -> CudaBudget:
        gc.collect()
        torch.cuda.empty_cache()
        self._ooms_at_start = int(torch.cuda.memory_stats(self.device).get("num_ooms", 0))
        self.set_budget(self.budget_bytes)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    @property
    def ooms(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_ooms", 0)) - self._ooms_at_start


def make_budget(budget_bytes: int, device: torch.device) -> PeerVisibleBudget | CudaBudget:
    return CudaBudget(budget_bytes, device) if device.type == "cuda" else PeerVisibleBudget(budget_bytes)


# -- recording what each optimizer step saw --------------------------------------------------------

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

    def steady_rate(self, cpu: bool = False) -> float | None:
        """Samples per second (of wall or of process CPU time) over optimizer steps 2..N of the final
        attempt (step 1 creates the optimizer state)."""
        steps = [s for s in self.train_steps() if s.attempt == self.attempt]
        if len(steps) < 2:
            return None
        elapsed = (steps[-1].cpu - steps[0].cpu) if cpu else (steps[-1].t - steps[0].t)
        return sum(len(s.ids) for s in steps[1:]) / elapsed if elapsed > 0 else None


# -- one system's run -------------------------------------------------------------------------------

@dataclass
class Context:
    workload: Workload
    data: Batch
    base: nn.Module
    budget_bytes: int
    steps: int
    device: torch.device
    truly_fits: int
    drop: tuple[int, int] | None = None  # (after this many steps, new budget bytes)


@dataclass
class RunResult:
    micro_batch: int | None = None  # in force at the end
    planned_micro: int | None = None  # what the finder chose, where it differs
    find_steps: int | None = None
    find_time_s: float | None = None
    find_ooms: int | None = None
    train_ooms: int = 0
    error: str | None = None
    model: nn.Module | None = None
    notes: list[str] = field(default_factory=list)
    recorder: Recorder | None = None
    wall_s: float = 0.0


def _slice(data: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in data.items()}


def _on(batch: Batch, device: torch.device) -> Batch:
    """The micro-batch as the step's device holds it: on CUDA a copy made by ``.to``; on CPU a clone,
    so that the emulated device pays for it as the peers pay for their collated micro-batches (slices
    of the data are views and would cost nothing)."""
    return {k: v.to(device) if device.type == "cuda" else v.clone() for k, v in batch.items()}


def _mean_loss(recorder: Recorder) -> Callable[[nn.Module, Batch], torch.Tensor]:
    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        recorder.forward(batch)
        total, count = loss_sum(model, batch)
        return total / count
    return loss


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


class GlobalBatchIterable:
    """Global batches of ``target`` samples in data order (autoaccum's ``fit`` takes them as given)."""

    def __init__(self, data: Batch, target: int, steps: int) -> None:
        self.data, self.target, self.steps = data, target, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Batch]:
        for k in range(self.steps):
            yield _slice(self.data, k * self.target, (k + 1) * self.target)


def run_autoaccum(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    w = ctx.workload
    model = recorder.watch_model(copy.deepcopy(ctx.base).to(ctx.device))
    optimizer = _optimizer(model)
    recorder.watch_optimizer(optimizer)

    def pair_loss(m: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        recorder.forward(batch)
        # (sum, count): autoaccum divides the step once by its item count. On CPU the guard's move to the
        # device is a no-op, so the micro-batch is copied here, as the peers' loaders copy theirs.
        return loss_sum(m, batch if ctx.device.type == "cuda" else _on(batch, ctx.device))

    first = _slice(ctx.data, 0, w.target_batch)
    result = RunResult(model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The probe enforces the same budget with its own counter (an emulated device on CPU).
        report = autoaccum.probe(model=model, loss_fn=pair_loss, make_batch=lambda b: _slice(first, 0, b),
                                 optimizer=optimizer, target_batch=w.target_batch, budget=ctx.budget_bytes)
        result.find_steps, result.find_time_s, result.find_ooms = report.probe_steps, report.wall_time_s, \
            report.probe_ooms
        recorder.phase = "train"
        recorder.new_attempt()
        budget.track(model, optimizer)
        with budget:
            fitted = autoaccum.fit(model, GlobalBatchIterable(ctx.data, w.target_batch, ctx.steps), w.target_batch,
                                   loss_fn=pair_loss, optimizer=optimizer, plan=report, max_steps=ctx.steps,
                                   epochs=None, device=ctx.device, progress=False)
    result.micro_batch, result.planned_micro = fitted.final_plan.micro_batch, report.plan.micro_batch
    result.train_ooms = fitted.oom_events
    result.notes.append(f"probe: largest fitting micro-batch {report.max_fitting_micro_batch} under "
                        f"{autoaccum.format_bytes(report.usable_bytes)} (budget less {report.headroom:.0%} headroom); "
                        f"plan {report.plan.describe()}; final {fitted.final_plan.describe()}")
    result.notes.extend(f"plan change: {c.describe()}" for c in fitted.plan_changes)
    result.notes.extend(f"warning: {str(c.message)[:90]}..." for c in caught if "BatchNorm" in str(c.message))
    return result


def run_hand(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    """nanoGPT-style: ``loss / accum_steps``; a fixed micro-batch chosen by an informed user."""
    target = ctx.workload.target_batch
    micro = max(m for m in (2 ** k for k in range(20)) if m <= ctx.truly_fits and target % m == 0)
    accum = target // micro
    model = recorder.watch_model(copy.deepcopy(ctx.base).to(ctx.device))
    optimizer = _optimizer(model)
    recorder.watch_optimizer(optimizer)
    loss_fn = _mean_loss(recorder)
    recorder.phase = "train"
    recorder.new_attempt()
    budget.track(model, optimizer)
    result = RunResult(micro_batch=micro, find_steps=0, find_time_s=0.0, find_ooms=0, model=model)
    try:
        with budget:
            for step in range(ctx.steps):
                for a in range(accum):
                    start = step * target + a * micro
                    loss = loss_fn(model, _on(_slice(ctx.data, start, start + micro), ctx.device)) / accum
                    loss.backward()
                    del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError as exc:
        result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.notes.append(f"micro {micro} x accum {accum} fixed (largest power of two that fits and divides "
                        f"{target}); no OOM handling")
    return result


def run_accelerate(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    target = ctx.workload.target_batch
    accelerator = Accelerator(cpu=ctx.device.type == "cpu")
    dataset = _Rows(ctx.data)
    holder: dict[str, Any] = {}
    recorder.phase = "train"  # the finder is the training run: every attempt trains from the start

    @find_executable_batch_size(starting_batch_size=target)
    def train(batch_size: int) -> None:
        accelerator.free_memory()
        recorder.new_attempt()
        accelerator.gradient_accumulation_steps = max(1, target // batch_size)
        model = recorder.watch_model(copy.deepcopy(ctx.base))
        optimizer = _optimizer(model)
        recorder.watch_optimizer(optimizer)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=_batched)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        holder.update(micro=batch_size, accum=accelerator.gradient_accumulation_steps)
        loss_fn = _mean_loss(recorder)
        steps = 0
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                optimizer.step()
                optimizer.zero_grad()
            del loss
            steps += accelerator.sync_gradients
            if steps == ctx.steps:
                holder["model"] = model  # only the run that finished: a kept failed model would leak
                return

    result = RunResult()
    budget.track()
    try:
        with budget:
            train()
    except Exception as exc:  # noqa: BLE001 - how the peer fails is the result
        result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.model = accelerator.unwrap_model(holder["model"]) if "model" in holder else None
    result.micro_batch = holder.get("micro")
    _finder_cost(result, recorder, budget)
    result.notes.append(f"micro {holder.get('micro')} x accum {holder.get('accum')} (accum = target // micro); "
                        f"finder: starting_batch_size={target}, x0.9 per OOM, restarts training")
    return result


class _Rows(torch.utils.data.Dataset):
    """The data as a map-style dataset for the peers' DataLoaders, fetched a batch at a time.

    ``__getitems__`` (torch >= 2.0) gathers a whole micro-batch with one index per tensor, and
    :func:`_batched` passes it through, so the peers pay one copy per micro-batch (as autoaccum and the
    hand loop do) instead of the per-sample Python of ``default_collate`` over dict rows."""

    def __init__(self, data: Batch) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data["ids"])

    def __getitem__(self, i: int) -> Batch:
        return {k: v[i] for k, v in self.data.items()}

    def __getitems__(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices)
        return {k: v[index] for k, v in self.data.items()}


def _batched(batch: Batch) -> Batch:
    """The collate function for :class:`_Rows`: the batch is already gathered."""
    return batch


def _finder_cost(result: RunResult, recorder: Recorder, budget: Any) -> None:
    """For peers whose finder IS the training run: everything before the final attempt, plus the OOMs
    of the final attempt's first step."""
    final_start = recorder.attempt_starts[-1] if recorder.attempt_starts else time.perf_counter()
    earlier = [s for s in recorder.steps if s.attempt < recorder.attempt]
    failed_attempts = max(recorder.attempt - 1, 0)
    result.find_steps = len(earlier) + failed_attempts  # completed steps of abandoned runs + each failing one
    result.find_time_s = final_start - (recorder.attempt_starts[0] if recorder.attempt_starts else final_start)
    result.find_ooms = sum(1 for t in budget.oom_times if t < final_start) if budget.oom_times else failed_attempts


def run_lightning(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    target = ctx.workload.target_batch
    dataset = _Rows(ctx.data)
    loss_fn = _mean_loss(recorder)

    class Module(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model
            self.batch_size = 2

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = _optimizer(self.model)
            recorder.watch_optimizer(optimizer)
            return optimizer

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=False,
                                               collate_fn=_batched)

    def trainer(**kwargs: Any) -> pl.Trainer:
        return pl.Trainer(accelerator="gpu" if ctx.device.type == "cuda" else "cpu", devices=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=tempfile.mkdtemp(prefix="compare-lightning-"), **kwargs)

    module = Module(recorder.watch_model(copy.deepcopy(ctx.base)))
    result = RunResult()
    budget.track(module)
    started = time.perf_counter()
    with budget:
        found = Tuner(trainer(max_steps=ctx.steps)).scale_batch_size(module, mode="binsearch", max_val=target)
        result.find_time_s = time.perf_counter() - started
        result.find_ooms = budget.ooms
        result.find_steps = len([s for s in recorder.steps if s.phase == "find"]) + budget.ooms
        micro = int(found or module.batch_size)
        accum = max(1, target // micro)
        module.batch_size = micro
        recorder.phase = "train"
        recorder.new_attempt()
        recorder.watch_model(module.model)  # restored from the tuner's checkpoint: training starts here
        try:
            trainer(max_steps=ctx.steps, accumulate_grad_batches=accum).fit(module)
        except Exception as exc:  # noqa: BLE001 - how the peer fails is the result
            result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.micro_batch, result.model = micro, module.model
    result.notes.append(f"micro {micro} x accum {accum} (binsearch, 5% margin; accum = target // micro in a "
                        f"second Trainer)")
    return result


def run_transformers(ctx: Context, recorder: Recorder, budget: Any) -> RunResult:
    import transformers
    from transformers import Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    target = ctx.workload.target_batch

    def token_loss(outputs: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        total = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                reduction="sum")
        return total / (num_items_in_batch if num_items_in_batch is not None else labels.ne(-100).sum())

    class BenchTrainer(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)  # the reference's order

        def _inner_training_loop(self, batch_size: int | None = None, *args: Any, **kwargs: Any) -> Any:
            recorder.new_attempt()
            holder["micro"] = batch_size
            return super()._inner_training_loop(batch_size, *args, **kwargs)

        def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
            optimizer = super().create_optimizer(*args, **kwargs)
            recorder.watch_optimizer(self.optimizer)
            return optimizer

        def compute_loss(self, model: nn.Module, inputs: Batch, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            recorder.forward(inputs)  # Trainer's own compute_loss, minus the sample ids the model does not take
            outputs = model(inputs["x"])
            loss = self.compute_loss_func(outputs, inputs["labels"], num_items_in_batch=num_items_in_batch)
            return (loss, outputs) if return_outputs else loss

    holder: dict[str, Any] = {}
    model = recorder.watch_model(copy.deepcopy(ctx.base))
    out_dir = tempfile.mkdtemp(prefix="compare-transformers-")
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=target, gradient_accumulation_steps=1,
        auto_find_batch_size=True, max_steps=ctx.steps, learning_rate=LR, weight_decay=0.0, max_grad_norm=0.0,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", report_to="none",
        logging_strategy="no", save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, use_cpu=ctx.device.type == "cpu", seed=0)
    result = RunResult(model=model)
    recorder.phase = "train"
    budget.track(model)
    try:
        with budget:
            BenchTrainer(model=model, args=args, train_dataset=_Rows(ctx.data), data_collator=_batched,
                         compute_loss_func=token_loss).train()
    except Exception as exc:  # noqa: BLE001 - how the peer fails is the result
        result.error = f"crashed: {type(exc).__name__}: {str(exc)[:60]}"
    result.micro_batch = holder.get("micro")
    _finder_cost(result, recorder, budget)
    result.notes.append(f"per_device_train_batch_size {target} -> {holder.get('micro')}, gradient_accumulation_steps "
                        f"1 (fixed); finder x0.9 per OOM, restarts the inner loop keeping weights and optimizer")
    return result


RUNNERS: dict[str, Callable[[Context, Recorder, Any], RunResult]] = {
    "autoaccum": run_autoaccum, "accelerate": run_accelerate, "lightning": run_lightning,
    "transformers": run_transformers, "hand": run_hand,
}


def run_system(system: str, ctx: Context) -> RunResult:
    budget = make_budget(ctx.budget_bytes, ctx.device)
    recorder = Recorder(budget, ctx.drop)
    started = time.perf_counter()
    gc.collect()
    quiet = logging.getLogger("autoaccum")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # plan changes are in the notes
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        try:
            result = RUNNERS[system](ctx, recorder, budget)
        except Exception as exc:  # noqa: BLE001 - a peer failing to run is a result, reported as such
            result = RunResult(error=f"failed: {type(exc).__name__}: {str(exc)[:100]}")
        finally:
            quiet.setLevel(level)
    result.recorder, result.wall_s = recorder, time.perf_counter() - started
    result.train_ooms = max(result.train_ooms, budget.ooms - (result.find_ooms or 0)) \
        if system != "autoaccum" else result.train_ooms
    return result


# -- budget, brute force and the reference ------------------------------------------------------------

def accumulated_steps(ctx: Context, micro: int, budget: Any, steps: int = 2, accumulate: bool = True) -> None:
    """Two AdamW steps, each accumulating two micro-batches of ``micro`` (one when ``micro`` is the target,
    or without ``accumulate``). The second micro-batch's forward runs with the first one's gradients
    alive: an accumulation step needs more memory than a lone step of the same micro-batch."""
    target = ctx.workload.target_batch
    model = copy.deepcopy(ctx.base).to(ctx.device)
    optimizer = _optimizer(model)
    budget.track(model, optimizer)
    parts = 1 if micro >= target or not accumulate else 2
    with budget:
        for step in range(steps):
            for a in range(parts):
                start = (step * parts + a) * micro
                total, count = loss_sum(model, _on(_slice(ctx.data, start, start + micro), ctx.device))
                (total / count / parts).backward()
                del total
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


class _NoBudget(contextlib.nullcontext):
    def track(self, *objs: Any) -> _NoBudget:
        return self


def peak_bytes(ctx: Context, micro: int) -> int:
    if ctx.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        accumulated_steps(ctx, micro, _NoBudget())
        return int(torch.cuda.max_memory_reserved(ctx.device))  # the fraction caps reserved memory
    meter = TrackedMemory()
    accumulated_steps(ctx, micro, meter)
    return meter.peak_bytes


def budget_for(ctx: Context, micro: int) -> int:
    """Bytes in which a plain accumulation loop fits ``micro`` samples but not ``micro + 1``."""
    low, high = peak_bytes(ctx, micro), peak_bytes(ctx, micro + 1)
    return (low + high) // 2 if high > low else low


def fits(ctx: Context, micro: int, budget_bytes: int, accumulate: bool = True) -> bool:
    if ctx.device.type == "cuda":  # the counter of a CPU run sees only its own tensors; a GPU sees all
        gc.collect()
    budget = make_budget(budget_bytes, ctx.device)
    try:
        accumulated_steps(ctx, micro, budget, accumulate=accumulate)
    except torch.OutOfMemoryError:
        return False
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return True


def brute_force(ctx: Context, budget_bytes: int, accumulate: bool = True) -> tuple[int, int]:
    """The largest micro-batch that runs two accumulated AdamW steps under the budget (doubling, then
    bisection), and how many sizes were tried. ``accumulate=False``: two lone steps of that size."""
    target = ctx.workload.target_batch
    tried = 0
    lo, hi = 0, None
    size = 1
    while hi is None:
        tried += 1
        if fits(ctx, size, budget_bytes, accumulate):
            lo = size
            if size >= target:
                return target, tried
            size = min(size * 2, target)
        else:
            hi = size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tried += 1
        lo, hi = (mid, hi) if fits(ctx, mid, budget_bytes, accumulate) else (lo, mid)
    return lo, tried


def reference(ctx: Context) -> nn.Module:
    """Full-batch training: one forward/backward on all ``target`` samples per step (item-weighted mean).

    On CUDA the full batch of the ``gpu`` models does not fit even the whole device: there the loss sums
    of chunks are accumulated and divided once by the step's item count (exact, but for BatchNorm)."""
    target = ctx.workload.target_batch
    chunk = target if ctx.device.type != "cuda" else max(ctx.truly_fits, 1)
    model = copy.deepcopy(ctx.base).to(ctx.device)
    optimizer = _optimizer(model)
    for step in range(ctx.steps):
        count = int(ctx.data["labels"][step * target:(step + 1) * target].ne(-100).sum())
        for start in range(step * target, (step + 1) * target, chunk):
            total, _ = loss_sum(model, _on(_slice(ctx.data, start, min(start + chunk, (step + 1) * target)),
                                           ctx.device))
            (total / count).backward()
            del total
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def param_diff(model: nn.Module | None, ref: nn.Module, init: nn.Module) -> tuple[float, float] | None:
    """(max rel diff to the reference, max diff relative to the reference's update), over tensors."""
    if model is None:
        return None
    rel = upd = 0.0
    for p, r, p0 in zip(model.parameters(), ref.parameters(), init.parameters(), strict=True):
        p, r, p0 = p.detach().cpu().double(), r.detach().cpu().double(), p0.detach().cpu().double()
        diff = (p - r).abs().max().item()
        rel = max(rel, diff / max(r.abs().max().item(), 1e-30))
        upd = max(upd, diff / max((r - p0).abs().max().item(), 1e-30))
    return rel, upd


# -- the whole comparison ------------------------------------------------------------------------------

@dataclass
class Config:
    size: str = "cpu"
    models: tuple[str, ...] = ("mlp", "gpt", "cnn")
    systems: tuple[str, ...] = SYSTEMS
    steps: int = 6
    drop_after: int = 2
    drop_fraction: float = 0.45
    device: str = "cpu"
    dtype: str = "float64"  # exactness is checked to ~1e-12 in fp64; in fp32, Adam turns rounding noise in
    # gradients that are zero in exact arithmetic (e.g. attention key biases) into full-size updates
    runtime_oom: bool = True
    threads: int = 1
    budget_gib: float | None = None  # a fixed budget (e.g. 16, 24, 40 on a GPU) instead of the calibrated one
    isolate: bool = True  # each system in its own process (see run_isolated)


def available(system: str) -> str | None:
    """None when the system can run, else why not."""
    module = PEER_MODULES.get(system)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - an import failing for any reason means: not available
        return f"not installed or not importable ({type(exc).__name__}: {str(exc)[:80]})"
    return None


@dataclass(frozen=True)
class Setup:
    """What one model's runs share; plain values, so a child process can rebuild the rest from it."""

    size: str
    model: str
    dtype: str
    device: str
    steps: int
    budget_bytes: int
    truly_fits: int
    drop_after: int
    drop_bytes: int
    runtime_oom: bool
    threads: int


def _build(setup: Setup) -> tuple[Workload, Batch, nn.Module, torch.device]:
    """The workload, its data and its seeded model (on the CPU: each system moves its own copy)."""
    w = workloads(setup.size)[setup.model]
    dtype = getattr(torch, setup.dtype)
    data = {k: v.to(dtype) if v.is_floating_point() else v
            for k, v in w.make_data(w.target_batch * setup.steps).items()}
    return w, data, w.make_model().to(dtype), torch.device(setup.device)


def run_pair(system: str, setup: Setup, freeze_gc: bool = False) -> dict[str, Any]:
    """Runs A (clean) and B (budget drop) of one system; the summary row."""
    w, data, base, device = _build(setup)
    ctx = Context(w, data, base, setup.budget_bytes, setup.steps, device, setup.truly_fits)
    ref = reference(ctx)
    if system in PEER_MODULES:
        importlib.import_module(PEER_MODULES[system])
    # Every system's recovery calls gc.collect(); on a slow shared CPU one full collection of the objects
    # that torch and the peers create at import costs 0.3-0.6 s, which would swamp what is measured. Those
    # objects are frozen (never collected, as they never die); what training creates is collected as usual.
    gc.collect()
    if freeze_gc:
        gc.freeze()
    gc_started = time.perf_counter()
    gc.collect()
    gc_s = time.perf_counter() - gc_started
    row = summarise(run_system(system, ctx), ref, base, w.target_batch)
    row["gc_collect_s"] = gc_s  # what one gc.collect() costs in this process (recoveries run it)
    if setup.runtime_oom:
        b_ctx = Context(w, data, base, setup.budget_bytes, setup.steps, device, setup.truly_fits,
                        drop=(setup.drop_after, setup.drop_bytes))
        row["runtime_oom"] = summarise_drop(run_system(system, b_ctx), ref, base, setup.drop_after)
    return row


def run_isolated(system: str, setup: Setup) -> dict[str, Any]:
    """``run_pair`` in a fresh Python process: no peer's imports, singletons (AcceleratorState), global
    seeds or logging settings leak into another's run, and ``gc.collect()`` costs what it costs with
    that system's own imports."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(asdict(setup)),
                           system], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"failed: child exited {proc.returncode}: {tail[:120]}"}
    return json.loads(lines[-1])


def run_workload(name: str, w: Workload, config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device(config.device)
    probe_setup = Setup(config.size, name, config.dtype, config.device, config.steps, 0, 0, 0, 0, False,
                        config.threads)
    _, data, base, _ = _build(probe_setup)
    ctx = Context(w, data, base, 0, config.steps, device, 0)
    budget_bytes = int(config.budget_gib * 2**30) if config.budget_gib else budget_for(ctx, w.micro_target)
    t0 = time.perf_counter()
    truly, tried = brute_force(ctx, budget_bytes)
    lone, _ = brute_force(ctx, budget_bytes, accumulate=False)
    log(f"{name}: {describe_model(base)}; target {w.target_batch}; budget {autoaccum.format_bytes(budget_bytes)}; "
        f"truly fits {truly} when accumulating, {lone} alone ({time.perf_counter() - t0:.1f}s)")
    drop_micro = max(1, round(config.drop_fraction * truly))
    drop_bytes = budget_for(ctx, drop_micro)
    setup = Setup(config.size, name, config.dtype, config.device, config.steps, budget_bytes, truly,
                  config.drop_after, drop_bytes, config.runtime_oom, config.threads)
    out: dict[str, Any] = {
        "model": name, "describe": describe_model(base), "target_batch": w.target_batch, "budget_bytes": budget_bytes,
        "truly_fits": truly, "fits_without_accumulation": lone, "brute_force_sizes_tried": tried,
        "token_level": w.token_level, "batchnorm": w.batchnorm,
        "runtime_drop": {"after_steps": config.drop_after, "budget_bytes": drop_bytes, "fits_micro": drop_micro},
        "note": w.note, "systems": {},
    }
    for system in config.systems:
        why = available(system)
        if why is not None:
            out["systems"][system] = {"error": why}
            log(f"  {system}: {why}")
            continue
        t0 = time.perf_counter()
        row = run_isolated(system, setup) if config.isolate else run_pair(system, setup)
        out["systems"][system] = row
        if "micro_batch" not in row:
            log(f"  {system}: {row.get('error')}")
            continue
        log(f"  {system} ({time.perf_counter() - t0:.0f}s): micro {row['micro_batch']} · find {row['find_steps']} "
            f"steps {_num(row['find_time_s'], '.2f')}s {row['find_ooms']} OOMs · global {row['global_batches']} · "
            f"{_num(row['samples_per_s'], ',.0f')} samples/s · rel diff {_num(row['max_rel_diff'], '.1e')}"
            + (f" · {row['error']}" if row.get("error") else "")
            + (f" · OOM recovery {_num(row['runtime_oom']['recovery_s'], '.2f')}s "
               f"{row['runtime_oom']['outcome']}" if "runtime_oom" in row else ""))
    return out


def summarise(r: RunResult, ref: nn.Module, init: nn.Module, target: int) -> dict[str, Any]:
    rec = r.recorder
    integrity = rec.integrity() if rec else {}
    diff = param_diff(r.model, ref, init) if r.error is None else None
    return {
        "micro_batch": r.micro_batch, "find_steps": r.find_steps, "find_time_s": r.find_time_s,
        "find_ooms": r.find_ooms, "train_ooms": r.train_ooms, "global_batches": integrity.get("global_batches"),
        "target_batch": target, "samples_per_s": rec.steady_rate() if rec and r.error is None else None,
        "samples_per_cpu_s": rec.steady_rate(cpu=True) if rec and r.error is None else None,
        "planned_micro_batch": r.planned_micro,
        "optimizer_steps": integrity.get("steps"), "repeated_samples": integrity.get("repeated_samples"),
        "lost_samples": integrity.get("lost_samples"), "inconsistent_steps": integrity.get("inconsistent_steps"),
        "max_rel_diff": None if diff is None else diff[0], "diff_vs_update": None if diff is None else diff[1],
        "error": r.error, "notes": r.notes, "wall_s": r.wall_s,
    }


def summarise_drop(r: RunResult, ref: nn.Module, init: nn.Module, after: int) -> dict[str, Any]:
    """Run B: the budget dropped after ``after`` optimizer steps; what did the OOM cost?"""
    rec = r.recorder
    assert rec is not None
    integrity = rec.integrity()
    recovery = None
    oom_after_drop = rec.drop_time is not None and (r.train_ooms > 0 or rec.attempt > 1)
    if oom_after_drop and r.error is None:
        final = [s for s in rec.steps if s.phase == "train" and s.attempt == rec.attempt]
        if len(final) > after:
            back = final[after].t  # the final attempt completes the step the OOM struck
            later = [b.t - a.t for a, b in zip(final[after:], final[after + 1:])]
            recovery = back - rec.drop_time - (statistics.median(later) if later else 0.0)
    if r.error is not None:
        outcome = "training stopped (" + r.error.split(":")[0] + ")" + \
            ("" if rec.drop_time is not None else " before the drop")
    elif rec.drop_time is None:
        outcome = "no drop reached"
    elif not oom_after_drop:
        outcome = "no OOM (micro fits the lower budget)"
    else:
        lost, rep, bad = integrity["lost_samples"], integrity["repeated_samples"], integrity["inconsistent_steps"]
        redone = len([s for s in rec.steps if s.phase == "train" and s.attempt < rec.attempt])
        parts = [f"{lost} lost" if lost else "", f"{rep} repeated" if rep else "",
                 f"{bad} steps mixed partial grads" if bad else "",
                 f"restarted, {redone} steps redone" if rec.attempt > 1 else "replayed in place",
                 f"micro -> {r.micro_batch}"]
        outcome = ", ".join(p for p in parts if p) if (lost or rep or bad) else \
            "none lost/repeated; " + ", ".join(p for p in parts if p)
    diff = param_diff(r.model, ref, init) if r.error is None else None
    return {
        "recovery_s": recovery, "outcome": outcome, "micro_batch_after": r.micro_batch, "error": r.error,
        "attempts": rec.attempt, "train_ooms": r.train_ooms, **{k: integrity[k] for k in integrity},
        "max_rel_diff": None if diff is None else diff[0], "diff_vs_update": None if diff is None else diff[1],
        "notes": r.notes,
    }


def _num(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _seconds(value: float | None) -> str:
    """Time lost to the OOM; differences under 10 ms are within the noise of one step."""
    if value is None:
        return ""
    return "<0.01 s · " if value < 0.01 else f"{value:.2f} s · "


def _global(row: dict[str, Any]) -> str:
    sizes = row.get("global_batches")
    if not sizes:
        return "–"
    shown = "/".join(str(s) for s in sizes)
    shown = shown if sizes == [row["target_batch"]] else f"**{shown}** (≠ {row['target_batch']})"
    flaws = [f"{row[k]} {label}" for k, label in (("repeated_samples", "samples repeated"),
                                                  ("lost_samples", "samples lost"),
                                                  ("inconsistent_steps", "steps with partial gradients"))
             if row.get(k)]
    return shown + ("; **" + ", ".join(flaws) + "**" if flaws else "")


def table(results: list[dict[str, Any]]) -> str:
    head = ("| model | system | find: steps · s · OOMs | micro (truly fits: accum; alone) | global / target | "
            "samples/s: wall · CPU | runtime OOM: time lost · samples | rel. diff (A) | Δ/update (A) | "
            "rel. diff after OOM (B) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for res in results:
        for system, row in res["systems"].items():
            if "micro_batch" not in row:
                lines.append(f"| {res['model']} | {system} | {row.get('error', '')} |" + " |" * 7)
                continue
            b = row.get("runtime_oom", {})
            find = "–" if row["find_steps"] is None else \
                f"{row['find_steps']} · {_num(row['find_time_s'], '.2f')} · {row['find_ooms']}"
            if system == "hand":
                find = "0 (picked by hand)"
            if row.get("train_ooms"):
                find += f" (+{row['train_ooms']} OOM in training)"
            planned = row.get("planned_micro_batch")
            micro = f"{planned} → {row['micro_batch']}" if planned not in (None, row["micro_batch"]) \
                else str(row["micro_batch"])
            error = ": ".join(row["error"].split(": ")[:2]) if row["error"] else ""
            rate = "–" if row["samples_per_s"] is None else \
                f"{row['samples_per_s']:,.0f} · {_num(row.get('samples_per_cpu_s'), ',.0f')}"
            lines.append(
                f"| {res['model']} | {system} | {find} | {micro} ({res['truly_fits']}; "
                f"{res['fits_without_accumulation']}) | "
                f"{_global(row) if not error else '**' + error + '**'} | {rate} | "
                f"{_seconds(b.get('recovery_s'))}"
                f"{b.get('outcome', '–')} | {_num(row['max_rel_diff'], '.1e')} | "
                f"{_num(row['diff_vs_update'], '.1e')} | {_num(b.get('max_rel_diff'), '.1e')} |")
    return "\n".join(lines)


def _git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "autoaccum"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes to autoaccum/" if dirty else "")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "autoaccum": f"{autoaccum.__version__} ({_git_head()})"}
    for name in ("accelerate", "lightning", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = "not installed"
    return out


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        import psutil

        cores = f"{psutil.cpu_count(logical=False)} cores / {psutil.cpu_count()} threads"
        mem = f", {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except Exception:  # noqa: BLE001
        cores, mem = "", ""
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ", no GPU"
    load = f"; load average {os.getloadavg()[0]:.1f} at the start" if hasattr(os, "getloadavg") else ""
    return f"{platform.system()} {cpu}, {cores}{mem}{gpu}; torch threads {torch.get_num_threads()}{load}"


def run(config: Config, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The whole comparison; returns the JSON document."""
    started = time.perf_counter()
    all_workloads = workloads(config.size)
    unknown = [m for m in config.models if m not in all_workloads]
    if unknown:
        raise ValueError(f"Invalid models: {unknown}. Allowed values: {', '.join(all_workloads)}")
    bad = [s for s in config.systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"Invalid systems: {bad}. Allowed values: {', '.join(SYSTEMS)}")
    device = torch.device(config.device)
    host = machine(device)
    results = [run_workload(m, all_workloads[m], config, log) for m in config.models]
    return {
        "kind": "autoaccum.compare", "config": {k: (list(v) if isinstance(v, tuple) else v)
                                                for k, v in vars(config).items()},
        "machine": host, "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_time_s": time.perf_counter() - started, "results": results,
    }


READING = """\
Each system trains the same seeded model on the same samples in the same order, at the same target
global batch and memory budget, with AdamW (lr 1e-3, no weight decay, no clipping). Run A is clean;
run B lowers the budget after 2 optimizer steps (to what fits about 45% of the truly-fitting
micro-batch, as when another process takes memory). `benchmarks/compare.py`'s docstring has the
details; every number is also in its JSON output.

How each system behaves, by construction (the numbers below show it):
- **autoaccum**: the probe measures real steps per candidate size and plans micro x accum covering
  the target exactly (weighted last micro-batch); the guard replays a step that ran out of memory on
  the same samples with half the micro-batch. A size that will accumulate is probed as an
  accumulation step (later micro-batches run with the earlier ones' gradients alive), so the plan
  fits as trained; it keeps 10% headroom, spreads the target evenly over the micro-steps, and picks
  among fitting sizes by measured samples/s (ties within 5% to the larger), so its micro-batch is
  below the brute-force limit. After an OOM, halving overshoots to about half the size that fits.
- **accelerate**: `find_executable_batch_size(starting_batch_size=target)` multiplies the batch by
  0.9 after every OOM and restarts the whole training function; with `gradient_accumulation_steps =
  target // micro` the global batch is `micro x accum`, not the target, unless micro divides it.
  `accelerator.backward` divides each micro-batch's *mean* loss by the accumulation steps: exact for
  equal micro-batches of a per-sample loss, not for a token-level loss on padded sequences.
- **lightning**: the tuner's binsearch runs 3 lone steps per trial (accumulation 1), keeps 95% of the
  largest success, and the accumulation must be fixed in a second Trainer; Lightning also divides mean
  losses by `accumulate_grad_batches`. An OOM during `fit` ends training.
- **transformers**: `auto_find_batch_size` multiplies `per_device_train_batch_size` by 0.9 per OOM with
  `gradient_accumulation_steps` fixed, so the global batch becomes the micro-batch. A retry restarts
  the inner loop from the first sample but keeps the model's weights and the optimizer from the failed
  attempt (samples repeated); an OOM inside the first `optimizer.step()` leaves AdamW's state half
  created, and the retry dies with `KeyError: 'exp_avg_sq'`. Its token-count path (`num_items_in_batch`)
  is exact but only ever sees one micro-batch per step here.
- **hand**: a nanoGPT-style loop (`loss / accum_steps`) with the largest power-of-two micro-batch that
  divides the target and truly fits (an informed user's pick; its cost is not counted). No OOM handling.
- **BatchNorm (cnn)**: each micro-batch normalises with its own statistics, so no system that
  accumulates can match the full-batch reference there (autoaccum warns about it); the differences in
  that column measure micro-batch size and global batch, not exactness.
"""

COLUMNS = (
    "Columns: *find* = training steps started, wall seconds and OOMs spent finding the micro-batch "
    "(accelerate/transformers: every failed attempt of the training run; a step that ran out of memory counts "
    "as one); *micro* = the micro-batch trained with (planned → final where an OOM changed it); *truly fits* = "
    "brute force under the same budget: a plain loop accumulating two micro-batches per AdamW step, and a lone "
    "step of that size (no accumulation); *global* = samples per optimizer step actually trained (bold where it "
    "is not the target), with samples the final model saw twice; *samples/s* = optimizer steps 2..N of the final "
    "run, per second of wall time and of process CPU time (one thread: on a shared machine CPU time is the "
    "steadier cost), the emulated device's per-op cost included; *runtime OOM* = run B: wall time lost beyond a "
    "normal step until the step that failed is done, and what happened to the samples (ids recorded per "
    "optimizer step from post-accumulate-grad hooks on every parameter); *rel. diff* = max over tensors of "
    "|p - ref|∞ / |ref|∞ against full-batch training on the same samples (fp64); *Δ/update* = the same "
    "difference relative to the reference's own change from the initial weights (1.0 = as large as the "
    "training itself)."
)


def _subsection_key(doc: dict[str, Any]) -> str:
    device = doc["config"]["device"]
    return "### CPU, emulated budget" if device == "cpu" else f"### {doc['machine'].split(', ')[-1]} ({device})"


def write_section(doc: dict[str, Any], command: str, path: Path = RESULTS) -> None:
    """Replace (or add) this benchmark's section of RESULTS.md, and in it the subsection of this
    device (a GPU run's table goes beside the CPU one); other sections stay as they are."""
    v = doc["versions"]
    key = _subsection_key(doc)
    sub = "\n".join([
        key, "",
        f"Command: `{command}` · {doc['date']} · {doc['machine']}",
        f"Versions: python {v['python']}, torch {v['torch']}, autoaccum {v['autoaccum']}, accelerate "
        f"{v['accelerate']}, lightning {v['lightning']}, transformers {v['transformers']} · "
        f"{doc['config']['dtype']} · {doc['config']['steps']} optimizer steps per run · wall time "
        f"{doc['wall_time_s']:.0f} s", "",
        "Models and budgets (on CPU the peers see `CUDA out of memory.` at the front of the emulated OOM's "
        "message): " + "; ".join(
            f"{r['model']}: {r['describe']}, target {r['target_batch']}, budget "
            f"{autoaccum.format_bytes(r['budget_bytes'])}, dropping to "
            f"{autoaccum.format_bytes(r['runtime_drop']['budget_bytes'])} after {r['runtime_drop']['after_steps']} "
            f"steps" for r in doc["results"]), "",
        table(doc["results"]), "",
    ])
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find(SECTION)
    subsections: dict[str, str] = {}
    if start != -1:
        nxt = text.find("\n## ", start + len(SECTION))
        body = text[start:nxt + 1 if nxt != -1 else len(text)]
        before, after = text[:start], text[nxt + 1:] if nxt != -1 else ""
        for part in body.split("\n### ")[1:]:
            subsections["### " + part.split("\n", 1)[0]] = "### " + part.rstrip("\n") + "\n"
    else:
        before, after = text.rstrip("\n") + "\n\n", ""
    subsections[key] = sub
    cpu_first = sorted(subsections, key=lambda k: (not k.startswith("### CPU"), k))
    section = "\n".join([SECTION, "", READING, COLUMNS, ""] + [subsections[k].rstrip("\n") + "\n" for k in cpu_first])
    text = before + section + ("\n" + after if after else "")
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "cpu", "gpu"), default="cpu")
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt", "cnn"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=None,
                        help="parameter dtype (default float64 on CPU, float32 on CUDA)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on CPU (default 1: stable timings on a shared machine)")
    parser.add_argument("--no-runtime-oom", action="store_true", help="skip run B (the budget drop)")
    parser.add_argument("--json-only", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="fixed memory budget in GiB for every model (e.g. 16, 24, 40 to emulate those cards on "
                             "a GPU); default: calibrated per model so a plain loop fits about a fifth of the target")
    parser.add_argument("--in-process", action="store_true", help="run every system in this process")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one system's runs, JSON out
    args, rest = parser.parse_known_args(argv)
    if args.child is not None:
        return _child(Setup(**json.loads(args.child)), rest[0])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.device == "cuda":  # an index: set_per_process_memory_fraction refuses a bare "cuda"
        args.device = "cuda:0"
    if args.steps < MIN_STEPS:
        parser.error(f"--steps must be >= {MIN_STEPS} (the budget drops after 2 steps; steady state needs more)")
    config = Config(size=args.size, models=tuple(args.models), systems=tuple(args.systems), steps=args.steps,
                    device=args.device, runtime_oom=not args.no_runtime_oom,
                    dtype=args.dtype or ("float32" if args.device.startswith("cuda") else "float64"),
                    threads=args.threads, isolate=not args.in_process, budget_gib=args.budget_gib)
    if config.device == "cpu":
        torch.set_num_threads(args.threads)
    log = (lambda s: None) if args.json_only else (lambda s: print(s, file=sys.stderr, flush=True))
    doc = run(config, log)
    if not args.json_only:
        print(table(doc["results"]))
        print()
    print(json.dumps(doc, indent=2, default=str))
    if not args.no_write:
        write_section(doc, "python benchmarks/compare.py" + ("" if argv is None and len(sys.argv) == 1
                                                              else " " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv)))
    return 0


def _child(setup: Setup, system: str) -> int:
    if setup.device == "cpu":
        torch.set_num_threads(setup.threads)
    print(json.dumps(run_pair(system, setup, freeze_gc=True), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
