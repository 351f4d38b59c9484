"""The command line, gpt2numba generate | check | score | serve | bench: commands.py (every flag, and the
commands but generate), generate.py (generate's work), summary.py (the figures of the summaries on stderr)."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
