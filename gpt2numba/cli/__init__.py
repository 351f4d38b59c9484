"""The command line, gpt2numba generate | check | score | serve | tune | bench: options.py (every flag, and the
words before argparse reads them), commands.py (the commands but generate), generate.py (generate's work),
summary.py (the figures of the summaries on stderr)."""

from .commands import console, main
from .options import build_parser

__all__ = ["build_parser", "console", "main"]
