"""The row-gather combine recipe: the MoE top-k combine becomes a plain CUDA kernel
(``combine_kernel`` of ``codegen/include/tldsl/sm90_grouped_gemm.hpp``).

Recognised shape (``moe_reduce_scatter.combine`` of :mod:`tldsl.ops.moe`)::

    @tl.compute_part(grid=(G0, G1))
    def part(j, pn):
        <scalar code and waits>
        acc = tl.fragment((BM, BN), tl.float32, fill)
        for k in tl.range(lo, hi, step):
            rows = <per-row i32 expression>            # e.g. tl.where(in_range, tl.load(pos, ...), -1)
            acc += tl.load_rows(y, rows, col, BN) [* <per-row scale, e.g. tl.load(w, (m0, k), (BM, 1))>]
        tl.store(out, (row0, col0), acc)
        <scalar code, loops and notifies>

No tensor cores: it is a bandwidth-bound gather. Each thread owns 1, 2, 4 or 8 consecutive columns
of a tile row (vector loads and stores, fp32 math; 8 — 16-byte loads — where the gathered rows are
16-bit and the columns allow, 1 or 2 where the columns are no multiple of 4:
:func:`..plan.combine.vector_width`), tiles visited persistently in the schedule's
order (with the part's ``align_shift``). The generated ``Prog`` (:mod:`.prog_hooks`) holds
the waits (a warp's lanes spin, each on its share of the innermost waiting loops' iterations,
then the CTA meets), the body (the per-row index and scale expressions, element by element)
and the notifies (the CTA meets, then one thread releases).
Rows < 0 of the gather read zero and out-of-bounds stores are dropped, as in the simulator.

**Kernel parameters** (:attr:`LoweredCombine.params`, in order): ``ptr_<y>`` (the gathered
tensor: another part writes it during the launch, so never ``__restrict__``), ``out_<out>``
(the stored tensor), ``rank``, ``launch``, ``sig_<name>``..., then every other tensor the
hooks read (``tbl_<name>`` for i32 tables, ``ptr_<name>`` for the rest), first use first.

Stages: :mod:`..match.combine`, :mod:`..plan.combine`, :func:`render_combine`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ...ir import core
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS
from ..abi import KernelParam, LoweredKernel, marker
from ..dtypes import c_type
from ..ir_queries import only_part
from ..match.combine import WHAT, match_combine
from ..plan.combine import CombinePlan, plan_combine
from ..plan.tile_order import order_group_m
from ..plan.wgmma import ORDERS
from ..rules.scalars import c_literal
from ..rules.scalars import element_math_includes
from .prog_hooks import HookEmitter, hook_fn, prog_members
from .recipe import Recipe


@dataclass(frozen=True)
class LoweredCombine(LoweredKernel):
    """A generated row-gather combine kernel, and what the host needs to launch it."""
    kernel_name: str
    part: str
    entry: str
    source: str
    threads: int
    tile: tuple[int, int]
    params: tuple[KernelParam, ...]
    buffers: dict                   # IR name -> (shape, dtype name) of every tensor passed by pointer
    signals: tuple[str, ...]
    signal_slots: dict
    tables: tuple[str, ...]
    grid_tiles: tuple[int, int]
    world_size: int
    align_shift: int
    order: str
    waits: int
    notifies: int
    wait_scopes: tuple[str, ...]
    options: tuple[str, ...] = ()
    tma: tuple = ()
    vec: int = 4                    # consecutive columns per thread

    kind = "combine"

    @property
    def num_tiles(self) -> int:
        return self.grid_tiles[0] * self.grid_tiles[1]

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return 0

    def grid(self, sm_count: int, ctas_per_sm: int = 1) -> tuple[int, int, int]:
        """Persistent launch: ``ctas_per_sm`` CTAs per SM, never more CTAs than tiles."""
        return (max(1, min(self.num_tiles, sm_count * ctas_per_sm)), 1, 1)

    def describe(self) -> str:
        return "\n".join([
            f"{self.entry}: {self.kernel_name}.{self.part}  row-gather combine, tile {self.tile[0]}x{self.tile[1]}, "
            f"{self.threads} threads x {self.vec} columns, order {self.order}",
            f"  tiles {self.grid_tiles[0]}x{self.grid_tiles[1]} = {self.num_tiles}, persistent; {self.waits} wait(s), "
            f"{self.notifies} notify(s) on {list(self.signals) or 'no signals'}",
            "  params: " + ", ".join(f"{p.ctype} {p.name}" for p in self.params)])


def render_combine(plan: CombinePlan) -> LoweredCombine:
    """The kernel of a plan: the ``Cfg``, the ``Prog`` hooks, the entry point."""
    m = plan.match
    fns = combine_hooks(plan)
    sched = plan.schedule
    return LoweredCombine(plan.kernel.name, plan.part.name, plan.entry, _source(plan, fns), plan.threads,
                          (m.BMf, m.BNf), plan.params, plan.buffers, tuple(s.name for s in plan.signals),
                          {s.name: s.type.slots for s in plan.signals},
                          tuple(b.name for b in plan.tensors if b.type.dtype.name == "i32"), plan.grid_tiles,
                          plan.kernel.world_size, plan.align_shift, sched.order, plan.waits, plan.notifies,
                          plan.wait_scopes, plan.options, vec=plan.vec)


def combine_hooks(plan: CombinePlan) -> list[str]:
    """The ``Prog`` hooks of a combine: ``waits``, ``body``, ``notifies``."""
    fns = HookEmitter(plan, WHAT, WAIT_OPS, lanes=32).signal_fn("waits")
    fns += hook_fn("void body(int pid0, int pid1, int tid)", _body(plan))
    return fns + HookEmitter(plan, WHAT, NOTIFY_OPS).signal_fn("notifies")


#: gathers kept in flight per thread: a loop over at most this many rows (constant bounds) is
#: unrolled into three passes — every row's index and scale, every row's load, the sums — over
#: as many of the thread's items at once as fit (a loop of one row, a plain row gather: four
#: items of a 128-row tile; the top-8 combine: one)
MAX_GATHERS_IN_FLIGHT = 8
#: the values a thread may hold for the items it gathers together: at 1024 threads a CTA, 64
#: registers a thread (an item of a one-row loop: its ``vec`` values, the gather folding into the
#: sum; of a longer loop: ``vec`` per row and the sum). Four items of one 8-wide row: 57 registers,
#: no spills; two items of a top-2 combine spilled 116 bytes
MAX_VALUES_IN_FLIGHT = 40


def items_at_once(plan: CombinePlan, trips: int | None) -> int:
    """Items a thread gathers together: as many of its items per tile as keep ``trips`` gathers
    each within :data:`MAX_GATHERS_IN_FLIGHT` and their values within :data:`MAX_VALUES_IN_FLIGHT`
    — where the threads divide the tile's items, a divisor of each thread's share (no thread
    then has a partial group); else the last group is partial (:func:`ragged`: the 96 threads of
    a combine folded into a grouped GEMM and a tile's 4096 items). 1 for a loop whose bounds are
    not constant or too long."""
    m = plan.match
    total = m.BMf * (m.BNf // plan.vec)
    if trips is None or not 0 < trips <= MAX_GATHERS_IN_FLIGHT:
        return 1
    per_thread = -(-total // plan.threads)
    values = plan.vec * (trips + (1 if trips > 1 else 0))
    g = max(1, min(per_thread, MAX_GATHERS_IN_FLIGHT // trips, MAX_VALUES_IN_FLIGHT // values))
    while total % plan.threads == 0 and per_thread % g:
        g -= 1
    return g


def ragged(plan: CombinePlan, G: int) -> bool:
    """Whether the last group of ``G`` items of some thread runs past the tile's items (those
    items are then skipped: no table read, gather or store; one item at a time, the item loop's
    own bound does it)."""
    m = plan.match
    return G > 1 and (m.BMf * (m.BNf // plan.vec)) % (plan.threads * G) != 0


def _body(plan: CombinePlan) -> list[str]:
    """``body()``: every thread owns ``vec`` consecutive columns of one tile row at a time (an
    item); per item, the loop gathers (and scales) the rows and sums them, then stores the columns.
    With a short loop of constant bounds every gather of ``items_at_once`` items is issued before
    the first is used: the combine is bound by the gathers' latency, not by bandwidth, when each
    waits for the last."""
    m = plan.match
    em = HookEmitter(plan, WHAT, rows=m.BMf)
    L: list[str] = []
    em.emit_values(plan.per_tile, em.ops, "    ", L)       # once per tile: the store's offsets, the loop's bounds
    o0, o1 = em.name(m.store.operands[1]), em.name(m.store.operands[2])
    lo, hi, st = (em.name(v) for v in m.loop.operands)
    fill = c_literal(float(m.frag.attrs.get("value", 0.0)))
    n = plan.vec
    V = m.BNf // n
    src, dst = m.src.type.shape, m.dst.type.shape
    trips = _constant_trips(lo, hi, st)
    G = items_at_once(plan, trips)
    in_flight = trips is not None and 0 < trips <= MAX_GATHERS_IN_FLIGHT
    L.append(f"    for (int item0 = tid; item0 < {m.BMf * V}; item0 += {plan.threads * G}) {{")
    with em.scope():
        L += [f"      float acc_[{G}][{n}];",
              "      #pragma unroll", f"      for (int g_ = 0; g_ < {G}; ++g_)", "        #pragma unroll",
              f"        for (int q = 0; q < {n}; ++q) acc_[g_][q] = {fill};"]
        if in_flight:
            L += _body_in_flight(plan, em, trips, lo, st, src, G, V)
        else:
            L += ["      {", "      const int item = item0;", f"      const int r = item / {V};",
                  f"      const int cv = (item - r * {V}) * {n};", "      float (&acc)[" + str(n) + "] = acc_[0];"]
            L += _body_one_by_one(plan, em, lo, hi, st, src)
            L.append("      }")
    L += ["      #pragma unroll", f"      for (int g_ = 0; g_ < {G}; ++g_) {{",
          f"        const int item = item0 + g_ * {plan.threads};",
          *([f"        if (item >= {m.BMf * V}) break;"] if ragged(plan, G) else []),
          f"        const int r = item / {V};",
          f"        const int cv = (item - r * {V}) * {n};",
          f"        tldsl::grouped::storev<{n}>({plan.dst_param}, {o0} + r, {dst[0]}, {o1} + cv, {dst[1]}, acc_[g_]);"
          f"{marker(m.store.loc)}",
          "      }",
          "    }"]
    return L


def _sum_term(acc: str, x: str, w: str | None) -> str:
    """``acc + x * w`` (or ``acc + x``) rounded at each op as the simulator rounds it: never
    contracted into an FMA, whose one rounding differs from numpy's two in the last bit."""
    return f"__fadd_rn({acc}, __fmul_rn({x}, {w}))" if w is not None else f"__fadd_rn({acc}, {x})"


def _constant_trips(lo: str, hi: str, st: str) -> int | None:
    """The loop's trip count where its bounds are literals, else None."""
    try:
        a, b, c = int(lo), int(hi), int(st)
    except ValueError:
        return None
    return len(range(a, b, c)) if c > 0 else None


def _body_one_by_one(plan: CombinePlan, em: HookEmitter, lo: str, hi: str, st: str, src) -> list[str]:
    """The loop as written: per row its index, its gather, its scale, its sum."""
    m, L = plan.match, []
    k = em.define(m.loop.regions[0].args[0])
    L.append(f"      {em.loop_header(k, lo, hi, st)} {{{marker(m.loop.loc)}")
    with em.scope():
        em.row = "r"
        em.emit_values(plan.per_row, em.ops, "        ", L)    # per gathered row: its id (and column)
        row, col = em.name(m.rows), em.name(m.gather.operands[2])
        L += [f"        float x[{plan.vec}];",
              f"        tldsl::grouped::loadv<{plan.vec}>({plan.src_param}, {row}, {src[0]}, {col} + cv, {src[1]}, x);"
              f"{marker(m.gather.loc)}"]
        if m.scale is not None:
            em.emit_values(plan.scale, em.ops, "        ", L)
            L.append(f"        const float w = (float)({em.name(m.scale)});{marker(m.mul.loc)}")
        L += ["        #pragma unroll",
              f"        for (int q = 0; q < {plan.vec}; ++q) "
              f"acc[q] = {_sum_term('acc[q]', 'x[q]', 'w' if m.scale is not None else None)};"]
    L.append("      }")
    return L


def _body_in_flight(plan: CombinePlan, em: HookEmitter, n: int, lo: str, st: str, src, G: int, V: int) -> list[str]:
    """The loop's ``n`` rows of ``G`` items in three unrolled passes: indices and scales (table
    reads), the gathers (all issued before any is used), then the sums in the loop's order."""
    m, L = plan.match, []
    scaled = m.scale is not None
    vec = plan.vec
    L += [f"      int rows_[{G}][{n}], cols_[{G}][{n}];", f"      float w_[{G}][{n}], x_[{G}][{n}][{vec}];"]
    if not scaled:
        L.append("      (void)w_;")
    L += ["      #pragma unroll", f"      for (int g_ = 0; g_ < {G}; ++g_) {{",
          f"        const int item = item0 + g_ * {plan.threads};", f"        const int r = item / {V};",
          "        (void)r;",
          "        #pragma unroll", f"        for (int j_ = 0; j_ < {n}; ++j_) {{{marker(m.loop.loc)}"]
    if ragged(plan, G):               # past the tile's items: no row (a zero gather), no table read
        L += [f"          rows_[g_][j_] = -1; cols_[g_][j_] = 0;{' w_[g_][j_] = 0.0f;' if scaled else ''}",
              f"          if (item >= {m.BMf * V}) continue;"]
    with em.scope():
        k = em.define(m.loop.regions[0].args[0])
        L.append(f"          const int {k} = {lo} + j_ * {st};")
        em.row = "r"
        em.emit_values(plan.per_row, em.ops, "          ", L)
        L += [f"          rows_[g_][j_] = {em.name(m.rows)};", f"          cols_[g_][j_] = {em.name(m.gather.operands[2])};"]
        if scaled:
            em.emit_values(plan.scale, em.ops, "          ", L)
            L.append(f"          w_[g_][j_] = (float)({em.name(m.scale)});{marker(m.mul.loc)}")
    L += ["        }", "      }",
          "      #pragma unroll", f"      for (int g_ = 0; g_ < {G}; ++g_) {{",
          f"        const int item = item0 + g_ * {plan.threads};", f"        const int r = item / {V};",
          f"        const int cv = (item - r * {V}) * {vec};",
          "        #pragma unroll", f"        for (int j_ = 0; j_ < {n}; ++j_)",
          f"          tldsl::grouped::loadv<{vec}>({plan.src_param}, rows_[g_][j_], {src[0]}, cols_[g_][j_] + cv, "
          f"{src[1]}, x_[g_][j_]);{marker(m.gather.loc)}",
          "      }",
          "      #pragma unroll", f"      for (int g_ = 0; g_ < {G}; ++g_)",
          "        #pragma unroll", f"        for (int j_ = 0; j_ < {n}; ++j_)", "          #pragma unroll",
          f"          for (int q = 0; q < {vec}; ++q) acc_[g_][q] = "
          f"{_sum_term('acc_[g_][q]', 'x_[g_][j_][q]', 'w_[g_][j_]' if scaled else None)};"]
    return L


def _source(plan: CombinePlan, fns: list[str]) -> str:
    kernel, part, m, sched = plan.kernel, plan.part, plan.match, plan.schedule
    digest = hashlib.sha256(repr((kernel.name, part.name, sched, m.BMf, m.BNf)).encode()).hexdigest()[:12]
    plist = ",\n    ".join(f"{q.ctype} {q.name}" for q in plan.params)
    structs, init = combine_structs(plan, fns)
    return "\n".join([
        f"// Generated by tldsl.codegen, recipe combine — do not edit. Kernel '{kernel.name}', compute part "
        f"'{part.name}' ({part.loc}).",
        f"// {m.dst.name}[{m.BMf}x{m.BNf} tiles] = sum over the loop of gather_rows({m.src.name})"
        f"{' * scale' if m.scale is not None else ''}; order {sched.order}; config {digest}",
        '#include "tldsl/sm90_grouped_gemm.hpp"',
        *element_math_includes(structs),
        "",
        "namespace {",
        "",
        *structs,
        "",
        "}  // namespace",
        "",
        f'extern "C" __global__ void __launch_bounds__({plan.threads})',
        f"{plan.entry}(",
        f"    {plist}) {{",
        f"  const Prog prog{{{', '.join(init)}}};",
        "  tldsl::grouped::combine_kernel<Cfg>(rank, prog);",
        "}",
        ""])


def combine_structs(plan: CombinePlan, fns: list[str], cfg: str = "Cfg", prog: str = "Prog",
                    folded: bool = False) -> tuple[list, list]:
    """(the ``Cfg`` and ``Prog`` structs of a combine, named ``cfg`` and ``prog``; the ``Prog``'s
    initialisers, kernel parameter names): its own kernel's, or those a grouped GEMM it is
    folded into instantiates for its spare warps."""
    kernel, part, m, sched = plan.kernel, plan.part, plan.match, plan.schedule
    sdt, ddt = c_type(m.src.type.dtype), c_type(m.dst.type.dtype)
    members, init = prog_members(plan, [(f"const {sdt}*", plan.src_param), (f"{ddt}*", plan.dst_param)])
    gm, gn = plan.grid_tiles
    return [
        f"struct {cfg} {{",
        f"  static constexpr int kThreads = {plan.threads}, BM = {m.BMf}, BN = {m.BNf};{marker(part.loc)}",
        f"  static constexpr int kGridM = {gm}, kGridN = {gn};",
        f"  static constexpr int kOrder = {ORDERS[sched.order]}, kGroupM = {order_group_m(sched.group_m)}, "
        f"kWorldSize = {kernel.world_size}, kAlignShift = {plan.align_shift};",
        "};",
        f"// kThreads threads share a tile; the generated body strides over BM x BN/{plan.vec} items by it.",
        f"static_assert({cfg}::kThreads == {plan.threads} && {cfg}::BN % {plan.vec} == 0 && {cfg}::BM * ({cfg}::BN / "
        f"{plan.vec}) == {m.BMf * (m.BNf // plan.vec)}, \"host/device combine mapping mismatch\");",
        "",
        f"struct {prog} {{",
        *(["  static constexpr bool kEnabled = true;   // the grouped GEMM runs it"] if folded else []),
        f"  static constexpr bool kHasWaits = {'true' if plan.waits else 'false'};",
        f"  static constexpr bool kHasNotifies = {'true' if plan.notifies else 'false'};",
        *members,
        *fns,
        "};"], init


RECIPE = Recipe("combine", "compute", 20, match_combine, plan_combine, render_combine,
                options=frozenset({"wait_timeout_ns", "entry"}), summary="row-gather weighted combine")


def lower_combine(kernel: core.Kernel, part: str | core.Part | None = None, *, wait_timeout_ns: int | None = None,
                  entry: str | None = None) -> LoweredCombine:
    """Lower ``kernel``'s row-gather combine compute part (the only one, or the one named) to a
    CUDA kernel: this recipe's match → plan → render, with the matcher's error (at the user's
    line) when the part does not fit."""
    p = only_part(kernel, part, WHAT, "compute parts", lambda q: q.role == "compute")
    return RECIPE.run(kernel, p, wait_timeout_ns=wait_timeout_ns, entry=entry)
