"""Where autoaccum's messages go when nobody configured logging.

autoaccum logs through ``logging.getLogger("autoaccum.<module>")``. A library normally leaves
handlers to the application, but then a run under a job scheduler (no terminal, no logging
configuration) shows nothing at all. So, as Lightning does for its own logger, ``fit`` and the
integrations make sure their messages are seen: where the ``autoaccum`` logger's level is unset it is
set to INFO (a root logger at WARNING, as ``logging.basicConfig()`` leaves it in Hugging Face's example
scripts, would drop the plan's banner), and where neither it nor the root logger has a handler, one
stream handler to stderr is added (once per process). An application's handlers and formats apply
(the messages propagate to them); silence autoaccum with
``logging.getLogger("autoaccum").setLevel(logging.WARNING)`` or ``fit(..., verbose=False)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

__all__ = ["SHOWN", "announce", "ensure_visible", "quiet", "rank_level", "user_stacklevel"]

#: set on a record's ``extra`` when the message is already shown on the terminal (above a progress bar)
SHOWN = "autoaccum_shown"


class _NotShownYet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, SHOWN, False)


class _OwnHandler(logging.StreamHandler):
    """The stderr handler ``ensure_visible`` adds (told apart from an application's own handlers)."""


def ensure_visible() -> None:
    """Give the ``autoaccum`` logger a stderr handler where nothing would show its messages."""
    package = logging.getLogger("autoaccum")
    if package.level == logging.NOTSET:  # a level set for autoaccum (WARNING: silenced) is kept
        package.setLevel(logging.INFO)
    if package.hasHandlers():  # the application's handlers (here or on the root) show them, in its format
        return
    handler = _OwnHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s autoaccum: %(message)s", "%H:%M:%S"))
    handler.addFilter(_NotShownYet())
    package.addHandler(handler)


@contextlib.contextmanager
def quiet(enabled: bool = True) -> Iterator[None]:
    """With ``enabled``, autoaccum's INFO messages are dropped for the duration (``fit(verbose=False)``): the
    ``autoaccum`` logger's level is raised to WARNING where it is lower, and put back afterwards. Warnings
    (plan changes) still show."""
    package = logging.getLogger("autoaccum")
    level = package.level
    if not enabled or package.getEffectiveLevel() >= logging.WARNING:
        yield
        return
    package.setLevel(logging.WARNING)
    try:
        yield
    finally:
        package.setLevel(level)


def announce(logger: logging.Logger, message: str, rank: int | None = None) -> None:
    """A line a user should see once, such as a run's plan: logged at INFO on rank 0 (DEBUG on the others,
    ``rank_level``), shown on stderr where logging is not configured (``ensure_visible``). On a terminal
    where autoaccum's own handler shows it and a tqdm bar may be drawn (a framework's), it is written with
    ``tqdm.write``, which redraws the bar below it."""
    level = rank_level(logging.INFO, rank)
    if level != logging.INFO:
        logger.log(level, message)
        return
    ensure_visible()
    own = any(isinstance(h, _OwnHandler) for h in logging.getLogger("autoaccum").handlers)
    shown = own and logger.isEnabledFor(logging.INFO) and "tqdm" in sys.modules and sys.stderr.isatty()
    if shown:
        from tqdm.auto import tqdm

        tqdm.write(f"autoaccum: {message}", file=sys.stderr)
    logger.info(message, extra={SHOWN: shown})


def rank_level(level: int, rank: int | None = None) -> int:
    """``level`` on rank 0, ``DEBUG`` on every other rank: what every rank would log alike (the probe's
    measurements, a plan change the ranks agreed on) is logged once, and still there on the other
    ranks for whoever turns on debug logging. ``rank``: the rank in the group that decided (default:
    this process's rank in ``torch.distributed``, or torchrun's ``RANK`` before a group exists)."""
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return level if rank == 0 else logging.DEBUG


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller that points at the first frame outside
    autoaccum: the user's line, however deep inside the package the warning is raised (Python 3.12's
    ``skip_file_prefixes`` does this; 3.10 and 3.11 lack it). A warning located in the user's code is
    also shown once per call site, not once per process."""
    frame = sys._getframe(1)  # the caller, which calls warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "autoaccum":
        frame = frame.f_back
        level += 1
    return level
