"""argparse types of the commands' numbers: a count of zero or below, a seed below zero, or a size
past a command's bound is a usage error in one line (exit 2), not a traceback from deep inside the
command (or a hang)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int of at least 1 (a size, a count, a world size)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def positive_int_at_most(high: int):
    """The argparse type of an int from 1 to ``high``: a size a command allocates from (a world
    size, rows), where a huge number would spin or run out of memory before anything said why."""
    def parse(text: str) -> int:
        value = positive_int(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {text}")
        return value
    parse.__name__ = f"positive int at most {high}"
    return parse


def nonnegative_int(text: str) -> int:
    """An int of at least 0 (a seed, an index)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int of 0 or more, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
