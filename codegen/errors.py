"""The one error every stage of the code generator raises, located at the tile program's line."""
from __future__ import annotations

from ..errors import CompilationError


class LoweringError(CompilationError):
    """The tile program (or its schedule) is outside what a lowering handles."""


def fail(what: str, msg: str, at=None) -> LoweringError:
    """A :class:`LoweringError` from stage/recipe ``what`` ("GEMM lowering", ...), pointing at
    ``at``: an IR op or part (its ``loc``), a location, or None."""
    return LoweringError(f"{what}: {msg}", getattr(at, "loc", at))


class NotApplicable(LoweringError):
    """A recipe's matcher saw a part of another kind altogether (another engine, no ``tl.dot``
    where its kernel has one, ...): the pipeline leaves its reason out when another recipe's
    refusal says more about the user's program. ``made_for``: the recipe that *is* made for
    such a part, when the matcher knows it (a GEMM over a stack of experts' weights: the grouped
    GEMM's) — that recipe refusing it too is then a fallback worth a warning."""

    def __init__(self, message: str, loc=None, made_for: str | None = None):
        super().__init__(message, loc)
        self.made_for = made_for


def not_applicable(what: str, msg: str, at=None, made_for: str | None = None) -> NotApplicable:
    """A :class:`NotApplicable` from recipe ``what``, located like :func:`fail`."""
    return NotApplicable(f"{what}: {msg}", getattr(at, "loc", at), made_for)
