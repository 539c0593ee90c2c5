"""The probe's progress on a terminal: one line on stderr, rewritten as each size is measured.

A probe runs real training steps at a handful of sizes and can take tens of seconds. On a terminal
it shows the sizes measured so far and the one being measured, then clears the line (the report or
the run's banner follows); off a terminal (a log file, a job scheduler) it writes nothing.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, TextIO

from autoaccum.memory.savers import describe_saver
from autoaccum.probe.report import Candidate

__all__ = ["ProbeProgress"]

_SAYS = {"ok": "fits", "over_budget": "over budget", "oom": "out of memory"}


class ProbeProgress:
    """``probe(..., progress=True)``'s line (see the module docstring).

    Args:
        enabled: show it (it is shown only where ``stream`` is a terminal).
        stream: where to write (default: ``sys.stderr`` as it is when the probe starts).
    """

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.stream: Any = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.on = bool(enabled and callable(isatty) and isatty())
        self.started = time.perf_counter()
        self.done: list[str] = []
        self.saver = "none"
        self.shown = False

    def measuring(self, size: int, length: int | None = None) -> None:
        """A size starts."""
        self._show(f"micro-batch {size}{_at(length)}")

    def measured(self, candidate: Candidate) -> None:
        """A size ended (fits, over budget, or out of memory)."""
        says = _SAYS.get(candidate.status, candidate.status)
        self.done.append(f"{candidate.micro_batch}{_at(candidate.length)} {says}")
        self._show(None)

    def measuring_with(self, saver: str) -> None:
        """The sizes are measured again, with ``saver``."""
        self.saver, self.done = saver, []

    def close(self) -> None:
        """Clear the line."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False

    def _show(self, now: str | None) -> None:
        if not self.on:
            return
        head = "autoaccum probe" + ("" if self.saver == "none" else f" (with {describe_saver(self.saver)})")
        tail = f" · measuring {now}" if now else ""
        tail += f" · {time.perf_counter() - self.started:.0f} s"
        width = max(shutil.get_terminal_size().columns - 1, 40)
        done = list(self.done)
        line = f"{head}: {', '.join(done)}{tail}" if done else f"{head}{tail}"
        while len(line) > width and len(done) > 1:  # the latest sizes are the ones worth seeing
            done = done[1:]
            line = f"{head}: ..., {', '.join(done)}{tail}"
        self.stream.write("\r\x1b[K" + line[:width])
        self.stream.flush()
        self.shown = True


def _at(length: int | None) -> str:
    return "" if length is None else f" at length {length}"
