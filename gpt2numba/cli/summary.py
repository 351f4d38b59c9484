"""The figures of the commands' one-line summaries on stderr: a rate only where there was work and a time, a noun
plural by its count."""

from __future__ import annotations


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
