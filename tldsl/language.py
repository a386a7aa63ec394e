"""The tile language: what a tile program calls (``import tldsl as tl``).

Shapes are static Python ints; offsets, ranks and loop counters are traced scalars.
Every function appends IR ops at the caller's line.
"""
from __future__ import annotations

import builtins
import numbers
from contextlib import contextmanager

import numpy as np

from .ir import core, types as T
from .ir.opdefs import BINARY_OPS, UNARY_OPS
from .tracing import (Fragment, RemoteRef, Scalar, SignalRef, Tile, TensorRef, as_scalar,
                      current, fail)

float16, bfloat16, float32, int32 = T.float16, T.bfloat16, T.float32, T.int32


class constexpr:
    """Annotation for keyword parameters that are compile-time constants (they specialise the trace)."""


class Symmetric:
    """Annotation for tensor parameters allocated symmetrically on every rank (peers may access them)."""


# -- grid / group -------------------------------------------------------------------

def rank() -> Scalar:
    """This rank's index in the process group (a traced scalar)."""
    return Scalar(current().emit("rank", [], [T.i32], hints=["rank"]).result)


def world_size() -> int:
    """The number of ranks: a Python int, because kernels are specialised per world size."""
    return current().world_size


# -- control flow ----------------------------------------------------------------------

class range:  # noqa: A001  (mirrors Python's name on purpose)
    """``for i in tl.range(lo, hi, step)``: a loop that stays a loop in the IR."""

    def __init__(self, start, stop=None, step=1):
        if stop is None:
            start, stop = 0, start
        if isinstance(step, numbers.Integral) and step <= 0:
            fail(f"tl.range step must be positive, got {step}")
        self.start, self.stop, self.step = start, stop, step

    def __iter__(self):
        b = current()
        lo, hi, st = as_scalar(self.start), as_scalar(self.stop), as_scalar(self.step)
        body = core.Block(args=[core.Value(T.i32, "i")])
        op = b.emit("for", [lo.value, hi.value, st.value], [], {"unroll": False}, [body])
        body.args[0].owner = body
        with b.region(body):
            yield Scalar(body.args[0])
        del op


def static_range(*args):
    """An explicitly unrolled loop: plain Python ints, one copy of the body per iteration."""
    for a in args:
        if isinstance(a, Scalar):
            fail("tl.static_range needs Python ints; use tl.range for a traced bound")
    return builtins.range(*args)


@contextmanager
def when(cond):
    """``with tl.when(cond):`` — the body runs only where ``cond`` holds (an IR `if` region)."""
    if isinstance(cond, (bool, np.bool_)):
        fail("tl.when with a Python bool: use a plain Python `if` for static conditions")
    c = as_scalar(cond)
    if c.dtype != T.bool_:
        fail(f"tl.when needs a boolean scalar, got {c.dtype}")
    b = current()
    body = core.Block()
    b.emit("if", [c.value], [], {}, [body])
    with b.region(body):
        yield


# -- memory ------------------------------------------------------------------------------

def _offsets(ref, offsets, what: str):
    if not isinstance(offsets, (tuple, list)):
        offsets = (offsets,)
    if len(offsets) != len(ref.shape):
        fail(f"{what}: {len(offsets)} offsets for a {len(ref.shape)}-d tensor '{_name(ref)}'")
    return [as_scalar(o).value for o in offsets]


def _name(ref):
    return ref.tensor.name if isinstance(ref, RemoteRef) else ref.name


def _tile_shape(shape, ndim, what):
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    shape = tuple(shape)
    if len(shape) != ndim or not all(isinstance(s, numbers.Integral) and s > 0 for s in shape):
        fail(f"{what}: tile shape must be {ndim} positive Python ints, got {shape}")
    return tuple(int(s) for s in shape)


def _rank_value(r):
    s = as_scalar(r)
    if s.dtype != T.int32:
        fail(f"a rank must be an i32 scalar, got {s.dtype}")
    ws = world_size()
    op = s.value.owner
    if isinstance(op, core.Op) and op.name == "const" and not (0 <= op.attrs["value"] < ws):
        fail(f"rank {op.attrs['value']} is outside the group of {ws} ranks")
    return s.value


def load(ref, offsets, shape) -> Tile:
    """Load a tile (global/symmetric -> shared memory). Out-of-bounds elements read as zero.

    ``shape`` may have fewer axes than the tensor: the leading axes then have extent 1 and are
    dropped from the tile (``tl.load(w, (expert, k, n), (BK, BN))`` on ``w [E, K, N]``).

    ``ref.at(r)`` loads from a peer (the ``tile_pull_data`` primitive).
    """
    if isinstance(ref, RemoteRef):
        from .primitives import tile_pull_data
        return tile_pull_data(ref, offsets, shape)
    if not isinstance(ref, TensorRef):
        fail(f"tl.load needs a tensor, got {type(ref).__name__}")
    offs = _offsets(ref, offsets, "tl.load")
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    tile_rank = len(tuple(shape))
    if 0 < tile_rank < len(ref.shape):
        # a lower-rank tile of a higher-rank tensor: leading axes are batch coordinates
        # (e.g. the expert of a grouped GEMM's [E, K, N] weights) and have extent 1
        shape = (1,) * (len(ref.shape) - tile_rank) + tuple(shape)
    box = _tile_shape(shape, len(ref.shape), "tl.load")
    tile_shape = box[len(box) - tile_rank:]
    op = current().emit("load", [ref.value, *offs], [T.TileType(tile_shape, ref.dtype, T.MemSpace.SHARED)],
                        {"shape": box})
    return Tile(op.result)


def load_rows(ref, rows, col_offset, ncols: int) -> Tile:
    """Gather rows ``ref[rows[i], col_offset:col_offset+ncols]`` (negative row ids read as zero)."""
    if not isinstance(ref, TensorRef) or len(ref.shape) != 2:
        fail("tl.load_rows needs a local 2-d tensor")
    if not isinstance(rows, Tile) or len(rows.shape) != 1 or rows.dtype != T.int32:
        fail("tl.load_rows needs a 1-d i32 tile of row indices")
    shape = (rows.shape[0], int(ncols))
    op = current().emit("load_rows", [ref.value, rows.value, as_scalar(col_offset).value],
                        [T.TileType(shape, ref.dtype, T.MemSpace.SHARED)], {"shape": shape})
    return Tile(op.result)


def load_scalar(ref, index) -> Scalar:
    """Read one element of an integer table: how dynamic (run-time) mappings reach the program."""
    if not isinstance(ref, TensorRef):
        fail("tl.load_scalar needs a local tensor")
    if ref.dtype != T.int32:
        fail(f"tl.load_scalar reads i32 tables, '{ref.name}' is {ref.dtype}")
    offs = _offsets(ref, index, "tl.load_scalar")
    return Scalar(current().emit("load_scalar", [ref.value, *offs], [T.i32]).result)


def store(ref, offsets, tile) -> None:
    """Store a tile to global memory (floats convert to the tensor's type); out-of-bounds parts are dropped.

    ``ref.at(r)`` stores to a peer (the ``tile_push_data`` primitive).
    """
    if isinstance(ref, RemoteRef):
        from .primitives import tile_push_data
        return tile_push_data(ref, offsets, tile)
    if not isinstance(ref, TensorRef):
        fail(f"tl.store needs a tensor, got {type(ref).__name__}")
    tile = _store_tile(ref, tile, "tl.store")
    offs = _offsets(ref, offsets, "tl.store")
    current().emit("store", [ref.value, *offs, tile.value])


def _store_tile(ref, tile, what) -> Tile:
    tile = as_tile(tile)
    if len(tile.shape) != len(ref.shape):
        fail(f"{what}: a {len(tile.shape)}-d tile into the {len(ref.shape)}-d tensor '{_name(ref)}'")
    if tile.dtype != ref.dtype:
        if tile.dtype.is_float and ref.dtype.is_float:
            tile = cast(tile, ref.dtype)
        else:
            fail(f"{what}: cannot store a {tile.dtype} tile into '{_name(ref)}' of {ref.dtype}")
    return tile


# -- tile construction and math ---------------------------------------------------------

def full(shape, value, dtype=float32) -> Tile:
    shape = _tile_shape(shape, len(shape) if isinstance(shape, tuple) else 1, "tl.full")
    dtype = T.dtype_of(dtype)
    op = current().emit("full", [], [T.TileType(shape, dtype)], {"shape": shape, "value": value, "dtype": dtype})
    return Tile(op.result)


def zeros(shape, dtype=float32) -> Tile:
    return full(shape, 0, dtype)


def fragment(shape, dtype=float32, fill=0.0) -> Fragment:
    """A mutable register fragment (e.g. an accumulator), initialised to ``fill``."""
    shape = _tile_shape(shape, len(shape) if isinstance(shape, tuple) else 1, "tl.fragment")
    dtype = T.dtype_of(dtype)
    op = current().emit("frag_alloc", [], [T.FragmentType(shape, dtype)],
                        {"shape": shape, "dtype": dtype, "value": fill})
    return Fragment(op.result)


def iota(n: int) -> Tile:
    """The i32 tile 0, 1, ..., n-1."""
    n = _tile_shape(n, 1, "tl.iota")[0]
    return Tile(current().emit("iota", [], [T.TileType((n,), T.int32)], {"n": n}).result)


def as_tile(x, like=None) -> Tile:
    if isinstance(x, Tile):
        return x
    if isinstance(x, Fragment):
        return x.read()
    if isinstance(x, (numbers.Number, Scalar)):
        shape = like.shape if like is not None else ()
        dtype = like.dtype if like is not None else T.float32
        if isinstance(x, Scalar):
            return broadcast_to(ewise("add", zeros(shape or (1,), x.dtype), x), shape) if shape else fail(
                "a scalar needs a tile shape here")
        return full(shape, x, dtype)
    fail(f"expected a tile, got {type(x).__name__}")


def _promote(dtypes):
    floats = [d for d in dtypes if d.is_float]
    if not floats:
        return T.int32 if T.int32 in dtypes else T.bool_
    if len(set(floats)) == 1:
        return floats[0]
    return T.float32


def ewise(op: str, *args) -> Tile:
    """Elementwise math with numpy broadcasting; Python numbers adopt the tile's type."""
    if op not in UNARY_OPS | BINARY_OPS | {"where"}:
        fail(f"unknown elementwise op '{op}'")
    tiles = [a for a in args if isinstance(a, (Tile, Fragment))]
    if not tiles:
        fail(f"'{op}' needs at least one tile operand")
    tiles = [as_tile(a) for a in tiles]
    tile_dtypes = [t.dtype for t in tiles]
    scal_dtypes = [a.dtype for a in args if isinstance(a, Scalar)]
    if op == "where":
        dtype = _promote([t.dtype for t in tiles[1:]] + scal_dtypes) if len(tiles) > 1 else _promote(scal_dtypes or [T.float32])
    else:
        dtype = _promote(tile_dtypes + scal_dtypes)
    if any(isinstance(a, float) for a in args) and not dtype.is_float:
        dtype = T.float32
    try:
        shape = np.broadcast_shapes(*[t.shape for t in tiles])
    except ValueError:
        fail(f"'{op}': tile shapes {[t.shape for t in tiles]} do not broadcast")
    vals = []
    for a in args:
        if isinstance(a, (Tile, Fragment)):
            vals.append(as_tile(a).value)
        elif isinstance(a, Scalar):
            vals.append(a.value)
        elif isinstance(a, (numbers.Number, np.number)):
            from .tracing import const
            cd = T.bool_ if isinstance(a, bool) else (dtype if dtype.is_float or isinstance(a, numbers.Integral) else T.float32)
            vals.append(const(a, cd if cd.kind != "bool" else T.bool_).value)
        else:
            fail(f"'{op}': unsupported operand {type(a).__name__}")
    if op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"):
        rdt = T.bool_
    else:
        rdt = dtype
    if op in ("exp", "exp2", "log", "sqrt", "recip", "div") and not rdt.is_float:
        rdt = T.float32
    if op == "where":
        rdt = dtype
    res = current().emit("ewise", vals, [T.TileType(tuple(shape), rdt)], {"op": op})
    return Tile(res.result)


def exp(x): return ewise("exp", x)
def exp2(x): return ewise("exp2", x)
def log(x): return ewise("log", x)
def sqrt(x): return ewise("sqrt", x)
def abs(x): return ewise("abs", x)  # noqa: A001


def where(cond, a, b) -> Tile:
    """Elementwise ``cond ? a : b``."""
    if not isinstance(cond, Tile) or cond.dtype != T.bool_:
        fail("tl.where needs a boolean tile as its condition")
    return ewise("where", cond, a, b)


def cast(x, dtype) -> Tile:
    x = as_tile(x)
    try:
        dtype = T.dtype_of(dtype)
    except TypeError as e:
        fail(f"tl.cast: {e}")
    if x.dtype == dtype:
        return x
    return Tile(current().emit("cast", [x.value], [T.TileType(x.shape, dtype)], {"dtype": dtype}).result)


def _reduce(op, x, axis):
    x = as_tile(x)
    nd = len(x.shape)
    if not isinstance(axis, numbers.Integral) or not -nd <= axis < nd:
        fail(f"reduction axis {axis} out of range for a {nd}-d tile")
    axis %= nd
    shape = x.shape[:axis] + x.shape[axis + 1:]
    if not shape:
        fail("reducing a tile to a scalar is not supported; keep one axis")
    return Tile(current().emit("reduce", [x.value], [T.TileType(shape, x.dtype)],
                               {"op": op, "axis": axis}).result)


def sum(x, axis) -> Tile:  # noqa: A001
    return _reduce("sum", x, axis)


def max(x, axis) -> Tile:  # noqa: A001
    return _reduce("max", x, axis)


def min(x, axis) -> Tile:  # noqa: A001
    return _reduce("min", x, axis)


def expand_dims(x, axis: int) -> Tile:
    x = as_tile(x)
    shape = list(x.shape)
    shape.insert(axis, 1)
    return Tile(current().emit("expand_dims", [x.value], [T.TileType(tuple(shape), x.dtype)],
                               {"axis": axis}).result)


def broadcast_to(x, shape) -> Tile:
    x = as_tile(x)
    shape = tuple(shape)
    try:
        if np.broadcast_shapes(x.shape, shape) != shape:
            raise ValueError
    except ValueError:
        fail(f"cannot broadcast a {x.shape} tile to {shape}")
    if x.shape == shape:
        return x
    return Tile(current().emit("broadcast", [x.value], [T.TileType(shape, x.dtype)], {"shape": shape}).result)


def trans(x) -> Tile:
    x = as_tile(x)
    if len(x.shape) != 2:
        fail("tl.trans needs a 2-d tile")
    return Tile(current().emit("trans", [x.value], [T.TileType(x.shape[::-1], x.dtype, x.space)]).result)


def dot(a, b, acc=None) -> Tile:
    """``a @ b`` with fp32 accumulation (lowered to WGMMA/MMA); ``acc`` is added when given."""
    a, b = as_tile(a), as_tile(b)
    if len(a.shape) != 2 or len(b.shape) != 2:
        fail(f"tl.dot needs 2-d tiles, got {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        fail(f"tl.dot: inner dimensions differ: {a.shape} @ {b.shape}")
    if a.dtype != b.dtype:
        fail(f"tl.dot: operand types differ ({a.dtype} vs {b.dtype}); cast one first")
    if not a.dtype.is_float:
        fail(f"tl.dot supports f16, bf16 and f32 operands, got {a.dtype}")
    out = Tile(current().emit("dot", [a.value, b.value],
                              [T.TileType((a.shape[0], b.shape[1]), T.float32)]).result)
    if acc is not None:
        out = as_tile(acc) + out
    return out


# -- kernel-level declarations ---------------------------------------------------------

def _declare(kind: str):
    b = current()
    if b.blocks:
        fail(f"{kind} must be declared in the kernel body, outside compute/comm parts")
    return b


def symmetric_buffer(shape, dtype, name: str = "workspace") -> TensorRef:
    """A kernel-owned workspace allocated on every rank with the same shape; peers may access it.

    It persists across launches (like an NVSHMEM heap allocation); the simulator fills it with
    NaN once, so a read of data that was never written shows up.
    """
    return _workspace(shape, dtype, name, T.MemSpace.SYMMETRIC)


def local_buffer(shape, dtype, name: str = "scratch") -> TensorRef:
    """A kernel-owned workspace in this rank's global memory (peers cannot access it)."""
    return _workspace(shape, dtype, name, T.MemSpace.GLOBAL)


def _workspace(shape, dtype, name, space):
    b = _declare("buffers")
    from .ir.location import user_location
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        fail(f"buffer '{name}' needs a positive shape, got {shape}")
    buf = core.Buffer(b.unique(name, b.buffers), T.TensorType(shape, T.dtype_of(dtype), space),
                      "workspace", loc=user_location())
    b.buffers.append(buf)
    return TensorRef(buf)


def signal(name: str, slots: int, scope: str = "local") -> SignalRef:
    """An array of ``slots`` counters. ``scope='local'`` links parts of one rank
    (producer/consumer); ``'symmetric'`` gives every rank a copy that peers notify."""
    b = _declare("signals")
    from .ir.location import user_location
    if scope not in ("local", "symmetric"):
        fail(f"signal scope must be 'local' or 'symmetric', got {scope!r}")
    if not isinstance(slots, numbers.Integral) or slots <= 0:
        fail(f"signal '{name}' needs a positive number of slots, got {slots}")
    sig = core.Signal(b.unique(name, b.signals), T.SignalType(int(slots), T.SignalScope(scope)),
                      loc=user_location())
    b.signals.append(sig)
    return SignalRef(sig)


def static_assert(cond: bool, message: str) -> None:
    """A trace-time check: raise a CompilationError at the caller's line unless ``cond``."""
    if not isinstance(cond, (bool, np.bool_)):
        fail("tl.static_assert needs a Python bool (a static condition); use tl.when for traced ones")
    if not cond:
        fail(message)
