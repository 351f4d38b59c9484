"""The figures of the commands' one-line summaries on stderr: a rate only where there was work and a time, a noun
plural by its count."""

from __future__ import annotations

import os
import time
from pathlib import Path


def rate(count: int, seconds: float, unit: str = "tokens") -> str | None:
    """``count`` over ``seconds`` as "N tokens/s" (two figures below 10: 0.087, not 0); None when nothing was done
    or no time passed, so that a summary of no work shows no rate (not 0, nan or 1000000000 tokens/s)."""
    if not count or seconds <= 0:
        return None
    per_second = count / seconds
    return f"{per_second:.0f} {unit}/s" if per_second >= 10 else f"{per_second:.2g} {unit}/s"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, plural but for one: "1 document", "2 documents", "0 documents" (``plural``: a noun's
    own plural, "hypotheses")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def since_start() -> float | None:
    """Seconds since this process started (Linux's start time in /proc, in clock ticks of 10 ms), or None where
    it cannot be read: the part of a command's time spent before the command ran (Python, the imports)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # (field 3 on: the name may hold spaces)
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def start(before_run: float | None, **seconds: float) -> str:
    """Where a command's start went: "imports 0.52 s, weights 0.40 s, tokenizer 0.10 s" (imports: Python's start
    and the imports, before the command ran; left out when unknown)."""
    parts = ({"imports": before_run} if before_run is not None else {}) | seconds
    return ", ".join(f"{name.replace('_', ' ')} {value:.2f} s" for name, value in parts.items())
