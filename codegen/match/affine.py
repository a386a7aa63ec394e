"""Affine forms of index expressions, shared by every recipe's matcher.

A form is a dict ``{leaf: coefficient, "": constant}`` over leaves: a name from ``symbols``
(a loop variable, keyed by its value id), ``"pid<axis>"`` for program ids, and — with
``opaque=True`` — any other value itself (a kernel size, a table load), so that two forms can
be subtracted to compare offsets symbolically. Without ``opaque`` a non-affine expression has
no form (None)."""
from __future__ import annotations

from ...ir import core


def _int_const(v: core.Value):
    op = v.owner
    if isinstance(op, core.Op) and op.name == "const":
        val = op.attrs["value"]
        if isinstance(val, int) and not isinstance(val, bool):
            return val
    return None


def _norm(d: dict) -> dict:
    return {k: x for k, x in d.items() if x != 0}


def combine(a: dict, b: dict, sign: int = 1) -> dict:
    """``a + sign * b``, with the leaves in the order they first appear (those of ``a``, then
    the new ones of ``b``): code generated from a form's terms is the same on every run."""
    return _norm({k: a.get(k, 0) + sign * b.get(k, 0) for k in [*a, *(k for k in b if k not in a)]})


def constant(form: dict | None) -> int | None:
    """The form's value when it has no leaves, else None."""
    if form is not None and set(form) <= {""}:
        return form.get("", 0)
    return None


def affine(v: core.Value, symbols: dict[int, str] | None = None, *, opaque: bool = False) -> dict | None:
    """The affine form of scalar ``v`` (see the module docstring)."""
    symbols = symbols or {}
    if v.id in symbols:
        return {symbols[v.id]: 1}
    c = _int_const(v)
    if c is not None:
        return {"": c}
    op = v.owner
    if isinstance(op, core.Op) and op.name == "program_id":
        return {f"pid{op.attrs['axis']}": 1}
    if isinstance(op, core.Op) and op.name == "arith" and op.attrs["op"] in ("add", "sub", "mul"):
        a, b = (affine(x, symbols, opaque=opaque) for x in op.operands)
        if a is not None and b is not None:
            kind = op.attrs["op"]
            if kind in ("add", "sub"):
                return combine(a, b, -1 if kind == "sub" else 1)
            ca, cb = constant(a), constant(b)
            if ca is not None:
                return _norm({k: ca * x for k, x in b.items()})
            if cb is not None:
                return _norm({k: cb * x for k, x in a.items()})
    return {v: 1} if opaque else None


def fmt(form: dict | None) -> str:
    """A form as text for error messages: ``2*pid0 + 64``."""
    if form is None:
        return "<not affine>"

    def one(k, x):
        if k == "":
            return str(x)
        name = k if isinstance(k, str) else (k.hint or f"%{k.id}")
        return name if x == 1 else f"{x}*{name}"
    parts = [one(k, x) for k, x in sorted(form.items(), key=lambda t: t[0] if isinstance(t[0], str) else f"~{t[0].id}")]
    return " + ".join(parts) or "0"


def fmt_all(forms) -> str:
    """Several forms as a tuple: ``(pid0*128, k)``."""
    return "(" + ", ".join(fmt(f) for f in forms) + ")"
