"""What the benchmarks share: a small MLP and its data, the hand-written training step every benchmark
compares with, a brute-force search for the largest size that fits, a quiet block for measured runs, a
Markdown table, and a command line (``--json-only``, ``--threads`` and a benchmark's own options) that
runs a benchmark and prints its table and one JSON document."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import json
import logging
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from autoaccum.plan.batch import batch_size, map_tensors
from autoaccum.plan.task import check_loss
from autoaccum.precision import autocast

#: the share of the memory a hand-configured step may use: the probe keeps 10% free (its default headroom),
#: so a brute force that compares with it keeps the same
HEADROOM_KEPT = 0.9

Divide = Literal["share", "accum_steps"]


def mlp(in_dim: int, width: int, depth: int = 2, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """The benchmarks' MLP ``in_dim -> width x depth -> 10``, seeded: the same weights every call."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(in_dim, width), act()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), act()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``factory`` after ``torch.manual_seed(0)``: the same weights every call."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return factory()
    return make


def vectors(n: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random inputs of ``width`` features and their labels of 10 classes, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)


def classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy of an ``(inputs, labels)`` batch."""
    return F.cross_entropy(model(batch[0]), batch[1])


def micro_batches(batch: Any, micro: int) -> list[Any]:
    """``batch`` cut into micro-batches of ``micro`` samples (views; the last one may be smaller)."""
    return [map_tensors(batch, lambda t, i=i: t[i:i + micro]) for i in range(0, batch_size(batch), micro)]


def hand_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, parts: Sequence[Any], loss_fn: Callable,
              *, divide: Divide = "share", prepare: Callable[[Any], Any] | None = None,
              dtype: torch.dtype | None = None, no_sync: bool = False) -> torch.Tensor:
    """One optimizer step of the accumulation loop one writes by hand: zero_grad; per micro-batch of
    ``parts`` the loss (forward under autocast to ``dtype``; None: fp32) and its backward; step.

    Each ``.backward()`` adds to ``.grad``, so each loss is weighted for the global batch:
    ``divide="share"``: a mean loss times its micro-batch's share of the step's samples, and a
    ``(loss_sum, num_items)`` pair summed as it is, the gradients divided once by the step's items
    (token-exact, as one full-batch backward; what autoaccum does). ``divide="accum_steps"``: nanoGPT's
    ``loss / accum_steps``, exact only for equal micro-batches of a per-sample mean.

    ``prepare(part)``: the micro-batch as its forward takes it (moved to the device, copied), made just
    before it. ``no_sync``: a DDP model all-reduces during the last backward only. Returns the step's
    loss, detached and not read (reading it is the caller's synchronisation).
    """
    optimizer.zero_grad(set_to_none=True)
    samples = sum(batch_size(part) for part in parts)
    device = next(model.parameters()).device
    step_loss: Any = 0
    items: Any = 0
    for i, part in enumerate(parts):
        window = model.no_sync() if no_sync and i < len(parts) - 1 else contextlib.nullcontext()
        with window:
            with autocast(device, dtype):
                loss, count = check_loss(loss_fn(model, part if prepare is None else prepare(part)))
            if count is not None:
                items = items + count
            elif divide == "accum_steps":
                loss = loss / len(parts)
            else:
                loss = loss * (batch_size(part) / samples)
            loss.backward()
        step_loss = step_loss + loss.detach()
        del loss
    if not isinstance(items, int) or items:  # summed token losses: the step's mean over its items
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(items)
        step_loss = step_loss / items
    optimizer.step()
    return step_loss


def largest_fitting(fits: Callable[[int], bool], upper: int, smallest: int = 1) -> tuple[int, int]:
    """The largest size in ``[smallest, upper]`` for which ``fits(size)`` (0 if none), by doubling from
    ``smallest`` and then bisection, and the number of sizes tried."""
    tried = 1
    if not fits(smallest):
        return 0, tried
    lo, hi = smallest, None
    while hi is None and lo < upper:
        size, tried = min(2 * lo, upper), tried + 1
        lo, hi = (size, None) if fits(size) else (lo, size)
    while hi is not None and hi - lo > 1:
        mid, tried = (lo + hi) // 2, tried + 1
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, tried


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """autoaccum's log lines (plan changes), warnings (the BatchNorm advice, Hugging Face's notes) and printing
    held back during a measured run."""
    logger = logging.getLogger("autoaccum")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows[0]`` is the header; columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it times the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def version_of(module: str) -> str:
    """``module.__version__``, or ``not installed``."""
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return "not installed"


def context() -> dict:
    """Where and when a run was made: the machine, its load, torch, the date, the command."""
    return {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg()[0],
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python", *sys.argv])}


def bench_main(doc: str, run: Callable[[argparse.Namespace], dict], table: Callable[[dict], str],
               options: Callable[[argparse.ArgumentParser], None] | None = None,
               argv: Sequence[str] | None = None) -> int:
    """Parse ``--json-only``, ``--threads`` and the benchmark's own ``options``, ``run(args)``, print the
    table and the JSON document with the run's context."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--json-only", action="store_true", help="print only the JSON document")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steadier timings on a shared machine)")
    if options is not None:
        options(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run(args)
    result.update(context(), total_wall_time_s=time.perf_counter() - started, threads=args.threads)
    if not args.json_only:
        print(table(result))
        print()
    print(json.dumps(result, indent=1, default=str))
    return 0
