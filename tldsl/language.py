"""The tile language: what a tile program calls (``import tldsl as tl``).

Shapes are static Python ints; offsets, ranks and loop counters are traced scalars.
Every function appends IR ops at the caller's line. The whole language is importable from
here: what is defined below, and what a tile program calls from the modules it builds on —
the rank and world size (:mod:`.tracing`) and the tile math (:mod:`.tiles`).
"""
from __future__ import annotations

import ast
import builtins
import numbers
from contextlib import contextmanager

import numpy as np

from .ir import core, types as T
from . import early_exits, loop_carried
from .errors import CompilationError
from .ir.location import Location, user_frame, user_location
from .numpy_protocol import install as _install_numpy_protocols
from .operands import check_tile_shape, offset_value, offset_values
from .primitives import tile_pull_data, tile_push_data
from .tiles import (Fragment, Tile, as_tile, broadcast_to, cast, check_fill, ewise, expand_dims, full, tile_for_store,
                    trans, zeros)
from .tiles import maximum as _maximum, minimum as _minimum
from .tracing import RemoteRef, Scalar, SignalRef, TensorRef, as_scalar, current, dtype_arg, fail, rank, world_size

float16, bfloat16, float32, int32 = T.float16, T.bfloat16, T.float32, T.int32


class constexpr:
    """Annotation for keyword parameters that are compile-time constants (they specialise the trace)."""


class Symmetric:
    """Annotation for tensor parameters allocated symmetrically on every rank (peers may access them)."""


# -- control flow ----------------------------------------------------------------------

class range:  # noqa: A001  (mirrors Python's name on purpose)
    """``for i in tl.range(lo, hi, step)``: a loop that stays a loop in the IR."""

    def __init__(self, start, stop=None, step=1):
        if stop is None:
            start, stop = 0, start
        for what, v in (("start", start), ("stop", stop), ("step", step)):
            if isinstance(v, Scalar) and v.dtype == T.int32:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                fail(f"tl.range {what} must be a Python int or an i32 scalar (a program id, a table entry), got "
                     + (f"a {v.dtype} scalar" if isinstance(v, Scalar) else f"{type(v).__name__} {v!r}"))
        if isinstance(step, numbers.Integral) and step <= 0:
            fail(f"tl.range step must be positive, got {step}")
        self.start, self.stop, self.step = start, stop, step

    def __iter__(self):
        b = current()
        loc, frame = user_location(), user_frame()
        _refuse_wrapped(loc)
        carried = _carried_before(loc, frame)
        lo, hi, st = as_scalar(self.start), as_scalar(self.stop), as_scalar(self.step)
        body = core.Block(args=[core.Value(T.i32, "i")])
        op = b.emit("for", [lo.value, hi.value, st.value], [], {"unroll": False}, [body])
        body.args[0].owner = body
        ran_to_its_end = False
        with b.region(body):
            try:
                yield Scalar(body.args[0])
                ran_to_its_end = True       # the for statement asked for the next index
                if b.blocks[-1] is not body:     # another loop's body opened inside ours is still open
                    raise CompilationError(
                        "two tl.range loops were advanced together (zip of two tl.range, or an iterator of one "
                        "stepped inside the other's body): each body is traced once, so the second would run "
                        "nested inside the first, not beside it. Write one tl.range and compute the other "
                        "index from it", user_location())
                _refuse_rebound(carried, frame, loc)
            finally:
                if not ran_to_its_end and b.left_early is None:
                    b.left_early = _left_early(op.loc)
        del op


def _carried_before(loc, frame) -> dict:
    """{name: (read, binding, its object now)} of the names the loop's body reads before it rebinds them
    (:mod:`.loop_carried`), as they stand before the body's trace; empty without the loop's source."""
    if loc is None or frame is None:
        return {}
    names = early_exits.loop_carried_names(loc.filename, loc.lineno, frame.f_globals)
    if not names:
        return {}
    now = frame.f_locals
    return {n: (*nodes, now[n]) for n, nodes in names.items() if n in now}


def _refuse_rebound(carried: dict, frame, loc) -> None:
    """Refuse a name the body read and then bound to another value: Python would carry it into the
    next iteration, the traced loop reads the value it had before the loop in every iteration."""
    if not carried:
        return
    now = frame.f_locals
    for name, (read, binding, before) in carried.items():
        if name in now and not loop_carried.same_value(before, now[name]):
            what = (f"`{name} {loop_carried.operator_symbol(binding.op)}= ...` at line {binding.lineno} binds `{name}` "
                    f"to a new {type(now[name]).__name__} (only a fragment is updated in place)"
                    if isinstance(binding, ast.AugAssign) else
                    f"`{name}` is read in this tl.range body (line {read.lineno}) and bound again at line "
                    f"{binding.lineno}")
            advice = (f"carry a tile across iterations in a fragment made before the loop ({name} = "
                      f"tl.fragment(shape, dtype); {name} += ..., or {name}.write(...); {name}.read())"
                      if isinstance(now[name], (Tile, Fragment)) else
                      "compute what changes from the loop index (an offset `start + i * step`), or carry it in a "
                      "fragment made before the loop")
            raise CompilationError(
                f"{what}: the body is traced once, so every iteration reads the value `{name}` had "
                f"before the loop, not the one the previous iteration left. Instead, {advice}",
                Location(loc.filename, binding.lineno, binding.col_offset))


def _refuse_wrapped(loc) -> None:
    """A ``tl.range`` iterated by ``zip`` / ``enumerate`` / ``map``... is refused: its body is traced
    once, so the wrapper would see one element of its other iterables (``enumerate`` counts 0 for every
    iteration; ``zip(range(1), tl.range(4))`` would run the IR loop 4 times)."""
    wrapper = early_exits.loop_iterable_wrapper(loc.filename, loc.lineno) if loc is not None else None
    if wrapper is not None:
        raise CompilationError(
            f"tl.range iterated through {wrapper}(...): the loop body is traced once and the IR loop runs "
            f"every iteration, so {wrapper} would see only the first element of its other arguments (and "
            "stop the trace where they are shorter). Iterate tl.range itself (`for i in tl.range(...)`) and "
            "compute other per-iteration values from its index", loc)


def _left_early(loc) -> CompilationError | None:
    """The error of a ``tl.range`` body left by a Python jump: None where its source shows no
    ``break`` or ``return`` (an exception left it, which propagates — or which the program caught)."""
    jumps = early_exits.loop_body_jumps(loc.filename, loc.lineno) if loc is not None else []
    if not jumps and loc is not None and early_exits.has_source(loc.filename):
        return None
    by = f" by {early_exits.describe(jumps)}" if jumps else " (by a break or return)"
    return CompilationError(
        f"this tl.range loop was left early{by}: its body is traced once and the loop runs every iteration, "
        "so a Python jump out of it would be taken for all of them. Bound the loop by tl.range's stop, or run "
        "it whole and guard the work with tl.when", loc)


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
    frame = user_frame()
    jumps = early_exits.when_body_jumps(frame)
    if jumps:
        word = early_exits.keyword(jumps[0])
        raise CompilationError(
            f"`{word}` inside `with tl.when(...)`: the body is traced once, so this {word} would be taken for "
            "every task and iteration, not only where the condition holds. Put the code it should skip under "
            "tl.when of the opposite condition", Location(frame.f_code.co_filename, jumps[0].lineno, jumps[0].col_offset))
    b = current()
    escaping = early_exits.when_escaping_names(frame)
    before = {n: frame.f_locals.get(n, _UNBOUND) for n in escaping} if escaping else {}
    open_before = list(b.blocks)
    body = core.Block()
    b.emit("if", [c.value], [], {}, [body])
    with b.region(body):
        yield
    if escaping:
        _refuse_escaping(escaping, before, frame, open_before, b)


_UNBOUND = object()


def _refuse_escaping(escaping: dict, before: dict, frame, open_before: list, b) -> None:
    """Refuse a name a ``tl.when`` body bound to another plain value and the program reads after it: the
    body is traced for every task, so after the block the name holds the body's value whether or not the
    condition held. (A tile or scalar made in the body is refused where it is used after the block.)"""
    now = frame.f_locals
    for name, binding in escaping.items():
        value = now.get(name, _UNBOUND)
        if value is _UNBOUND or loop_carried.same_value(before[name], value):
            continue
        traced = getattr(value, "value", None)
        home = b.home.get(traced.id) if isinstance(traced, core.Value) else None
        if home is not None and not any(home is blk for blk in open_before):
            continue                                # made in the body: refused at its use after it
        raise CompilationError(
            f"`{name}` is bound inside this tl.when body (line {binding.lineno}) and read after it: the body is "
            f"traced once for every task, so after the block `{name}` holds the body's value whether or not the "
            f"condition held. Choose the value instead ({name} = tl.select(cond, new, {name}) for a scalar, "
            "tl.where for a tile), or use it only inside the block",
            Location(frame.f_code.co_filename, binding.lineno, binding.col_offset))


# -- memory ------------------------------------------------------------------------------

def load(ref, offsets, shape) -> Tile:
    """Load a tile (global/symmetric -> shared memory). Out-of-bounds elements read as zero.

    ``shape`` may have fewer axes than the tensor: the leading axes then have extent 1 and are
    dropped from the tile (``tl.load(w, (expert, k, n), (BK, BN))`` on ``w [E, K, N]``).

    ``ref.at(r)`` loads from a peer (the ``tile_pull_data`` primitive).
    """
    if isinstance(ref, RemoteRef):
        return tile_pull_data(ref, offsets, shape)
    if not isinstance(ref, TensorRef):
        fail(f"tl.load needs a tensor, got {type(ref).__name__}")
    offs = offset_values(ref, offsets, "tl.load")
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    tile_rank = len(tuple(shape))
    if 0 < tile_rank < len(ref.shape):
        # a lower-rank tile of a higher-rank tensor: leading axes are batch coordinates
        # (e.g. the expert of a grouped GEMM's [E, K, N] weights) and have extent 1
        shape = (1,) * (len(ref.shape) - tile_rank) + tuple(shape)
    box = check_tile_shape(shape, len(ref.shape), "tl.load")
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
    shape = (rows.shape[0], check_tile_shape(ncols, 1, "tl.load_rows")[0])
    op = current().emit("load_rows", [ref.value, rows.value, offset_value(ref, col_offset, "tl.load_rows")],
                        [T.TileType(shape, ref.dtype, T.MemSpace.SHARED)], {"shape": shape})
    return Tile(op.result)


def add_rows(ref, rows, col_offset, tile) -> None:
    """Scatter-add: ``ref[rows[i], col_offset:col_offset+ncols] += tile[i]`` for every ``i`` whose row
    id is not negative (a tile's rows ``[n, ncols]``, floats converted to the tensor's type).

    The dual of :func:`load_rows`, for sums whose terms arrive from many tiles in no fixed order (the
    MoE combine done by the expert GEMM's epilogue). Adds from different tasks to the same element
    need no ordering between them: the GPU makes each add atomic, and the simulator checks them
    against every read or write of those elements that no signal orders. Each term is rounded to the
    tensor's type, then added, and the sum rounded to it, in whatever order the adds land: a bf16 sum
    is not bit-reproducible."""
    if not isinstance(ref, TensorRef) or len(ref.shape) != 2:
        fail("tl.add_rows needs a local 2-d tensor")
    if not ref.dtype.is_float:
        fail(f"tl.add_rows adds floats; '{ref.name}' is {ref.dtype}")
    if not isinstance(rows, Tile) or len(rows.shape) != 1 or rows.dtype != T.int32:
        fail("tl.add_rows needs a 1-d i32 tile of row indices")
    tile = as_tile(tile)
    if len(tile.shape) != 2 or tile.shape[0] != rows.shape[0]:
        fail(f"tl.add_rows adds a [{rows.shape[0]}, ncols] tile (one row per row id), got {list(tile.shape)}")
    if not tile.dtype.is_float:
        fail(f"tl.add_rows adds a float tile, got {tile.dtype}")
    current().emit("add_rows", [ref.value, rows.value, offset_value(ref, col_offset, "tl.add_rows"), tile.value])


def load_scalar(ref, index) -> Scalar:
    """Read one element of an integer table: how dynamic (run-time) mappings reach the program."""
    if not isinstance(ref, TensorRef):
        fail("tl.load_scalar needs a local tensor")
    if ref.dtype != T.int32:
        fail(f"tl.load_scalar reads i32 tables, '{ref.name}' is {ref.dtype}")
    offs = offset_values(ref, index, "tl.load_scalar")
    return Scalar(current().emit("load_scalar", [ref.value, *offs], [T.i32]).result)


def store(ref, offsets, tile) -> None:
    """Store a tile to global memory (floats convert to the tensor's type); out-of-bounds parts are dropped.

    ``ref.at(r)`` stores to a peer (the ``tile_push_data`` primitive).
    """
    if isinstance(ref, RemoteRef):
        return tile_push_data(ref, offsets, tile)
    if not isinstance(ref, TensorRef):
        fail(f"tl.store needs a tensor, got {type(ref).__name__}")
    tile = tile_for_store(ref, tile, "tl.store")
    offs = offset_values(ref, offsets, "tl.store")
    current().emit("store", [ref.value, *offs, tile.value])


# -- tile construction and math ---------------------------------------------------------

def fragment(shape, dtype=float32, fill=0.0) -> Fragment:
    """A mutable register fragment (e.g. an accumulator), initialised to ``fill`` (a Python
    number, or a traced scalar: then written once after its allocation)."""
    if isinstance(fill, Scalar):                # a run-time value: allocated as zeros, then written
        frag = fragment(shape, dtype, 0)
        frag.write(full(frag.shape, fill, dtype))
        return frag
    shape = check_tile_shape(shape, len(shape) if isinstance(shape, (tuple, list)) else 1, "tl.fragment")
    dtype = dtype_arg(dtype, "tl.fragment")
    check_fill(fill, "tl.fragment", dtype)
    op = current().emit("frag_alloc", [], [T.FragmentType(shape, dtype)],
                        {"shape": shape, "dtype": dtype, "value": fill})
    return Fragment(op.result)


def iota(n: int) -> Tile:
    """The i32 tile 0, 1, ..., n-1."""
    n = check_tile_shape(n, 1, "tl.iota")[0]
    return Tile(current().emit("iota", [], [T.TileType((n,), T.int32)], {"n": n}).result)


def exp(x):
    """``e ** x``, elementwise (a float tile, whatever ``x`` is)."""
    return ewise("exp", x)


def exp2(x):
    """``2 ** x``, elementwise (a float tile)."""
    return ewise("exp2", x)


def log(x):
    """The natural logarithm, elementwise (a float tile)."""
    return ewise("log", x)


def sqrt(x):
    """The square root, elementwise (a float tile; NaN below 0)."""
    return ewise("sqrt", x)


def abs(x):  # noqa: A001
    """The absolute value, elementwise (the tile's own type)."""
    return ewise("abs", x)


def sigmoid(x):
    """The logistic function ``1 / (1 + exp(-x))``, elementwise (SiLU is ``x * tl.sigmoid(x)``,
    the gate of a gated MLP)."""
    return ewise("sigmoid", x)


def tanh(x):
    """The hyperbolic tangent, elementwise (the tanh approximation of GELU)."""
    return ewise("tanh", x)


def erf(x):
    """The error function, elementwise (exact GELU is ``0.5 * x * (1 + tl.erf(x / sqrt(2)))``)."""
    return ewise("erf", x)


def rsqrt(x):
    """``1 / sqrt(x)``, elementwise (RMSNorm's scale); ``inf`` at 0, NaN below."""
    return ewise("rsqrt", x)


def where(cond, a, b) -> Tile:
    """Elementwise ``cond ? a : b``."""
    if isinstance(cond, Scalar):
        fail("tl.where takes a boolean tile as its condition, got a traced scalar: for a choice between "
             "two values write tl.select(cond, a, b) (tl.where(tl.full(shape, cond, tl.bool_), a, b) for tiles), "
             "for a guarded region `with tl.when(cond):`")
    if not isinstance(cond, Tile) or cond.dtype != T.bool_:
        fail("tl.where needs a boolean tile as its condition")
    return ewise("where", cond, a, b)


def _reduce(op, x, axis):
    x = as_tile(x)
    nd = len(x.shape)
    if axis is None:
        fail(f"tl.{op} needs the axis to reduce along (tl.{op}(t, 1) for each row's); reducing a tile to one "
             "scalar is not supported: keep one axis")
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        # a bool is an int to Python: tl.sum(t, True) would reduce along axis 1
        got = f"{type(axis).__name__} {axis!r}" if isinstance(axis, (numbers.Number, np.bool_)) else type(axis).__name__
        hint = (f": write tl.{op}(t, {int(axis)})" if isinstance(axis, (float, np.floating)) and float(axis).is_integer()
                else "")
        fail(f"tl.{op}'s axis must be an int (the axis of the {nd}-d tile to reduce along), got {got}{hint}")
    if not -nd <= axis < nd:
        fail(f"reduction axis {axis} out of range for a {nd}-d tile")
    axis %= nd
    shape = x.shape[:axis] + x.shape[axis + 1:]
    if not shape:
        fail("reducing a tile to a scalar is not supported; keep one axis")
    if op == "sum" and x.dtype == T.bool_:
        x = cast(x, T.int32)        # numpy's: the sum of a mask counts its true elements (an i32 tile)
    return Tile(current().emit("reduce", [x.value], [T.TileType(shape, x.dtype)],
                               {"op": op, "axis": axis}).result)


def sum(x, axis=None) -> Tile:  # noqa: A001
    """The sum along ``axis``, which is removed; at least one axis must remain (of a bool tile: the
    count of true elements, i32, as numpy counts)."""
    return _reduce("sum", x, axis)


def max(x, axis=None) -> Tile:  # noqa: A001
    """The maximum along ``axis``, which is removed (``tl.maximum`` is the elementwise one)."""
    return _reduce("max", x, axis)


def min(x, axis=None) -> Tile:  # noqa: A001
    """The minimum along ``axis``, which is removed (``tl.minimum`` is the elementwise one)."""
    return _reduce("min", x, axis)


def dot(a, b, acc=None) -> Tile:
    """``a @ b`` with fp32 accumulation (lowered to WGMMA/MMA); ``acc`` is added when given.

    f16 and bf16 operands are multiplied exactly on the GPU's tensor cores, as in the simulator.
    f32 operands run on the GPU as TF32 (10-bit mantissas, the tensor cores' f32 mode) while the
    simulator multiplies in full f32: compare their results with TF32's tolerance, or cast the
    operands to f16/bf16 where both must agree closely."""
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


# ``a @ b`` on tiles is :func:`dot` (set here: tiles sit below the language, which builds dot on them)
Tile.__matmul__ = lambda a, b: dot(a, b)


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
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        fail(f"buffer '{name}' needs a shape of positive Python ints, got {type(shape).__name__} {shape!r}")
    shape = tuple(shape)
    if not shape or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s > 0 for s in shape):
        traced = any(isinstance(s, Scalar) for s in shape)
        fail(f"buffer '{name}' needs a shape of positive Python ints, got {shape!r}"
             + (" (a traced scalar cannot size a buffer: shapes are static)" if traced else
                " (use // for a whole number)" if any(isinstance(s, float) for s in shape) else ""))
    shape = tuple(int(s) for s in shape)
    if any(s >= 2 ** 31 for s in shape):
        fail(f"buffer '{name}' of shape {shape}: kernels index each dimension with 32-bit ints, so every dimension "
             "must be below 2**31; split it (a long 1-d buffer into rows of a 2-d one)")
    unique = b.unique(name, b.buffers)
    buf = core.Buffer(unique, T.TensorType(shape, dtype_arg(dtype, f"buffer '{name}'"), space),
                      "workspace", loc=user_location(), cname=b.c_name(unique, b.buffers))
    b.buffers.append(buf)
    return TensorRef(buf)


#: a signal's slots are named by 32-bit int channels (as tensor dimensions are indexed), so fewer than this
MAX_SIGNAL_SLOTS = 2 ** 31


def signal(name: str, slots: int, scope: str = "local") -> SignalRef:
    """An array of ``slots`` counters. ``scope='local'`` links parts of one rank
    (producer/consumer); ``'symmetric'`` gives every rank a copy that peers notify."""
    b = _declare("signals")
    if not isinstance(name, str) or not name:
        fail(f"tl.signal's first argument is its name (a non-empty string, e.g. tl.signal(\"ready\", {slots})), "
             f"got {name!r}")
    if scope not in ("local", "symmetric"):
        fail(f"signal scope must be 'local' or 'symmetric', got {scope!r}")
    if not isinstance(slots, numbers.Integral) or isinstance(slots, bool) or slots <= 0:
        fail(f"signal '{name}' needs a positive number of slots, got {slots!r}")
    if slots >= MAX_SIGNAL_SLOTS:
        fail(f"signal '{name}' of {slots} slots: notifies and waits name a slot with a 32-bit int channel, so a "
             "signal has fewer than 2**31 slots (one per tile or chunk it orders is the usual count)")
    unique = b.unique(name, b.signals)
    sig = core.Signal(unique, T.SignalType(int(slots), T.SignalScope(scope)),
                      loc=user_location(), cname=b.c_name(unique, b.signals))
    b.signals.append(sig)
    return SignalRef(sig)


def static_assert(cond: bool, message: str) -> None:
    """A trace-time check: raise a CompilationError at the caller's line unless ``cond``."""
    if not isinstance(cond, (bool, np.bool_)):
        fail("tl.static_assert needs a Python bool (a static condition); use tl.when for traced ones")
    if not cond:
        fail(message)


__all__ = ["float16", "bfloat16", "float32", "int32", "constexpr", "Symmetric", "rank", "world_size", "range",
           "static_range", "when", "load", "load_rows", "load_scalar", "store", "full", "zeros", "fragment", "iota",
           "ewise", "exp", "exp2", "log", "sqrt", "abs", "sigmoid", "tanh", "erf", "rsqrt", "where", "cast", "sum", "max", "min", "expand_dims",
           "broadcast_to", "trans", "dot", "symmetric_buffer", "local_buffer", "signal", "static_assert"]

# numpy's ufuncs on tiles, fragments and traced scalars trace as these (np.exp(t) is tl.exp(t))
_install_numpy_protocols((Tile, Fragment, Scalar), {"exp": exp, "exp2": exp2, "log": log, "sqrt": sqrt, "tanh": tanh,
                                                    "maximum": _maximum, "minimum": _minimum})
