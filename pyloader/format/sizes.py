"""Byte sizes written by people: ``"64M"``, ``"1.5GiB"``, ``"20g"``, ``1 << 26``.

One parser for every size option (``convert --shard-size``, ``cache_limit``, ``cache --limit``,
``memory_budget``), and ``format_size`` to print sizes in the same units.
"""

from __future__ import annotations

import re

# A number, then an optional unit letter, an optional "i" and an optional "B", any case.
# Every unit is a power of 1024: "1M" == "1MiB" == "1MB" == 1 << 20.
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)i?b?\s*", re.IGNORECASE)
_UNITS = " kmgtp"


def parse_size(s: str | int, *, minimum: int = 0) -> int:
    """Bytes from an int or a size string.

    Strings such as ``"123"``, ``"512K"``, ``"64M"``, ``"1.5GiB"``, ``"10GB"``, ``"2t"`` or
    ``"1P"`` (K, M, G, T, P: powers of 1024, any case, optional ``i`` and ``B``; a fraction
    is rounded down to whole bytes).

    Raises ValueError naming ``s`` if it is not a size or is below ``minimum`` (callers
    that need a positive size pass ``minimum=1``).
    """
    if isinstance(s, int) and not isinstance(s, bool):
        value = s
    else:
        m = _SIZE_RE.fullmatch(str(s))
        if not m:
            raise ValueError(f"invalid size {s!r}; use a number of bytes or e.g. 512K, 64M, 20G, 1.5TiB")
        value = int(float(m.group(1)) * (1 << (10 * _UNITS.index(m.group(2).lower() or " "))))
    if value < minimum:
        raise ValueError(f"size {s!r} must be >= {minimum} bytes")
    return value


def format_size(n: int | float) -> str:
    """``n`` bytes as people write sizes, in the units ``parse_size`` reads: ``"512 B"``, ``"78.8 KiB"``, ``"1 MiB"``.

    Exact values print without a fraction; so ``parse_size`` of the output (spaces dropped) is
    within 0.05 of a unit of ``n``.
    """
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            break
        v /= 1024
    if unit == "B" or v == int(v):
        return f"{int(v)} {unit}"
    return f"{v:.1f} {unit}"


__all__ = ["format_size", "parse_size"]
