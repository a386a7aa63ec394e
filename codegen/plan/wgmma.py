"""Planning the WGMMA mainloop both GEMM recipes share (plain and grouped): the tile
configuration and every number the host and the C++ template must agree on (shared memory,
registers, epilogue buffers), chosen from the compute schedule within sm_90's limits."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...ir import core
from ...ir.part_graph import parts_waiting_through_others, reaches, waits_on
from ...ir.schedule import ComputeSchedule
from ..dtypes import MMA_INPUTS, elem_bytes
from ..errors import fail
from ..ir_queries import const_value

SMEM_LIMIT = 232448           # dynamic shared memory per block on sm_90 (227 KiB)
ACC_LIMIT = 128               # fp32 accumulators per consumer thread we allow (register file)
ORDERS = {"row_major": 0, "swizzled": 1, "comm_aligned": 2}   # tile orders (tile_order.hpp)


@dataclass(frozen=True)
class GemmConfig:
    """Tile configuration, and every number the host and the C++ template must agree on."""
    BM: int
    BN: int
    BK: int
    stages: int
    order: str
    group_m: int
    cluster: tuple[int, int]
    consumer_wgs: int
    epi_buffers: int
    producer_regs: int
    consumer_regs: int
    in_dtype: str
    out_dtype: str
    split_n: bool = False           # BM 64: the consumer warpgroups split the tile's columns, not its rows
    notify_slots: int = 0           # full/empty mbarrier pairs of the grouped GEMM's deferred-notify ring
    half_tiles: bool = False        # grouped GEMM: a tile of <= 64 valid rows runs as 64 rows
    pingpong: bool = False          # grouped GEMM: each consumer warpgroup owns whole tiles, the two taking turns
    pair_rows: bool = False         # grouped GEMM: 64-row program tiles, two of one expert to a 128-row CTA tile
    b_k_major: bool = False         # plain GEMM: B stored [N, K] (`tl.dot(a, tl.trans(b_tile))`), chunked as A
    overlap_store: bool = False     # a tile's 16-bit C held in registers, stored during the next K loop

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumer_wgs)

    @property
    def elem_bytes(self) -> int:
        return elem_bytes(self.in_dtype)

    @property
    def out_bytes(self) -> int:
        return elem_bytes(self.out_dtype)

    # swizzle widths (bytes) and chunk widths (elements) of the A, B and C shared-memory tiles
    @property
    def SA(self) -> int: return min(128, self.BK * self.elem_bytes)
    @property
    def EA(self) -> int: return self.SA // self.elem_bytes
    @property
    def SB(self) -> int: return min(128, (self.BK if self.b_k_major else self.BN) * self.elem_bytes)
    @property
    def EB(self) -> int: return self.SB // self.elem_bytes
    @property
    def SC(self) -> int: return min(128, self.BN * self.out_bytes)
    @property
    def EC(self) -> int: return self.SC // self.out_bytes
    @property
    def wg_n(self) -> int:
        """Tile columns one consumer warpgroup owns (its WGMMA's N)."""
        return self.BN // self.consumer_wgs if self.split_n else self.BN

    @property
    def acc_per_thread(self) -> int:
        return self.m_blocks * self.wg_n // 2

    @property
    def m_blocks(self) -> int:
        """64-row blocks one consumer warpgroup computes of a tile."""
        return 1 if self.split_n else self.BM // (64 * (1 if self.pingpong else self.consumer_wgs))

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory the launch must request (mirrors GemmTraits::kSmemBytes)."""
        return _smem_bytes(self.BM, self.BN, self.BK, self.stages, self.consumer_wgs, self.epi_buffers,
                           self.elem_bytes, self.out_bytes, self.notify_slots)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def epilogue_buffer_bytes(BN: int, out_bytes: int) -> int:
    """Shared memory of one epilogue buffer (64 rows of C, swizzle-aligned): what a store
    staged through C's buffers must fit."""
    return _round_up(64 * min(128, BN * out_bytes), 1024)


def _smem_bytes(BM, BN, BK, stages, wgs, epi_buffers, eb, ob, notify_slots=0) -> int:
    stage_a, stage_b = BM * BK * eb, BK * BN * eb
    epi_buf = epilogue_buffer_bytes(BN, ob)
    off_c = _round_up(stages * (stage_a + stage_b), 1024)
    used = off_c + wgs * epi_buffers * epi_buf + 2 * stages * 8 + 2 * notify_slots * 8
    return used + 1024


#: BN from which a 64-row tile splits its columns between two consumer warpgroups (each a
#: 64 x BN/2 WGMMA of N >= 128) where the recipe allows it, instead of one warpgroup on the whole
#: tile: small MoE experts pad to 64 rows, with the tensor cores of both warpgroups busy
SPLIT_N_MIN_BN = 256


def choose_config(what: str, sched: ComputeSchedule, in_dtype: str, out_dtype: str, *, K: int, cluster=None,
                  loc=None, clusters_lowered=((1, 1), (2, 1)), split_n: bool = False,
                  notify_slots: int = 0, pingpong: bool = False) -> GemmConfig:
    """The configuration of the schedule's tile for a K loop over ``K``, or a LoweringError from
    recipe ``what`` at ``loc``. ``split_n``: the recipe's template lets a 64-row tile's consumer
    warpgroups split its columns (taken from ``BN >=`` :data:`SPLIT_N_MIN_BN`); ``notify_slots``:
    the mbarrier pairs of its deferred-notify ring, in shared memory after the stages' (doubled
    for ping-pong: one ring per consumer warpgroup); ``pingpong``: the recipe's template can run
    its consumer warpgroups in turns on whole tiles — taken for 128 x 128 tiles (a whole tile's
    accumulators fit one warpgroup, :data:`ACC_LIMIT`; the one shape measured so far), so that one
    warpgroup's epilogue overlaps the other's K loop."""
    BM, BN, BK = sched.tile
    if sched.stages < 2 and K > BK:
        # the consumers release a stage only once the next K step's WGMMAs are issued (one batch
        # stays in flight), so with one stage the producer would wait for it forever
        raise fail(what, f"stages={sched.stages} with K={K} over BK={BK}: the consumers keep one K step's WGMMAs "
                         "in flight while the producer loads the next, which needs a second stage (use stages >= 2)",
                   loc)
    cl = tuple(cluster if cluster is not None else getattr(sched, "cluster", (1, 1)))
    if BM < 64:
        raise fail(what, f"BM={BM}: WGMMA works on 64-row blocks, so BM must be 64, 128 or 256", loc)
    if BK < 16:
        raise fail(what, f"BK={BK}: WGMMA consumes K in steps of 16, so BK must be >= 16", loc)
    if BN < 16:
        raise fail(what, f"BN={BN}: this lowering needs BN >= 16", loc)
    if cl not in clusters_lowered:
        raise fail(what, f"cluster {cl}: this lowering supports {list(clusters_lowered)}", loc)
    split = split_n and BM == 64 and BN >= SPLIT_N_MIN_BN and BN % 128 == 0
    wgs = 2 if BM >= 128 or split else 1
    pp = pingpong and (BM, BN) == (128, 128)
    regs = (40, 232) if wgs == 2 else (0, 0)
    cfg = GemmConfig(BM=BM, BN=BN, BK=BK, stages=sched.stages, order=sched.order, group_m=sched.group_m, cluster=cl,
                     consumer_wgs=wgs, epi_buffers=2, producer_regs=regs[0], consumer_regs=regs[1],
                     in_dtype=in_dtype, out_dtype=out_dtype, split_n=split,
                     notify_slots=notify_slots * (2 if pp else 1), pingpong=pp)
    if cfg.acc_per_thread > ACC_LIMIT:
        raise fail(what, f"tile {sched.tile} needs {cfg.acc_per_thread} fp32 accumulators per consumer thread; at "
                   f"most {ACC_LIMIT} fit the register file with two consumer warpgroups (use BM*BN <= 128*256)", loc)
    # two epilogue buffers per consumer warpgroup where they fit, else one
    for bufs in (2, 1):
        if replace(cfg, epi_buffers=bufs).smem_bytes <= SMEM_LIMIT:
            return replace(cfg, epi_buffers=bufs)
    raise fail(what, f"tile {sched.tile} with {sched.stages} stages needs {replace(cfg, epi_buffers=1).smem_bytes} "
               f"bytes of shared memory, more than the {SMEM_LIMIT} an sm_90 block may use: lower `stages` or the "
               "tile", loc)


#: the output dtypes both WGMMA epilogues store
STORE_DTYPES = ("f16", "bf16", "f32")


def check_tiles(what: str, a_tile, b_tile, acc_tile, tile, at) -> None:
    """The tiles the K loop multiplies and accumulates are the compute schedule's ``(BM, BN, BK)``."""
    BM, BN, BK = tile
    if tuple(a_tile) != (BM, BK) or tuple(b_tile) != (BK, BN) or tuple(acc_tile) != (BM, BN):
        raise fail(what, f"tile shapes A {tuple(a_tile)}, B {tuple(b_tile)}, acc {tuple(acc_tile)} do not match the "
                   f"compute schedule's tile {(BM, BN, BK)}", at)


def check_k_loop(what: str, loop: core.Op, K: int, BK: int) -> None:
    """The K loop is ``tl.range(0, K, BK)``."""
    lo, hi, st = (const_value(v) for v in loop.operands)
    if (lo, hi, st) != (0, K, BK):
        raise fail(what, f"the K loop must be tl.range(0, {K}, {BK}) (K of A/B, step BK), got ({lo}, {hi}, {st})",
                   loop)


def check_operands(what: str, a_dt, b_dt, out_dt: str, K: int, N: int, dot, store, loaders: str = "TMA",
                   b_row: int | None = None) -> None:
    """The operands the WGMMA mainloop takes: A and B both f16 or both bf16, C f16/bf16/f32, and
    rows 16-byte aligned (``loaders`` name what copies them: TMA, cp.async; ``b_row``: B's row
    length where it is not N, a B stored [N, K])."""
    in_dt = a_dt.name
    if in_dt != b_dt.name or in_dt not in MMA_INPUTS:
        raise fail(what, f"A and B must both be f16 or both bf16 for WGMMA, got {a_dt} and {b_dt}", dot)
    if out_dt not in STORE_DTYPES:
        raise fail(what, f"C must be f16, bf16 or f32, got {out_dt}", store)
    eb, ob = elem_bytes(in_dt), elem_bytes(out_dt)
    for name, pitch in (("A", K * eb), ("B", (N if b_row is None else b_row) * eb), ("C", N * ob)):
        if pitch % 16:
            raise fail(what, f"{loaders} needs 16-byte aligned rows: {name}'s row pitch is {pitch} bytes "
                             f"(pad K and N to multiples of {16 // eb})", dot)


def check_cluster_waits(what: str, kernel: core.Kernel, part: core.Part, cluster, scheduled=(1, 1)) -> None:
    """Refuse thread-block clusters for a part that waits, directly or through other parts, on
    what it notifies itself: the CTAs of a cluster share B (TMA multicast), so neither of their
    tiles finishes before both have passed their waits — a tile whose wait needs its partner's
    result (a row stored, then moved back by a communication part) would hang on any grid, a
    coupling the simulator, running the tiles apart, does not model. A part that waits on its
    own tiles only through other parts must also walk them in the schedule's order
    (``scheduled``: the schedule's clusters, which order the tiles): the simulator checks it in
    that order on one slot, as a GPU giving it fewer CTAs than tiles runs it, and a kernel
    walking another order could wait on a later tile of its CTA. (One whose tiles wait for each
    other directly is kept resident by the GPU run plan, in any order.)"""
    if not reaches(waits_on(kernel), part.name, part.name):
        return
    if tuple(cluster) != (1, 1):
        raise fail(what, f"cluster {tuple(cluster)}: the CTAs of a cluster share B, so neither tile finishes before "
                   f"both have passed their waits, and part '{part.name}' waits, through other parts, on signals it "
                   "notifies itself: a tile's wait could need its cluster partner's result and hang. Use cluster "
                   "(1, 1)", part)
    if tuple(scheduled) != (1, 1) and part.name in parts_waiting_through_others(kernel):
        raise fail(what, f"cluster (1, 1) in place of the schedule's {tuple(scheduled)}: the kernel would walk its "
                   f"tiles without the clusters, in another order than the one the simulator checks part "
                   f"'{part.name}' in (it waits, through other parts, on signals it notifies itself, so a tile "
                   "waiting for a later one of its CTA hangs). Use a schedule without clusters", part)
