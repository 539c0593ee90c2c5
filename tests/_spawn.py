"""Spawning gloo ranks for a test: each rank runs ``fn(rank, world_size, **kwargs)`` in its own
process, bounded by a timeout (a hang fails the test instead of blocking the run); what each rank
returns is saved for the parent to compare, and an exception is written next to it."""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

__all__ = ["TIMEOUT_S", "errors", "results", "spawn"]

TIMEOUT_S = 90  # per spawned run; a healthy one takes a few seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Any, rank: int, world_size: int, port: int, out: str, kwargs: dict) -> None:
    torch.set_num_threads(1)
    import autoaccum.distributed  # noqa: F401 - before the group exists (see autoaccum.distributed.process_group)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        result = fn(rank, world_size, **kwargs)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except BaseException as exc:
        (Path(out) / f"rank{rank}.error").write_text(f"{type(exc).__name__}\n{traceback.format_exc()}")
        raise
    # What the README (Many GPUs: at exit) asks of a script: nothing holding the group (a framework's
    # DDP wrapper in a reference cycle is freed by the collection), then destroy it, which joins gloo's
    # worker threads before the interpreter shuts down.
    del result
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn: Any, tmp_path: Path, *, world_size: int = 2, timeout_s: float = TIMEOUT_S, allow_hang: bool = False,
          **kwargs: Any) -> tuple[list[int | None], float]:
    """Run ``fn(rank, world_size, **kwargs)`` in ``world_size`` gloo processes; (exit codes, seconds).

    A process still alive at the deadline is killed and the test fails (a hang is a failure), unless
    ``allow_hang``: then its exit code is None."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, str(tmp_path), kwargs))
             for rank in range(world_size)]
    started = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, started + timeout_s - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung and not allow_hang:
        pytest.fail(f"ranks {hung} still running after {timeout_s} s: a hang")
    return [None if r in hung else p.exitcode for r, p in enumerate(procs)], time.monotonic() - started


def errors(tmp_path: Path, world_size: int = 2) -> list[str | None]:
    """Per rank: the name of the exception it ended with (then its traceback), or None."""
    files = [tmp_path / f"rank{r}.error" for r in range(world_size)]
    return [f.read_text() if f.exists() else None for f in files]


def results(tmp_path: Path, codes: list[int | None]) -> list[Any]:
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors(tmp_path, len(codes))) if e is not None]
    assert codes == [0] * len(codes) and not failed, "\n".join(failed) or f"exit codes {codes}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(len(codes))]


