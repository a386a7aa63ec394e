"""Planning the plain GEMM: the checks a match must pass to be this kernel (shapes, tile
offsets, the K loop, a generated epilogue's sums), the tile configuration, the hooks the tile
program's sync ops run in, and the kernel ABI they add up to (parameters, TMA descriptors).

The ways AllGather+GEMM stages this rank's rows in the GEMM itself (``own_rows``,
``gather_rows``, ``push_rows``) come from the parts the schedule fused into the compute part
(:mod:`.fused_rows`): extra parameters and descriptors, bound to the IR's names, and a template
hook the renderer names."""
from __future__ import annotations

from dataclasses import replace, dataclass

from ...ir import core
from ...ir import types as T
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS
from ...ir.schedule import ComputeSchedule
from ..abi import (LAUNCH_PARAM, RANK_PARAM, KernelParam, TmaDescriptorSpec, buffer_param, entry_name, is_this_rank,
                   peer_signal_param, signal_param, table_param, tma_param, wait_timeout_options)
from ..dtypes import SWIZZLE, ctype, elem_bytes
from ..errors import fail
from ..ir_queries import SCALAR_OPS, kernel_tensor, needed_ops, scope_of, widest_scope
from ..match.affine import affine, fmt_all
from ..match.gemm import WHAT, GemmMatch, is_accumulator
from .tile_order import order_align_shift
from .fused_rows import FusedRows, plan_fused_rows
from .wgmma import (STORE_DTYPES, GemmConfig, check_cluster_waits, check_k_loop, check_operands, check_tiles,
                    choose_config, epilogue_buffer_bytes)

#: the elementwise ops a generated epilogue's sum may apply to the accumulator and loaded tiles
SUM_OPS = ("add", "mul", "sub")

_GRID_TMA = "const __grid_constant__ cute::TmaDescriptor"


# -- the hooks -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hook:
    """Where the template runs some of the tile program's ops: the producer's waits before a
    tile's loads or a stage's, the epilogue's notifies or generated sums. ``roots`` are the ops
    the hook is for; of the rest of ``ops`` it runs the index code, loops and conditions they
    need (:func:`..ir_queries.needed_ops`): ``needed``, what the renderer emits. The other
    fields are what the rendered code reads, in program order: the kernel parameters it needs."""
    ops: tuple[core.Op, ...]
    roots: frozenset[int]                          # ids of the root ops
    needed: frozenset[int]                         # ids of the ops the hook runs: the roots and what they need
    signals: tuple[core.Signal, ...] = ()          # this rank's copy: sig_<name>
    peer_signals: tuple[core.Signal, ...] = ()     # every rank's copies: sig_<name>_peers
    tables: tuple[core.Buffer, ...] = ()           # load_scalar tables: tbl_<name>
    waits: int = 0
    notifies: int = 0
    notify_scope: str = "gpu"                      # the widest scope of the notifies
    waited: tuple[core.Signal, ...] = ()           # the signals waited on
    stored: tuple[core.Buffer, ...] = ()           # a generated epilogue's sum stores: tma_<name>
    loaded: tuple[core.Buffer, ...] = ()           # the tiles its sums load: buf_<name>


def _walk(ops):
    for op in ops:
        yield op
        for r in op.regions:
            yield from r.walk()


def _tile_loads(v: core.Value):
    """The load ops of a sum's value, depth first (the order its C++ fetches them)."""
    op = v.owner
    if op.name == "load":
        yield op
    elif op.name in ("cast", "ewise"):
        for x in op.operands:
            yield from _tile_loads(x)


def hook(ops, is_root, c_store: core.Op | None = None) -> Hook:
    """The hook of ``ops`` whose roots satisfy ``is_root``; ``c_store``: the accumulator's store
    into C (in a generated epilogue the template's own, any other store a sum)."""
    ops = tuple(ops)
    needed = needed_ops(ops, is_root)
    roots = frozenset(id(op) for op in _walk(ops) if is_root(op))
    use: dict[str, list] = {k: [] for k in ("signals", "peer_signals", "tables", "waited", "stored", "loaded")}
    count = {"waits": 0, "notifies": 0}
    scopes = []

    def add(key, x):
        if x not in use[key]:
            use[key].append(x)
    for op in _walk(ops):
        if id(op) not in needed:
            continue
        if op.name == "load_scalar":
            add("tables", op.operands[0].owner)
        if id(op) not in roots:
            continue
        if op.name in WAIT_OPS:
            add("signals", op.operands[0].owner)
            add("waited", op.operands[0].owner)
            count["waits"] += 1
        elif op.name in NOTIFY_OPS:
            local = op.name == "producer_tile_notify" or is_this_rank(op.operands[2])
            add("signals" if local else "peer_signals", op.operands[0].owner)
            scopes.append(scope_of(op))
            count["notifies"] += 1
        elif op.name == "store" and op is not c_store:
            add("stored", op.operands[0].owner)
            for ld in _tile_loads(op.operands[-1]):
                add("loaded", ld.operands[0].owner)
    return Hook(ops, roots, frozenset(needed), **{k: tuple(v) for k, v in use.items()}, **count,
                notify_scope=widest_scope(scopes))


def wait_hook(m: GemmMatch) -> Hook:
    """The prologue's waits, run by the producer before each tile's loads (``TileWaits``)."""
    return hook(m.prologue, lambda op: op.name in WAIT_OPS)


def stage_wait_hook(m: GemmMatch) -> Hook:
    """The waits in the K loop, run by the producer before it loads a stage
    (``TileWaits::stage``), with the prologue's index code they may use."""
    body = list(m.loop.regions[0].ops)
    loop_waits = {id(op) for op in _walk(body) if op.name in WAIT_OPS}
    return hook([op for op in m.prologue if op.name in SCALAR_OPS] + body, lambda op: id(op) in loop_waits)


def epilogue_hook(m: GemmMatch) -> Hook:
    """The code after the store (``TileNotifies``: its notifies) or, when the tile program
    chooses per tile what to store, after the K loop (``TileEpilogue``: stores, waits,
    notifies)."""
    if m.extras:
        return hook(m.epilogue_context, lambda op: op.name in NOTIFY_OPS | WAIT_OPS | {"store"}, m.store)
    return hook(m.epilogue_context, lambda op: op.name in NOTIFY_OPS)


# -- the variants that stage this rank's rows of A --------------------------------------------------

#: the scalar an ``own_rows`` / ``gather_rows`` GEMM takes: how many tile columns share the
#: staging (``scalar:own_cols``)
OWN_COLS = "own_cols"
#: the kernel's own counters (no IR signal): an ``own_rows`` GEMM's staged tiles, a
#: ``push_rows`` GEMM's pushed tiles (``signal:<name>`` parameters: zeroed int64 tensors)
OWN_STAGED, PUSH_COUNT = "own_staged", "push_count"


def peer_table(signal: str) -> str:
    """The name a table of every rank's addresses of ``signal`` is passed under (an int64
    tensor among the signals): ``<signal>_peers``."""
    return f"{signal}_peers"


def own_row_signals(rows: FusedRows) -> tuple[str, ...]:
    """The int64 tensors an ``own_rows`` GEMM takes among its signals, by name."""
    arrive = rows.arrive.name if rows.arrive is not None else "own_arrive"
    return (OWN_STAGED, arrive, peer_table(arrive))


def push_row_signals(rows: FusedRows) -> tuple[str, ...]:
    """The int64 tensors a ``push_rows`` GEMM takes among its signals, by name."""
    return (PUSH_COUNT, peer_table(rows.ready.name))


def push_landing(q: int) -> str:
    """The buffer a ``push_rows`` GEMM pushes into for its ``q``-th peer (ring order after it)."""
    return f"push_landing_{q}"


def _a_like(cfg: GemmConfig, param: str, buf: str, K: int, rows: int) -> TmaDescriptorSpec:
    """A descriptor with A's boxes (a stage is stored as it was loaded)."""
    return TmaDescriptorSpec(param, buf, "A", cfg.in_dtype, ctype(cfg.in_dtype).tma, (K, rows),
                             (K * cfg.elem_bytes,), (cfg.EA, cfg.BM), (1, 1), SWIZZLE[cfg.SA])


def _own_rows(kernel, part, m: GemmMatch, cfg: GemmConfig, M: int, K: int, epilogue: Hook, params: list,
              rows_plan: FusedRows) -> tuple:
    """``own_rows`` / ``gather_rows``: check the GEMM can load this rank's rows from its shard
    and store the A stages itself, add the parameters, and return the TMA descriptors of the
    shard and of where the stages go (A's boxes: a stage is stored as it was loaded) — the slot
    (``own_rows``, this rank's rows) or the gathered output (``gather_rows``, every row)."""
    what = "own_rows" if rows_plan.kind == "own_rows" else "gather_rows"
    W = kernel.world_size
    if rows_plan.gathered is not m.a or tuple(rows_plan.shard.type.shape) != (M // W, K):
        raise fail(WHAT, f"{what}: the fused parts move '{rows_plan.shard.name}' {list(rows_plan.shard.type.shape)} "
                   f"into '{rows_plan.gathered.name}', but the GEMM's A is '{m.a.name}' [{M}, {K}] gathered from "
                   f"{W} ranks", part)
    if M % W or (M // W) % cfg.BM:
        raise fail(WHAT, f"{what}: this rank's rows of '{m.a.name}' (M/W = {M}/{W}) must be whole {cfg.BM}-row tiles",
                   part)
    if cfg.cluster != (1, 1):
        raise fail(WHAT, f"{what}: the GEMM stores A stages without thread-block clusters (got {cfg.cluster})", part)
    if epilogue.notifies or m.extras:
        raise fail(WHAT, f"{what}: the GEMM must not notify or run a generated epilogue (AllGather+GEMM's compute "
                   "part does neither)", part)
    rows = M // W
    shard = rows_plan.shard.name
    if what == "gather_rows":
        params += [KernelParam("tma_a_own", _GRID_TMA, "tma", "tma:tma_a_own"),
                   KernelParam("tma_a_copy", _GRID_TMA, "tma", "tma:tma_a_copy")]
        params.append(KernelParam(OWN_COLS, "int", "i32", f"scalar:{OWN_COLS}"))
        return _a_like(cfg, "tma_a_own", shard, K, rows), _a_like(cfg, "tma_a_copy", rows_plan.out.name, K, M)
    params += [KernelParam("tma_a_own", _GRID_TMA, "tma", "tma:tma_a_own"),
               KernelParam("tma_a_slot", _GRID_TMA, "tma", "tma:tma_a_slot")]
    ctypes = ("unsigned long long* __restrict__", "const unsigned long long*", "unsigned long long* const* __restrict__")
    params += [KernelParam(param, ctype_, "ptr", f"signal:{name}")
               for param, ctype_, name in zip(("own_staged", "own_arrive", "own_arrive_peers"), ctypes,
                                              own_row_signals(rows_plan))]
    params.append(KernelParam(OWN_COLS, "int", "i32", f"scalar:{OWN_COLS}"))
    return _a_like(cfg, "tma_a_own", shard, K, rows), _a_like(cfg, "tma_a_slot", rows_plan.slot.name, K, rows)


def _check_push_order(kernel, part, sched, M: int, cfg: GemmConfig) -> None:
    """``push_rows``: every rank's GEMM waits for the others' pushes, and a CTA publishes its
    pushes only as it leaves this rank's rows — so every CTA must visit all its tiles of this
    rank's rows before any other: the ``comm_aligned`` order (it starts at this rank's rows) with
    those rows whole groups of ``group_m`` tile rows (a group straddling them would interleave
    this rank's tiles with a peer's in one CTA's sequence: a cross-rank deadlock)."""
    rows = M // kernel.world_size // cfg.BM
    shift = getattr(part, "align_shift", 0)
    # a shift that is a multiple of W starts on this rank's rows too: the order reads it reduced
    if sched.order != "comm_aligned" or order_align_shift(shift, kernel.world_size) != 0 or rows % sched.group_m:
        raise fail(WHAT, f"push_rows: each CTA must push its tiles of this rank's rows before it waits for a peer's, "
                   f"so the order must be 'comm_aligned' starting at this rank's rows (align_shift a multiple of "
                   f"{kernel.world_size}) with its {rows} tile rows whole groups (group_m dividing {rows}); got "
                   f"order={sched.order!r}, align_shift={shift}, group_m={sched.group_m}", part)


def _push_rows(kernel, cfg: GemmConfig, M: int, K: int, params: list, rows_plan: FusedRows) -> tuple:
    """``push_rows``: the parameters and the descriptors of the peers' landing buffers (both
    slots, ``[2 M, K]``; stored with A's boxes, as the stages were loaded)."""
    specs = []
    for q in range(kernel.world_size - 1):
        params.append(KernelParam(f"tma_push_{q}", _GRID_TMA, "tma", f"tma:tma_push_{q}"))
        specs.append(_a_like(cfg, f"tma_push_{q}", push_landing(q), K, 2 * M))
    count, table = push_row_signals(rows_plan)
    params += [KernelParam("push_count", "unsigned long long* __restrict__", "ptr", f"signal:{count}"),
               KernelParam("push_flag_peers", "unsigned long long* const* __restrict__", "ptr", f"signal:{table}")]
    return tuple(specs)


# -- checks ------------------------------------------------------------------------------------------

def _check_shapes(part: core.Part, m: GemmMatch, sched: ComputeSchedule):
    BM, BN, BK = sched.tile
    a, b, c = m.a.type, m.b.type, m.c.type
    if len(a.shape) != 2 or len(b.shape) != 2 or len(c.shape) != 2:
        raise fail(WHAT, "A, B and C must be 2-d", m.dot)
    M, K = a.shape
    N, K2 = b.shape if m.b_k_major else tuple(reversed(b.shape))
    if K2 != K or tuple(c.shape) != (M, N):
        b_form = " (B stored [N, K], its tiles transposed)" if m.b_k_major else ""
        raise fail(WHAT, f"shapes do not form a GEMM: A {list(a.shape)}, B {list(b.shape)}{b_form}, C {list(c.shape)}",
                   m.dot)
    la, lb = m.dot.operands[0].owner, m.b_load
    b_tile = tuple(reversed(lb.attrs["shape"])) if m.b_k_major else lb.attrs["shape"]
    check_tiles(WHAT, la.attrs["shape"], b_tile, m.frag.attrs["shape"], sched.tile, m.dot)
    check_k_loop(WHAT, m.loop, K, BK)
    k = {m.loop.regions[0].args[0].id: "k"}
    b_offs = ({"pid1": BN}, {"k": 1}) if m.b_k_major else ({"k": 1}, {"pid1": BN})
    want = {"a": ({"pid0": BM}, {"k": 1}), "b": b_offs, "c": ({"pid0": BM}, {"pid1": BN})}
    for key, op, offs in (("a", la, la.operands[1:]), ("b", lb, lb.operands[1:]),
                          ("c", m.store, m.store.operands[1:3])):
        got = tuple(affine(v, k) for v in offs)
        if got != want[key]:
            raise fail(WHAT, f"{key.upper()} tile offsets must be {fmt_all(want[key])} (grid ids pid0, pid1; "
                       f"K loop variable k), got {fmt_all(got)}", op)
    if tuple(part.grid) != (-(-M // BM), -(-N // BN)):
        raise fail(WHAT, f"the grid must be (cdiv(M, BM), cdiv(N, BN)) = {(-(-M // BM), -(-N // BN))}, "
                   f"got {part.grid}", part)
    check_operands(WHAT, a.dtype, b.dtype, m.out_dtype, K, N, m.dot, m.store, b_row=K if m.b_k_major else N)
    ob = elem_bytes(m.out_dtype)
    for st in m.extras:
        _check_epilogue_store(st, m, sched, ob)
    return M, N, K


def _check_notifies_follow_a_store(m: GemmMatch) -> None:
    """In a generated epilogue a notify releases the tile's stores: one must come before it (in
    the order the epilogue runs them)."""
    for op in _walk(m.epilogue):
        if op.name == "store":
            return
        if op.name in NOTIFY_OPS:
            raise fail(WHAT, "a notify before the tile's store in a generated GEMM epilogue", op)


def _check_no_wait_after_the_k_loop(m: GemmMatch) -> None:
    """Without a generated epilogue the template runs only the notifies after the K loop
    (``TileNotifies``): a wait there (a tile program choosing per tile what to store, its one store
    C's) would be dropped, so the part is refused — the general lowering runs it."""
    for op in _walk(m.epilogue):
        if op.name in WAIT_OPS:
            raise fail(WHAT, "a wait after the K loop runs only in a generated epilogue (one that also stores a "
                       "sum of the accumulator and loaded tiles); with C's store alone it would be dropped", op)


def _check_epilogue_store(st: core.Op, m: GemmMatch, sched: ComputeSchedule, c_bytes: int):
    """A generated epilogue's sum store: a 2-d TMA-storable buffer, the tile's columns, a value
    built from the accumulator and (BM, BN) tiles loaded at the tile's columns."""
    BM, BN, _ = sched.tile
    buf = kernel_tensor(st.operands[0], "an epilogue store's target", st, WHAT)
    dt = buf.type.dtype.name
    if len(buf.type.shape) != 2 or dt not in STORE_DTYPES:
        raise fail(WHAT, f"an epilogue store needs a 2-d f16 / bf16 / f32 tensor, got '{buf.name}' "
                   f"{list(buf.type.shape)} {dt}", st)
    if buf.type.shape[1] * elem_bytes(dt) % 16:
        raise fail(WHAT, f"TMA needs 16-byte aligned rows: '{buf.name}' rows are {buf.type.shape[1] * elem_bytes(dt)} "
                   "bytes", st)
    if 64 * min(128, BN * elem_bytes(dt)) > epilogue_buffer_bytes(BN, c_bytes):
        raise fail(WHAT, f"the epilogue stages '{buf.name}' ({dt}) in C's buffers, which are too small for it at "
                   f"BN={BN}; store the sum in a type no wider than C's", st)
    col = affine(st.operands[2])
    if col != {"pid1": BN}:
        raise fail(WHAT, f"an epilogue store must write the tile's columns (pid1*BN), got {fmt_all((col,))}", st)

    def check(v: core.Value):
        op = v.owner
        if is_accumulator(v, m.frag) and op.name == "frag_read":
            return
        if not isinstance(op, core.Op):
            raise fail(WHAT, "an epilogue value must be computed from the accumulator and loaded tiles", st)
        if op.name == "cast":
            check(op.operands[0])
        elif op.name == "ewise":
            if op.attrs["op"] not in SUM_OPS:
                raise fail(WHAT, f"elementwise '{op.attrs['op']}' in a GEMM epilogue: only {sorted(SUM_OPS)} "
                           "are lowered", op)
            for x in op.operands:
                if not isinstance(x.type, T.TileType):
                    raise fail(WHAT, "scalars in an epilogue sum are not lowered", op)
                check(x)
        elif op.name == "load":
            lb = kernel_tensor(op.operands[0], "an epilogue load's source", op, WHAT)
            ldt = lb.type.dtype.name
            if len(lb.type.shape) != 2 or ldt not in STORE_DTYPES or lb.type.shape[1] % 2:
                raise fail(WHAT, f"an epilogue load needs a 2-d f16 / bf16 / f32 tensor with an even row length, got "
                           f"'{lb.name}' {list(lb.type.shape)} {ldt}", op)
            if tuple(op.attrs["shape"]) != (BM, BN):
                raise fail(WHAT, f"an epilogue load must read a whole ({BM}, {BN}) tile, got {op.attrs['shape']}", op)
            if affine(op.operands[2]) != {"pid1": BN}:
                raise fail(WHAT, f"an epilogue load must read the tile's columns (pid1*BN), got "
                           f"{fmt_all((affine(op.operands[2]),))}", op)
        else:
            raise fail(WHAT, f"'{op.name}' in an epilogue sum: the GEMM lowering adds loaded tiles to the accumulator",
                       op)
    if tuple(st.operands[-1].type.shape) != (BM, BN):
        raise fail(WHAT, f"an epilogue store must write a whole ({BM}, {BN}) tile", st)
    check(st.operands[-1])


# -- the plan ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmPlan:
    """Everything :func:`..recipes.gemm.render_gemm` needs: the match, its configuration, its
    hooks and the kernel ABI."""
    kernel: core.Kernel
    part: core.Part
    match: GemmMatch
    config: GemmConfig
    M: int
    N: int
    K: int
    entry: str
    align_shift: int
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    options: tuple[str, ...]                   # NVRTC options
    waits: Hook                                # before each tile's loads
    stage_waits: Hook                          # before each stage's loads
    epilogue: Hook                             # after the store / the K loop
    notified: tuple[core.Signal, ...]          # the signals the epilogue adds to (this rank's copies)
    rows: FusedRows | None = None              # what the parts fused into it ask (own/gather/push_rows)

    @property
    def own_rows(self) -> bool:
        return self.rows is not None and self.rows.kind == "own_rows"

    @property
    def gather_rows(self) -> bool:
        return self.rows is not None and self.rows.kind in ("gather_rows", "push_rows")

    @property
    def push_rows(self) -> bool:
        return self.rows is not None and self.rows.kind == "push_rows"

    @property
    def waited(self) -> tuple[core.Signal, ...]:
        """Every signal the kernel waits on: the producer's, then a generated epilogue's."""
        sigs = list(self.waits.signals) + [s for s in self.stage_waits.signals if s not in self.waits.signals]
        return tuple(sigs + [s for s in self.epilogue.waited if s not in sigs])


def overlaps_store(cfg: GemmConfig, m: GemmMatch, epi: Hook, waits: int) -> bool:
    """Whether each tile's C is held in registers as 16-bit pairs and stored during the next tile's K
    loop (``HeldTile`` in sm90_gemm.hpp): a plain store of a 16-bit C (no generated epilogue) whose
    staging chunks are a multiple of 16 columns (stmatrix stores two 8-column groups at a time). A
    tile's notifies then run a tile later, once its stores are complete — so not in a part that also
    waits, whose next tile may wait on what those notifies release, nor where it notifies peers."""
    return (not m.extras and cfg.out_bytes == 2 and cfg.EC % 16 == 0
            and not (epi.notifies and (waits or epi.peer_signals)))


def plan_gemm(kernel: core.Kernel, part: core.Part, m: GemmMatch, *, cluster=None,
              wait_timeout_ns: int | None = None, entry: str | None = None) -> GemmPlan:
    """The plan of a matched GEMM (options: see :func:`..recipes.gemm.lower_gemm`)."""
    sched = kernel.compute_schedule or ComputeSchedule()
    M, N, K = _check_shapes(part, m, sched)
    if m.extras:
        _check_notifies_follow_a_store(m)
    else:
        _check_no_wait_after_the_k_loop(m)
    cfg = choose_config(WHAT, sched, m.a.type.dtype.name, m.out_dtype, K=K, cluster=cluster,
                        loc=part.loc)
    if m.b_k_major:      # the same shared memory, B's stages chunked along K as A's
        cfg = replace(cfg, b_k_major=True)
    check_cluster_waits(WHAT, kernel, part, cfg.cluster, sched.cluster)
    waits, stage, epi = wait_hook(m), stage_wait_hook(m), epilogue_hook(m)
    if overlaps_store(cfg, m, epi, waits.waits + stage.waits):
        cfg = replace(cfg, overlap_store=True)

    params = [KernelParam("tma_a", _GRID_TMA, "tma", "tma:tma_a"),
              KernelParam("tma_b", _GRID_TMA, "tma", "tma:tma_b"),
              KernelParam("tma_c", _GRID_TMA, "tma", "tma:tma_c"),
              KernelParam("M", "int", "i32", "M", M), KernelParam("N", "int", "i32", "N", N),
              KernelParam("K", "int", "i32", "K", K), RANK_PARAM, LAUNCH_PARAM]
    notified = tuple(s for s in epi.signals if _notifies(m.epilogue, s))
    waited = list(waits.signals) + [s for s in stage.signals if s not in waits.signals]
    for s in waited:   # waited on (and maybe notified): this rank's copy
        ctype_ = ("unsigned long long* __restrict__" if s in notified
                  else "const unsigned long long* __restrict__")
        params.append(KernelParam(signal_param(s), ctype_, "ptr", f"signal:{s.name}"))
    for s in epi.signals:   # in the epilogue only: notified (or waited on, by a generated epilogue)
        if s not in waited:
            ctype_ = "unsigned long long* __restrict__" if s in notified else "const unsigned long long*"
            params.append(KernelParam(signal_param(s), ctype_, "ptr", f"signal:{s.name}"))
    for s in epi.peer_signals:
        params.append(KernelParam(peer_signal_param(s), "unsigned long long* const* __restrict__", "ptr",
                                  f"peer_signals:{s.name}"))
    tables = list(waits.tables) + [t for t in stage.tables if t not in waits.tables]
    tables += [t for t in epi.tables if t not in tables]
    for t in tables:
        params.append(KernelParam(table_param(t), "const int* __restrict__", "ptr", f"buffer:{t.name}"))
    for b in epi.stored:     # a generated epilogue: its sum stores' descriptors, the tensors it loads
        params.append(KernelParam(tma_param(b), _GRID_TMA, "tma", f"tma:{tma_param(b)}"))
    for b in epi.loaded:     # peers write these during the kernel: plain (L2) loads, never the read-only path
        params.append(KernelParam(buffer_param(b), f"const {ctype(b.type.dtype).c}*", "ptr", f"data:{b.name}"))

    tma = _tma_specs(cfg, m, M, N, K) + tuple(_store_spec(cfg, b) for b in epi.stored)
    rows = plan_fused_rows(kernel, part, m.a)
    if rows is not None:
        tma += _own_rows(kernel, part, m, cfg, M, K, epi, params, rows)
        if rows.kind == "push_rows":
            _check_push_order(kernel, part, sched, M, cfg)
            tma += _push_rows(kernel, cfg, M, K, params, rows)
    return GemmPlan(kernel, part, m, cfg, M, N, K, entry_name(kernel, part, entry),
                    order_align_shift(getattr(part, "align_shift", 0), kernel.world_size), tuple(params), tma,
                    wait_timeout_options(wait_timeout_ns),
                    waits, stage, epi, notified, rows)


def _notifies(ops, sig) -> bool:
    return any(op.name in NOTIFY_OPS and op.operands[0].owner is sig for op in _walk(ops))


def _store_spec(cfg: GemmConfig, buf: core.Buffer) -> TmaDescriptorSpec:
    """The TMA descriptor of a generated epilogue's sum store (64-row boxes, like C's)."""
    dt = buf.type.dtype.name
    ob = elem_bytes(dt)
    rows, cols = buf.type.shape
    sc = min(128, cfg.BN * ob)
    return TmaDescriptorSpec(tma_param(buf), buf.name, "C", dt, ctype(dt).tma, (cols, rows),
                             (cols * ob,), (sc // ob, 64), (1, 1), SWIZZLE[sc],
                             l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE")


def _tma_specs(cfg: GemmConfig, m: GemmMatch, M: int, N: int, K: int) -> tuple[TmaDescriptorSpec, ...]:
    eb, ob = cfg.elem_bytes, cfg.out_bytes
    a = _a_like(cfg, "tma_a", m.a.name, K, M)
    if cfg.b_k_major:     # [N, K]: boxes of EB columns (K) by BN rows, a cluster's CTAs loading 1/cluster each
        b = TmaDescriptorSpec("tma_b", m.b.name, "B", cfg.in_dtype, ctype(cfg.in_dtype).tma, (K, N), (K * eb,),
                              (cfg.EB, cfg.BN // cfg.cluster[0]), (1, 1), SWIZZLE[cfg.SB])
    else:
        b = TmaDescriptorSpec("tma_b", m.b.name, "B", cfg.in_dtype, ctype(cfg.in_dtype).tma, (N, K), (N * eb,),
                              (cfg.EB, cfg.BK), (1, 1), SWIZZLE[cfg.SB])
    c = TmaDescriptorSpec("tma_c", m.c.name, "C", cfg.out_dtype, ctype(cfg.out_dtype).tma, (N, M), (N * ob,),
                          (cfg.EC, 64), (1, 1), SWIZZLE[cfg.SC], l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE")
    return (a, b, c)
