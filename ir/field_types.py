"""Check a frozen options dataclass's fields against their annotations before its own rules run:
``ComputeSchedule(tile=None)`` or ``CommSchedule(order=np.zeros(2))`` then fails naming the
field and what it takes, instead of deep in a rule (``'NoneType' object is not iterable``, an
ambiguous array truth value).

Annotations are read as written (``from __future__ import annotations`` keeps them strings):
``str``, ``int``, ``bool``, ``float``, ``X | None`` and ``tuple[int, ...]`` / ``tuple[int, int]``;
any other annotation is not checked here.
"""
from __future__ import annotations

import dataclasses
import numbers


def check_field_names(cls, args, kwargs, error, noun: str = "field") -> None:
    """Raise ``error(message)`` where ``cls(*args, **kwargs)`` names a field ``cls`` has not
    (``tiles=`` for ``tile=``) or passes more values than it has fields: its fields listed, rather
    than the dataclass constructor's TypeError. Called from the class's ``__new__``."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise error(f"{cls.__name__} has no {noun} {', '.join(map(repr, unknown))}; its {noun}s: {', '.join(names)}")
    if len(args) > len(names):
        raise error(f"{cls.__name__} takes at most {len(names)} values ({', '.join(names)}), got {len(args)}")


def field_problem(value, annotation: str) -> str | None:
    """Why ``value`` does not fit ``annotation`` (the words of an error), or None if it does."""
    kinds = [k.strip() for k in annotation.split("|")]
    if "None" in kinds and value is None:
        return None
    kinds = [k for k in kinds if k != "None"]
    if len(kinds) != 1:
        return None
    kind = kinds[0]
    if kind == "str":
        return None if isinstance(value, str) else "a str"
    if kind == "int":
        return None if _is_int(value) else "an int"
    if kind == "bool":
        return None if isinstance(value, bool) else "True or False"
    if kind == "float":
        return None if isinstance(value, numbers.Real) and not isinstance(value, bool) else "a number"
    if kind.startswith("tuple[") and kind.endswith("]"):
        items = [i.strip() for i in kind[len("tuple["):-1].split(",")]
        if not all(i in ("int", "...") for i in items):
            return None
        length = None if "..." in items else len(items)
        want = f"a tuple of {length or ''} ints".replace("  ", " ")
        if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
            return want
        if length is not None and len(value) != length:
            return want
    return None


def check_field_types(obj, error) -> None:
    """Raise ``error(message)`` for the first field of the dataclass ``obj`` whose value does not
    fit its annotation; ``error`` makes the caller's exception (a ScheduleError at the user's line)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        want = field_problem(value, f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if want is not None:
            raise error(f"{type(obj).__name__}({f.name}=...): {f.name} takes {want}"
                        + (" or None" if "None" in str(f.type) else "") + f", got {_short(value)}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _short(value) -> str:
    text = f"{value!r}"
    text = " ".join(text.split())
    return (text[:60] + "…" if len(text) > 60 else text) + f" ({type(value).__name__})"
