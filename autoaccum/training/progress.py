"""What ``fit`` reports while it runs: banner, progress bar, one JSON line per step (also to the
``report_to`` targets and callbacks, ``autoaccum.training.trackers``), summary.

The metrics file gets one line per optimizer step. A resumed run first cuts the file back to the
checkpoint's step (``truncate_metrics``: the lines of the steps after the checkpoint, which the
resumed run trains again, and a line a kill cut short), so that each step appears once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from autoaccum.jsonio import write_bytes_atomic
from autoaccum.log import SHOWN
from autoaccum.plan.plan import Plan
from autoaccum.training.trackers import Reporter
from autoaccum.units import format_bytes

__all__ = ["Progress", "truncate_metrics"]

logger = logging.getLogger("autoaccum.fit")


class Progress:
    """Banner, progress bar, metrics file and summary, from rank 0 only.

    Messages go to the ``autoaccum.fit`` logger (INFO; ``verbose=False`` drops them); on a
    terminal a tqdm bar on stderr shows each step and the messages above it (``progress=False``
    turns the bar off). ``log_file`` gets one JSON line per optimizer step; ``resumed_at``: the
    checkpoint's step, where the file is cut back to first (``truncate_metrics``).
    """

    def __init__(self, progress: bool, total: int | None, log_file: str | os.PathLike[str] | None, rank: int,
                 verbose: bool = True, resumed_at: int | None = None, reporter: Reporter | None = None) -> None:
        self.rank, self.verbose = rank, verbose
        self.reporter = reporter if reporter is not None else Reporter(None, rank=rank)
        self.interactive = progress and rank == 0 and sys.stderr.isatty()
        self.bar: Any = None
        if self.interactive:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        if log_file is not None and rank == 0 and resumed_at is not None:
            truncate_metrics(log_file, resumed_at)
        self.log = open(log_file, "a") if log_file is not None and rank == 0 else None  # noqa: SIM115

    def say(self, message: str) -> None:
        if self.rank != 0 or not self.verbose:
            return
        if self.interactive:
            self.bar.write(message, file=sys.stderr)
        # on a terminal the bar showed it: autoaccum's own stderr handler skips it, the application's do not
        logger.info(message, extra={SHOWN: self.interactive})

    def step(self, record: dict[str, Any], plan: Plan | None = None) -> None:
        """One optimizer step: its line in the metrics file; on the bar, its numbers and the plan's cut
        (``plan``: the plan in force, ``Plan.describe``; cut by length, the micro-batches this step took)."""
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        self.reporter.step(record)
        if self.bar is not None:
            peak, steps = record["peak_bytes"], record["micro_steps"]
            cut = plan.describe() if plan is not None and plan.tokens is None else \
                f"{steps} micro-batch{'es' if steps != 1 else ''}" + ("" if plan is None else " cut by length")
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4g} · lr {record['lr']:.3g} · {record['samples_per_s']:,.0f} samples/s · "
                f"{cut}" + ("" if peak is None else f" · peak {format_bytes(peak)}"), refresh=False)
            self.bar.update(1)

    def evaluated(self, step: int, loss: float) -> None:
        """An evaluation after the step's metrics were written (the one at the end of the run)."""
        self.reporter.evaluated(step, loss)

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
        self.reporter.close(failed)


def truncate_metrics(path: str | os.PathLike[str], step: int) -> int:
    """Cut the metrics file back to ``step``: drop the lines at its end of steps after ``step`` (and a
    last line a kill cut short), atomically (the file is rewritten whole: temp file, fsync, rename).
    Lines before them (e.g. an earlier run's, appended to the same file) are kept. Returns the
    number of lines dropped; a missing file is left missing.

    Raises:
        ValueError: a whole line at the end of the file is not JSON (the file is not a metrics file: a
            user's notes), which cutting would delete; the file is left as it is.
    """
    path = Path(path)
    if not path.exists():
        return 0
    lines = path.read_bytes().splitlines(keepends=True)
    keep = len(lines)
    while keep:
        line = lines[keep - 1]
        try:
            record = json.loads(line)
        except ValueError:
            if line.endswith(b"\n"):  # a whole line that is not JSON: not ours, and not to be lost
                raise ValueError(
                    f"log_file {str(path)!r} holds a line that is not one of autoaccum's metrics (line {keep}: "
                    f"{line[:60].decode(errors='replace').rstrip()!r}); resuming cuts the file back to step {step}, "
                    f"which would delete it. Give log_file= a file of its own, or move that text out") from None
            keep -= 1  # the last line, torn by a kill mid-write (a complete line ends in a newline)
            continue
        if not line.endswith(b"\n") or isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] > step:
            keep -= 1
            continue
        break
    if keep < len(lines):
        write_bytes_atomic(path, b"".join(lines[:keep]))
        logger.debug("metrics file %s cut back to step %d (%d lines of later steps dropped)", path, step,
                     len(lines) - keep)
    return len(lines) - keep
