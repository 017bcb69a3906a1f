"""Values from the command line: byte sizes (``40GB``, ``512MiB``, ``1e9``) and the eviction
weight alpha (``auto`` or a float >= 0)."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def split_size(text: str | int | float) -> tuple[float, str]:
    """``"1.5GiB"`` -> ``(1.5, "GIB")``; plain numbers have unit ``""``. Raises ValueError."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text), ""
    m = _SIZE.fullmatch(str(text))
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 40GB, 512MiB, 1e9)")
    return float(m.group(1)), m.group(2).upper()


def parse_bytes(text: str | int | float) -> int:
    """``"40GB"`` -> 40e9, ``"1.5GiB"`` -> 1.5 * 2**30; plain numbers are bytes."""
    value, unit = split_size(text)
    return int(value * _UNITS[unit])


#: the alpha that means "tuned online"
AUTO = "auto"


def parse_alpha(text: str | float | None) -> float | None:
    """The FLOP-aware eviction weight: ``"auto"`` or None -> None (tuned online); else a finite
    float >= 0. Raises ValueError for anything else."""
    if text is None or (isinstance(text, str) and text.strip().lower() == AUTO):
        return None
    try:
        alpha = float(text)
    except ValueError:
        raise ValueError(f"alpha must be 'auto' or a number >= 0, got {text!r}") from None
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be 'auto' or a number >= 0, got {text!r}")
    return alpha
