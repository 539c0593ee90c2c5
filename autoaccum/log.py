"""Where autoaccum's messages go when nobody configured logging.

autoaccum logs through ``logging.getLogger("autoaccum.<module>")``. A library normally leaves
handlers to the application, but then a run under a job scheduler (no terminal, no logging
configuration) shows nothing at all. So, as Hugging Face and Lightning do, ``fit`` makes sure its
messages reach stderr: when neither the ``autoaccum`` logger nor the root logger has a handler, it
adds one stream handler to ``autoaccum`` (once per process) and, if the logger's level is unset,
sets INFO. An application's own logging configuration takes precedence; silence it with
``logging.getLogger("autoaccum").setLevel(logging.WARNING)`` or ``fit(..., verbose=False)``.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["ensure_visible", "SHOWN"]

#: set on a record's ``extra`` when the message is already shown on the terminal (above a progress bar)
SHOWN = "autoaccum_shown"


class _NotShownYet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, SHOWN, False)


def ensure_visible() -> None:
    """Give the ``autoaccum`` logger a stderr handler where nothing would show its messages."""
    package = logging.getLogger("autoaccum")
    if package.hasHandlers():  # the application configured logging (here or on the root): its rules apply
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s autoaccum: %(message)s", "%H:%M:%S"))
    handler.addFilter(_NotShownYet())
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)
