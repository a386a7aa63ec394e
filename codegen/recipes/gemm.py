"""The plain GEMM recipe: a compute part that is a GEMM becomes a Hopper (sm_90a) kernel.

Recognised shape (the ``gemm`` part of :mod:`tldsl.ops.allgather_gemm`)::

    @tl.compute_part(grid=(cdiv(M, BM), cdiv(N, BN)))
    def gemm(pm, pn):
        <scalar code and waits>                      # prologue: any mix of arith/for/if/waits
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm*BM, k), (BM, BK)), tl.load(b, (k, pn*BN), (BK, BN)))
        tl.store(c, (pm*BM, pn*BN), acc)             # converts to c's type

with ``(BM, BN, BK)`` the compute schedule's tile, ``a: [M, K]`` and ``b: [K, N]`` 16-bit floats
(f16 / bf16) and ``c: [M, N]`` f16 / bf16 / f32. After the store the tile program may notify
(GEMM + ReduceScatter's ``rs.notify_rows(...)``: index code, loops, conditions and
``*_notify`` ops): that code becomes ``TileNotifies``, run by one consumer thread once the
tile's TMA stores are complete (``cp.async.bulk.wait_group 0`` + ``fence.proxy.async`` by each
storing thread, a named barrier of the consumer warpgroups, ``fence.acq_rel`` at the widest
notify scope, one ``red.relaxed.add`` per notify). A GEMM without notifies compiles to the
same code as before (``NoNotifies``).

Stages: :mod:`..match.gemm` (the structure), :mod:`..plan.gemm` (checks, configuration,
hooks, ABI), :func:`render_gemm` here (the template's instantiation; its hooks' waits and
notifies rendered by :mod:`..rules.sync` / :mod:`..rules.primitives`).

Design choice — **our own mainloop on CuTe's arch-level ops, not CUTLASS's collective**:
the kernel (``codegen/include/tldsl/sm90_gemm.hpp``) calls ``cute::SM90_TMA_LOAD_2D`` /
``SM90_TMA_STORE_2D``, the ``cute::SM90::GMMA::MMA_64xNx16_*_SS`` ops and
``cutlass::arch`` mbarriers directly, with every shared-memory offset, GMMA descriptor and TMA
coordinate computed by plain integer arithmetic. Reasons:

* the kernel ABI must be flat (``extern "C"``, pointers, ints, ``__grid_constant__`` TMA
  descriptors encoded in Python): CUTLASS's collectives carry their TMA descriptors inside
  ``Params`` structs made by C++ host code (``make_tma_copy``), which NVRTC (device-only)
  cannot run for us;
* the TileLink primitives need hooks at places a collective does not expose: the producer
  spins on a tile's signals *between* the tile scheduler and that tile's TMA loads (then
  ``fence.proxy.async.global``), the tile order is the schedule's (``row_major``, ``swizzled``,
  ``comm_aligned`` per rank), and the epilogues notify after their stores;
* NVRTC time: the arch-level headers parse in ~1.6 s, the whole kernel compiles in ~2-3 s on
  2 cores, against ~14 s for a CollectiveBuilder GEMM and ~10 s for the CuTe-layout probe;
* the host must know the exact TMA boxes and shared-memory size; computing them once in
  Python (:class:`GemmConfig`) and ``static_assert``-ing the C++ side against it keeps the two
  from drifting.

The price is owning the pipeline's correctness and speed (the structure follows the
warp-specialized persistent design that reaches cuBLAS speed: a TMA producer warp, two
consumer warpgroups, mbarrier stage ring, one WGMMA batch in flight, TMA-store epilogue).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ...ir import core
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS
from ..abi import (KernelParam, LoweredKernel, TmaDescriptorSpec, buffer_param, kernel_entry, marker,
                   peer_signal_param, signal_param, table_param, tma_param)
from ..dtypes import c_type, ctype
from ..errors import fail
from ..ir_queries import only_part
from ..match.gemm import WHAT, match_gemm
from ..plan.gemm import OWN_COLS, GemmPlan, Hook, own_row_signals, plan_gemm, push_row_signals
from ..plan.wgmma import GemmConfig
from ..rules.primitives import SCOPE
from ..rules.sync import SignalEmitter
from .recipe import Recipe
from .wgmma import gemm_cfg_fields, gemm_cfg_options

#: the C++ of a generated epilogue's elementwise sum ops (round to nearest, as the simulator)
_FLOAT_OPS = {"add": "__fadd_rn", "sub": "__fsub_rn", "mul": "__fmul_rn"}


# -- the hooks' C++ ----------------------------------------------------------------------------------

class _HookEmitter(SignalEmitter):
    """C++ for one of the plan's hooks: its roots, the index code that feeds them and the loops
    and conditions around them (the plan's ``hook.needed``), in program order."""

    def __init__(self, kernel: core.Kernel, hook: Hook):
        super().__init__(kernel, list(hook.ops), WHAT, hook.needed)
        self.hook = hook


class _WaitEmitter(_HookEmitter):
    """The tile program's prologue: the waits a tile's loads depend on."""

    def emit_other(self, op, ind, lines):
        if op.name not in WAIT_OPS:
            raise fail(WHAT, f"'{op.name}' is not supported in the GEMM prologue", op)
        lines.append(ind + self.wait_statement(op))


class _StageWaitEmitter(_WaitEmitter):
    """The waits in the K loop (``TileWaits::stage``): run by the producer before it loads the
    stage of K offset ``k0`` (the loop variable); counts them in ``waited``."""

    def __init__(self, kernel: core.Kernel, hook: Hook, loop: core.Op):
        super().__init__(kernel, hook)
        self.bind(loop.regions[0].args[0], "k0")

    def emit_other(self, op, ind, lines):
        super().emit_other(op, ind, lines)
        lines.append(ind + "++waited;")


class NotifyEmitter(_HookEmitter):
    """The tile program's epilogue: the notifies after a tile's store (e.g. GEMM +
    ReduceScatter's ``notify_rows``). Run by one thread once the tile's TMA stores are
    complete, after one ``fence.acq_rel`` at the widest scope of the notifies (the template's,
    at ``TileNotifies::kScope``); each notify is then a relaxed (strong) atomic add at its own
    scope — together a release pattern."""

    def emit_other(self, op, ind, lines):
        if op.name not in NOTIFY_OPS:
            raise fail(WHAT, f"'{op.name}' after the tile's store is not supported by the GEMM lowering (only index "
                       "arithmetic, loops and notifies may follow the store)", op)
        lines.append(ind + self.notify_statement(op)[1])


class _EpilogueEmitter(_HookEmitter):
    """A generated epilogue (the tile program's code after the K loop, when it chooses per tile
    what to store): run by every consumer thread with the template's ``EpilogueCtx``. The store
    of the accumulator becomes ``ctx.store`` (then, when notifies follow, ``ctx.release``: the
    tile's stores complete, a fence at their widest scope); waits spin on every thread (acquire:
    the loads after them see what the waited-for writers wrote); a sum store becomes
    ``ctx.apply`` (per accumulator pair: the elementwise expression, with guarded L2 loads)
    then ``ctx.store`` of the sum; notifies add on one thread."""

    def __init__(self, kernel: core.Kernel, hook: Hook, c_store: core.Op):
        super().__init__(kernel, hook)
        self.c_store = c_store
        self.stores_done = 0

    def emit_other(self, op, ind, lines):
        n = op.name
        mk = marker(op.loc)
        if n in ("frag_read", "load", "ewise", "cast"):
            return                                   # part of a store's value: emitted there
        if n in WAIT_OPS:
            lines.append(ind + self.wait_statement(op))      # every thread: each acquires what it loads
            return
        if n in NOTIFY_OPS:
            if not self.stores_done:
                raise fail(WHAT, "internal: a notify before the tile's store (the planner checks the order)", op)
            lines.append(f"{ind}if (ctx.notifier()) {self.notify_statement(op)[1]}")
            return
        if n != "store":
            raise fail(WHAT, f"'{n}' is not supported in a generated GEMM epilogue", op)
        buf = op.operands[0].owner
        row, col = self.name(op.operands[1], op), self.name(op.operands[2], op)
        et = c_type(buf.type.dtype)
        self.stores_done += 1
        if op is self.c_store:
            lines.append(f"{ind}ctx.template store<{et}>(&tma_c, {col}, {row});  // store {buf.name}{mk}")
            if self.hook.notifies:
                lines.append(f"{ind}ctx.template release<{SCOPE[self.hook.notify_scope]}>();")
            return
        self._fetches: list[tuple[str, str]] = []   # this store's loads (type, expression): members v0, v1, ...
        y0, y1 = self._expr(op.operands[-1], "lo", "x0", op), self._expr(op.operands[-1], "hi", "x1", op)
        k = self.stores_done
        members = " ".join(f"{t} v{i};" for i, (t, _) in enumerate(self._fetches))
        loads = " ".join(f"f.v{i} = {e};" for i, (_, e) in enumerate(self._fetches))
        lines += [f"{ind}struct Fetched{k} {{ {members or 'int unused;'} }};",
                  f"{ind}ctx.apply([&](int r, int c) {{  // {buf.name} = the sum: loads ...{mk}",
                  f"{ind}  Fetched{k} f; {loads}",
                  f"{ind}  (void)r; (void)c; return f;",
                  f"{ind}}}, [&](float& x0, float& x1, const Fetched{k}& f) {{  // ... then arithmetic",
                  f"{ind}  (void)f;",
                  f"{ind}  const float y0 = {y0};",
                  f"{ind}  const float y1 = {y1};",
                  f"{ind}  x0 = y0;",
                  f"{ind}  x1 = y1;",
                  f"{ind}}});",
                  f"{ind}ctx.template store<{et}>(&{tma_param(buf)}, {col}, {row});  // store {buf.name}{mk}"]

    def _expr(self, v: core.Value, half: str, x: str, at) -> str:
        """C++ float expression of tile value ``v`` at one element of a pair (``half``: ``lo`` or
        ``hi``); ``x`` names the accumulator element there. Loads become members of the pair's
        fetched values (one per load op, shared by both halves)."""
        op = v.owner
        rdt = v.type.dtype.name
        if op.name == "frag_read":
            return x
        if op.name == "cast":
            inner = self._expr(op.operands[0], half, x, at)
            return inner if rdt == "f32" else f"tldsl::sm90::epi_round<{c_type(rdt)}>({inner})"
        if op.name == "ewise":
            a, b = (self._expr(o, half, x, at) for o in op.operands)
            e = f"{_FLOAT_OPS[op.attrs['op']]}({a}, {b})"
            return e if rdt == "f32" else f"tldsl::sm90::epi_round<{c_type(rdt)}>({e})"
        if op.name == "load":
            buf = op.operands[0].owner
            rows, cols = buf.type.shape
            r0, c0 = self.name(op.operands[1], at), self.name(op.operands[2], at)
            load = f"tldsl::sm90::epi_load2({buffer_param(buf)}, {r0} + r, {c0} + c, {rows}, {cols})"
            ptype = f"tldsl::sm90::EpiPair<{c_type(buf.type.dtype)}>::type"
            if (ptype, load) not in self._fetches:
                self._fetches.append((ptype, load))
            return f"tldsl::sm90::epi_{half}(f.v{self._fetches.index((ptype, load))})"
        raise fail(WHAT, f"'{op.name}' in a GEMM epilogue sum", op)


# -- the lowered kernel ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoweredGemm(LoweredKernel):
    """A generated kernel: CUDA source, entry point, launch shape and host-side descriptions."""
    kernel_name: str                 # the IR kernel
    part: str                        # the compute part
    entry: str                       # extern "C" symbol
    source: str                      # one self-contained CUDA C++ translation unit
    config: GemmConfig
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    M: int
    N: int
    K: int
    grid_tiles: tuple[int, int]
    world_size: int
    align_shift: int
    waits: int                       # wait ops the producer runs (before a tile, before its stages)
    signals: tuple[str, ...]         # signals the waits read (kernel params "sig_<name>")
    options: tuple[str, ...] = ()    # extra NVRTC options (defines)
    notes: tuple[str, ...] = field(default=())
    notifies: int = 0                # notify ops in the tile program's epilogue (after the store)
    notify_signals: tuple[str, ...] = ()   # signals they add to (params "sig_<name>" / "sig_<name>_peers")
    epilogue_waits: int = 0          # waits in a generated epilogue (before its sums)
    data_buffers: tuple[tuple[str, tuple[int, ...], str], ...] = ()   # (name, shape, dtype) it loads: "data:<name>"
    own_rows: bool = False           # this rank's rows of A read from its shard, staged into its slot and A
    gather_rows: bool = False        # this rank's rows of A read from its shard, every row stored into A's output
    push_rows: bool = False          # gather_rows, and this rank's rows pushed into every peer's landing buffer
    row_signals: tuple[str, ...] = ()   # own/push_rows: the int64 tensors it also takes among its signals

    @property
    def num_tiles(self) -> int:
        return self.grid_tiles[0] * self.grid_tiles[1]

    def tma_buffer(self, param: str) -> str:
        """The IR buffer the TMA descriptor parameter ``param`` is made from (the tensor a caller
        passes under that name)."""
        for t in self.tma:
            if t.param == param:
                return t.buffer
        raise KeyError(f"{self.entry} has no TMA parameter {param!r}")

    @property
    def cluster_dims(self) -> tuple[int, int, int]:
        return (self.config.cluster[0] * self.config.cluster[1], 1, 1)

    def grid(self, sm_count: int) -> tuple[int, int, int]:
        """Persistent launch: at most one CTA per SM, never more clusters than cluster tiles,
        and a whole number of clusters (each needs ``cluster`` CTAs at once)."""
        cm = self.config.cluster[0]
        cluster_tiles = -(-self.grid_tiles[0] // cm) * self.grid_tiles[1]
        clusters = max(1, min(cluster_tiles, sm_count // cm))
        return (clusters * cm, 1, 1)

    def describe(self) -> str:
        c = self.config
        b = f"B[{self.N}x{self.K}]^T (B stored K-major)" if c.b_k_major else f"B[{self.K}x{self.N}]"
        lines = [f"{self.entry}: {self.kernel_name}.{self.part}  C[{self.M}x{self.N}] = A[{self.M}x{self.K}] @ "
                 f"{b}  {c.in_dtype}->{c.out_dtype}",
                 f"  tile {c.BM}x{c.BN}x{c.BK}, {c.stages} stages, order {c.order}, cluster {c.cluster}, "
                 f"{c.consumer_wgs} consumer warpgroups + 1 producer ({c.threads} threads), "
                 f"{c.acc_per_thread} fp32 acc/thread, smem {c.smem_bytes} B",
                 f"  tiles {self.grid_tiles[0]}x{self.grid_tiles[1]} = {self.num_tiles}, persistent; "
                 f"{self.waits} wait(s) on {list(self.signals) or 'no signals'}"
                 + (f" ({self.epilogue_waits} more in the epilogue, before its sums of "
                    f"{[d[0] for d in self.data_buffers]})" if self.epilogue_waits else "") + "; "
                 f"{self.notifies} notify(s) on {list(self.notify_signals) or 'no signals'} after the tile's stores"
                 + ("; this rank's rows of A read from its shard and staged by the GEMM (own_rows)"
                    if self.own_rows else "")
                 + ("; this rank's rows of A read from its shard, the peers' from A (pushed there), every row "
                    "stored into A_gathered by the GEMM (gather_rows)" if self.gather_rows else "")
                 + ("; the GEMM pushes this rank's rows into the peers' landing buffers and publishes them "
                    "(push_rows)" if self.push_rows else ""),
                 "  params: " + ", ".join(f"{p.ctype} {p.name}" for p in self.params)]
        lines += self.describe_tma()
        return "\n".join(lines)


# -- rendering ---------------------------------------------------------------------------------------

def render_gemm(plan: GemmPlan) -> LoweredGemm:
    """The kernel of a plan: the template ``tldsl::sm90::gemm_kernel`` instantiated with the
    plan's configuration and its hooks' C++."""
    kernel, part, m, epi = plan.kernel, plan.part, plan.match, plan.epilogue
    wait_lines = _WaitEmitter(kernel, plan.waits).emit("    ")
    stage_lines = _StageWaitEmitter(kernel, plan.stage_waits, m.loop).emit("    ")
    if m.extras:
        epilogue_lines = _EpilogueEmitter(kernel, epi, m.store).emit("      ")
    else:
        epilogue_lines = NotifyEmitter(kernel, epi).emit("    ")
    notified = [s.name for s in plan.notified] + [s.name for s in epi.peer_signals if s not in plan.notified]
    return LoweredGemm(kernel.name, part.name, plan.entry, _source(plan, wait_lines, stage_lines, epilogue_lines),
                       plan.config, plan.params, plan.tma, plan.M, plan.N, plan.K, tuple(part.grid),
                       kernel.world_size, plan.align_shift, plan.waits.waits + plan.stage_waits.waits,
                       tuple(s.name for s in plan.waited), plan.options,
                       notifies=epi.notifies, notify_signals=tuple(notified), epilogue_waits=epi.waits,
                       data_buffers=tuple((b.name, tuple(b.type.shape), b.type.dtype.name) for b in epi.loaded),
                       own_rows=plan.own_rows, gather_rows=plan.gather_rows, push_rows=plan.push_rows,
                       row_signals=_row_signals(plan))


def _row_signals(plan: GemmPlan) -> tuple[str, ...]:
    if plan.own_rows:
        return own_row_signals(plan.rows)
    if plan.push_rows:
        return push_row_signals(plan.rows)
    return ()


def _tile_waits(plan: GemmPlan, wait_lines, stage_lines) -> tuple[list[str], str]:
    """The ``TileWaits`` struct (the producer's waits before a tile and before a stage) and its
    construction in the kernel; no struct when the tile program does not wait."""
    waits, stage = plan.waits, plan.stage_waits
    staged = stage.waits > 0
    if not (waits.waits or staged):
        return [], "tldsl::sm90::NoWaits{}"
    sigs = list(waits.signals) + [s for s in (stage.signals if staged else ()) if s not in waits.signals]
    tbls = list(waits.tables) + [t for t in (stage.tables if staged else ()) if t not in waits.tables]
    members = ["  int rank;", "  unsigned long long launch;"]
    members += [f"  const unsigned long long* {signal_param(s)};" for s in sigs]
    members += [f"  const int* {table_param(t)};" for t in tbls]
    stage_fn = ["  // the waits in the K loop, run by the producer before it loads the stage at K offset k0;",
                "  // returns how many ran (the producer then fences before its TMA reads)",
                "  __device__ __forceinline__ int stage(int pid0, int pid1, int k0) const {",
                "    (void)pid0; (void)pid1; (void)k0;",
                "    int waited = 0;",
                *stage_lines,
                "    return waited;",
                "  }"] if staged else \
               ["  __device__ __forceinline__ int stage(int, int, int) const { return 0; }"]
    lines = ["// The tile program's waits, run by the producer before each tile's TMA loads.",
             "struct TileWaits {",
             f"  static constexpr bool kEnabled = {'true' if waits.waits else 'false'};",
             f"  static constexpr bool kStaged = {'true' if staged else 'false'};",
             *members,
             "  __device__ __forceinline__ void operator()(int pid0, int pid1) const {",
             "    (void)pid0; (void)pid1;",
             *wait_lines,
             "  }",
             *stage_fn,
             "};",
             ""]
    init = ["rank", "launch"] + [signal_param(s) for s in sigs] + [table_param(t) for t in tbls]
    return lines, "TileWaits{" + ", ".join(init) + "}"


def _tile_epilogue(plan: GemmPlan, epilogue_lines) -> tuple[list[str], str]:
    """The ``TileEpilogue`` struct (a generated epilogue, run by every consumer thread) and the
    template arguments that pass it."""
    epi = plan.epilogue
    fields = [("int rank", "rank"), ("unsigned long long launch", "launch"),
              ("const cute::TmaDescriptor* tma_c_ptr", "&tma_c")]      # (member, its value in the kernel)
    fields += [(f"{'' if s in plan.notified else 'const '}unsigned long long* {signal_param(s)}", signal_param(s))
               for s in epi.signals]
    fields += [(f"unsigned long long* const* {peer_signal_param(s)}", peer_signal_param(s)) for s in epi.peer_signals]
    fields += [(f"const int* {table_param(t)}", table_param(t)) for t in epi.tables]
    fields += [(f"const cute::TmaDescriptor* {tma_param(b)}_ptr", f"&{tma_param(b)}") for b in epi.stored]
    fields += [(f"const {c_type(b.type.dtype)}* {buffer_param(b)}", buffer_param(b)) for b in epi.loaded]
    aliases = ["    const cute::TmaDescriptor& tma_c = *tma_c_ptr;"] + \
              [f"    const cute::TmaDescriptor& {tma_param(b)} = *{tma_param(b)}_ptr;" for b in epi.stored]
    lines = ["// The tile program's code after the K loop, run by every consumer thread: which stores a tile",
             "// makes (the accumulator into C; or, after waits, its elementwise sum with loaded tiles),",
             "// and the notifies after the accumulator's store.",
             "struct TileEpilogue {",
             "  static constexpr bool kEnabled = true;",
             *[f"  {decl};" for decl, _ in fields],
             "  template <class Ctx>",
             "  __device__ __forceinline__ void operator()(Ctx& ctx, int pid0, int pid1) const {",
             "    (void)pid0; (void)pid1;",
             *aliases,
             "    {",
             *epilogue_lines,
             "    }",
             "  }",
             "};",
             ""]
    return lines, ", tldsl::sm90::NoNotifies{}, TileEpilogue{" + ", ".join(value for _, value in fields) + "}"


def _tile_notifies(plan: GemmPlan, notify_lines) -> tuple[list[str], str]:
    """The ``TileNotifies`` struct (the notifies after the store, run by one consumer thread)
    and the template argument that passes it."""
    epi = plan.epilogue
    members = ["  int rank;"]
    members += [f"  unsigned long long* {signal_param(s)};" for s in epi.signals]
    members += [f"  unsigned long long* const* {peer_signal_param(s)};" for s in epi.peer_signals]
    members += [f"  const int* {table_param(t)};" for t in epi.tables]
    lines = ["// The tile program's notifies after its store, run by one consumer thread once the tile's",
             "// TMA stores are complete, after fence.acq_rel at kScope (each add is then a release).",
             "struct TileNotifies {",
             "  static constexpr bool kEnabled = true;",
             f"  static constexpr int kScope = {SCOPE[epi.notify_scope]};",
             *members,
             "  __device__ __forceinline__ void operator()(int pid0, int pid1) const {",
             "    (void)pid0; (void)pid1;",
             *notify_lines,
             "  }",
             "};",
             ""]
    init = (["rank"] + [signal_param(s) for s in epi.signals] + [peer_signal_param(s) for s in epi.peer_signals]
            + [table_param(t) for t in epi.tables])
    return lines, ", TileNotifies{" + ", ".join(init) + "}"


def _rows_hooks(plan: GemmPlan) -> str:
    """The template arguments of the variants that stage this rank's rows of A (none notifies
    or runs a generated epilogue: checked by the planner)."""
    head = ", tldsl::sm90::NoNotifies{}, tldsl::sm90::NoEpilogue{}, "
    if plan.own_rows:       # the plain store, then this rank's rows staged into the slot and A
        return (head + "tldsl::sm90::OwnRows<Cfg::kWorldSize>{&tma_a_own, &tma_a_slot, "
                f"own_staged, own_arrive, own_arrive_peers, launch, {OWN_COLS}}}")
    if not plan.push_rows:  # gather_rows: every row's stages stored into the gathered copy
        return head + f"tldsl::sm90::GatherRows<Cfg::kWorldSize>{{&tma_a_own, &tma_a_copy, {OWN_COLS}}}"
    # ... and this rank's rows pushed into the peers' landing buffers, then published
    pushes = ", ".join(f"&tma_push_{q}" for q in range(plan.kernel.world_size - 1)) or "nullptr"
    return (head + "tldsl::sm90::GatherRows<Cfg::kWorldSize, true, true>{&tma_a_own, &tma_a_copy, "
            f"{OWN_COLS}, {{{pushes}}}, push_count, push_flag_peers, launch, "
            "int(launch & 1ull) * M, (unsigned long long)(M / Cfg::kWorldSize / Cfg::BM) * "
            f"(unsigned long long)({OWN_COLS} < (N + Cfg::BN - 1) / Cfg::BN ? {OWN_COLS} : "
            "(N + Cfg::BN - 1) / Cfg::BN)}")


def _source(plan: GemmPlan, wait_lines, stage_lines, epilogue_lines) -> str:
    kernel, part, m, cfg = plan.kernel, plan.part, plan.match, plan.config
    M, N, K = plan.M, plan.N, plan.K
    b_major = "K" if cfg.b_k_major else "MN"
    gmma = (f"cute::SM90::GMMA::MMA_64x{cfg.BN}x16_{ctype(cfg.in_dtype).gmma}_SS<"
            f"cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::{b_major}>")
    b_shape = f"B[{N}x{K}]^T" if cfg.b_k_major else f"B[{K}x{N}]"
    part_mk, dot_mk, store_mk = marker(part.loc), marker(m.dot.loc), marker(m.store.loc)
    digest = hashlib.sha256(repr((kernel.name, part.name, cfg)).encode()).hexdigest()[:12]
    L = [
        f"// Generated by tldsl.codegen, recipe gemm — do not edit. Kernel '{kernel.name}', compute part "
        f"'{part.name}' ({part.loc}).",
        f"// C[{M}x{N}] {cfg.out_dtype} = A[{M}x{K}] {cfg.in_dtype} ('{m.a.name}') @ {b_shape} {cfg.in_dtype} "
        f"('{m.b.name}') -> '{m.c.name}'",
        f"// tile {cfg.BM}x{cfg.BN}x{cfg.BK}, {cfg.stages} stages, order {cfg.order}, cluster {cfg.cluster}; "
        f"config {digest}",
        '#include "tldsl/sm90_gemm.hpp"',
        "",
        "namespace {",
        "",
        *gemm_cfg_fields(cfg, gmma, kernel.world_size, plan.align_shift, dot_mk, part_mk),
        *gemm_cfg_options(cfg),
        "};",
        "using Tr = tldsl::sm90::GemmTraits<Cfg>;",
        "// The host computed these (TMA boxes, dynamic shared memory); the template must agree.",
        f"static_assert(Tr::kSmemBytes == {cfg.smem_bytes}, \"host/device shared-memory size mismatch\");",
        f"static_assert(Tr::EA == {cfg.EA} && Tr::EB == {cfg.EB} && Tr::EC == {cfg.EC}, "
        "\"host/device TMA box mismatch\");",
        f"static_assert(Tr::kThreads == {cfg.threads}, \"host/device block size mismatch\");",
        "",
    ]
    waits, waits_expr = _tile_waits(plan, wait_lines, stage_lines)
    L += waits
    hooks_arg = ""
    if m.extras:
        epilogue, hooks_arg = _tile_epilogue(plan, epilogue_lines)
        L += epilogue
    elif plan.epilogue.notifies:
        notifies, hooks_arg = _tile_notifies(plan, epilogue_lines)
        L += notifies
    if plan.own_rows or plan.gather_rows:
        hooks_arg = _rows_hooks(plan)
    L += ["}  // namespace", ""]
    L += kernel_entry(plan.entry, cfg.threads, plan.params, [
        "  (void)launch;",
        f"  tldsl::sm90::gemm_kernel<Cfg>(&tma_a, &tma_b, &tma_c, M, N, K, rank, {waits_expr}{hooks_arg});{dot_mk}",
        f"  // stores: {m.c.name}{store_mk}"])
    return "\n".join(L)


# -- the recipe ---------------------------------------------------------------------------------------

RECIPE = Recipe("gemm", "compute", 40, match_gemm, plan_gemm, render_gemm,
                options=frozenset({"cluster", "wait_timeout_ns", "entry"}),
                summary="warp-specialised persistent TMA + WGMMA GEMM")


def lower_gemm(kernel: core.Kernel, part: str | core.Part | None = None, *, cluster=None,
               wait_timeout_ns: int | None = None, entry: str | None = None) -> LoweredGemm:
    """Lower ``kernel``'s compute part (the only one, or the one named) to a Hopper GEMM kernel.

    ``cluster`` overrides the schedule's cluster shape (``ComputeSchedule.cluster`` when the
    schedule has one, else ``(1, 1)``); ``wait_timeout_ns`` compiles the waits with a timeout
    that traps (debugging hangs).

    Parts the schedule fused into the compute part (AllGather+GEMM with
    ``CommSchedule(own_rows='compute')``; :mod:`..plan.fused_rows`) make the GEMM move this
    rank's rows itself — its rows of A (``[rank * M/W, (rank + 1) * M/W)``, whole tiles) read
    from the shard (the IR's name) without their waits, each A stage stored as it is loaded,
    spread over the first ``own_cols`` tile columns (a launch argument):

    * ``own_rows`` (``mode='pull'``; the runtime's staging="gemm"): into the slot peers pull
      from (``<shard>_slot``, the IR's name) and A, counting staged tiles in ``own_staged`` and
      publishing the launch into slot ``rank`` of every peer's arrival array (the IR's arrival
      signal; ``<arrive>_peers``: their addresses; this rank's is waited on, one launch back,
      before the slot is overwritten): ``tldsl::sm90::OwnRows``;
    * ``gather_rows`` (``mode='push'``, the copy engines pushing the peers' shards): every row
      read from A itself (the landing buffer) but this rank's, every stage stored into the
      gathered output (``<A>_out``): ``tldsl::sm90::GatherRows``;
    * ``push_rows`` (``engine='compute'``): also this rank's stages into every peer's landing
      buffer (``push_landing_<q>``: peer ``(rank + 1 + q) % W``'s, both slots, ``[2 M, K]``;
      rows of the slot ``launch % 2``), counting storing tiles in ``push_count`` and, with the
      launch's last, writing ``launch`` into slot ``rank`` of every peer's ready array
      (``<ready>_peers``: their addresses) — what the copy engine's push would have written.

    The recipe's stages run directly (match → plan → render), as the pipeline runs them once it
    has chosen this recipe: this entry point names the recipe, so there is nothing to choose."""
    p = only_part(kernel, part, WHAT, "compute parts", lambda q: q.role == "compute")
    if p.role != "compute":
        raise fail(WHAT, f"part '{p.name}' is a {p.role} part; lower_gemm lowers compute parts", p)
    return RECIPE.run(kernel, p, cluster=cluster, wait_timeout_ns=wait_timeout_ns, entry=entry)
