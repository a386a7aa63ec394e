"""The C identifiers generated code gives the IR's tensors and signals.

An IR name need not be a C identifier (a workspace may be called ``"x-y"``), so generated code
spells each tensor and signal by a *C name*: the IR name with every character a C identifier
cannot hold made ``_``. Two names can come out equal that way (``"x-y"`` and ``"x_y"``), or one
can come out as another's derived parameter (``"a_peers"`` beside ``a``'s table of peers'
pointers, ``buf_a_peers``), so the tracer gives each tensor, and each signal, a C name of its
own (:func:`unique_c_name`): the plain one where it is free, else with ``_1``, ``_2``, ...
appended. The runtime binds parameters by IR name, never by C name."""
from __future__ import annotations

import re
from typing import Iterable


def c_identifier(s: str) -> str:
    """A C identifier made from an IR name (not one-to-one: see :func:`unique_c_name`)."""
    s = re.sub(r"[^0-9A-Za-z_]", "_", s)
    return s if s and not s[0].isdigit() else "_" + s


#: what codegen appends to a C name for a tensor's or signal's other parameters (``buf_<n>_peers``,
#: a staged copy's descriptor ``tma_<n>_<R>x64``, ``tma_a_tensor`` for a tensor called a)
_DERIVED = re.compile(r"peers|tensor|\d+x64")


def _clash(a: str, b: str) -> bool:
    """Whether C names ``a`` and ``b`` would give some parameter the same identifier."""
    if a == b:
        return True
    short, long_ = sorted((a, b), key=len)
    return long_.startswith(short + "_") and _DERIVED.fullmatch(long_[len(short) + 1:]) is not None


def unique_c_name(name: str, taken: Iterable[str | None]) -> str:
    """The C name for IR name ``name`` beside the C names ``taken`` (those of the same kernel's
    other tensors, or other signals): :func:`c_identifier` of it, with ``_1``, ``_2``, ...
    appended while that would clash with one of them."""
    taken = [t for t in taken if t]
    base = c_identifier(name)
    out, i = base, 0
    while any(_clash(out, t) for t in taken):
        i += 1
        out = f"{base}_{i}"
    return out
