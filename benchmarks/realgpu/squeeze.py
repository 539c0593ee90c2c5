"""The squeeze a row runs under, leaving this process ``budget_bytes`` to use.

- ``process`` (on CUDA): a second process holds the rest of the card, as another job would; autoaccum
  is given no budget and reads its default (what is free to it).
- ``budget`` (the CPU smoke run): an explicit ``budget=``, enforced by the tracked counter (an emulated
  OOM at the crossing), the only squeeze a CPU has.
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["SqueezeKind", "Squeezed", "release", "squeeze"]

SqueezeKind = Literal["process", "budget"]

#: the other process: takes its CUDA context, then holds the bytes it is told until its stdin closes
_HOLDER = """
import sys, torch
device = torch.device(sys.argv[1])
torch.empty(1, device=device)
print("ready", flush=True)
block = torch.empty(int(sys.stdin.readline()), dtype=torch.uint8, device=device)
print("holding", flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class Squeezed:
    """What a squeeze gives the runs inside it."""

    kind: SqueezeKind  # ``process`` or ``budget``
    true_budget_bytes: int  # what this process can really use (the reference's budget)
    probe_budget: int | None  # the ``budget=`` autoaccum is given (None: its default)
    emulate: bool  # the tracked counter enforces ``true_budget_bytes`` (CPU)
    enforced_by: str  # how an overrun shows (a real OOM, an emulated one, or only the peak)


def release(device: torch.device, collect: bool = True) -> None:
    """Free what earlier runs left: a collection (unless ``collect`` is False: reference counting freed it
    all), and on CUDA the allocator's cached blocks."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _free_to_us(device: torch.device) -> int:
    """What this process can use now: free device memory plus its own allocator's reserve."""
    return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device))


def _expect(proc: subprocess.Popen, word: str) -> None:
    line = proc.stdout.readline().strip() if proc.stdout is not None else ""
    if line != word:
        raise RuntimeError(f"the memory-holding process did not say {word!r} (said {line!r}, exit code "
                           f"{proc.poll()}); is the card shared or too small?")


@contextlib.contextmanager
def _other_process(device: torch.device, budget_bytes: int) -> Iterator[int]:
    """A second process holds all but ``budget_bytes`` of what this process could use; yields what is left."""
    release(device)
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(device)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        _expect(proc, "ready")  # its CUDA context is in place: what is free now is what it can take
        hold = _free_to_us(device) - budget_bytes
        if hold <= 0:
            raise RuntimeError(f"only {_free_to_us(device)} bytes are free; cannot leave {budget_bytes}")
        proc.stdin.write(f"{hold}\n")  # type: ignore[union-attr] - a pipe, as asked
        proc.stdin.flush()  # type: ignore[union-attr]
        _expect(proc, "holding")
        yield _free_to_us(device)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def squeeze(kind: SqueezeKind, budget_bytes: int, device: torch.device) -> Iterator[Squeezed]:
    """Run the block under squeeze ``kind`` leaving ``budget_bytes`` (see the module docstring)."""
    if (kind == "process") != (device.type == "cuda"):
        raise ValueError(f"Invalid squeeze {kind!r} on {device.type}: the other process needs CUDA, and on CUDA "
                         f"nothing enforces a budget (use 'process')")
    if kind == "process":
        with _other_process(device, budget_bytes) as left:
            yield Squeezed(kind, left, None, False, "a real OOM (another process holds the rest of the card)")
    else:
        try:
            yield Squeezed(kind, budget_bytes, budget_bytes, True, "an emulated OOM (the tracked counter)")
        finally:
            release(device)
