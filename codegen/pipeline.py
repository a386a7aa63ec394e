"""The code generator as one pipeline: a part of a traced kernel → a lowered kernel.

Stages, in order (each a function below; data flows one way):

1. :func:`select` — the part exists and the kernel is traced;
2. :func:`match` — the recipes for the part's role (``recipes.RECIPES``), highest priority
   first; the first whose matcher accepts the part wins. Each matcher runs once; when none
   accepts, the error is the refusal of the one recipe made for this kind of part (at the
   user's line), or every recipe's reason. Where a matcher names the recipe made for the part
   (``NotApplicable.made_for``) and that recipe refuses it too, the general lowering taking it,
   that is a fallback as in 3;
3. :func:`plan` — the winning recipe chooses its configuration from the match, the schedules
   and the options: tiles, stages, shared memory, the kernel's ABI (parameters, TMA boxes).
   When the planner refuses (a tile its template cannot run, say), :func:`fall_back` gives the
   part to the role's last recipe, the general lowering, when its matcher accepts it (the
   refusal stays on the lowered kernel, ``declined``, and is a ``FallbackWarning`` at the part's line);
4. :func:`render` — the recipe fills its template, every IR op inside it rendered by the
   rules (``rules.scalars``, ``rules.primitives``);
5. compile (``LoweredKernel.compile`` → ``toolchain``): NVRTC, content-addressed cache.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ..errors import FallbackWarning
from ..ir import core
from ..ir.location import user_location
from .errors import LoweringError, NotApplicable
from .recipes import RECIPES, Recipe


@dataclass
class Selected:
    """What :func:`match` found: the recipe and its match, plus why the others declined."""
    kernel: core.Kernel
    part: core.Part
    recipe: Recipe
    match: Any
    declined: list[tuple[str, LoweringError]] = field(default_factory=list)


def select(kernel: core.Kernel, part: str | core.Part) -> core.Part:
    """Stage 1: the part to lower (a LoweringError naming the parts when there is no such part)."""
    if not isinstance(kernel, core.Kernel):
        raise LoweringError(f"lower() takes a traced kernel (a tldsl IR Kernel), got {type(kernel).__name__}: "
                            f"trace it first — kernel_fn.trace(world_size, *tensor_specs, compute=..., comm=...) "
                            f"— or take result.kernel from tl.simulate(...)")
    names = [q.name for q in kernel.parts]
    if isinstance(part, core.Part) and any(part is q for q in kernel.parts):
        return part
    if isinstance(part, str) and part in names:
        return kernel.part(part)
    raise LoweringError(f"kernel '{kernel.name}' has no part {part!r}; its parts: "
                        + ", ".join(f"'{q.name}' ({q.role})" for q in kernel.parts)
                        + " — pass a part's name or one of kernel.parts")


def match(kernel: core.Kernel, part: core.Part, recipes=RECIPES) -> Selected:
    """Stage 2: the first recipe, by priority, whose matcher accepts ``part``."""
    if part.fused:
        owner = next(q.name for q in kernel.parts if q.role == "compute")
        raise LoweringError(f"part '{part.name}' is fused into compute part '{owner}' (the schedule's choice): "
                            f"it is no kernel of its own — lower '{owner}', whose kernel does its work", part.loc)
    declined: list[tuple[str, LoweringError]] = []
    for recipe in sorted((r for r in recipes if r.role == part.role), key=lambda r: -r.priority):
        try:
            m = recipe.match(kernel, part)
        except LoweringError as e:
            declined.append((recipe.name, e))
            continue
        return Selected(kernel, part, recipe, m, declined)
    relevant = [(name, e) for name, e in declined if not isinstance(e, NotApplicable)]
    if len(relevant) == 1:          # one recipe is for this kind of part: its refusal, at the user's line
        raise relevant[0][1]
    reasons = [f"  {name}: {getattr(e, 'raw_message', str(e))}"
               + (f" ({e.loc.short()})" if getattr(e, "loc", None) is not None else "") for name, e in relevant or declined]
    raise LoweringError(f"no lowering recognises {part.role} part '{part.name}' of kernel '{kernel.name}'"
                        + (":\n" + "\n".join(reasons) if reasons else ""), part.loc)


def plan(sel: Selected, options: dict) -> Any:
    """Stage 3: the recipe's plan (its configuration and ABI) for the match."""
    return sel.recipe.plan(sel.kernel, sel.part, sel.match, **sel.recipe.take(options))


def render(sel: Selected, the_plan: Any):
    """Stage 4: the lowered kernel (CUDA source and host-side description) of a plan, which
    keeps the program it came from (``program``)."""
    lowered = sel.recipe.render(the_plan)
    object.__setattr__(lowered, "program", (sel.kernel, sel.part))   # lowered kernels are frozen
    return lowered


def lower(kernel: core.Kernel, part: str | core.Part, **options):
    """Lower one part of ``kernel``: select → match → plan → render. An option the chosen
    recipe does not take is an error (it would change nothing)."""
    return _lower(kernel, part, options, strict=True)


def lower_all(kernel: core.Kernel, **options) -> dict:
    """Every part of ``kernel`` lowered: {part name: lowered kernel}. One set of options for
    every part: each recipe takes the ones it knows (an option no recipe knows is an error).
    Parts fused into the compute part are lowered with it (they have no entry of their own)."""
    return {p.name: _lower(kernel, p, options, strict=False) for p in kernel.parts if not p.fused}


def _lower(kernel, part, options: dict, strict: bool):
    p = select(kernel, part)
    _check_options(options)
    sel = match(kernel, p)
    ignored = sorted(set(options) - set(sel.recipe.options))
    if strict and ignored:
        raise LoweringError(f"the {sel.recipe.name} recipe lowers part '{p.name}' and takes no option "
                            f"{', '.join(ignored)}; it takes: {', '.join(sorted(sel.recipe.options)) or 'none'}", p.loc)
    # a recipe made for this kind of part refused it at its matcher and the general lowering took it:
    # reported as a planner's refusal is (the part runs, slower than that recipe's template would)
    refused = _made_for_it(sel)
    while True:
        try:
            lowered = render(sel, plan(sel, options))
        except LoweringError as e:
            # the chosen recipe's planner refused (its tiles, say): the general lowering takes the
            # part when it can; else the planner's error
            refused.append((sel.recipe.name, e))
            sel = fall_back(sel, e, options if strict else {})
            if sel is None:
                raise
            continue
        if refused:
            _record_fallback(lowered, p, sel.recipe.name, refused)
        return lowered


def _made_for_it(sel: Selected) -> list[tuple[str, LoweringError]]:
    """When the role's last recipe, the general lowering, accepted ``sel.part``: the refusals of the
    recipes another matcher named as made for it (:attr:`NotApplicable.made_for`); else none. (Most
    matchers refuse most programs outright — "expected one tl.dot" — which is no fallback.)"""
    last = min((r for r in RECIPES if r.role == sel.part.role), key=lambda r: r.priority)
    if sel.recipe is not last:
        return []
    named = {e.made_for for _, e in sel.declined if isinstance(e, NotApplicable) and e.made_for}
    return [(name, e) for name, e in sel.declined if name in named and not isinstance(e, NotApplicable)]


def _record_fallback(lowered, part: core.Part, recipe: str, refused: list[tuple[str, LoweringError]]) -> None:
    """A part the recipe made for it refused to plan, lowered by ``recipe`` instead: the refusals
    go on the lowered kernel (``declined``: its ``describe()`` and HTML show them) and into a
    :class:`~tldsl.errors.FallbackWarning` at the part's line, so a schedule the fast template
    cannot run (too many stages, say) is never silently a slower kernel."""
    reasons = tuple((name, getattr(e, "raw_message", str(e))) for name, e in refused)
    object.__setattr__(lowered, "declined", reasons)
    why = "; ".join(f"the {name} recipe refused: {msg}" for name, msg in reasons)
    message = (f"part '{part.name}' of kernel '{lowered.kernel_name}' is lowered by the {recipe} recipe: {why}. "
               f"It computes the same, without that recipe's template (where the refusal names the schedule, "
               f"another schedule gets the template back)")
    loc = part.loc or user_location()         # the part's line, else the caller's first line outside tldsl
    if loc is None:
        warnings.warn(message, FallbackWarning, stacklevel=2)
    else:       # (with a registry, Python's default filter shows it once per line, not at every tl.run in a loop)
        warnings.warn_explicit(message, FallbackWarning, loc.filename, loc.lineno, registry=_FALLBACKS_SHOWN)


#: the warning registry of the fallback warnings (shown once per part's line and message)
_FALLBACKS_SHOWN: dict = {}


def fall_back(sel: Selected, error: LoweringError, options: dict) -> Selected | None:
    """Stage 2 again after ``sel``'s planner refused the part with ``error``: the role's last
    recipe (the general lowering, which takes any part its matcher accepts) when it is below
    ``sel``'s, accepts the part and takes ``options``; else None. Only the last: a specialised
    recipe between them was made for other programs (and a runtime expects what it builds)."""
    role = [r for r in RECIPES if r.role == sel.part.role]
    last = min(role, key=lambda r: r.priority)
    if last.priority >= sel.recipe.priority or set(options) - set(last.options):
        return None
    try:
        m = last.match(sel.kernel, sel.part)
    except LoweringError:
        return None
    return Selected(sel.kernel, sel.part, last, m, sel.declined + [(sel.recipe.name, error)])


def _check_options(options: dict) -> None:
    known = set().union(*(r.options for r in RECIPES))
    unknown = sorted(set(options) - known)
    if unknown:
        raise LoweringError(f"unknown lowering option(s) {unknown}; the recipes take {sorted(known)}")
