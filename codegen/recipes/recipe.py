"""What a recipe is: a matcher, a planner and a renderer for one kind of kernel, with the
priority the pipeline tries it at."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ...ir import core


@dataclass(frozen=True)
class Recipe:
    """One way to lower a part (see :mod:`tldsl.codegen.pipeline`).

    ``match(kernel, part)`` returns the recipe's match or raises LoweringError at the op that
    does not fit; ``plan(kernel, part, match, **options)`` returns its plan; ``render(plan)``
    the lowered kernel. ``options`` names the keyword options ``plan`` takes (``lower_all``
    passes one set to every part; each recipe takes its own)."""
    name: str
    role: str                     # the part role it lowers: "compute" | "comm"
    priority: int                 # tried highest first
    match: Callable[[core.Kernel, core.Part], Any]
    plan: Callable[..., Any]
    render: Callable[[Any], Any]
    options: frozenset[str] = frozenset()
    summary: str = ""

    def run(self, kernel: core.Kernel, part: core.Part, **options):
        """The recipe's stages on ``part`` (match → plan → render), as the pipeline runs them once
        it has chosen this recipe: the matcher's refusal is the error, at the user's line."""
        return self.render(self.plan(kernel, part, self.match(kernel, part), **options))

    def take(self, options: dict) -> dict:
        """The options this recipe's planner takes."""
        return {k: v for k, v in options.items() if k in self.options}

    def __repr__(self) -> str:
        what = f": {self.summary}" if self.summary else ""
        return f"Recipe({self.name!r}, {self.role}, priority {self.priority}{what})"
