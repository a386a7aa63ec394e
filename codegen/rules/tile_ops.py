"""The C++ of every tile op for the general lowering (:mod:`..recipes.general`), in one table.

:data:`RULES` maps each IR op name to its :class:`Rule`: ``statement`` — what the CTA runs at
the op (a loop of its threads over the op's output elements; a dot on tensor cores; the group's
barrier only between statements that touch the same memory, :mod:`.barriers`) — and
``element`` — the C++ of one element of the op's value at given tile
coordinates, for values computed where they are consumed (the plan,
:mod:`..plan.general`, says which values those are; every other value is read from its
slot, in shared memory or in the group's global-memory scratch). Index code, loops and guards
come from :mod:`.scalars`; waits, notifies and the data primitives' element moves from
:mod:`.primitives` (waits and notifies through :mod:`.sync`).

Every element follows the simulator's rules (numpy's): loads outside a tensor read 0, stores
outside it are dropped, 16-bit floats compute in float and round at every op, i32 and float
operands together compute in double, casts to i32 truncate (NaN and out-of-range values give
INT_MIN, as numpy does on x86), reductions start from their first element (a float sum then adds
+0: numpy's starts from it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...ir import core
from ...ir import types as T
from ...ir.opdefs import DATA_OPS, FLOAT_RESULT_OPS, NOTIFY_OPS, WAIT_OPS, data_operands
from ...ir.semantics import float_of
from ..abi import buffer_param, is_this_rank, marker, peer_buffer_param
from ..dtypes import elem_bytes, scalar_ctype
from ..match.general import WHAT
from ..plan.general import GeneralPlan, reduce_partials, reduce_slot
from . import primitives
from .dot_loop import emit_dot_loop, is_pipelined
from . import held as held_rules
from .chunks import Elements, chunk_coords, row_pointer, storage_ctype, vec_ok
from .scalars import FloatConstant, c_double_literal, c_literal, element_expr
from .sync import SignalEmitter
from .barriers import BarrierTracker, slot_access, tensor_access

#: the tensor-core operand kind of a dot, by operand dtype (``include/tldsl/general.hpp``):
#: f16 / bf16 multiply exactly (WGMMA m64nNk16 where the plan puts the dot there, else mma.sync
#: m16n8k16); f32 operands run as TF32 (mma.sync m16n8k8), their inputs rounded to TF32 — a
#: dot of f32 tiles is a TF32 product with fp32 accumulation
MMA_KIND = {"f16": "tldsl::gen::MmaKind::kF16", "bf16": "tldsl::gen::MmaKind::kBF16",
            "f32": "tldsl::gen::MmaKind::kTF32"}


#: the barrier of a task group (the CTA when it runs one): between statements that touch the same
#: memory (:mod:`.barriers`)
BARRIER = "tldsl::gen::group_sync<kGroups>(grp, gthreads);"
#: 16-byte chunks of a tile's rows a thread of a load keeps in flight at once (8 spilled in the
#: 512-thread CTAs of the memory-bound parts, 128 registers a thread)
LOAD_BATCH = 4
#: elements one thread of an element loop takes per iteration (thread t of the group: elements
#: t, t + threads, ...: neighbouring threads on neighbouring elements, so shared memory is read
#: without bank conflicts, and independent work to overlap)
ELEMENT_RUN = 4


def value_ctype(dtype: T.DType) -> str:
    """The C++ type tile math holds an element of ``dtype`` in (16-bit floats: float)."""
    return "float" if dtype.is_float else scalar_ctype(dtype)


def literal(value, dtype: T.DType) -> str:
    """A C++ literal of ``value`` stored as ``dtype`` (the simulator's ``to_storage``: 16-bit
    floats rounded to nearest even, floats to i32 truncated)."""
    if dtype.kind == "bool":
        return c_literal(bool(value))
    if dtype.kind == "int":
        return c_literal(int(np.asarray(value).astype(np.int32)))
    return c_literal(float_of(value, dtype.name))


#: the functions rounding a float to a 16-bit type's precision (the result still a float)
_ROUNDING = {"f16": "tldsl::gen::round_f16", "bf16": "tldsl::gen::round_bf16"}


def round_to(dtype: T.DType, expr: str, compute: str) -> str:
    """``expr`` (in ``compute``) as a value of ``dtype``: 16-bit floats rounded, double narrowed."""
    if dtype.name in _ROUNDING:
        return f"{_ROUNDING[dtype.name]}({expr})"
    if dtype.name == "f32" and compute != "float":
        return f"(float)({expr})"
    if dtype.kind == "int" and compute != "int":
        return f"(int)({expr})"
    return expr


def convert(expr: str, src: str, dst: str) -> str:
    """A value held in C type ``src`` as compute type ``dst`` (a float constant as a double: the
    exact double of its Python value, which the simulator's float64 math uses)."""
    if src == dst:
        return expr
    if dst == "double" and isinstance(expr, FloatConstant):
        return c_double_literal(expr.value)
    if dst == "bool":
        return f"(({expr}) != 0)"
    return f"({dst})({expr})"


def _kind(dtype: T.DType) -> str:
    return "float" if dtype.is_float else ("int" if dtype.kind == "int" else "bool")


def compute_type(op: core.Op) -> str:
    """The C type an ``ewise`` op computes in, as numpy promotes: tiles are typed arrays,
    scalars and constants are Python numbers (weak); f32 with i32 is float64; math on
    integers is float64."""
    kind = op.attrs["op"]
    ops = op.operands[1:] if kind == "where" else op.operands
    strong = {_kind(a.type.dtype) for a in ops if isinstance(a.type, T.TileType)}
    weak = {_kind(a.type.dtype) for a in ops if not isinstance(a.type, T.TileType)}
    if "float" in strong:
        ct = "double" if "int" in strong else "float"
    elif "int" in strong:
        ct = "double" if "float" in weak else "int"
    else:
        ct = "double" if "float" in weak else ("int" if "int" in weak else "bool")
    if kind in FLOAT_RESULT_OPS and ct in ("int", "bool"):
        ct = "double"
    return ct


def operand_coords(coords: list[str], shape, out_shape) -> list[str]:
    """The coordinates of an operand of ``shape`` broadcast (numpy's rules) to ``out_shape``."""
    lead = len(out_shape) - len(shape)
    return [("0" if s == 1 and out_shape[lead + a] != 1 else coords[lead + a]) for a, s in enumerate(shape)]


def flat_index(coords: list[str], shape) -> str:
    """Row-major offset of ``coords`` in a tile of ``shape``."""
    terms, stride = [], 1
    for c, s in reversed(list(zip(coords, shape))):
        if c != "0":
            terms.append(c if stride == 1 else f"{c} * {stride}")
        stride *= s
    return " + ".join(reversed(terms)) or "0"


# -- element rules: one element of an op's value -----------------------------------------------------

def _ewise_element(em, op, coords, el: Elements) -> str:
    kind = op.attrs["op"]
    out_shape = op.result.type.shape
    ct = compute_type(op)
    args = []
    for i, a in enumerate(op.operands):
        x = em.value(a, operand_coords(coords, a.type.shape, out_shape) if isinstance(a.type, T.TileType) else [], el)
        src = value_ctype(a.type.dtype)
        args.append(convert(x, src, "bool") if (kind == "where" and i == 0) else convert(x, src, ct))
    rdt = op.result.type.dtype
    expr = element_expr(kind, args, ct)
    if rdt.kind == "bool":
        return el.var("bool", expr)
    if rdt.name in _ROUNDING:
        return el.rounded_var(storage_ctype(rdt), _ROUNDING[rdt.name], expr)
    return el.var(value_ctype(rdt), round_to(rdt, expr, ct))


def _cast_element(em, op, coords, el: Elements) -> str:
    src, dst = op.operands[0].type.dtype, op.result.type.dtype
    x = em.value(op.operands[0], coords, el)
    if dst.kind == "bool":
        return el.var("bool", f"(({x}) != 0)")
    if dst.kind == "int":
        return el.var("int", f"tldsl::gen::f2i({x})" if src.is_float else f"(int)({x})")
    if dst.name in _ROUNDING:
        return el.rounded_var(storage_ctype(dst), _ROUNDING[dst.name], f"(float)({x})")
    return el.var("float", f"(float)({x})")


def _full_element(em, op, coords, el: Elements) -> str:
    return literal(op.attrs["value"], op.attrs["dtype"])


def _iota_element(em, op, coords, el: Elements) -> str:
    return coords[0]


def _expand_dims_element(em, op, coords, el: Elements) -> str:
    axis, n = op.attrs["axis"], len(op.operands[0].type.shape)
    pos = axis if axis >= 0 else max(0, n + axis)      # where the IR's type put the unit axis (list.insert)
    return em.value(op.operands[0], coords[:pos] + coords[pos + 1:], el)


def _broadcast_element(em, op, coords, el: Elements) -> str:
    src = op.operands[0]
    return em.value(src, operand_coords(coords, src.type.shape, op.result.type.shape), el)


def _trans_element(em, op, coords, el: Elements) -> str:
    return em.value(op.operands[0], coords[::-1], el)


# -- statement rules: what the CTA runs at an op ------------------------------------------------------

def _tensor_index(dims, gcoords: list[str]) -> tuple[str, str]:
    """(in-bounds condition, flat 64-bit offset) of tensor coordinates ``gcoords``."""
    cond = " && ".join(f"(unsigned)({g}) < {d}u" for g, d in zip(gcoords, dims))
    terms, stride = [], 1
    for g, d in reversed(list(zip(gcoords, dims))):
        terms.append(f"(long long)({g})" if stride == 1 else f"(long long)({g}) * {stride}ll")
        stride *= d
    return cond, " + ".join(reversed(terms))


def _load_statement(em, op, ind, lines):
    buf = op.operands[0].owner
    offs = [em.name(o, op) for o in op.operands[1:]]
    box = tuple(op.attrs["shape"])
    shape = tuple(op.result.type.shape)
    lead = len(box) - len(shape)
    if op.result.id in em.plan.held:
        return held_rules.held_load(em, op, offs, ind, lines)
    slot = em.slot(op.result)
    st = storage_ctype(buf.type.dtype)
    if shape and len(box) == len(buf.type.shape) and elem_bytes(buf.type.dtype) in (2, 4):
        return _chunked_load(em, op, buf, offs, lead, shape, slot, st, ind, lines)

    def body(coords, el):
        g = [offs[a] if a < lead else f"{offs[a]} + {coords[a - lead]}" for a in range(len(box))]
        cond, flat = _tensor_index(buf.type.shape, g)
        return [f"{slot}[{flat_index(coords, shape)}] = ({cond}) ? {buffer_param(buf)}[{flat}] : "
                f"tldsl::gen::put<{st}>(0);"]
    em.element_loop(op, shape, body, ind, lines, f"load {buf.name} -> {slot}")


def _chunked_load(em, op, buf, offs, lead, shape, slot, st, ind, lines):
    """A tile load as 16-byte chunks of its rows: each thread loads LOAD_BATCH chunks into
    registers (vector loads where a chunk lies inside the tensor and is aligned, element by
    element at the edges, zeros outside), then writes them to the tile's slot."""
    V = 16 // elem_bytes(buf.type.dtype)
    n = shape[-1]
    nc = math.prod(shape[:-1]) * -(-n // V)
    dims = buf.type.shape
    base = buffer_param(buf)
    k = em.fresh()
    ch, e0, b, vec = f"ch{k}", f"e{k}", f"b{k}", f"vec{k}"
    i1, i2, i3 = ind + "  ", ind + "    ", ind + "      "

    def chunk(e):
        el = Elements(em, op)
        coords, flat = chunk_coords(el, e, shape, V)
        g = [offs[a] if a < lead else f"{offs[a]} + {coords[a - lead]}" for a in range(len(dims))]
        return el, coords, flat, g
    lines.append(f"{ind}{{  // load {buf.name} -> {slot}, 16-byte chunks of its rows{marker(op.loc)}")
    lines.append(f"{i1}const bool {vec} = {vec_ok(buf, base, offs[-1], V)};")
    lines.append(f"{i1}(void){vec};")
    lines.append(f"{i1}for (int {e0} = tid; {e0} < {nc}; {e0} += {LOAD_BATCH} * gthreads) {{")
    lines.append(f"{i2}tldsl::comm::Chunk<{st}, {V}> {ch}[{LOAD_BATCH}];")
    lines.append(f"{i2}#pragma unroll")
    lines.append(f"{i2}for (int {b} = 0; {b} < {LOAD_BATCH}; ++{b}) {{")
    e = f"e{k}x"
    el, coords, flat, g = chunk(e)
    lines.append(f"{i3}const int {e} = {e0} + {b} * gthreads;")
    lines.append(f"{i3}if ({e} < {nc}) {{")
    if len(dims) > 1:
        row, col, ncols = row_pointer(el, base, dims, g, st, False)
    else:
        row, col, ncols = base, g[-1], dims[-1]
    lines += [f"{i3}  {ln}" for ln in el.lines]
    lines.append(f"{i3}  " + primitives.tile_pull_data(st, row, col, ncols, chunk=f"{ch}[{b}]", vec=str(V),
                                                     left=f"{n} - {coords[-1]}", vec_ok=vec))
    lines.append(f"{i3}}}")
    lines.append(f"{i2}}}")
    lines.append(f"{i2}#pragma unroll")
    lines.append(f"{i2}for (int {b} = 0; {b} < {LOAD_BATCH}; ++{b}) {{")
    el, coords, flat, g = chunk(e)
    lines.append(f"{i3}const int {e} = {e0} + {b} * gthreads;")
    lines.append(f"{i3}if ({e} < {nc}) {{")
    lines += [f"{i3}  {ln}" for ln in el.lines]
    if n % V == 0:
        lines.append(f"{i3}  tldsl::comm::st_vec<{st}, {V}>({slot} + {flat}, {ch}[{b}]);")
    else:
        lines.append(f"{i3}  #pragma unroll")
        lines.append(f"{i3}  for (int v = 0; v < {V}; ++v)")
        lines.append(f"{i3}    if ({coords[-1]} + v < {n}) {slot}[{flat} + v] = {ch}[{b}].get(v);")
    lines.append(f"{i3}}}")
    lines.append(f"{i2}}}")
    lines.append(f"{i1}}}")
    lines.append(f"{ind}}}")
    lines.append(f"{ind}{BARRIER}")


def _load_rows_statement(em, op, ind, lines):
    t = op.operands[0].owner
    shape = tuple(op.result.type.shape)
    slot = em.slot(op.result)
    st = storage_ctype(t.type.dtype)

    def body(coords, el):
        cond, elem = _row_element(em, op, coords, el)
        return [f"{slot}[{flat_index(coords, shape)}] = ({cond}) ? {elem} : tldsl::gen::put<{st}>(0);"]
    em.element_loop(op, shape, body, ind, lines, f"load_rows {t.name} -> {slot}")


def _row_element(em, op, coords, el) -> tuple[str, str]:
    """``(condition, element)`` of ``load_rows`` / ``add_rows``: tensor element ``(rows[coords[0]],
    col + coords[1])``, and whether that row id is not negative and both lie inside the tensor."""
    buf, rows, col = op.operands[:3]
    t = buf.owner
    nrows, ncols = t.type.shape
    r = em.value(rows, [coords[0]], el)
    c = f"{em.name(col, op)} + {coords[1]}"
    return (f"{r} >= 0 && {r} < {nrows} && (unsigned)({c}) < {ncols}u",
            f"{buffer_param(t)}[(long long)({r}) * {ncols}ll + ({c})]")


def _add_rows_statement(em, op, ind, lines):
    t, tile = op.operands[0].owner, op.operands[3]
    shape = tuple(tile.type.shape)
    if _adds_in_pairs(em, op, t, shape):
        return _add_row_pairs(em, op, t, tile, shape, ind, lines)

    def body(coords, el):
        cond, elem = _row_element(em, op, coords, el)
        return [f"if ({cond}) tldsl::gen::add_to(&{elem}, (float)({em.value(tile, coords, el)}));"]
    em.element_loop(op, shape, body, ind, lines, f"add_rows -> {t.name}")


def _adds_in_pairs(em, op, t, shape) -> bool:
    """Whether ``add_rows`` adds two adjacent columns a thread (``tldsl::gen::add_pair``): into a
    16-bit tensor, whose single-element reductions sm_90 runs as compare-and-swap loops, from a
    tile of an even column count. The pairs replace the plain element loop only: ``add_rows``
    never runs in chunk order today (``plan/held.py``), and should it, that walk stays as it is."""
    return t.type.dtype.bits == 16 and shape[1] % 2 == 0 and id(op) not in em.plan.canon


def _add_row_pairs(em, op, t, tile, shape, ind, lines):
    """``add_rows`` over column pairs: a thread adds columns ``2j`` and ``2j + 1`` of a row, as one
    packed reduction where both lie inside the tensor and their address is 4-byte aligned."""
    def body(coords, el):
        c0 = [coords[0], f"(2 * {coords[1]})"]
        c1 = [coords[0], f"(2 * {coords[1]} + 1)"]
        cond0, elem = _row_element(em, op, c0, el)
        cond1, _ = _row_element(em, op, c1, el)
        return [f"tldsl::gen::add_pair(&{elem}, (float)({em.value(tile, c0, el)}), "
                f"(float)({em.value(tile, c1, el)}), {cond0}, {cond1});"]
    em.element_loop(op, (shape[0], shape[1] // 2), body, ind, lines, f"add_rows -> {t.name}, column pairs")


def _store_statement(em, op, ind, lines):
    buf, *offs_v, tile = op.operands
    t = buf.owner
    offs = [em.name(o, op) for o in offs_v]
    shape = tuple(tile.type.shape)
    st = storage_ctype(t.type.dtype)
    if id(op) in em.plan.canon:
        return held_rules.held_store(em, op, t, offs, tile, em.plan.canon[id(op)], ind, lines, BARRIER)
    if shape and len(shape) == len(offs) == len(t.type.shape) and elem_bytes(t.type.dtype) in (2, 4):
        return _chunked_store(em, op, t, offs, tile, shape, st, ind, lines)

    def body(coords, el):
        x = em.value(tile, coords, el)
        g = [f"{o} + {c}" for o, c in zip(offs, coords)]
        cond, flat = _tensor_index(t.type.shape, g)
        return [f"if ({cond}) {buffer_param(t)}[{flat}] = {el.put(st, x)};"]
    em.element_loop(op, shape, body, ind, lines, f"store -> {t.name}")


def _chunked_store(em, op, t, offs, tile, shape, st, ind, lines):
    """A tile store as 16-byte chunks of its rows: each thread computes a chunk's elements, then
    stores it as one vector where it lies inside the tensor and is aligned (element by element
    at the edges, nothing outside)."""
    V = 16 // elem_bytes(t.type.dtype)
    n = shape[-1]
    nc = math.prod(shape[:-1]) * -(-n // V)
    dims = t.type.shape
    base = buffer_param(t)
    k = em.fresh()
    ch, e, v, vec = f"ch{k}", f"e{k}", f"v{k}", f"vec{k}"
    i1, i2, i3 = ind + "  ", ind + "    ", ind + "      "
    el = Elements(em, op)
    coords, _ = chunk_coords(el, e, shape, V)
    g = [f"{o} + {c}" for o, c in zip(offs, coords)]
    if len(dims) > 1:
        row, col, ncols = row_pointer(el, base, dims, g, st, True)
    else:
        row, col, ncols = base, g[-1], dims[-1]
    inner = Elements(em, op)
    x = em.value(tile, coords[:-1] + [f"({coords[-1]} + {v})"], inner)
    lines.append(f"{ind}{{  // store -> {t.name}, 16-byte chunks of the tile's rows{marker(op.loc)}")
    lines.append(f"{i1}const bool {vec} = {vec_ok(t, base, offs[-1], V)};")
    lines.append(f"{i1}(void){vec};")
    lines.append(f"{i1}for (int {e} = tid; {e} < {nc}; {e} += gthreads) {{")
    lines += [f"{i2}{ln}" for ln in el.lines]
    lines.append(f"{i2}tldsl::comm::Chunk<{st}, {V}> {ch} = {{}};")
    lines.append(f"{i2}#pragma unroll")
    lines.append(f"{i2}for (int {v} = 0; {v} < {V}; ++{v}) {{")
    guard = n % V != 0
    if guard:
        lines.append(f"{i3}if ({coords[-1]} + {v} < {n}) {{")
    j = i3 + ("  " if guard else "")
    lines += [f"{j}{ln}" for ln in inner.lines]
    lines.append(f"{j}{ch}.set({v}, {inner.put(st, x)});")
    if guard:
        lines.append(f"{i3}}}")
    lines.append(f"{i2}}}")
    full = (1 << V) - 1
    lines.append(f"{i2}" + primitives.tile_push_data(st, row, col, ncols, ch, f"{full}u", vec=str(V),
                                                    left=f"{n} - {coords[-1]}", vec_ok=vec))
    lines.append(f"{i1}}}")
    lines.append(f"{ind}}}")
    lines.append(f"{ind}{BARRIER}")


_REDUCE = {"sum": "tldsl::gen::add({0}, {1})", "max": "tldsl::gen::max_({0}, {1})",
           "min": "tldsl::gen::min_({0}, {1})"}
_REDUCE_BOOL = {"sum": "({0} || {1})", "max": "({0} || {1})", "min": "({0} && {1})"}
#: what a float reduction starts from: combining it with x gives x, except that a sum starts from +0
#: as numpy's does (its identity): a sum of -0s is +0 (ir/semantics.py's ``_sum_reduce``)
_IDENTITY = {"sum": "0.0f", "max": "__uint_as_float(0xff800000u)", "min": "__uint_as_float(0x7f800000u)"}


@dataclass(frozen=True)
class _Reduction:
    """What both reduction renderings read of a ``reduce`` op."""
    em: object
    op: core.Op
    partials: str | None = None     # reduce these K partial results an output instead (held chunks')
    K: int = 0

    @property
    def x(self):
        return self.op.operands[0]

    @property
    def axis(self) -> int:
        return self.op.attrs["axis"]

    @property
    def kind(self) -> str:
        return self.op.attrs["op"]

    @property
    def n(self) -> int:
        return self.K if self.partials else self.x.type.shape[self.axis]

    @property
    def shape(self) -> tuple:
        return tuple(self.op.result.type.shape)

    @property
    def nout(self) -> int:
        return math.prod(self.shape)

    @property
    def dt(self):
        return self.op.result.type.dtype

    @property
    def ct(self) -> str:
        return value_ctype(self.dt)

    @property
    def comb(self) -> str:
        return (_REDUCE_BOOL if self.dt.kind == "bool" else _REDUCE)[self.kind]

    def result(self, acc: str) -> str:
        """The reduction's value from its combined ``acc``: a float sum plus +0, as numpy's sum starts
        from +0 (a sum of -0s is +0, where the elements alone add to -0; every other value stays)."""
        if self.kind == "sum" and self.dt.is_float:
            return f"tldsl::gen::add({acc}, 0.0f)"
        return acc

    def element_at(self, r: str, coords: list[str]) -> tuple[list[str], str]:
        """(lines, C++ value) of element ``r`` of the reduced axis at output ``coords`` (its own
        lines: they run inside the reduction's loop)."""
        if self.partials:
            return [], f"{self.partials}[({flat_index(coords, self.shape)}) * {self.K} + {r}]"
        el = Elements(self.em, self.op)
        v = self.em.value(self.x, coords[:self.axis] + [r] + coords[self.axis:], el)
        return el.lines, v

    def decode(self, idx: str, coords: list[str], ind: str) -> list[str]:
        """``coords`` of flat output index ``idx``, row-major."""
        out = []
        for a, s_ in enumerate(self.shape):
            inner = math.prod(self.shape[a + 1:])
            xx = idx if inner == 1 else f"{idx} / {inner}"
            if a > 0:
                xx = f"({xx}) % {s_}"
            out.append(f"{ind}const int {coords[a]} = {xx};")
        return out

    def shuffle(self, acc: str, off: str, lanes: str, ind: str) -> list[str]:
        """``acc`` combined over ``lanes`` consecutive lanes of a warp."""
        return [f"{ind}for (int {off} = {lanes} / 2; {off} > 0; {off} >>= 1) {{",
                f"{ind}  const {self.ct} {acc}o = tldsl::gen::shfl_xor({acc}, {off});",
                f"{ind}  {acc} = {self.comb.format(acc, acc + 'o')};", f"{ind}}}"]


def _reduce_statement(em, op, ind, lines):
    """Each output element reduced by L consecutive lanes of a warp (L a power of two up to 32,
    at most the reduced length): lane l combines elements l, l + L, ..., then the lanes combine
    their partial values through warp shuffles. Every thread of the group runs the same
    iterations (an out-of-range lane reduces the last output again and writes nothing), so the
    whole warp is there for each shuffle. Where the outputs would leave warps idle:
    :func:`_reduce_by_warps`."""
    order = em.plan.canon.get(id(op))
    if order is not None:
        return _reduce_held(em, op, order, ind, lines)
    _reduce_rows(_Reduction(em, op), ind, lines)


def _reduce_held(em, op, order, ind, lines):
    """A reduction along the rows of held registers: of one row, thread by thread, then warp by
    warp (:func:`.held.one_row_reduction`); of several, each chunk's partial result into shared
    memory (:func:`.held.chunk_partials`), then those reduced as a row reduction reduces."""
    slot = em.slot(op.result)
    red = _Reduction(em, op)
    layout = reduce_slot(op, em.plan.threads, order)
    if layout.one_row:
        every = replicated_name(op.result) if op.result.id in em.plan.replicated else None
        return held_rules.one_row_reduction(red, order, slot, layout.warp_offset, _IDENTITY[red.kind],
                                            storage_ctype(red.dt), ind, lines, BARRIER, every)
    part = f"chunks{em.fresh()}"
    lines += [f"{ind}{{  // {red.kind} over axis {red.axis} of registers -> {slot}{marker(op.loc)}",
              f"{ind}  {red.ct}* const {part} = reinterpret_cast<{red.ct}*>(reinterpret_cast<unsigned char*>({slot}) + "
              f"{layout.chunk_offset});"]
    held_rules.chunk_partials(red, order, part, ind + "  ", lines, BARRIER)
    _reduce_rows(_Reduction(em, op, part, order.K), ind + "  ", lines)
    lines.append(f"{ind}}}")


def _reduce_rows(red: _Reduction, ind, lines):
    em, op = red.em, red.op
    P = reduce_partials(op, em.plan.threads, red.n)
    if P > 1:
        return _reduce_by_warps(red, P, ind, lines)
    n, shape, nout, ct, comb = red.n, red.shape, red.nout, red.ct, red.comb
    slot = em.slot(op.result)
    L = 1
    while L * 2 <= min(32, n):
        L *= 2
    k = em.fresh()
    kl, e0, e, o, lane, acc, r, off = (f"kL{k}", f"e{k}", f"e{k}x", f"o{k}", f"l{k}", f"acc{k}", f"r{k}", f"s{k}")
    coords = [f"c{k}x{a}" for a in range(len(shape))]
    first, v0 = red.element_at(lane, coords)
    rest, v = red.element_at(r, coords)
    i1, i2 = ind + "  ", ind + "    "
    L_ = [f"{ind}{{  // {red.kind} over axis {red.axis} -> {slot}, {L} lanes an output{marker(op.loc)}",
          f"{i1}constexpr int {kl} = TLDSL_REDUCE_LANES({L});",
          f"{i1}for (int {e0} = 0; {e0} < {nout} * {kl}; {e0} += gthreads) {{",
          f"{i2}const int {e} = {e0} + tid;",
          f"{i2}const int {lane} = {e} % {kl};",
          f"{i2}const int {o} = {e} / {kl} < {nout} ? {e} / {kl} : {nout - 1};",
          *red.decode(o, coords, i2),
          f"{i2}{ct} {acc};", f"{i2}{{", *[f"{i2}  {ln}" for ln in first], f"{i2}  {acc} = {v0};", f"{i2}}}",
          f"{i2}#pragma unroll 4",
          f"{i2}for (int {r} = {lane} + {kl}; {r} < {n}; {r} += {kl}) {{", *[f"{i2}  {ln}" for ln in rest],
          f"{i2}  {acc} = {comb.format(acc, v)};", f"{i2}}}",
          *red.shuffle(acc, off, kl, i2),
          f"{i2}if ({e} < {nout} * {kl} && {lane} == 0) {slot}[{flat_index(coords, shape)}] = "
          f"tldsl::gen::put<{storage_ctype(red.dt)}>({red.result(acc)});",
          f"{i1}}}", f"{ind}}}", f"{ind}{BARRIER}"]
    lines += L_


def _reduce_by_warps(red: _Reduction, P: int, ind: str, lines: list[str]) -> None:
    """A reduction whose outputs would leave warps idle (:func:`..plan.general.reduce_partials`):
    P warps an output, warp p of output o combining elements p * 32 + lane, then every P * 32th,
    its lanes by shuffles; the P partial results meet in shared memory after the output's slot
    and one thread an output combines them in warp order."""
    em, op = red.em, red.op
    n, nout, ct, comb = red.n, red.nout, red.ct, red.comb
    slot = em.slot(op.result)
    k = em.fresh()
    kl, part, g, o, lane, acc, r, off, q = (f"kL{k}", f"part{k}", f"g{k}", f"o{k}", f"l{k}", f"acc{k}", f"r{k}",
                                            f"s{k}", f"q{k}")
    coords = [f"c{k}x{a}" for a in range(len(red.shape))]
    first, v0 = red.element_at(f"({q} * {kl} + {lane})", coords)
    rest, v = red.element_at(r, coords)
    i1, i2, i3 = ind + "  ", ind + "    ", ind + "      "
    offset = reduce_slot(op, em.plan.threads).warp_offset
    lines += [
        f"{ind}{{  // {red.kind} over axis {red.axis} -> {slot}, {P} warps an output{marker(op.loc)}",
        f"{i1}constexpr int {kl} = TLDSL_REDUCE_LANES(32);",
        f"{i1}{ct}* const {part} = reinterpret_cast<{ct}*>(reinterpret_cast<unsigned char*>({slot}) + {offset});",
        f"{i1}for (int {g} = tid / {kl}; {g} < {nout * P}; {g} += gthreads / {kl}) {{",
        f"{i2}const int {lane} = tid % {kl}, {o} = {g} % {nout}, {q} = {g} / {nout};",
        *red.decode(o, coords, i2),
        f"{i2}{ct} {acc};", f"{i2}{{", *[f"{i2}  {ln}" for ln in first], f"{i2}  {acc} = {v0};", f"{i2}}}",
        f"{i2}#pragma unroll 4",
        f"{i2}for (int {r} = {q} * {kl} + {lane} + {P} * {kl}; {r} < {n}; {r} += {P} * {kl}) {{",
        *[f"{i2}  {ln}" for ln in rest], f"{i2}  {acc} = {comb.format(acc, v)};", f"{i2}}}",
        *red.shuffle(acc, off, kl, i2),
        f"{i2}if ({lane} == 0) {part}[{g}] = {acc};",
        f"{i1}}}",
        f"{i1}{BARRIER}",
        f"{i1}for (int {o} = tid; {o} < {nout}; {o} += gthreads) {{",
        f"{i2}{ct} {acc} = {part}[{o}];",
        f"{i2}for (int {q} = 1; {q} < {P}; ++{q}) {{",
        f"{i3}const {ct} {acc}o = {part}[{q} * {nout} + {o}];",
        f"{i3}{acc} = {comb.format(acc, acc + 'o')};", f"{i2}}}",
        f"{i2}{slot}[{o}] = tldsl::gen::put<{storage_ctype(red.dt)}>({red.result(acc)});",
        f"{i1}}}", f"{ind}}}", f"{ind}{BARRIER}"]


def _dot_statement(em, op, ind, lines):
    a, b = op.operands
    (M, K), N = a.type.shape, b.type.shape[1]
    kind = MMA_KIND[a.type.dtype.name]
    target = em.plan.epilogues.get(op.result.id)
    if target is None:
        slot = em.slot(op.result)
        store = [f"{slot}[ra * {N} + ca] = v;"]
    else:                           # the statement after the dot, computed as each result comes out
        el = Elements(em, target)
        el.memo[(op.result.id, ("ra", "ca"))] = "v"
        if target.name == "frag_write":
            dst = target.operands[0]
            x = em.value(target.operands[1], ["ra", "ca"], el)
        else:
            dst = target.result
            x = RULES[target.name].element(em, target, ["ra", "ca"], el)
        slot = em.slot(dst)
        store = el.lines + [f"{slot}[ra * {N} + ca] = {el.put(storage_ctype(dst.type.dtype), x)};"]
    def operand(v):
        el = Elements(em, op)
        x = em.value(v, ["ra", "ca"], el)
        return ["[&](int ra, int ca) -> float {", *[f"  {ln}" for ln in el.lines], f"  return (float)({x});", "}"]
    i1 = ind + "  "
    wg = em.plan.wgmma.get(op.result.id)
    if wg is None:
        lines.append(f"{ind}{{  // dot {M}x{K} @ {K}x{N} -> {slot} on tensor cores (mma.sync){marker(op.loc)}")
        lines.append(f"{i1}tldsl::gen::mma_dot<{kind}, {M}, {N}, {K}>(")
    else:                           # on WGMMA, its operands staged in shared memory (general_wgmma.hpp)
        lines.append(f"{ind}{{  // dot {M}x{K} @ {K}x{N} -> {slot} on tensor cores (WGMMA, 64x{wg.nt} tiles, "
                     f"K staged {wg.kc} at a time){marker(op.loc)}")
        lines.append(f"{i1}static_assert(tldsl::gen::wgmma_staging_bytes({M}, {N}, {wg.nt}, {wg.kc}) == "
                     f"{wg.nbytes}, \"the plan's staging size\");")
        lines.append(f"{i1}tldsl::gen::wgmma_dot<{kind}, {M}, {N}, {K}, {wg.nt}, {wg.kc}>({em.staging(op)},")
    fa, fb = operand(a), operand(b)
    lines += [f"{i1}    {ln}" for ln in fa[:-1]] + [f"{i1}    {fa[-1]},"]
    lines += [f"{i1}    {ln}" for ln in fb[:-1]] + [f"{i1}    {fb[-1]},"]
    lines.append(f"{i1}    [&](int ra, int ca, float v) {{")
    lines += [f"{i1}      {ln}" for ln in store]
    lines.append(f"{i1}    }});")
    lines.append(f"{ind}}}")
    lines.append(f"{ind}{BARRIER}")


def _frag_alloc_statement(em, op, ind, lines):
    if id(op) in em.plan.absorbed:
        return                      # a pipelined dot loop's registers start from the fill
    slot = em.slot(op.result)
    dt = op.attrs["dtype"]
    lit = literal(op.attrs["value"], dt)
    shape = tuple(op.result.type.shape)
    em.element_loop(op, shape, lambda coords, el: [f"{slot}[{flat_index(coords, shape)}] = "
                                                   f"tldsl::gen::put<{storage_ctype(dt)}>({lit});"],
                    ind, lines, f"fragment {slot} = {lit}")


def _frag_write_statement(em, op, ind, lines):
    if id(op) in em.plan.absorbed:
        return                      # the dot before it wrote the fragment
    frag, tile = op.operands
    slot = em.slot(frag)
    shape = tuple(frag.type.shape)
    st = storage_ctype(frag.type.dtype)

    def body(coords, el):
        x = em.value(tile, coords, el)
        return [f"{slot}[{flat_index(coords, shape)}] = {el.put(st, x)};"]
    em.element_loop(op, shape, body, ind, lines, f"write fragment {slot}")


def _frag_read_statement(em, op, ind, lines):
    if op.result.id in em.plan.views:
        return                      # read in place
    src, dst = em.slot(op.operands[0]), em.slot(op.result)
    shape = tuple(op.result.type.shape)
    em.element_loop(op, shape, lambda coords, el: [f"{dst}[{flat_index(coords, shape)}] = "
                                                   f"{src}[{flat_index(coords, shape)}];"],
                    ind, lines, f"copy of fragment {src} -> {dst}")


def replicated_name(v: core.Value) -> str:
    """The C++ name of a one-element value every thread holds (:func:`..plan.general._replicated`)."""
    return f"rep{v.id}"


def _replicated_statement(em, op, ind, lines):
    """A one-element value every thread computes into its own register (no slot, no barrier)."""
    v = op.result
    st = storage_ctype(v.type.dtype)
    el = Elements(em, op)
    x = RULES[op.name].element(em, op, ["0"] * len(v.type.shape), el)
    lines += [f"{ind}{st} {replicated_name(v)};  // {op.name}, one element in every thread's registers{marker(op.loc)}",
              f"{ind}{{", *[f"{ind}  {ln}" for ln in el.lines], f"{ind}  {replicated_name(v)} = {el.put(st, x)};",
              f"{ind}}}"]


def _stored_element_statement(em, op, ind, lines):
    """An element op whose value the plan stores: computed once, into its slot."""
    if op.result.id in em.plan.replicated:
        return _replicated_statement(em, op, ind, lines)
    if op.result.id in em.plan.held:
        return held_rules.held_element(em, op, RULES[op.name].element, ind, lines, BARRIER)
    if not em.plan.materialised(op.result) or id(op) in em.plan.absorbed:
        return                      # computed where it is consumed, or by the dot before it
    slot = em.slot(op.result)
    shape = tuple(op.result.type.shape)
    st = storage_ctype(op.result.type.dtype)

    def body(coords, el):
        x = RULES[op.name].element(em, op, coords, el)
        return [f"{slot}[{flat_index(coords, shape)}] = {el.put(st, x)};"]
    em.element_loop(op, shape, body, ind, lines, f"{op.name} -> {slot}")


# -- data primitives on SMs: element by element through the primitives' own rules (rules.primitives)

def _tensor_base(em, v: core.Value, rank: core.Value, op) -> str:
    """This rank's pointer to tensor ``v``, or ``rank`` 's through the table of every rank's."""
    if is_this_rank(rank):
        return buffer_param(v.owner)
    return f"{peer_buffer_param(v.owner)}[{em.name(rank, op)}]"


def _data_statement(em, op, ind, lines):
    src, srank, soffs, dst, drank, doffs, tile = data_operands(op)
    shape = tuple(op.attrs["shape"])
    if dst is None:                 # pull into a tile (its slot)
        slot = em.slot(op.result)
        st = storage_ctype(src.type.dtype)
        base, offs = _tensor_base(em, src, srank, op), [em.name(o, op) for o in soffs]

        def body(coords, el):
            row, col, ncols = row_pointer(el, base, src.type.shape, [f"{o} + {c}" for o, c in zip(offs, coords)], st, False)
            return [f"{slot}[{flat_index(coords, shape)}] = {primitives.tile_pull_data(st, row, col, ncols)};"]
        return em.element_loop(op, shape, body, ind, lines, f"{op.name} {src.owner.name} -> {slot}")
    # into a tensor: chunks of V consecutive elements of a row (16 bytes), as the communication
    # kernels move them (16-byte vectors where aligned and inside the tensors)
    st = storage_ctype(dst.type.dtype)
    V = 16 // elem_bytes(dst.type.dtype)
    n = shape[-1]
    dbase, doff = _tensor_base(em, dst, drank, op), [em.name(o, op) for o in doffs]
    aligned = [(dst, doff)]
    if src is not None:
        sbase, soff = _tensor_base(em, src, srank, op), [em.name(o, op) for o in soffs]
        aligned.append((src, soff))
    vec_ok = " && ".join(f"(({o[-1]}) % {V}) == 0" for _, o in aligned) \
        if all(t.type.shape[-1] % V == 0 for t, _ in aligned) else "false"

    def body(coords, el):
        ch, m, e = f"ch{em.fresh()}", f"m{em.fresh()}", f"k{em.fresh()}"
        c = f"({coords[-1]}) * {V}"
        out = [f"tldsl::comm::Chunk<{st}, {V}> {ch};"]
        if tile is not None:        # a tile into a tensor: the chunk's elements computed in place
            inner = Elements(em, op)
            x = em.value(tile, coords[:-1] + [f"({c} + {e})"], inner)
            out += ["#pragma unroll", f"for (int {e} = 0; {e} < {V}; ++{e}) {{", f"  if ({c} + {e} < {n}) {{",
                    *[f"    {ln}" for ln in inner.lines], f"    {ch}.set({e}, {inner.put(st, x)});", "  }", "}",
                    f"const unsigned {m} = ~0u;"]
        else:                       # a copy: only elements inside both tensors move
            srow, scol, sn = row_pointer(el, sbase, src.type.shape, [f"{o} + {x}" for o, x in zip(soff, coords[:-1] + [c])],
                                  st, False)
            out += [f"unsigned {m};", primitives.tile_pull_data(st, srow, scol, sn, chunk=ch, vec=str(V),
                                                                left=f"{n} - {c}", vec_ok="vec_ok", mask=m)]
        row, col, ncols = row_pointer(el, dbase, dst.type.shape, [f"{o} + {x}" for o, x in zip(doff, coords[:-1] + [c])],
                               st, True)
        return out + [primitives.tile_push_data(st, row, col, ncols, ch, m, vec=str(V), left=f"{n} - {c}",
                                                vec_ok="vec_ok")]
    lines.append(f"{ind}{{")
    lines.append(f"{ind}  const bool vec_ok = {vec_ok};")
    lines.append(f"{ind}  (void)vec_ok;")
    em.element_loop(op, shape[:-1] + (-(-n // V),), body, ind + "  ", lines, f"{op.name} -> {dst.owner.name}")
    lines.append(f"{ind}}}")


def _wait_statement(em, op, ind, lines):
    lines.append(ind + em.wait_statement(op, cta=True))


def _notify_statement(em, op, ind, lines):
    _, stmt = em.notify_statement(op, cta=True)
    lines.append(ind + stmt)


#: statements whose protocols rely on the group's barriers (their own kept, one before them where
#: anything is pending): waits, notifies, data primitives, dots
OPAQUE_OPS = frozenset({"dot"}) | DATA_OPS | WAIT_OPS | NOTIFY_OPS


def _tensor_accesses(op: core.Op) -> set:
    """The tensors a statement reads (``load``, ``load_rows``) or writes (``store``; ``add_rows`` both)."""
    if op.name in ("load", "load_rows"):
        return {tensor_access(id(op.operands[0].owner), "r")}
    if op.name == "store":
        return {tensor_access(id(op.operands[0].owner), "w")}
    if op.name == "add_rows":           # (reads what it adds to)
        return {tensor_access(id(op.operands[0].owner), "r"), tensor_access(id(op.operands[0].owner), "w")}
    return set()


@dataclass(frozen=True)
class Rule:
    """How one IR op is lowered: ``statement(emitter, op, indent, lines)`` at the op,
    ``element(emitter, op, coords, elements)`` for one element of its value computed in place."""
    statement: Callable | None = None
    element: Callable | None = None


#: every tile, memory and signal op the general lowering renders (index code, ``for`` and
#: ``if`` are :mod:`.scalars`' rule)
RULES: dict[str, Rule] = {
    "load": Rule(_load_statement),
    "load_rows": Rule(_load_rows_statement),
    "store": Rule(_store_statement),
    "add_rows": Rule(_add_rows_statement),
    "reduce": Rule(_reduce_statement),
    "dot": Rule(_dot_statement),
    "frag_alloc": Rule(_frag_alloc_statement),
    "frag_write": Rule(_frag_write_statement),
    "frag_read": Rule(_frag_read_statement),
    "ewise": Rule(_stored_element_statement, _ewise_element),
    "cast": Rule(_stored_element_statement, _cast_element),
    "full": Rule(_stored_element_statement, _full_element),
    "iota": Rule(_stored_element_statement, _iota_element),
    "expand_dims": Rule(_stored_element_statement, _expand_dims_element),
    "broadcast": Rule(_stored_element_statement, _broadcast_element),
    "trans": Rule(_stored_element_statement, _trans_element),
    **{d: Rule(_data_statement) for d in DATA_OPS},
    **{w: Rule(_wait_statement) for w in WAIT_OPS},
    **{n: Rule(_notify_statement) for n in NOTIFY_OPS},
}


class TileEmitter(SignalEmitter):
    """The part's body as the task loop's C++: index code by the scalar rule, every other op
    by its :data:`RULES` entry."""

    def __init__(self, plan: GeneralPlan):
        self.grid_rank = len(plan.part.grid)
        super().__init__(plan.kernel, list(plan.part.body.ops), WHAT)
        self.plan = plan
        self._n = 0
        self.barriers = BarrierTracker()
        self._acc: set | None = None        # the accesses of the statement being emitted
        self._regions: list[str] = []       # the op of each region being emitted ("for" / "if")

    def is_root(self, op: core.Op) -> bool:
        return True                 # every op of the part runs

    @property
    def num_tasks(self) -> int:
        return math.prod(self.plan.part.grid)

    def fresh(self) -> int:
        self._n += 1
        return self._n

    def slot(self, v: core.Value) -> str:
        """The C++ name of the slot of a stored value or fragment: a pointer into shared memory,
        or into the group's global-memory scratch where the plan spilled it (the same C++ reads
        and writes either). Named here, the statement being emitted writes it (:meth:`value`
        reads)."""
        name = self._slot_name(v)
        self._record(v, "w")
        return name

    def _slot_name(self, v: core.Value) -> str:
        if v.id not in self.plan.slots:
            raise self.fail(f"internal: the plan gave no slot to a value of '{v.owner.name}'", v.owner)
        return f"smem{v.id}"        # no '_<n>' suffix: never an index-code name (rules.scalars)

    def _record(self, v: core.Value, mode: str) -> None:
        """Note that the statement being emitted touches ``v`` 's slot (named for writing: read and
        written, as far as the barriers know)."""
        s = self.plan.slots.get(v.id)
        if self._acc is not None and s is not None:
            self._acc.add(slot_access("scratch" if s.spilled else "arena", s.offset, s.nbytes, mode))

    def staging(self, dot: core.Op) -> str:
        """The C++ name of the shared memory a WGMMA dot stages its operands in."""
        if dot.result.id not in self.plan.stagings:
            raise self.fail("internal: the plan gave no staging to a dot on WGMMA", dot)
        return f"stage{dot.result.id}"

    def value(self, v: core.Value, coords: list[str], el: Elements) -> str:
        """The C++ of element ``coords`` of ``v`` (a scalar: its name)."""
        if not isinstance(v.type, (T.TileType, T.FragmentType)):
            return self.name(v, el.op)
        key = (v.id, tuple(coords))
        if key in el.memo:
            return el.memo[key]
        shape = tuple(v.type.shape)
        if v.id in self.plan.replicated:
            out = f"tldsl::gen::get({replicated_name(v)})"
            el.memo[key] = out
            return out
        if v.id in self.plan.held:
            raise self.fail("internal: a value held in registers read outside its chunk order", el.op)
        if v.id in self.plan.slots or v.id in self.plan.views:
            src = self.plan.views.get(v.id)
            stored = v if src is None else v.owner.operands[0]
            slot = self._slot_name(stored)
            self._record(stored, "r")
            out = el.var(value_ctype(v.type.dtype), f"tldsl::gen::get({slot}[{flat_index(coords, shape)}])")
        else:
            op = v.owner
            rule = RULES.get(op.name)
            if rule is None or rule.element is None:
                raise self.fail(f"internal: '{op.name}' has no element rule", op)
            out = rule.element(self, op, coords, el)
        el.memo[key] = out
        return out

    def element_loop(self, op: core.Op, shape, body, ind: str, lines: list[str], what: str) -> None:
        """A loop of the group's threads over the elements of ``shape``: ``body(coords, elements)``
        gives the statement's last lines; the group's barrier follows (a trailing barrier, which
        :meth:`emit_other` drops unless the next statement needs it). A thread takes
        :data:`ELEMENT_RUN` elements an iteration (unrolled) where the tile is not tiny."""
        order = self.plan.canon.get(id(op))
        if order is not None and tuple(order.shape) == tuple(shape):
            return held_rules.element_statement(self, op, order, body, ind, lines, what, BARRIER)
        n = math.prod(shape)
        k = self.fresh()
        e = f"e{k}"
        coords = [f"c{k}x{a}" for a in range(len(shape))]
        el = Elements(self, op)
        tail = body(coords, el)
        U = ELEMENT_RUN if n >= 32 * ELEMENT_RUN else 1
        i1 = ind + "  "
        lines.append(f"{ind}{{  // {what}{marker(op.loc)}")
        if U > 1:
            i2 = ind + "        "
            lines.append(f"{i1}for (int {e}b = tid; {e}b < {n}; {e}b += {U} * gthreads) {{")
            lines.append(f"{i1}  #pragma unroll")
            lines.append(f"{i1}  for (int u{k} = 0; u{k} < {U}; ++u{k}) {{")
            lines.append(f"{i1}    const int {e} = {e}b + u{k} * gthreads;")
            lines.append(f"{i1}    if ({e} < {n}) {{")
        else:
            i2 = ind + "    "
            lines.append(f"{i1}for (int {e} = tid; {e} < {n}; {e} += gthreads) {{")
        for a, s_ in enumerate(shape):
            inner = math.prod(shape[a + 1:])
            x = e if inner == 1 else f"{e} / {inner}"
            if a > 0:
                x = f"({x}) % {s_}"
            lines.append(f"{i2}const int {coords[a]} = {x};")
        lines += [f"{i2}{ln}" for ln in el.lines + tail]
        if U > 1:
            lines.append(f"{i1}    }}")
            lines.append(f"{i1}  }}")
        lines.append(f"{i1}}}")
        lines.append(f"{ind}}}")
        lines.append(f"{ind}{BARRIER}")

    def ring(self, loop: core.Op) -> str:
        """The C++ name of the shared memory of a pipelined dot loop's ring of stages."""
        if id(loop) not in self.plan.rings:
            raise self.fail("internal: the plan gave no ring to a pipelined dot loop", loop)
        return f"ring_mem{self.plan.rings[id(loop)].value.id}"

    def emit(self, indent: str = "    ") -> list[str]:
        """The task body; a barrier ends it only where the next task's first statements touch
        what its last ones did (:meth:`.barriers.BarrierTracker.task_end`)."""
        lines = super().emit(indent)
        if self.barriers.task_end():
            lines.append(f"{indent}{BARRIER}  // before the next task touches what this one's last statements did")
        return lines

    def emit_op(self, op: core.Op, ind: str, lines: list[str]) -> None:
        if is_pipelined(self.plan, op):
            if self.barriers.opaque():
                lines.append(f"{ind}{BARRIER}")
            emit_dot_loop(self, self.plan.dot_loops[id(op)], ind, lines, BARRIER)
            if not lines[-1].strip().startswith(BARRIER):
                lines.append(f"{ind}{BARRIER}")
            return
        if op.name == "load_scalar" and id(op.operands[0].owner) in self.plan.written:
            acc = {tensor_access(id(op.operands[0].owner), "r")}     # a table the part also writes
            if self.barriers.before(acc):
                lines.append(f"{ind}{BARRIER}  // a table read after a statement that writes it")
            self.barriers.after(acc, False)
        if op.name in ("for", "if"):
            self._regions.append(op.name)
            try:
                return super().emit_op(op, ind, lines)
            finally:
                self._regions.pop()
        super().emit_op(op, ind, lines)

    def enter_region(self, block: core.Block, ind: str, lines: list[str]) -> None:
        self.barriers.enter()

    def leave_region(self, block: core.Block, ind: str, lines: list[str]) -> None:
        if self.barriers.leave(self._regions[-1] == "for"):
            lines.append(f"{ind}{BARRIER}  // before the next iteration touches what this one's last statements did")

    def emit_other(self, op: core.Op, ind: str, lines: list[str]) -> None:
        """A statement by its rule, with a barrier before it only where it touches memory that the
        statements since the last barrier touched (:mod:`.barriers`)."""
        rule = RULES.get(op.name)
        if rule is None or rule.statement is None:
            raise self.fail(f"'{op.name}' is not lowered by the general lowering", op)
        if op.name in OPAQUE_OPS:
            if self.barriers.opaque():
                lines.append(f"{ind}{BARRIER}")
            return rule.statement(self, op, ind, lines)
        out: list[str] = []
        self._acc = _tensor_accesses(op)
        try:
            rule.statement(self, op, ind, out)
            acc = self._acc
        finally:
            self._acc = None
        if not out:
            return                  # computed where consumed: no statement
        trailing = out[-1].strip().startswith(BARRIER)
        if trailing:
            out.pop()
        if self.barriers.before(acc):
            lines.append(f"{ind}{BARRIER}  // {op.name} touches memory the statements since the last barrier did")
        lines += out
        self.barriers.after(acc, any(BARRIER in ln for ln in out))

    def slot_declarations(self, ind: str) -> list[str]:
        """One typed pointer per slot into the group's shared-memory arena ``tldsl_arena``, or
        into its global-memory scratch ``tldsl_scratch`` (a spilled slot)."""
        out = []
        for vid, s in sorted(self.plan.slots.items(), key=lambda kv: (kv[1].spilled, kv[1].offset, kv[0])):
            st = storage_ctype(s.dtype)
            base, where = ("tldsl_scratch", ", in global scratch") if s.spilled else ("tldsl_arena", "")
            out.append(f"{ind}{st}* const {self.slot(s.value)} = static_cast<{st}*>(__builtin_assume_aligned({base} + {s.offset}, 16));"
                       f"  // {'x'.join(map(str, s.shape))} {s.dtype}, {s.op.name}{where}{marker(s.op.loc)}")
        for s in sorted(self.plan.rings.values(), key=lambda s: (s.offset, s.value.id)):
            lp = self.plan.dot_loops[id(s.op)]
            out.append(f"{ind}unsigned char* const {self.ring(s.op)} = tldsl_arena + {s.offset};  // {s.nbytes} B: "
                       f"{lp.stages} stages of a pipelined dot loop (aligned to 1024 B where used){marker(s.op.loc)}")
        for s in sorted(self.plan.stagings.values(), key=lambda s: (s.offset, s.value.id)):
            out.append(f"{ind}unsigned char* const {self.staging(s.op)} = static_cast<unsigned char*>("
                       f"__builtin_assume_aligned(tldsl_arena + {s.offset}, 16));  // {s.nbytes} B, WGMMA operands "
                       f"of a dot{marker(s.op.loc)}")
        return out
