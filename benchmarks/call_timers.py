"""Timing a benchmark's parts by wrapping the functions that do them (cold_probe.py, ddp_parts.py)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

__all__ = ["time_calls"]


def time_calls(targets: dict[str, list[tuple[Any, str]]], spent: dict[str, float],
               sync: Callable[[], None] = lambda: None) -> None:
    """Replace each ``owner.name`` in ``targets`` (part -> its functions) by a wrapper that adds the call's wall
    time to ``spent[part]``, between two ``sync()`` calls (a device's synchronisation, where its work is
    asynchronous). Functions ``owner`` lacks are skipped (an older checkout). For the process's life."""
    for part, functions in targets.items():
        for owner, name in [(o, n) for o, n in functions if hasattr(o, n)]:
            inner = getattr(owner, name)

            def timed(*args: Any, _inner: Callable = inner, _part: str = part, **kwargs: Any) -> Any:
                sync()
                started = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    sync()
                    spent[_part] = spent.get(_part, 0.0) + time.perf_counter() - started
            setattr(owner, name, functools.wraps(inner)(timed))
