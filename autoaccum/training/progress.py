"""What ``fit`` reports while it runs: banner, progress bar, one JSON line per step, summary."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from autoaccum.log import SHOWN
from autoaccum.units import format_bytes

__all__ = ["Progress"]

logger = logging.getLogger("autoaccum.fit")


class Progress:
    """Banner, progress bar, metrics file and summary, from rank 0 only.

    Messages go to the ``autoaccum.fit`` logger (INFO; ``verbose=False`` drops them); on a
    terminal a tqdm bar on stderr shows each step and the messages above it (``progress=False``
    turns the bar off). ``log_file`` gets one JSON line per optimizer step.
    """

    def __init__(self, progress: bool, total: int | None, log_file: str | os.PathLike[str] | None, rank: int,
                 verbose: bool = True) -> None:
        self.rank, self.verbose = rank, verbose
        self.interactive = progress and rank == 0 and sys.stderr.isatty()
        self.bar: Any = None
        if self.interactive:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.log = open(log_file, "a") if log_file is not None and rank == 0 else None  # noqa: SIM115

    def say(self, message: str) -> None:
        if self.rank != 0 or not self.verbose:
            return
        if self.interactive:
            self.bar.write(message, file=sys.stderr)
        # on a terminal the bar showed it: autoaccum's own stderr handler skips it, the application's do not
        logger.info(message, extra={SHOWN: self.interactive})

    def step(self, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        if self.bar is not None:
            peak = record["peak_bytes"]
            self.bar.set_postfix_str(
                f"loss {record['loss']:.4g} · lr {record['lr']:.3g} · {record['samples_per_s']:,.0f} samples/s · "
                f"micro {record['micro_batch']} x accum {record['accum_steps']}"
                + ("" if peak is None else f" · peak {format_bytes(peak)}"), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
