"""Random well-formed tile programs (:class:`.program_tree.Program`), for the differential fuzzer.

Every choice goes through a :class:`Chooser`: :class:`RandomChooser` (a seeded ``random.Random``,
for ``python -m tldsl.testing.fuzz``) or the hypothesis strategy's chooser (which shrinks a
failing program towards the first option of every choice, so options are listed simplest first).

What "well-formed" means here, so that the simulator accepts every program: each output element
is written by one task; a part that reads what another part wrote waits for the producer's notify
of every tile it reads; workspace rows are only read where something wrote them; tiles pushed
into a peer never spill into another rank's rows (slots are padded to whole tiles). Numbers stay
small (inputs in [-1, 1], magnitudes bounded, no division by anything near zero, comparisons only
on exact values) so a GPU run can be compared with fixed tolerances.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Protocol, Sequence, TypeVar

from .program_tree import (Arg, Binary, Broadcast, Cast, Expr, ExpandDims, Full, Iota, Let, Load, Part, Program,
                           Reduce, SignalDecl, Store, Trans, Unary, Var, When, Where, Workspace)

T = TypeVar("T")

#: the magnitude no intermediate may exceed (fp16 holds it with room; products stay exact-ish)
MAX_BOUND = 64.0
FLOAT_CONSTANTS = (0.5, 2.0, -1.5, 0.25, 3.0, -0.75)
INT_CONSTANTS = (1, 2, 3, -2, 5, 7)
#: the math functions the language may have beyond the basic ones (used where it has them)
BOUNDED_MATH = ("sigmoid", "tanh", "erf")


class Chooser(Protocol):
    def integer(self, lo: int, hi: int) -> int: ...          # inclusive
    def choice(self, options: Sequence[T]) -> T: ...


class RandomChooser:
    """Choices from a seeded ``random.Random``."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)

    def choice(self, options):
        return options[self.rng.randrange(len(options))]


def chance(ch: Chooser, percent: int) -> bool:
    """True ``percent``% of the time; shrinks to False."""
    return ch.integer(0, 99) >= 100 - percent


def weighted(ch: Chooser, table: dict):
    """A key of ``table`` with probability proportional to its weight; shrinks to the first key."""
    n = ch.integer(0, sum(table.values()) - 1)
    for key, w in table.items():
        if n < w:
            return key
        n -= w
    raise AssertionError("unreachable")


def cdiv(a, b):
    return -(-a // b)


def promote(*dtypes):
    """The dtype tl's elementwise math gives operands of these dtypes (as tldsl.tiles does)."""
    floats = {d for d in dtypes if d in ("f16", "bf16", "f32")}
    if not floats:
        return "i32"
    return floats.pop() if len(floats) == 1 else "f32"


def _language_has(fn: str) -> bool:
    import tldsl
    return hasattr(tldsl, fn)


class ProgramGenerator:
    """Builds one program: its arguments, declarations and parts."""

    def __init__(self, ch: Chooser):
        self.ch = ch
        self.args: list[Arg] = []
        self.decls: list = []
        self.parts: list[Part] = []
        self.counts: Counter = Counter()
        self.world_size = 1
        self.keep_int = False            # integer trees stay integer (they feed an i32 tensor)
        self.comm: str | None = None     # the communication schedule the library's collectives take
        self.compute: str | None = None  # a compute schedule: the order the compute parts' tiles run in
        self.dot_tiles: list[tuple[int, int, int]] = []  # (BM, BN, BK) of each K loop of dots generated
        self.recipe_tile: tuple[int, int, int] | None = None  # a part's recipe needs it as the schedule's tile
        self.row_tiles: dict[str, int] = {}               # part -> rows a task covers (where a stage said)
        self.pipeline: tuple[str, str] | None = None     # (producer, consumer) of a pipeline program

    # -- names and declarations ---------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        n = self.counts[prefix]
        self.counts[prefix] += 1
        return f"{prefix}{n}"

    def arg(self, shape, dtype, kind="input", symmetric=False, low=-1.0, high=1.0) -> str:
        prefix = {"input": "x", "output": "y", "rows": "rows", "table": "tab"}[kind]
        name = self.fresh(prefix)
        if kind == "input" and dtype == "i32":
            low, high = -8, 8
        self.args.append(Arg(name, tuple(shape), dtype, symmetric, kind, low, high))
        return name

    def workspace(self, shape, dtype, symmetric=False) -> str:
        name = self.fresh("ws")
        self.decls.append(Workspace(name, tuple(shape), dtype, symmetric))
        return name

    def signal(self, slots, scope="local") -> str:
        name = self.fresh("ready" if scope == "local" else "arrived")
        self.decls.append(SignalDecl(name, slots, scope))
        return name

    def part(self, role, grid, params, body, engine=None, row_tile: int | None = None) -> None:
        """Add a part; ``row_tile``: the rows a task of it covers (``r0 = pm * row_tile``), where
        another part's waits count its tasks."""
        self.parts.append(Part(self.fresh("stage" if role == "compute" else "comm"), role, tuple(grid),
                               tuple(params), tuple(body), engine))
        if row_tile is not None:
            self.row_tiles[self.parts[-1].name] = row_tile

    def program(self) -> Program:
        return Program(self.world_size, tuple(self.args), tuple(self.decls), tuple(self.parts), self.comm,
                       self.compute)

    # -- sizes ----------------------------------------------------------------------------------
    def tile(self, options=(8, 16, 32)) -> int:
        return self.ch.choice(options)

    def extent(self, tile: int, most_tiles: int = 2) -> int:
        """A tensor extent covered by at most ``most_tiles`` tiles; rarely a multiple of the tile."""
        return self.ch.integer(1, tile * most_tiles)

    def float_dtype(self) -> str:
        """An argument's float type: bf16 as often as the others (the type most models run in)."""
        return self.ch.choice(("f32", "f16", "bf16"))

    def half_dtype(self) -> str:
        """A tensor-core operand's 16-bit type."""
        return self.ch.choice(("f16", "bf16"))

    # -- expressions ----------------------------------------------------------------------------
    def bind(self, stmts: list, value: Expr, prefix: str = "t") -> Var:
        """``name = value`` in ``stmts``; the name, typed like the value."""
        name = self.fresh(prefix)
        stmts.append(Let(name, value))
        return Var(name=name, shape=value.shape, dtype=value.dtype, bound=value.bound, exact=value.exact)

    def tree(self, leaves: list[Expr], depth: int) -> Expr:
        """A random elementwise expression over ``leaves`` (all of one shape, or broadcastable)."""
        if depth <= 0 or chance(self.ch, 25):
            return self.ch.choice(leaves)
        x = self.tree(leaves, depth - 1)
        if x.dtype == "i32":
            return self.int_node(x, leaves, depth)
        kind = weighted(self.ch, {"binary": 40, "unary": 25, "where": 10, "cast": 10, "rowwise": 15})
        if kind == "binary":
            return self.binary(x, self.tree(leaves, depth - 1) if chance(self.ch, 60) else None)
        if kind == "unary":
            return self.unary(x)
        if kind == "where":
            return self.where(x, leaves, depth)
        if kind == "cast":
            to = self.ch.choice(tuple(d for d in ("f32", "f16", "bf16") if d != x.dtype))
            return Cast(shape=x.shape, dtype=to, bound=x.bound, exact=x.exact and to == "f32", x=x,
                        method=chance(self.ch, 50))
        return self.rowwise(x)

    def binary(self, a: Expr, b: Expr | None) -> Expr:
        ch = self.ch
        if b is None or b.dtype == "i32":
            c = ch.choice(FLOAT_CONSTANTS)
            op = ch.choice(("mul", "add"))
            bound = a.bound * abs(c) if op == "mul" else a.bound + abs(c)
            exact = a.exact and op == "mul" and abs(c) in (0.25, 0.5, 2.0)
            return Binary(shape=a.shape, dtype=a.dtype, bound=bound, exact=exact, op=op, a=a, b=c)
        shape = broadcast_shape(a.shape, b.shape)
        dtype = promote(a.dtype, b.dtype)
        op = ch.choice(("add", "sub", "mul", "div", "max", "min"))
        if op == "mul" and a.bound * b.bound > MAX_BOUND:
            op = "add"
        if op == "div":        # a / (|b| + 1): never near a division by zero
            den = Binary(shape=b.shape, dtype=b.dtype, bound=b.bound + 1, op="add",
                         a=Unary(shape=b.shape, dtype=b.dtype, bound=b.bound, exact=b.exact, fn="abs", x=b), b=1.0)
            return Binary(shape=shape, dtype=dtype, bound=a.bound, op="div", a=a, b=den)
        bound = {"add": a.bound + b.bound, "sub": a.bound + b.bound, "mul": a.bound * b.bound}.get(
            op, max(a.bound, b.bound))
        exact = a.exact and b.exact and op in ("max", "min")
        return Binary(shape=shape, dtype=dtype, bound=bound, exact=exact, op=op, a=a, b=b)

    def unary(self, x: Expr) -> Expr:
        ch = self.ch
        fns = ["neg", "abs", "exp", "log", "sqrt", "recip", "exp2"]
        fns += [f for f in (*BOUNDED_MATH, "rsqrt") if _language_has(f)]
        fn = ch.choice(tuple(fns))
        same = dict(shape=x.shape, dtype=x.dtype)
        if fn in ("neg", "abs"):
            return Unary(**same, bound=x.bound, exact=x.exact, fn=fn, x=x)
        if fn in BOUNDED_MATH:
            return Unary(**same, bound=1.0, fn=fn, x=x)
        if fn in ("exp", "exp2"):      # of at most 2: bounded by e^2 (and 4)
            capped = x if x.bound <= 2 else Binary(**same, bound=x.bound, op="min", a=x, b=2.0)
            return Unary(**same, bound=8.0, fn=fn, x=capped)
        shifted = Binary(**same, bound=x.bound + 1, op="add", a=Unary(**same, bound=x.bound, fn="abs", x=x),
                         b=1.0 if fn != "sqrt" else 0.25)
        bound = {"log": x.bound, "sqrt": x.bound ** 0.5 + 1, "recip": 1.0, "rsqrt": 1.0}[fn]
        return Unary(**same, bound=bound, fn=fn, x=shifted)

    def condition(self, leaves: list[Expr], shape) -> Expr | None:
        """A boolean tile of exact values (so every backend takes the same branch)."""
        exact = [leaf for leaf in leaves if leaf.exact and broadcast_shape(leaf.shape, shape) == tuple(shape)]
        if not exact:
            return None
        def compare():
            x = self.ch.choice(exact)
            op = self.ch.choice(("gt", "lt", "ge", "le", "ne", "eq"))
            c = self.ch.choice((0, 1, -2, 5, 9)) if x.dtype == "i32" else self.ch.choice((0.0, 0.25, -0.5))
            return Binary(shape=x.shape, dtype="i1", exact=True, op=op, a=x, b=c)
        cond = compare()
        if chance(self.ch, 25):       # two conditions joined: & or |
            other = compare()
            cond = Binary(shape=broadcast_shape(cond.shape, other.shape), dtype="i1", exact=True,
                          op=self.ch.choice(("and", "or")), a=cond, b=other)
        return cond

    def where(self, x: Expr, leaves, depth) -> Expr:
        cond = self.condition(leaves, x.shape)
        if cond is None:
            return self.unary(x)
        other = self.tree(leaves, depth - 1) if chance(self.ch, 50) else None
        if other is None or other.dtype == "i32" or broadcast_shape(other.shape, x.shape) != x.shape:
            c = self.ch.choice(FLOAT_CONSTANTS)
            return Where(shape=x.shape, dtype=x.dtype, bound=max(x.bound, abs(c)), exact=x.exact, cond=cond,
                         a=x, b=c)
        return Where(shape=x.shape, dtype=promote(x.dtype, other.dtype), bound=max(x.bound, other.bound),
                     exact=x.exact and other.exact, cond=cond, a=x, b=other)

    def rowwise(self, x: Expr) -> Expr:
        """``x`` combined with a reduction of itself along one axis (``x - max(x, 1)[:, None]``)."""
        if len(x.shape) != 2:
            return self.unary(x)
        ch = self.ch
        axis = ch.choice((1, 0))
        fn = ch.choice(("max", "sum", "min"))
        rshape = x.shape[:axis] + x.shape[axis + 1:]
        red: Expr = Reduce(shape=rshape, dtype=x.dtype, bound=x.bound, exact=x.exact and fn != "sum", fn=fn, x=x,
                           axis=axis)
        if fn == "sum":                   # a mean-like scale keeps the bound
            scale = 1.0 / pow2_at_least(x.shape[axis])
            red = Binary(shape=rshape, dtype=x.dtype, bound=x.bound, op="mul", a=red, b=scale)
        e = ExpandDims(shape=x.shape[:axis] + (1,) + x.shape[axis + 1:], dtype=x.dtype, bound=red.bound,
                       exact=red.exact, x=red, axis=axis, indexing=chance(self.ch, 50))
        return Binary(shape=x.shape, dtype=x.dtype, bound=2 * x.bound, op="sub", a=x, b=e)

    def int_node(self, x: Expr, leaves, depth) -> Expr:
        ch = self.ch
        kind = weighted(ch, {"binary": 40, "const": 30, "unary": 10, "where": 10,
                             "to_float": 0 if self.keep_int else 10})
        if kind == "binary":
            y = self.tree([leaf for leaf in leaves if leaf.dtype == "i32"] or [x], depth - 1)
            op = ch.choice(("add", "sub", "max", "min", "mul"))
            if op == "mul" and x.bound * y.bound > 10_000:
                op = "add"
            bound = x.bound * y.bound if op == "mul" else x.bound + y.bound
            return Binary(shape=broadcast_shape(x.shape, y.shape), dtype=promote(x.dtype, y.dtype), bound=bound,
                          exact=True, op=op, a=x, b=y)
        if kind == "const":
            op = ch.choice(("add", "mul", "floordiv", "mod"))
            c = ch.choice(INT_CONSTANTS)
            if op in ("floordiv", "mod"):
                c = abs(c)                # Python's floor semantics on negative tiles, by a positive divisor
            bound = {"add": x.bound + abs(c), "mul": x.bound * abs(c), "floordiv": x.bound, "mod": abs(c)}[op]
            return Binary(shape=x.shape, dtype="i32", bound=bound, exact=True, op=op, a=x, b=c)
        if kind == "unary":
            return Unary(shape=x.shape, dtype="i32", bound=x.bound, exact=True, fn=ch.choice(("neg", "abs")), x=x)
        if kind == "where":
            cond = self.condition(leaves, x.shape)
            if cond is not None:
                return Where(shape=x.shape, dtype="i32", bound=max(x.bound, 3), exact=True, cond=cond, a=x,
                             b=ch.choice((0, 3, -1)))
        cast = Cast(shape=x.shape, dtype="f32", bound=x.bound, exact=True, x=x, method=chance(ch, 50))
        return Binary(shape=x.shape, dtype="f32", bound=x.bound / 16, exact=True, op="mul", a=cast, b=0.0625)

    # -- leaves: tiles a body reads -------------------------------------------------------------
    def tile_leaves(self, stmts, tensors, r0, c0, BM, BN, dtype) -> list[Expr]:
        """One to three tiles of shape (BM, BN) at (r0, c0) read from ``tensors`` (name -> (shape,
        dtype, exact: whether its contents are the same bits on every backend)) or made on the spot:
        a transposed tile, a row vector, an iota ramp or column index, a constant."""
        ch = self.ch
        leaves = []
        for name, (shape, dt, exact) in tensors.items():
            leaves.append(self.bind(stmts, Load(shape=(BM, BN), dtype=dt, exact=exact, tensor=name, offsets=(r0, c0),
                                                box=(BM, BN))))
        if dtype == "i32":
            return leaves
        extra = weighted(ch, {"none": 25, "trans": 15, "bias": 15, "iota": 10, "cols": 10, "full": 10, "bf16": 10})
        if extra == "trans":      # a tile of a transposed input, turned round
            name = self.arg(_tail_shape(tensors)[::-1], self.float_dtype())
            t = Load(shape=(BN, BM), dtype=self.args[-1].dtype, exact=True, tensor=name, offsets=(c0, r0), box=(BN, BM))
            leaves.append(self.bind(stmts, Trans(shape=(BM, BN), dtype=t.dtype, exact=True, x=t)))
        elif extra == "bias":     # a row vector broadcast down the tile
            n = _tail_shape(tensors)[1]
            name = self.arg((n,), self.float_dtype())
            b = Load(shape=(BN,), dtype=self.args[-1].dtype, exact=True, tensor=name, offsets=(c0,), box=(BN,))
            e = ExpandDims(shape=(1, BN), dtype=b.dtype, exact=True, x=b, axis=0, indexing=chance(ch, 50))
            if chance(ch, 50):
                e = Broadcast(shape=(BM, BN), dtype=b.dtype, exact=True, x=e)
            leaves.append(self.bind(stmts, e, "bias"))
        elif extra == "iota":     # the column index as a float ramp in [0, 1)
            i = Cast(shape=(BN,), dtype="f32", bound=BN, exact=True, x=Iota(shape=(BN,), dtype="i32", exact=True))
            ramp = Binary(shape=(BN,), dtype="f32", bound=1.0, exact=True, op="mul", a=i, b=1.0 / pow2_at_least(BN))
            leaves.append(self.bind(stmts, ExpandDims(shape=(1, BN), dtype="f32", exact=True, x=ramp, axis=0,
                                                      indexing=True), "ramp"))
        elif extra == "cols":     # the column index, for masks
            cols = Binary(shape=(BN,), dtype="i32", bound=float(_tail_shape(tensors)[1] + BN), exact=True, op="add",
                          a=Iota(shape=(BN,), dtype="i32", exact=True), b=c0)
            leaves.append(self.bind(stmts, ExpandDims(shape=(1, BN), dtype="i32", bound=cols.bound, exact=True, x=cols,
                                                      axis=0, indexing=chance(ch, 50)), "cols"))
        elif extra == "full":
            leaves.append(self.bind(stmts, Full(shape=(BM, BN), dtype=self.ch.choice(("f32", "f16")), bound=0.5,
                                                exact=True, value=self.ch.choice((0.5, 0.0, -0.25))), "const"))
        elif extra == "bf16":     # compute in bf16: a leaf cast down (exact: inputs are multiples of 1/64)
            leaves[0] = self.bind(stmts, Cast(shape=leaves[0].shape, dtype="bf16", exact=True, x=leaves[0],
                                              method=chance(ch, 50)))
        return leaves

    def store(self, stmts, out: str, offsets, value: Expr, guards: tuple[str, str] | None = None,
              alternative: Expr | None = None) -> None:
        """Store ``value``; with ``guards`` (a condition and its complement), tasks where the first
        holds store ``value`` and the others ``alternative`` (each element still written once)."""
        if guards is None:
            stmts.append(Store(out, offsets, value))
            return
        stmts.append(When(guards[0], (Store(out, offsets, value),)))
        stmts.append(When(guards[1], (Store(out, offsets, alternative),)))


def broadcast_shape(a, b):
    """numpy's broadcast of two tile shapes (a 1-d row against a 2-d tile: the tile's shape)."""
    if len(a) != len(b):
        return tuple(a) if len(a) > len(b) else tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"shapes {a} and {b} do not broadcast")
        out.append(max(x, y))
    return tuple(out)


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _tail_shape(tensors: dict):
    """The shape of the first tensor a stage reads (the one its tiles cut)."""
    return next(iter(tensors.values()))[0]
