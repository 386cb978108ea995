"""Message sizes on the command line: ``8,1K,1M,16M`` and ``8:64M[:factor]``."""

from __future__ import annotations

import re

__all__ = ["parse_size", "parse_sizes", "parse_sweep", "format_size"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)

#: Largest message the tool accepts (UCX lengths are size_t; this keeps
#: buffers allocatable).
MAX_SIZE = 1 << 34


def parse_size(text: str) -> int:
    """``"8"`` -> 8, ``"1K"`` -> 1024, ``"16M"`` / ``"16MiB"`` -> 16 MiB.

    Raises
    ------
    ValueError
        For anything else (negative, fractional, unknown unit, too large).
    """
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(
            f"bad size {text!r}: use a byte count with an optional K, M or G "
            "suffix (binary units), e.g. 8, 64K, 1M"
        )
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n > MAX_SIZE:
        raise ValueError(f"bad size {text!r}: at most {format_size(MAX_SIZE)}")
    return n


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (duplicates dropped, order kept).

    Raises
    ------
    ValueError
        For an empty list or a bad size.
    """
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"bad size list {text!r}: no sizes")
    out: list[int] = []
    for p in parts:
        n = parse_size(p)
        if n not in out:
            out.append(n)
    return out


def parse_sweep(text: str) -> list[int]:
    """``LO:HI[:FACTOR]``: LO, LO*FACTOR, ... up to HI (FACTOR defaults to 2).

    Raises
    ------
    ValueError
        For a malformed sweep, LO > HI or a factor below 2.
    """
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"bad sweep {text!r}: use LO:HI or LO:HI:FACTOR, e.g. 8:64M")
    lo, hi = parse_size(parts[0]), parse_size(parts[1])
    factor = 2
    if len(parts) == 3:
        try:
            factor = int(parts[2])
        except ValueError:
            factor = 0
        if factor < 2:
            raise ValueError(f"bad sweep {text!r}: FACTOR must be an integer >= 2")
    if lo > hi:
        raise ValueError(f"bad sweep {text!r}: LO is larger than HI")
    out = []
    n = lo
    while n <= hi:
        out.append(n)
        n = n * factor if n else 1
    if out[-1] != hi:
        out.append(hi)
    return out


def format_size(n: int) -> str:
    """8 -> ``"8"``, 1024 -> ``"1K"``, 1536 -> ``"1536"``, 1<<20 -> ``"1M"``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
