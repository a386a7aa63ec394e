"""The grouped GEMM recipe: the MoE expert GEMMs over run-time tile tables become Hopper
(sm_90a) kernels (``codegen/include/tldsl/sm90_grouped_gemm.hpp``).

Recognised shape (``allgather_moe.grouped_gemm`` and ``moe_reduce_scatter.grouped_gemm`` of
:mod:`tldsl.ops.moe`, and any tile program of the same form)::

    @tl.compute_part(grid=(G, cdiv(N, BN)))
    def part(i, pn):
        <scalar code: index arithmetic, table reads (load_scalar), waits>
        [acc = tl.fragment((BM, BN), tl.float32)]
        with tl.when(<guard>):                         # optional: the tile runs only where it holds
            <scalar code, loops and waits>             # the tile's prologue
            [rows = <per-row i32 expression, e.g. tl.load(ids, (i*BM,), (BM,))>]
            [acc = tl.fragment((BM, BN), tl.float32)]
            for k in tl.range(0, K, BK):
                acc += tl.dot(A, B)
            [tl.store(c, (i*BM, pn*BN), acc)]          # here: tiles outside the guard store nothing
            [<scalar code, loops and notifies>]        # after the store
        [tl.store(c, (i*BM, pn*BN), acc)]              # here: tiles outside the guard store zeros

    The store may instead add the tile's rows into rows of C chosen at run time (the MoE combine in
    the epilogue, ``tldsl.ops.moe.moe_combined_experts``): ``tl.add_rows(c, ids, pn*BN, acc)`` or of
    ``acc * scale`` (``ids`` and ``scale`` per-row expressions, ``scale`` (BM, 1) f32; ``acc`` possibly
    row-masked) — held tiles whose chunks are added at L2 by vector reductions (``HeldAddedTile``), a
    16-bit C, no notifies; half tiles only where the ids are -1 past the mask's count. Waits between
    the K loop and ``tl.add_rows`` (an output another part clears first) are the consumers'
    (``late_waits``): a warp of each consumer warpgroup acquires before the tile is held, its
    barrier orders the warpgroup's adds after them.

    A = tl.load_rows(a, rows, k, BK)       (gathered rows, by index; negative rows read 0)
      | tl.load(a, (i*BM, k), (BM, BK))    (dense)
    B = tl.load(w, (e, k, pn*BN), (BK, BN))   on w [E, K, N], e any scalar (the expert)
      | tl.load(w, (k, pn*BN), (BK, BN))      on w [K, N]

The kernel is the persistent warp-specialized TMA + WGMMA design of ``sm90_gemm.hpp``
(whose traits, swizzle, WGMMA call and epilogue it reuses by ``#include``): one producer
warpgroup, one or two consumer warpgroups, a ``stages``-deep mbarrier ring, tiles visited in
the compute schedule's order (``tile_at``), a TMA-store epilogue. What the tile program
adds is generated into a ``Prog`` struct (:mod:`.prog_hooks`): ``active`` (the guard, e.g.
``tile_expert[i] >= 0``, read from the run-time table by producer and consumers alike, so
skipped tiles cost one load), ``batch`` (the expert: B's TMA is 3-D over ``[E, K, N]`` with a
box of 1 along E), ``row`` (the gathered row ids), ``waits`` (acquire spins, before the tile's
loads; the guard and loops around them kept) and ``notifies`` (after the tile's TMA stores
completed: one ``fence.acq_rel``, then relaxed ``red.add`` operations — a release pattern).
Gathered A rows are copied by the producer warpgroup's 128 threads with 16-byte ``cp.async``
(zero-fill for padding rows and columns past K) straight into the swizzled layout TMA would
produce, completing the stage's full barrier with ``cp.async.mbarrier.arrive.noinc``;
consumers fence the async proxy before their WGMMAs. With ``cluster=(2, 1)`` two CTAs take
vertically adjacent tiles of one tile column (as the plain GEMM's clusters do) and, where both
tiles run on the same expert — most pairs: an expert's rows are consecutive tiles — each loads
half of B and multicasts it to both (``_grouped_mm``'s kernel on Hopper shares B the same way);
a pair on two experts loads B per CTA, and a CTA whose tile's guard is false passes its stages
on empty while its partner computes.

**Semantics kept from the simulator**: out-of-bounds tile loads (tables, weights, TMA boxes)
read zero, out-of-bounds stores are dropped, rows < 0 of a gather read zero, tiles outside
the guard store zeros where the program stores them outside the guard. Where the simulator
raises (a gathered row past the end of its tensor, a table index out of range), the kernel
reads zero (gathers) or is undefined (``load_scalar``): the simulator is the place to find
those bugs.

**Kernel parameters** (:attr:`LoweredGroupedGemm.params`, in order): ``tma_a`` (dense A
only), ``tma_b`` (2-D or 3-D), ``tma_c``; ``ptr_<a>`` (gathered A only: its base pointer);
``rank`` (i32); ``launch`` (u64, the 1-based epoch the waits count in); ``sig_<name>`` (u64
counters: this rank's copy of every signal waited on, then notified); ``tbl_<name>``
(``const int*``: every i32 table the hooks read, in the order they run); with a row-gather part
folded in (``side=``: a combine, a row gather), then its parameters the GEMM's do not already
name, in its order. Shapes are
compile-time constants of the generated ``Cfg`` (the trace fixes them); the host and the C++
side agree on shared memory, TMA boxes, thread counts and the gather's thread mapping
through ``static_assert``\\ s, as in the GEMM recipe.

Stages: :mod:`..match.grouped_gemm`, :mod:`..plan.grouped_gemm`, :func:`render_grouped_gemm`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

from ...ir import core
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS
from ..abi import KernelParam, LoweredKernel, TmaDescriptorSpec, kernel_entry, marker, pointer_param
from ..dtypes import c_type, ctype
from ..ir_queries import only_part
from ..match.grouped_gemm import WHAT, match_grouped_gemm
from ..plan.grouped_gemm import GroupedGemmPlan, plan_grouped_gemm
from ..plan.wgmma import GemmConfig
from ..errors import LoweringError
from .combine import combine_hooks, combine_structs
from ..rules.scalars import element_math_includes
from .prog_hooks import HookEmitter, hook_fn, prog_members
from .recipe import Recipe
from .wgmma import gemm_cfg_fields, gemm_cfg_options


@dataclass(frozen=True)
class LoweredGroupedGemm(LoweredKernel):
    """A generated grouped-GEMM kernel, and what the host needs to launch it."""
    kernel_name: str
    part: str
    entry: str
    source: str
    config: GemmConfig
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    buffers: dict                    # IR name -> (shape, dtype name) of every tensor passed by pointer
    signals: tuple[str, ...]         # signals waited on / notified (kernel params "sig_<name>")
    signal_slots: dict               # signal name -> slots
    tables: tuple[str, ...]          # i32 tables read (kernel params "tbl_<name>")
    M: int                           # rows of A (gathered: rows that may be gathered)
    N: int
    K: int
    grid_tiles: tuple[int, int]
    world_size: int
    align_shift: int
    gather: bool
    batched: bool
    store_inactive: bool
    waits: int
    notifies: int
    wait_scopes: tuple[str, ...]     # memory scopes of the waits' acquires ("gpu", "sys")
    options: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    side: str | None = None          # a row-gather part folded into the producer's spare warps
    side_tiles: tuple[int, int] | None = None

    kind = "grouped_gemm"

    @property
    def num_tiles(self) -> int:
        return self.grid_tiles[0] * self.grid_tiles[1]

    @property
    def cluster_dims(self) -> tuple[int, int, int]:
        return (self.config.cluster[0], 1, 1)

    def grid(self, sm_count: int) -> tuple[int, int, int]:
        """Persistent launch: at most one CTA per SM, never more clusters than cluster tiles
        (``cluster[0]`` tile rows each; paired 64-row tiles: slots of two), and a whole number of
        clusters."""
        cm = self.config.cluster[0]
        rows = -(-self.grid_tiles[0] // 2) if self.config.pair_rows else self.grid_tiles[0]
        cluster_tiles = -(-rows // cm) * self.grid_tiles[1]
        return (max(1, min(cluster_tiles, sm_count // cm)) * cm, 1, 1)

    def describe(self) -> str:
        c = self.config
        a = "gathered rows (cp.async)" if self.gather else "dense (TMA)"
        lines = [f"{self.entry}: {self.kernel_name}.{self.part}  grouped GEMM, A {a} [{self.M}x{self.K}], "
                 f"B {_b_form(self.batched, c.b_k_major)} (TMA), C {c.out_dtype}",
                 f"  tile {c.BM}x{c.BN}x{c.BK}, {c.stages} stages, order {c.order}, cluster {c.cluster}, "
                 f"{c.consumer_wgs} consumer warpgroups + 1 producer ({c.threads} threads)"
                 f"{f', each on {c.BM}x{c.wg_n} columns' if c.split_n else ''}"
                 f"{', ping-pong: each on whole tiles, in turns' if c.pingpong else ''}, smem {c.smem_bytes} B"
                 f"{'; tiles of <= 64 valid rows run as 64 rows' if c.half_tiles and not c.pair_rows else ''}"
                 f"{'; the part tiles 64 rows: two of one expert as one tile, any other alone' if c.pair_rows else ''}",
                 f"  tiles {self.grid_tiles[0]}x{self.grid_tiles[1]} = {self.num_tiles}, persistent; "
                 f"inactive tiles {'store zeros' if self.store_inactive else 'are skipped'}; {self.waits} wait(s), "
                 f"{self.notifies} notify(s) on {list(self.signals) or 'no signals'}",
                 "  params: " + ", ".join(f"{p.ctype} {p.name}" for p in self.params)]
        if self.side:
            lines.insert(-1, f"  folded in: row-gather part '{self.side}', {self.side_tiles[0]}x{self.side_tiles[1]} "
                             "tiles on the producer warpgroup's warps 1-3 (96 threads), each once its waits hold; "
                             "the whole grid must be resident")
        lines += self.describe_tma()
        return "\n".join(lines)


def render_grouped_gemm(plan: GroupedGemmPlan) -> LoweredGroupedGemm:
    """The kernel of a plan: the template's ``Cfg``, the ``Prog`` hooks, the entry point."""
    m = plan.match
    # active(): the guard; batch(): the expert; row(): the gathered row ids (one emitter each:
    # their names are the function's)
    L: list[str] = []
    cond = HookEmitter(plan, WHAT).value(m.guard.operands[0], "    ", L) if m.guard is not None else "true"
    fns = hook_fn("bool active(int pid0, int pid1)", L + [f"    return {cond};"])
    L = []
    e = HookEmitter(plan, WHAT).value(m.batch, "    ", L) if m.batched else "0"
    fns += hook_fn("int batch(int pid0, int pid1)", L + [f"    return {e};"])
    if m.gather:
        em = HookEmitter(plan, WHAT, rows=plan.part_rows)
        em.row = "r"
        L = []
        r = em.value(m.rows, "    ", L)
        fns += hook_fn("int row(int pid0, int pid1, int r)", L + [f"    return {r};"])
    if m.row_limit is not None:         # valid_rows(): the stored tile's rows from it on are zeros
        L = []
        n = HookEmitter(plan, WHAT).value(m.row_limit, "    ", L)
        fns += hook_fn("int valid_rows(int pid0, int pid1)", L + [f"    return {n};"])
    if m.adds_rows:                     # row_target() / row_scale(): where each row is added, scaled by what
        for name, ct, v in (("row_target", "int", m.targets), ("row_scale", "float", m.scale)):
            if v is None:
                continue
            em = HookEmitter(plan, WHAT, rows=plan.part_rows)
            em.row = "r"
            L = []
            x = em.value(v, "    ", L)
            fns += hook_fn(f"{ct} {name}(int pid0, int pid1, int r)", L + [f"    return {x};"])
    # waits() and notifies(), with their guards and loops
    late = m.late_waits
    fns += HookEmitter(plan, WHAT, WAIT_OPS, lanes=32, pick=lambda op: id(op) not in late).signal_fn("waits")
    # ... and those after the K loop, run by a consumer warp before the tile's rows are held (then added)
    if plan.late_waits:
        fns += HookEmitter(plan, WHAT, WAIT_OPS, lanes=32, pick=lambda op: id(op) in late).signal_fn("late_waits")
    # ... the notifies as one consumer thread runs them, or spread over the notifier warp's lanes
    # (sm90_grouped_gemm.hpp): only the one the template calls
    if plan.notifier_warp:
        fns += HookEmitter(plan, WHAT, NOTIFY_OPS, lanes=32).signal_fn("notifies_lanes")
    else:
        fns += HookEmitter(plan, WHAT, NOTIFY_OPS).signal_fn("notifies")
    sp = plan.side
    params, buffers = side_params(plan), dict(plan.buffers)
    signals = {s.name: s.type.slots for s in plan.signals}
    tables = [b.name for b in plan.tensors if b.type.dtype.name == "i32"]
    waits, notifies, scopes = plan.waits + plan.late_waits, plan.notifies, set(plan.wait_scopes)
    if sp is not None:
        buffers.update(sp.buffers)
        signals.update({s.name: s.type.slots for s in sp.signals})
        tables += [b.name for b in sp.tensors if b.type.dtype.name == "i32" and b.name not in tables]
        waits, notifies, scopes = waits + sp.waits, notifies + sp.notifies, scopes | set(sp.wait_scopes)
    return LoweredGroupedGemm(
        plan.kernel.name, plan.part.name, plan.entry, _source(plan, fns), plan.config, params, plan.tma,
        buffers, tuple(signals), signals, tuple(tables), plan.M, plan.N, plan.K, tuple(plan.part.grid),
        plan.kernel.world_size, plan.align_shift, m.gather, m.batched, not m.store_inside, waits, notifies,
        tuple(sorted(scopes)), plan.options, side=sp.part.name if sp is not None else None,
        side_tiles=sp.grid_tiles if sp is not None else None)


def notifies_guarded(m) -> bool:
    """Whether every notify of the part sits inside its ``tl.when`` guard: a tile the guard skips
    then has nothing to release, and the template does not hand it to the notifier."""
    if m.guard is None:
        return False
    inside = {id(op) for op in m.guard.regions[0].walk()}
    return all(id(op) in inside for op in m.part.walk() if op.name in NOTIFY_OPS)


def side_params(plan: GroupedGemmPlan) -> tuple[KernelParam, ...]:
    """The GEMM's parameters, then the folded part's that it does not have (one parameter per
    tensor or signal; a pointer both read is declared as the GEMM declares it). A pointer the
    folded part writes is declared without ``__restrict__``: other CTAs read what it stores
    while the kernel runs, once the part's notifies (inline-asm barrier, fence and atomic, which
    the compiler must not move its stores across) release it."""
    params = list(plan.params)
    if plan.side is None:
        return tuple(params)
    have = {p.name: p for p in params}
    for q in plan.side.params:
        if q.name not in have:
            if q.kind == "ptr" and not q.ctype.startswith("const "):
                q = replace(q, ctype=q.ctype.replace(" __restrict__", ""))
            params.append(q)
            have[q.name] = q
        elif have[q.name].source != q.source:
            raise LoweringError(f"internal: parameter {q.name} means {have[q.name].source} in '{plan.part.name}' "
                                f"and {q.source} in '{plan.side.part.name}'", plan.part.loc)
    return tuple(params)


def _b_form(batched: bool, k_major: bool) -> str:
    """How B is stored, for ``describe``."""
    shape = ("[E, N, K]" if batched else "[N, K]") if k_major else ("[E, K, N]" if batched else "[K, N]")
    return shape + (" per expert" if batched else "") + (", read K-major" if k_major else "")


def _source(plan: GroupedGemmPlan, fns: list[str]) -> str:
    kernel, part, m, cfg = plan.kernel, plan.part, plan.match, plan.config
    M, N, K = plan.M, plan.N, plan.K
    b_major = "K" if cfg.b_k_major else "MN"       # B stored [N, K] / [E, N, K]: read K-major, as A
    gmma = (f"cute::SM90::GMMA::MMA_64x{cfg.wg_n}x16_{ctype(cfg.in_dtype).gmma}_SS<"
            f"cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::{b_major}>")
    part_mk, dot_mk, store_mk = marker(part.loc), marker(m.dot.loc), marker(m.store.loc)
    digest = hashlib.sha256(repr((kernel.name, part.name, cfg, m.gather, m.batched)).encode()).hexdigest()[:12]
    units = cfg.BK * cfg.elem_bytes // 16
    row_step = 128 // units
    a_param = pointer_param(m.a)
    members, init = prog_members(plan)
    if m.adds_rows:
        members.append(f"  {c_type(m.out_dtype)}* out;")
        init.append(pointer_param(m.c))
    E = m.b.type.shape[0] if m.batched else 1
    L = [
        f"// Generated by tldsl.codegen, recipe grouped_gemm — do not edit. Kernel '{kernel.name}', compute part "
        f"'{part.name}' ({part.loc}).",
        f"// C[{part.grid[0]}x{plan.part_rows} rows, {N}] {cfg.out_dtype} ('{m.c.name}') = "
        f"{'gather_rows' if m.gather else 'tile'}(A[{M}x{K}] {cfg.in_dtype} '{m.a.name}') @ "
        f"{'B[e]' if m.batched else 'B'}{'^T' if cfg.b_k_major else ''} ('{m.b.name}' {list(m.b.type.shape)})",
        f"// tile {cfg.BM}x{cfg.BN}x{cfg.BK}, {cfg.stages} stages, order {cfg.order}, cluster {cfg.cluster}; "
        f"config {digest}",
        '#include "tldsl/sm90_grouped_gemm.hpp"',
        "",
        "namespace {",
        "",
        *gemm_cfg_fields(cfg, gmma, kernel.world_size, plan.align_shift, dot_mk, part_mk),
        f"  static constexpr bool kGather = {'true' if m.gather else 'false'}, "
        f"kBatched = {'true' if m.batched else 'false'}, "
        f"kStoreInactive = {'false' if m.store_inside else 'true'};",
        f"  static constexpr int kM = {M}, kK = {K}, kGridM = {part.grid[0]}, kGridN = {part.grid[1]};"
        f"  // N = {N}, E = {E}",
        f"  static constexpr bool kHalfTiles = {'true' if cfg.half_tiles else 'false'};"
        f"{'   // a tile of <= 64 valid rows: 64 rows' if cfg.half_tiles else ''}",
        f"  static constexpr bool kPairRows = {'true' if cfg.pair_rows else 'false'};"
        f"{'   // the part tiles 64 rows: two of one expert to a CTA tile' if cfg.pair_rows else ''}",
        f"  static constexpr bool kNotifierWarp = {'true' if plan.notifier_warp else 'false'};"
        f"{'   // the notifies run on the producer warpgroup, warp 1' if plan.notifier_warp else ''}",
        *([f"  using GmmaHalf = cute::SM90::GMMA::MMA_64x{cfg.BN // 2}x16_{ctype(cfg.in_dtype).gmma}_SS<"
           f"cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::{b_major}>;"] if cfg.half_tiles and not cfg.pingpong
          else []),
        *gemm_cfg_options(cfg),
        "};",
        "using Tr = tldsl::grouped::GroupedTraits<Cfg>;",
        "// The host computed these (TMA boxes, dynamic shared memory, the gather's thread map); the template",
        "// must agree.",
        f"static_assert(Tr::kSmemBytes == {cfg.smem_bytes}, \"host/device shared-memory size mismatch\");",
        f"static_assert(Tr::EA == {cfg.EA} && Tr::EB == {cfg.EB} && Tr::EC == {cfg.EC}, "
        "\"host/device TMA box mismatch\");",
        f"static_assert(Tr::kThreads == {cfg.threads}, \"host/device block size mismatch\");",
        f"static_assert(Tr::kUnitsA == {units} && Tr::kRowStep == {row_step} && Tr::kFullArrivals == "
        f"{129 if m.gather else 1}, \"host/device gather mapping mismatch\");",
        *([f"static_assert(Tr::kOffsets32 == {'true' if M * K + cfg.BK < 1 << 31 else 'false'}, "
           "\"host/device width of the gathered rows' offsets\");"] if m.gather else []),
        "",
        "// What the tile program adds around the GEMM: guard, expert, gathered rows, waits, notifies.",
        "struct Prog {",
        f"  static constexpr bool kHasWaits = {'true' if plan.waits else 'false'};",
        f"  static constexpr bool kHasLateWaits = {'true' if plan.late_waits else 'false'};"
        f"{'   // late_waits(): before a tile is held, its rows then added' if plan.late_waits else ''}",
        f"  static constexpr bool kHasNotifies = {'true' if plan.notifies else 'false'};",
        f"  static constexpr bool kRowLimit = {'true' if m.row_limit is not None else 'false'};",
        f"  static constexpr bool kNotifiesGuarded = {'true' if notifies_guarded(m) else 'false'};"
        "   // a tile the guard skips notifies nothing",
        f"  static constexpr bool kAddRows = {'true' if m.adds_rows else 'false'}, "
        f"kRowScale = {'true' if m.scale is not None else 'false'};"
        f"{'   // tl.add_rows: each row added into row row_target() of out, times row_scale()' if m.adds_rows else ''}",
        f"  static constexpr int kLdc = {N}, kRowsC = {m.c.type.shape[0]};",
        *members,
        *fns,
        "};",
        "",
    ]
    side, side_init = [], []
    if plan.side is not None:
        sp = plan.side
        side, side_init = combine_structs(sp, combine_hooks(sp), "SideCfg", "SideProg", folded=True)
        L += [f"// Folded in: compute part '{sp.part.name}' ({sp.part.loc}), run by the producer warpgroup's spare "
              "warps.", *side, ""]
    L += ["}  // namespace", ""]
    inc = L.index('#include "tldsl/sm90_grouped_gemm.hpp"') + 1
    L[inc:inc] = element_math_includes(L)
    call = (f"  tldsl::grouped::grouped_gemm_kernel<Cfg{', SideCfg' if side else ''}>("
            f"{'nullptr' if m.gather else '&tma_a'}, &tma_b, &tma_c, {a_param if m.gather else 'nullptr'}, rank, prog"
            f"{', side' if side else ''});{dot_mk}")
    L += kernel_entry(plan.entry, cfg.threads, side_params(plan), [
        f"  const Prog prog{{{', '.join(init)}}};",
        *([f"  const SideProg side{{{', '.join(side_init)}}};"] if side else []),
        call,
        f"  // stores: {m.c.name}{store_mk}"])
    return "\n".join(L)


RECIPE = Recipe("grouped_gemm", "compute", 30, match_grouped_gemm, plan_grouped_gemm, render_grouped_gemm,
                options=frozenset({"cluster", "wait_timeout_ns", "entry", "side"}),
                summary="grouped GEMM over per-tile tables (MoE)")


def lower_grouped_gemm(kernel: core.Kernel, part: str | core.Part | None = None, *, cluster=None,
                       wait_timeout_ns: int | None = None, entry: str | None = None,
                       side: str | None = None) -> LoweredGroupedGemm:
    """Lower ``kernel``'s grouped-GEMM compute part (the only one, or the one named) to a Hopper
    kernel: this recipe's match → plan → render, with the matcher's error (at the user's line)
    when the part does not fit. ``cluster`` overrides the schedule's ((1, 1) or (2, 1): pairs of
    vertically adjacent tiles that multicast B when both run on the same expert);
    ``wait_timeout_ns`` compiles the waits with a timeout that traps (debugging hangs); ``side``
    folds the named row-gather part (a combine, a row gather) into the kernel (it then has no
    launch of its own; :func:`~..plan.grouped_gemm.plan_side`)."""
    p = only_part(kernel, part, WHAT, "compute parts", lambda q: q.role == "compute")
    return RECIPE.run(kernel, p, cluster=cluster, wait_timeout_ns=wait_timeout_ns, entry=entry, side=side)
