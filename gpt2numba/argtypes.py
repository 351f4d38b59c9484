"""argparse types for the command lines' numbers (gpt2numba's and the benchmark's): each checks its range as
it parses, so a value out of range is refused before anything loads, in a message that argparse starts with
the flag as the user typed it ("argument --top-p: must be in (0, 1], got 2"). tests/test_cli.py
walks every parser and fails on a number flag without one."""

from __future__ import annotations

import argparse
import math


def in_range(kind, low=None, high=None, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite ``kind`` (int or float) in the range, else an error that argparse puts
    after the flag's name ("argument --top-p: must be in (0, 1], got 2"). ``.range`` says it for the tests."""
    name = "an integer" if kind is int else "a number"
    if low is None and high is None:
        text = f"a finite {name.split()[-1]}"
    elif high is None:
        text = f"{'above' if low_open else 'at least'} {low}"
    elif low is None:
        text = f"{'below' if high_open else 'at most'} {high}"
    else:
        text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {name}, got {value!r}") from None
        if (not math.isfinite(number) or low is not None and (number <= low if low_open else number < low)
                or high is not None and (number >= high if high_open else number > high)):
            raise argparse.ArgumentTypeError(f"must be {text}, got {value}")
        return number
    parse.range, parse.bounds = text, (kind, low, high, low_open, high_open)
    return parse


COUNT = in_range(int, 1)  # how many of something: at least 1
