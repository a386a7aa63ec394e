"""argparse types of the commands' numbers: a count of zero or below, or a seed below zero, is a
usage error in one line (exit 2), not a traceback from deep inside the command."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int of at least 1 (a size, a count, a world size)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


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
