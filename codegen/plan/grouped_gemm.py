"""Planning a grouped GEMM: the shapes and tile offsets the template supports, the WGMMA
configuration (:mod:`.wgmma`, with more producer registers when A is gathered), the TMA
descriptors, and the kernel's parameters — the template's, then what the tile program's
hooks read (:mod:`.prog_params`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...ir import core
from ...ir.opdefs import WAIT_OPS, NOTIFY_OPS
from ...ir.part_graph import reaches, self_signals, waits_on
from ...ir.schedule import ComputeSchedule
from ..abi import (LAUNCH_PARAM, RANK_PARAM, KernelParam, TmaDescriptorSpec, entry_name, pointer_param,
                   wait_timeout_options)
from ..dtypes import SWIZZLE, c_type, ctype
from ..errors import LoweringError, fail
from ..ir_queries import const_value, scope_of
from ..match import affine as aff
from ..match.grouped_gemm import WHAT, GroupedGemmMatch
from ..match.per_row import depends_on
from ...ir.opdefs import written_buffers
from .tile_order import order_align_shift
from .prog_params import signal_hook, signal_params, signals_used, tensor_param, tensors_read, value_hook
from .wgmma import GemmConfig, check_cluster_waits, check_k_loop, check_operands, check_tiles, choose_config

#: the registers a 384-thread CTA holds (ptxas gives each thread 168 under ``__launch_bounds__(384,
#: 1)``): ``setmaxnreg`` only moves them between warpgroups — a consumer's increase waits until
#: the producer's decrease has freed enough, so 128 * producer + 256 * consumer must not exceed it
#: (more would wait forever)
REGISTER_POOL = 168 * 384
#: producer / consumer registers after ``setmaxnreg`` when A is gathered (the producer warpgroup
#: keeps the tile's row ids and cp.async addresses in registers): 128 * 56 + 256 * 224 = the pool;
#: 224 still holds the 128 accumulators of a 128x256 tile without spills (checked in the tests).
GATHER_REGS = (56, 224)
#: ... when a row-gather part is folded into the producer warpgroup's spare warps (each keeps up to eight
#: gathered 8-wide rows and their sum in flight): 128 * 104 + 256 * 200 = the pool
SIDE_REGS = (104, 200)
#: ... when each consumer thread holds a tile's 16-bit pairs besides its accumulators (overlapped stores)
#: and the deferred notifies' state (or the held rows' targets, where they are added into C), a producer
#: that runs no waits: 128 * 24 + 256 * 240 = the pool (232
#: spilled a few bytes at W = 4; a producer running waits spills at 24)
HELD_REGS = (24, 240)
#: slots of the deferred-notify ring (sm90_grouped_gemm.hpp): how many tiles' notifies the
#: consumers may hand the notifier warp ahead of it (it runs one as fast as it is handed one)
NOTIFY_SLOTS = 2
_TMA = "const __grid_constant__ cute::TmaDescriptor"


@dataclass(frozen=True)
class GroupedGemmPlan:
    """Everything the renderer needs: the match, the configuration and the kernel's ABI."""
    kernel: core.Kernel
    part: core.Part
    match: GroupedGemmMatch
    config: GemmConfig
    M: int                          # rows of A (gathered: rows that may be gathered)
    N: int
    K: int
    entry: str
    align_shift: int
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    buffers: dict                   # IR name -> (shape, dtype name) of every tensor passed by pointer
    signals: tuple[core.Signal, ...]        # waited on / notified: params sig_<name>
    tensors: tuple[core.Buffer, ...]        # read by the hooks: tbl_<name> / ptr_<name>
    written: frozenset[str]                 # tensors another part writes: read coherently
    waits: int
    notifies: int
    wait_scopes: tuple[str, ...]            # memory scopes of the waits' acquires ("gpu", "sys")
    options: tuple[str, ...]                # NVRTC options
    side: object = None                     # CombinePlan of a row-gather part folded into the spare producer warps
    late_waits: int = 0                     # waits after the K loop, before the rows are added (the consumers')

    @property
    def part_rows(self) -> int:
        """Rows of one of the part's tiles (the program's BM; the CTA's tile may hold two)."""
        return self.config.BM // 2 if self.config.pair_rows else self.config.BM

    @property
    def notifier_warp(self) -> bool:
        """Whether the template runs the tiles' notifies on the producer's warp 1 (``notifies_lanes``,
        the consumers' deferred-notify ring) rather than on a consumer thread (``notifies``)."""
        return uses_notifier_warp(self.match, self.waits, self.notifies, self.side)


def uses_notifier_warp(m: GroupedGemmMatch, waits: int, notifies: int, side) -> bool:
    """The template's ``kNotifierWarp``: a part that notifies and never waits (its notifies deferred to
    the next tile's K loop), A by TMA and nothing folded in (the producer's warp 1 otherwise busy)."""
    return bool(notifies) and not waits and side is None and not m.gather


def overlaps_store(cfg: GemmConfig, waits: int, notifies: int, side, gather: bool) -> bool:
    """Whether each tile's C is held in registers as 16-bit pairs and stored during the consumer
    warpgroup's next K loop (``HeldTile`` in sm90_gemm.hpp): 16-bit C in whole 64-column chunks, the
    cooperative consumers (ping-pong already stores one tile while the other warpgroup computes), no
    part folded in (its consumers keep fewer registers), notifies, if any, deferred to the next tile
    (a part that waits notifies each tile at once, its stores complete), and A loaded by TMA (a
    producer gathering rows sets the pace: AllGather+MoE's GEMM measured 1 % slower holding tiles,
    BENCHMARKS.md, fifty-eighth session)."""
    return (cfg.out_bytes == 2 and cfg.EC % 16 == 0 and not cfg.pingpong and side is None
            and not (notifies and waits) and not gather)


def plan_grouped_gemm(kernel: core.Kernel, part: core.Part, m: GroupedGemmMatch, *, cluster=None,
                      wait_timeout_ns: int | None = None, entry: str | None = None,
                      side: str | None = None) -> GroupedGemmPlan:
    """The plan of a matched grouped GEMM under the kernel's compute schedule; ``side`` names a
    row-gather part (a combine, a row gather) folded into the kernel (:func:`plan_side`)."""
    sched = kernel.compute_schedule or ComputeSchedule()
    M, N, K = _check_shapes(m, sched)
    in_dt = m.a.type.dtype.name
    walk = list(part.walk())
    # the waits before the tile's loads (the producer's and consumers'), and those after the K loop
    # (the consumers', before a tile's rows are added: GroupedGemmMatch.late_waits)
    waits = [op for op in walk if op.name in WAIT_OPS and id(op) not in m.late_waits]
    late = [op for op in walk if op.name in WAIT_OPS and id(op) in m.late_waits]
    notifies = sum(op.name in NOTIFY_OPS for op in walk)
    # the deferred-notify ring's barriers only where the notifier warp uses them
    ring = NOTIFY_SLOTS if uses_notifier_warp(m, len(waits), notifies, side) else 0
    # ping-pong consumers where A comes by TMA (with a gathered A the producer's cp.asyncs set the pace:
    # measured 3-7 % slower at 128 x 128 there; BENCHMARKS.md, twenty-eighth session)
    # (rows added into C: held tiles of the cooperative consumers, each program tile a CTA tile)
    cfg = None if m.adds_rows else paired_config(kernel, m, sched, in_dt, K, cluster, ring, side, part.loc)
    if cfg is None:
        cfg = choose_config(WHAT, sched, in_dt, m.out_dtype, K=K, cluster=cluster, loc=part.loc, split_n=True,
                            notify_slots=ring, pingpong=not m.gather and not m.adds_rows)
    if m.b_k_major:     # the same shared memory, B's stages chunked along K as A's
        cfg = replace(cfg, b_k_major=True)
    if m.gather and cfg.consumer_wgs == 2:
        cfg = replace(cfg, producer_regs=GATHER_REGS[0], consumer_regs=GATHER_REGS[1])
    # half tiles, but not with a part folded in: there every tile computes its 128 rows (measured on one
    # H200, the stress row's folded row gather 5.42 ms without half tiles against 6.32 with them, its folded
    # combine 3.14 against 3.67, the Mixtral rows as fast or faster; BENCHMARKS.md, thirty-third session)
    if m.row_limit is not None and half_tiles_fit(cfg) and side is None and (not m.adds_rows or targets_masked(m)):
        cfg = replace(cfg, half_tiles=True)
    side_plan = plan_side(kernel, part, m, side, wait_timeout_ns) if side is not None else None
    if side_plan is not None and cfg.consumer_wgs == 2:
        cfg = replace(cfg, producer_regs=SIDE_REGS[0], consumer_regs=SIDE_REGS[1])
    if overlaps_store(cfg, len(waits), notifies, side, m.gather):
        cfg = replace(cfg, overlap_store=True)
        if (notifies or (m.adds_rows and not waits)) and not m.gather and cfg.consumer_wgs == 2:
            cfg = replace(cfg, producer_regs=HELD_REGS[0], consumer_regs=HELD_REGS[1])
    elif m.adds_rows:
        raise fail(WHAT, "rows are added into C from held tiles only: a TMA-loaded A, 16-bit C in whole 64-column "
                   "chunks, cooperative consumers and nothing folded in", m.store)

    ops = part.body.ops
    written = written_buffers(kernel)
    if cfg.cluster != (1, 1):
        _check_cluster(m, written, ops, cfg.cluster)
    check_cluster_waits(WHAT, kernel, part, cfg.cluster, sched.cluster)
    if m.row_limit is not None:
        _check_row_limit(m, written, ops)
    signals = signals_used(ops)
    # the hooks in the order the renderer emits them: active, batch, row, valid rows, waits, notifies
    tensors = tensors_read(ops, [value_hook(ops, [m.guard.operands[0]] if m.guard is not None else []),
                                 value_hook(ops, [m.batch] if m.batched else []),
                                 value_hook(ops, [m.rows] if m.gather else []),
                                 value_hook(ops, [m.row_limit] if m.row_limit is not None else []),
                                 value_hook(ops, [m.targets] if m.adds_rows else []),
                                 value_hook(ops, [m.scale] if m.scale is not None else []),
                                 signal_hook(ops, WAIT_OPS), signal_hook(ops, NOTIFY_OPS)])
    if m.adds_rows and m.c in tensors:
        raise fail(WHAT, f"the tile's guard, expert, row ids or scales read '{m.c.name}', which the part adds rows "
                   "into while the kernel runs", m.store)
    params = [] if m.gather else [KernelParam("tma_a", _TMA, "tma", "tma:tma_a")]
    params += [KernelParam("tma_b", _TMA, "tma", "tma:tma_b"), KernelParam("tma_c", _TMA, "tma", "tma:tma_c")]
    buffers = {}
    if m.gather:
        params.append(KernelParam(pointer_param(m.a), f"const {c_type(in_dt)}* __restrict__", "ptr",
                                  f"buffer:{m.a.name}"))
        buffers[m.a.name] = (tuple(m.a.type.shape), in_dt)
    params += [RANK_PARAM, LAUNCH_PARAM]
    params += signal_params(signals)
    for b in tensors:
        params.append(tensor_param(b, written))
        buffers[b.name] = (tuple(b.type.shape), b.type.dtype.name)
    if m.adds_rows:                     # C by pointer: the rows' adds address it (Prog::out)
        params.append(KernelParam(pointer_param(m.c), f"{c_type(m.out_dtype)}*", "ptr", f"buffer:{m.c.name}"))
        buffers[m.c.name] = (tuple(m.c.type.shape), m.out_dtype)
    return GroupedGemmPlan(kernel, part, m, cfg, M, N, K, entry_name(kernel, part, entry),
                           order_align_shift(getattr(part, "align_shift", 0), kernel.world_size), tuple(params),
                           _tma_specs(cfg, m, M, N, K),
                           buffers, signals, tensors, written, len(waits),
                           notifies, tuple(sorted({scope_of(op) for op in waits + late})),
                           wait_timeout_options(wait_timeout_ns), side_plan, len(late))


def paired_config(kernel: core.Kernel, m: GroupedGemmMatch, sched: ComputeSchedule, in_dt: str, K: int, cluster,
                  ring: int, side, loc) -> GemmConfig | None:
    """The configuration that runs a part of 64-row tiles (an MoE expert padded to 64 rows, not 128)
    on 128-row CTA tiles: two program tiles of one expert as one tile (both consumer warpgroups on
    its rows, B loaded once for 128 rows), any other as a half tile (Cfg::kPairRows,
    ``pair_tile`` in sm90_grouped_gemm.hpp). Where it does not apply, None: the tiles then run as
    64 rows with the consumer warpgroups splitting the columns (measured 0-20 % slower in the
    MoE+RS GEMM, 7-34 % where A is gathered: BENCHMARKS.md, twenty-ninth session, call 4).

    Applies to 64-row tiles whose stored rows past a run-time count are zeros (the count tells a
    full tile from a partial one), without clusters (pairs of CTAs would hold a leader and its
    follower), with nothing folded in, a guard and an expert no other part writes while the
    kernel runs, and tiles that do not wait on each other; the stages must fit 128-row tiles.
    The order walks slots of two program tiles (a group: ``group_m`` slots), the two of a slot
    on one CTA."""
    cl = tuple(cluster if cluster is not None else getattr(sched, "cluster", (1, 1)))
    BM, BN, BK = sched.tile
    if BM != 64 or m.row_limit is None or cl != (1, 1) or side is not None:
        return None
    # every role of the kernel decides from the guard and the expert of a tile and of its neighbour
    # whether they pair: what those read must not change while the kernel runs (else the roles could
    # disagree and their rings fall out of step)
    if _written_reads(m.part.body.ops, tile_choice_values(m), written_buffers(kernel)):
        return None
    # a pair waits for both tiles before computing the first and notifies for both after storing the
    # second: where the part's tiles wait on each other (directly or through other parts), a tile's
    # waits could need its partner's notifies
    if self_signals(m.part) or reaches(waits_on(kernel), m.part.name, m.part.name):
        return None
    cta = replace(sched, tile=(128, BN, BK))
    try:
        cfg = choose_config(WHAT, cta, in_dt, m.out_dtype, K=K, cluster=cl, loc=loc, split_n=True,
                            notify_slots=ring, pingpong=False)
    except LoweringError:
        return None
    cfg = replace(cfg, b_k_major=m.b_k_major)
    return replace(cfg, half_tiles=True, pair_rows=True) if half_tiles_fit(cfg) else None


def half_tiles_fit(cfg: GemmConfig) -> bool:
    """Whether a tile of at most 64 valid rows (the rest stored as zeros) can run as a half tile: its
    64 rows on both consumer warpgroups, each a 64 x BN/2 WGMMA (a 128-row tile whose warpgroups split
    rows; BN/2 a WGMMA width, a multiple of C's 64-row store chunks) — or, ping-pong, on the one
    warpgroup that owns the tile, one m64 block instead of two."""
    if cfg.pingpong:            # (128 x 128 tiles only: the m64 block is the tile's own WGMMA)
        return True
    half = cfg.BN // 2
    return (cfg.BM == 128 and cfg.consumer_wgs == 2 and not cfg.split_n and cfg.BN % 16 == 0
            and half % cfg.EC == 0 and (cfg.b_k_major or half % cfg.EB == 0))


#: threads of a folded part: warps 1-3 of the producer warpgroup (warp 0 issues the TMA loads)
SIDE_THREADS = 96


def plan_side(kernel: core.Kernel, part: core.Part, m: GroupedGemmMatch, side: str, wait_timeout_ns):
    """The plan of the row-gather part ``side`` folded into this grouped GEMM's kernel: its tiles
    run on the three producer warps that a TMA-loaded A leaves idle, each as soon as its waits
    hold — an MoE combine as the GEMM's tiles complete (instead of after the whole GEMM), a row
    gather ahead of the GEMM tiles that read its rows (instead of before the whole GEMM). Refused
    where the GEMM gathers A (every producer thread copies rows), where the side's tiles wait on
    each other, or where the two wait on each other, directly or through other parts: they share
    each SM's CTA, and the side runs its tiles in order, so a GEMM tile waiting for a side tile
    queued behind one that waits for the GEMM tile would never finish. One way round is safe:
    the side's warps never wait for the GEMM's, or the GEMM's never for the side's (the whole
    grid is resident)."""
    from ..match.combine import match_combine
    from .combine import plan_combine
    names = [p.name for p in kernel.parts]
    if side not in names:
        raise fail(WHAT, f"side={side!r}: kernel '{kernel.name}' has no part of that name (parts: {names})", part)
    sp = kernel.part(side)
    if sp is part or sp.role != "compute":
        raise fail(WHAT, f"side={side!r}: only another compute part (a row gather or combine) folds into "
                   f"'{part.name}'", part)
    if m.gather:
        raise fail(WHAT, f"side={side!r}: '{part.name}' gathers its A rows on every producer thread; a part folds "
                   "only into a grouped GEMM whose A is loaded by TMA", m.a_load)
    own = self_signals(sp)
    if own:
        raise fail(WHAT, f"side={side!r}: the tiles of '{side}' wait on each other (signals {own}); on the producer's "
                   "spare warps they run in a fixed order on fewer CTAs than its own kernel would have, so a tile "
                   "could wait on one queued behind it", part)
    deps = waits_on(kernel)
    if reaches(deps, part.name, side) and reaches(deps, side, part.name):
        raise fail(WHAT, f"side={side!r}: '{part.name}' and '{side}' wait on each other (on signals the other "
                   "notifies, directly or through other parts); folded into one kernel they could wait on each "
                   "other forever", part)
    return plan_combine(kernel, sp, match_combine(kernel, sp), wait_timeout_ns=wait_timeout_ns,
                        entry=None, threads=SIDE_THREADS)


def _check_row_limit(m: GroupedGemmMatch, written, ops) -> None:
    """The consumers read a tile's row limit as it starts, before any of the part's waits hold, to
    choose how to run it: it must read what no other part writes while the kernel runs."""
    for name in _written_reads(ops, [m.row_limit], written):
        raise fail(WHAT, f"the row mask's count reads '{name}', which another part writes while the kernel "
                   "runs; the kernel reads the count before the tile's waits, so it must come from a tensor "
                   "filled before the launch", m.row_mask[0])


def tile_choice_values(m: GroupedGemmMatch) -> list:
    """The values every role of the kernel decides a tile's course from, besides its row count: the
    guard and the expert (a cluster pair sharing B, a pair of 64-row tiles)."""
    return ([m.guard.operands[0]] if m.guard is not None else []) + ([m.batch] if m.batched else [])


def _written_reads(ops, values, written) -> list[str]:
    """The tensors that computing ``values`` reads and that another part of the kernel writes."""
    return [b.name for b in tensors_read(ops, [value_hook(ops, values)]) if b.name in written]


def _check_cluster(m: GroupedGemmMatch, written, ops, cluster) -> None:
    """Clusters of two vertically adjacent tiles share B (TMA multicast) when both tiles' guards
    hold on the same expert, which each CTA decides for both tiles: the guard and the expert must
    read what no part writes while the kernel runs (else the two CTAs may disagree), and so must B
    (a CTA loads half of its partner's B, after its own waits only)."""
    if m.b.name in written:
        raise fail(WHAT, f"cluster {cluster}: B ('{m.b.name}') is written by another part of the kernel, so a CTA "
                   "cannot load its partner's half of B; use cluster (1, 1)", m.b_load)
    for name in _written_reads(ops, tile_choice_values(m), written):
        raise fail(WHAT, f"cluster {cluster}: the tile guard or the expert reads '{name}', which another part "
                   "writes while the kernel runs, so the CTAs of a cluster may disagree on it; use cluster (1, 1)",
                   m.guard or m.b_load)


def _check_shapes(m: GroupedGemmMatch, sched: ComputeSchedule) -> tuple[int, int, int]:
    """(M, N, K), once the tensors, tiles, offsets and dtypes fit the template."""
    BM, BN, BK = sched.tile
    at, bt, ct = m.a.type, m.b.type, m.c.type
    if len(at.shape) != 2 or len(ct.shape) != 2 or len(bt.shape) not in (2, 3):
        raise fail(WHAT, f"A and C must be 2-d and B 2-d or 3-d ([E, K, N]); got A {list(at.shape)}, "
                   f"B {list(bt.shape)}, C {list(ct.shape)}", m.dot)
    Ma, K = at.shape
    Kb, N = tuple(reversed(bt.shape[-2:])) if m.b_k_major else bt.shape[-2:]
    if Kb != K or ct.shape[1] != N:
        b_form = " (B stored [N, K], its tiles transposed)" if m.b_k_major else ""
        raise fail(WHAT, f"shapes do not form a GEMM: A {list(at.shape)}, B {list(bt.shape)}{b_form}, "
                   f"C {list(ct.shape)}", m.dot)
    b_tile = m.b_load.result.type.shape
    check_tiles(WHAT, m.a_load.attrs["shape"], tuple(reversed(b_tile)) if m.b_k_major else b_tile,
                m.frag.attrs["shape"], sched.tile, m.dot)
    check_k_loop(WHAT, m.loop, K, BK)
    iv = m.loop.regions[0].args[0]
    sym = {iv.id: "k"}
    if m.gather:
        if tuple(m.rows.type.shape) != (BM,) or m.rows.type.dtype.name != "i32":
            raise fail(WHAT, f"the gathered row ids must be a ({BM},) i32 tile, got {m.rows.type}", m.a_load)
        col = aff.affine(m.a_load.operands[2], sym)
        if col != {"k": 1}:
            raise fail(WHAT, f"the gather must read columns (k, k + BK): its column offset must be k, got "
                       f"{aff.fmt_all((col,))}", m.a_load)
        if depends_on(m.rows, iv):
            raise fail(WHAT, "the gathered row ids must not depend on the K loop", m.a_load)
    else:
        got = tuple(aff.affine(v, sym) for v in m.a_load.operands[1:])
        if got != ({"pid0": BM}, {"k": 1}):
            raise fail(WHAT, f"A tile offsets must be (pid0*{BM}, k), got {aff.fmt_all(got)}", m.a_load)
    b_offs = m.b_load.operands[1:]
    box, want, names = ((BN, BK), ({"pid1": BN}, {"k": 1}), f"pid1*{BN}, k") if m.b_k_major else \
        ((BK, BN), ({"k": 1}, {"pid1": BN}), f"k, pid1*{BN}")
    if m.batched:
        if tuple(m.b_load.attrs["shape"]) != (1, *box):
            raise fail(WHAT, f"B must be loaded as one expert's {box} tile: box (1, {box[0]}, {box[1]}), got "
                       f"{m.b_load.attrs['shape']}", m.b_load)
        if depends_on(m.batch, iv):
            raise fail(WHAT, "B's expert coordinate must not depend on the K loop", m.b_load)
        b_offs = b_offs[1:]
    got = tuple(aff.affine(v, sym) for v in b_offs)
    if got != want:
        raise fail(WHAT, f"B tile offsets must be ({'e, ' if m.batched else ''}{names}), got {aff.fmt_all(got)}",
                   m.b_load)
    if m.adds_rows:
        _check_added_rows(m, BM, BN, N)
    else:
        got = tuple(aff.affine(v, sym) for v in m.store.operands[1:3])
        if got != ({"pid0": BM}, {"pid1": BN}):
            raise fail(WHAT, f"C tile offsets must be (pid0*{BM}, pid1*{BN}), got {aff.fmt_all(got)}", m.store)
    if tuple(m.store.operands[-1].type.shape) != (BM, BN):
        raise fail(WHAT, f"the stored tile must be the ({BM}, {BN}) accumulator", m.store)
    check_operands(WHAT, at.dtype, bt.dtype, m.out_dtype, K, N, m.dot, m.store, loaders="TMA and cp.async",
                   b_row=K if m.b_k_major else None)
    return Ma, N, K


def targets_masked(m: GroupedGemmMatch) -> bool:
    """Whether the added rows' ids are themselves negative past the row mask's count,
    ``tl.where(tl.iota(BM) < n, ids, -1)`` with ``n`` read as the mask's is: then the rows a half tile
    does not compute add nothing in the program either. Elsewhere every row is held and added (a
    masked row adds 0 times its factor, which matters for a NaN, an infinite factor or a -0 there)."""
    where = m.targets.owner
    if not (isinstance(where, core.Op) and where.name == "ewise" and where.attrs.get("op") == "where"):
        return False
    cond, _, fill = where.operands
    neg = const_value(fill)
    lt = cond.owner
    if neg is None or neg >= 0 or not (isinstance(lt, core.Op) and lt.name == "ewise" and lt.attrs.get("op") == "lt"):
        return False
    iota, n = lt.operands
    if not (isinstance(iota.owner, core.Op) and iota.owner.name == "iota"):
        return False
    return _same_scalar(n, m.row_limit)


def _same_scalar(a: core.Value, b: core.Value) -> bool:
    """``a`` and ``b`` are the same value, or reads of the same table at the same affine index."""
    if a is b:
        return True
    oa, ob = a.owner, b.owner
    if not (isinstance(oa, core.Op) and isinstance(ob, core.Op) and oa.name == ob.name == "load_scalar"
            and oa.operands[0].owner is ob.operands[0].owner and len(oa.operands) == len(ob.operands)):
        return False
    return all(x is y or (aff.affine(x) is not None and aff.affine(x) == aff.affine(y))
               for x, y in zip(oa.operands[1:], ob.operands[1:]))


def _check_added_rows(m: GroupedGemmMatch, BM: int, BN: int, N: int) -> None:
    """What the template's row adds (``HeldAddedTile::add_chunk``: 16 bytes of a row at a time, by vector
    reductions of 16-bit pairs) ask of ``tl.add_rows(c, rows, pn*BN, acc * scale)``."""
    col = aff.affine(m.store.operands[2], {})
    if col != {"pid1": BN}:
        raise fail(WHAT, f"the added tile's column offset must be pid1*{BN}, got {aff.fmt_all((col,))}", m.store)
    if m.out_dtype not in ("bf16", "f16"):
        raise fail(WHAT, f"rows are added by vector reductions of 16-bit pairs: C must be bf16 or f16, got "
                   f"{m.out_dtype}", m.store)
    if N % 8:
        raise fail(WHAT, f"rows are added 16 bytes at a time: C's rows must be a multiple of 8 columns, got {N}",
                   m.store)
    if any(op.name in NOTIFY_OPS for op in m.part.walk()):
        raise fail(WHAT, "a part adding rows into C notifies nothing here (the adds of every thread would have to "
                   "complete before a tile's notify)", m.store)


def _tma_specs(cfg: GemmConfig, m: GroupedGemmMatch, M: int, N: int, K: int) -> tuple[TmaDescriptorSpec, ...]:
    """A (dense only: a gathered A is copied by cp.async), B (3-D over [E, K, N] with a box of
    one expert when batched) and C."""
    eb, ob = cfg.elem_bytes, cfg.out_bytes
    dt = ctype(cfg.in_dtype).tma
    out = []
    if not m.gather:
        out.append(TmaDescriptorSpec("tma_a", m.a.name, "A", cfg.in_dtype, dt, (K, M), (K * eb,), (cfg.EA, cfg.BM),
                                     (1, 1), SWIZZLE[cfg.SA]))
    # B [K, N] / [E, K, N], boxes of EB columns of N by BK rows; K-major ([N, K] / [E, N, K]): EB columns of K
    # by BN rows (a cluster's CTAs split B's chunks, as MN-major, or each loads the whole tile)
    inner, outer, box = (K, N, (cfg.EB, cfg.BN)) if cfg.b_k_major else (N, K, (cfg.EB, cfg.BK))
    if m.batched:
        E = m.b.type.shape[0]
        out.append(TmaDescriptorSpec("tma_b", m.b.name, "B", cfg.in_dtype, dt, (inner, outer, E),
                                     (inner * eb, K * N * eb), (*box, 1), (1, 1, 1), SWIZZLE[cfg.SB]))
    else:
        out.append(TmaDescriptorSpec("tma_b", m.b.name, "B", cfg.in_dtype, dt, (inner, outer), (inner * eb,), box,
                                     (1, 1), SWIZZLE[cfg.SB]))
    Mc = m.c.type.shape[0]
    out.append(TmaDescriptorSpec("tma_c", m.c.name, "C", cfg.out_dtype, ctype(cfg.out_dtype).tma, (N, Mc),
                                 (N * ob,), (cfg.EC, 64), (1, 1), SWIZZLE[cfg.SC],
                                 l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE"))
    return tuple(out)
