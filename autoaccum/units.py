"""Byte sizes: parse what users type ("8GiB", "8 GB", "8589934592"), print what people read; counts in words."""

from __future__ import annotations

import math
import re

__all__ = ["counted", "format_bytes", "parse_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "budget") -> int:
    """Turn ``8GiB``, ``"8 GB"``, ``8589934592`` or ``"8589934592"`` into a positive number of bytes.

    Decimal units (kB, MB, GB) are powers of 1000, binary units (KiB, MiB, GiB) powers of 1024.

    Raises:
        ValueError: the value is not a size, or not > 0.
        TypeError: the value is neither a number nor a string.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{name} must be a number of bytes or a string like '8GiB', got {type(value).__name__}")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"Invalid {name} {value!r}: expected a number of bytes with an optional unit "
                f"(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '8GiB' or '8589934592'"
            )
        written = match.group(2)
        if len(written) > 1 and written[0].isupper() and written[-1] == "b":  # Gb, Mb: the symbols of bits
            raise ValueError(f"Invalid {name} {value!r}: {written!r} is a unit of bits, not bytes. Write "
                             f"{written[:-1]}B (powers of 1000) or {written[0]}iB (powers of 1024), e.g. '8GiB'")
        number = float(match.group(1)) * _UNITS[unit]
        in_bytes = _UNITS[unit] == 1
    else:
        number, in_bytes = float(value), True
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"Invalid {name} {value!r}: must be at least 1 byte. Allowed range: 1 B ~ any finite size "
                         f"(e.g. '8GiB')")
    if in_bytes and number != int(number):  # '1.5' is 1.5 bytes: a unit left out ('1.4MiB' rounds down)
        raise ValueError(f"Invalid {name} {value!r}: {number:g} bytes is not a whole number of bytes; a number "
                         f"without a unit counts bytes. Give the unit, e.g. '{_digits(value)}GiB' or "
                         f"'{_digits(value)}MiB'")
    return int(number)


def _digits(value: int | float | str) -> str:
    """The number a size was written with, without its unit."""
    match = _PATTERN.match(value) if isinstance(value, str) else None
    return match.group(1) if match else f"{value:g}"  # type: ignore[str-format]


def format_bytes(num_bytes: int | float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, three significant digits."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1023.5 or unit == "TiB":  # 1023.5 KiB and up print as 1 MiB, not "1.02e+03 KiB"
            digits = f"{value:.0f}" if unit == "B" or value >= 100 else f"{value:.3g}"
            return f"{sign}{digits} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``1 step``, ``2 steps`` (``plural``: where adding an s is wrong, e.g. ``passes``)."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
