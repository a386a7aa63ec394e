"""Checking the operands a tile-language call is given — offsets, tile shapes, ranks — where
the call is made; shared by the language (:mod:`.language`) and the primitives
(:mod:`.primitives`)."""
from __future__ import annotations

import numbers

from .ir import core, types as T
from .tracing import RemoteRef, Scalar, as_scalar, fail, world_size


def offset_values(ref, offsets, what: str):
    """The IR values of ``offsets`` into ``ref``, one per axis."""
    if not isinstance(offsets, (tuple, list)):
        offsets = (offsets,)
    if len(offsets) != len(ref.shape):
        fail(f"{what}: {len(offsets)} offsets for a {len(ref.shape)}-d tensor '{tensor_name(ref)}'")
    return [offset_value(ref, o, what) for o in offsets]


def offset_value(ref, o, what: str):
    """The IR value of one offset into ``ref``: a Python int or a traced i32 (a float would be
    truncated by the simulator and rounded down by the generated code)."""
    if not isinstance(o, numbers.Integral) and not (isinstance(o, Scalar) and o.dtype.kind == "int"):
        fail(f"{what}: offset {o!r} into '{tensor_name(ref)}' must be an int or a traced i32 scalar "
             f"(tl.cast a float, or // to round it)")
    return as_scalar(o).value


def tensor_name(ref):
    """The name of a tensor or of ``tensor.at(rank)``."""
    return ref.tensor.name if isinstance(ref, RemoteRef) else ref.name


def check_tile_shape(shape, ndim, what):
    """``shape`` as ``ndim`` positive Python ints (one int for a 1-d tile)."""
    if isinstance(shape, (numbers.Integral, Scalar)):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError:
        fail(f"{what}: tile shape must be {ndim} positive Python ints, got {type(shape).__name__} {shape!r}")
    if len(shape) != ndim or not all(isinstance(s, numbers.Integral) and s > 0 for s in shape):
        static = " (tile shapes are static: a traced scalar cannot be one; take a larger tile and mask it)" \
            if any(isinstance(s, Scalar) for s in shape) else ""
        fail(f"{what}: tile shape must be {ndim} positive Python ints, got {shape}{static}")
    return tuple(int(s) for s in shape)


def rank_value(r):
    """The IR value of a rank operand: an i32 scalar, inside the group when it is a constant."""
    s = as_scalar(r)
    if s.dtype != T.int32:
        fail(f"a rank must be an i32 scalar, got {s.dtype}")
    ws = world_size()
    op = s.value.owner
    if isinstance(op, core.Op) and op.name == "const" and not (0 <= op.attrs["value"] < ws):
        fail(f"rank {op.attrs['value']} is outside the group of {ws} ranks")
    return s.value
