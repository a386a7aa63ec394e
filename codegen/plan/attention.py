"""Planning the flash-attention kernel: the tile configuration and every number the host and
``sm90_attention.hpp`` must agree on (shared memory, registers, TMA boxes), chosen from the
match and the compute schedule within sm_90's limits; which of the tile program's ops its
control code runs; and the kernel's ABI, which follows from both."""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import core
from ...ir.opdefs import WAIT_OPS
from ...ir.schedule import ComputeSchedule
from ..abi import (LAUNCH_PARAM, RANK_PARAM, KernelParam, TmaDescriptorSpec, entry_name, signal_param, table_param,
                   wait_timeout_options)
from ..dtypes import MMA_INPUTS, SWIZZLE, ctype
from ..errors import fail
from ..ir_queries import CONTROL_OPS, SCALAR_OPS, needed_ops
from ..match.attention import WHAT, AttentionMatch
from .tile_order import order_align_shift
from .wgmma import SMEM_LIMIT

HEAD_DIMS = (16, 32, 64, 128)
BLOCK_N = (16, 32, 64, 128)
#: the softmax variants: "plain" scales and masks every score (FMUL + select, FADD + EX2), "fold"
#: folds the scale into one FFMA per exponential, "split" also gives key blocks that mask no key
#: of a warpgroup's rows a mask-free body
SOFTMAX = ("plain", "fold", "split")
DEFAULT_SOFTMAX = "split"
ACC_LIMIT = 128               # fp32 S + O values per consumer thread: (BN + D) / 2


@dataclass(frozen=True)
class AttentionConfig:
    """Tile configuration, and every number the host and the C++ template must agree on."""
    BM: int
    BN: int
    D: int
    stages: int
    order: str
    group_m: int
    grid: tuple[int, int]
    consumer_wgs: int
    producer_regs: int
    consumer_regs: int
    in_dtype: str
    out_dtype: str
    causal: bool
    overlap: bool
    softmax: str          # one of SOFTMAX: how the exponentials and masks are computed
    scale: float          # the score scale of the tile program
    fill: float           # the masked score value
    init_max: float       # the initial running max

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumer_wgs)

    @property
    def S(self) -> int:
        """Swizzle width (bytes) of the row chunks of Q, K, V and O in shared memory."""
        return min(128, 2 * self.D)

    @property
    def E(self) -> int:
        """Elements per row chunk (the TMA box's inner extent)."""
        return self.S // 2

    @property
    def chunks(self) -> int:
        return self.D // self.E

    @property
    def acc_per_thread(self) -> int:
        return (self.BN + self.D) // 2

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory the launch must request (mirrors AttnTraits::kSmemBytes)."""
        return _smem_bytes(self.BM, self.BN, self.D, self.stages)

    @property
    def num_tiles(self) -> int:
        return self.grid[0] * self.grid[1]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _smem_bytes(BM, BN, D, stages) -> int:
    stage = _round_up(BN * D * 2, 1024)
    used = _round_up(BM * D * 2, 1024) + 2 * stages * stage + (2 + 3 * stages) * 8
    return used + 1024


def choose_config(m: AttentionMatch, sched: ComputeSchedule, grid, in_dtype: str, out_dtype: str, *,
                  stages: int | None = None, overlap: bool | None = None, softmax: str | None = None,
                  loc=None) -> AttentionConfig:
    BM, BN, D = m.BM, m.BN, m.D
    if tuple(getattr(sched, "cluster", (1, 1))) != (1, 1):
        raise fail(WHAT, f"cluster {sched.cluster}: the attention lowering runs one CTA per tile (use (1, 1))", loc)
    if D not in HEAD_DIMS:
        raise fail(WHAT, f"head dim D={D}: the WGMMA kernel supports D in {HEAD_DIMS} (D is the K extent of Q K^T, "
                         "a multiple of 16, and the N extent of P V)", loc)
    if BM not in (64, 128):
        raise fail(WHAT, f"BM={BM}: one consumer warpgroup per 64 query rows, so BM must be 64 or 128", loc)
    if BN not in BLOCK_N:
        raise fail(WHAT, f"BN={BN}: the key block must be one of {BLOCK_N} (a multiple of the WGMMA K of 16)", loc)
    if (BN + D) // 2 > ACC_LIMIT:
        raise fail(WHAT, f"BN={BN} with D={D} needs {(BN + D) // 2} fp32 accumulators per consumer thread (S and O); "
                         f"at most {ACC_LIMIT} fit the register file (BN + D <= 256)", loc)
    if in_dtype not in MMA_INPUTS:
        raise fail(WHAT, f"q, k and v must be f16 or bf16 for WGMMA, got {in_dtype}", loc)
    if out_dtype not in MMA_INPUTS:
        raise fail(WHAT, f"o must be f16 or bf16 (it is staged through the Q buffer), got {out_dtype}", loc)
    st = sched.stages if stages is None else int(stages)
    if st < 1:
        raise fail(WHAT, f"stages={st}: need at least one", loc)
    if _smem_bytes(BM, BN, D, st) > SMEM_LIMIT:
        raise fail(WHAT, f"BM={BM}, BN={BN}, D={D} with {st} stages needs {_smem_bytes(BM, BN, D, st)} bytes of "
                         f"shared memory, more than the {SMEM_LIMIT} an sm_90 block may use: lower `stages` or BN", loc)
    ov = (st >= 2) if overlap is None else bool(overlap)
    if ov and st < 2:
        raise fail(WHAT, "overlap=True needs at least 2 stages (the previous block's V stays resident while the next "
                         "block's S is computed)", loc)
    sm = DEFAULT_SOFTMAX if softmax is None else softmax
    if sm not in SOFTMAX:
        raise fail(WHAT, f"softmax={sm!r}: choose one of {', '.join(SOFTMAX)}", loc)
    wgs = BM // 64
    # producer 40 / consumers 232 registers (setmaxnreg; 128*40 + 256*232 <= 64K). Also with one
    # consumer warpgroup: capped at 232, ptxas allocates the S, P and O fragments without
    # spilling, while with the 255 of a plain 256-thread launch bound it spills a few words.
    regs = (40, 232)
    gm, gn = (grid[0], grid[1]) if len(grid) == 2 else (grid[0], 1)
    return AttentionConfig(BM, BN, D, st, sched.order, sched.group_m, (gm, gn), wgs, regs[0], regs[1], in_dtype,
                           out_dtype, m.causal, ov, sm, m.scale,
                           m.fill, m.init_max)


# -- the control code ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ControlCode:
    """What ``Prog::run`` runs: the ``roots`` (every wait; the coordinates, bounds and loop nest
    the template reads) and the index code, loops and conditions they need. ``prologue``: its
    top-level statements before ``on_tile`` — the index code first, then the waits (and the loops
    around them) before the key blocks; the key-block loop nest follows. ``signals`` and
    ``tables``: what it reads (parameters ``sig_<name>``, ``tbl_<name>``), in that order."""
    roots: frozenset[int]            # ids of the root ops
    needed: frozenset[int]           # ids of the ops it runs: the roots and what they need
    prologue: tuple[core.Op, ...]
    signals: tuple[core.Signal, ...]
    tables: tuple[core.Buffer, ...]
    waits: int


def control_code(m: AttentionMatch) -> ControlCode:
    vals = [*m.q_load.operands[1:], *m.store.operands[1:3], m.k_load.operands[2], m.v_load.operands[2], m.kb]
    vals += [k for k in m.shard_terms if isinstance(k, core.Value)]
    if m.causal:
        vals += [m.key_base, m.q_base]
        if m.q_split is not None:
            vals += [m.q_split, m.q_base1]
    for op in m.chain:
        vals += list(op.operands)
    roots = frozenset({id(v.owner) for v in vals if isinstance(v.owner, core.Op)} | {id(op) for op in m.chain})
    top = m.part.body.ops
    needed = needed_ops(top, lambda op: op.name in WAIT_OPS or id(op) in roots)
    chain0 = top.index(m.chain[0])
    prologue = [op for op in top if op.name in SCALAR_OPS and op.name != "const" and id(op) in needed]
    prologue += [op for op in top[:chain0] if id(op) in needed and (op.name in WAIT_OPS or op.name in CONTROL_OPS)]
    runs = [op for op in core.Block([*prologue, m.chain[0]]).walk() if id(op) in needed]
    signals = dict.fromkeys(op.operands[0].owner for op in runs if op.name in WAIT_OPS)
    tables = dict.fromkeys(op.operands[0].owner for op in runs if op.name == "load_scalar")
    return ControlCode(roots, frozenset(needed), tuple(prologue), tuple(signals), tuple(tables),
                       sum(op.name in WAIT_OPS for op in runs))


# -- the plan ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionPlan:
    """Everything the renderer needs: the match, the configuration, the control code and the
    kernel's ABI."""
    kernel: core.Kernel
    part: core.Part
    match: AttentionMatch
    config: AttentionConfig
    control: ControlCode
    entry: str
    align_shift: int
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    buffers: dict                       # IR buffer name -> (shape, dtype name) of q, k, v and o
    nvrtc_options: tuple[str, ...]
    notes: tuple[str, ...]


def plan_attention(kernel: core.Kernel, part: core.Part, m: AttentionMatch, *, stages: int | None = None,
                   overlap: bool | None = None, softmax: str | None = None,
                   wait_timeout_ns: int | None = None, entry: str | None = None) -> AttentionPlan:
    """The configuration and ABI of ``part``'s flash-attention kernel.

    ``stages`` overrides the compute schedule's pipeline depth; ``overlap`` turns the
    intra-warpgroup overlap (P V of a block during the next block's softmax) on or off (default:
    on with >= 2 stages); ``softmax`` picks one of :data:`SOFTMAX` (default ``"split"``);
    ``wait_timeout_ns`` compiles the waits with a timeout that traps."""
    sched = kernel.compute_schedule or ComputeSchedule()
    qbuf, kbuf, vbuf, obuf = (m.q_load.operands[0].owner, m.k_load.operands[0].owner, m.v_load.operands[0].owner,
                              m.store.operands[0].owner)
    in_dt = qbuf.type.dtype.name
    for b in (kbuf, vbuf):
        if b.type.dtype.name != in_dt:
            raise fail(WHAT, f"q, k and v must share a dtype, got '{qbuf.name}' {in_dt} and '{b.name}' {b.type.dtype}",
                       m.k_load)
    if len(obuf.type.shape) != 2:
        raise fail(WHAT, f"the output '{obuf.name}' must be 2-d", m.store)
    cfg = choose_config(m, sched, part.grid, in_dt, obuf.type.dtype.name, stages=stages, overlap=overlap,
                        softmax=softmax, loc=part.loc)
    for b in (qbuf, kbuf, vbuf, obuf):
        if (b.type.shape[1] * 2) % 16:
            raise fail(WHAT, f"TMA needs 16-byte aligned rows: '{b.name}' rows are {b.type.shape[1] * 2} bytes "
                             "(pad the width to a multiple of 8)", m.store if b is obuf else m.k_load)
    ctl = control_code(m)
    params = [KernelParam(f"tma_{r}", "const __grid_constant__ cute::TmaDescriptor", "tma", f"tma:tma_{r}")
              for r in ("q", "k", "v", "o")]
    params += [RANK_PARAM, LAUNCH_PARAM]
    params += [KernelParam(signal_param(s), "const unsigned long long* __restrict__", "ptr", f"signal:{s.name}")
               for s in ctl.signals]
    params += [KernelParam(table_param(t), "const int* __restrict__", "ptr", f"buffer:{t.name}")
               for t in ctl.tables]
    notes = (f"stages {stages} instead of the schedule's {sched.stages}",) \
        if stages is not None and stages != sched.stages else ()
    return AttentionPlan(kernel, part, m, cfg, ctl, entry_name(kernel, part, entry),
                         order_align_shift(getattr(part, "align_shift", 0), kernel.world_size), tuple(params),
                         _tma_specs(cfg, m, qbuf, kbuf, vbuf, obuf),
                         {b.name: (tuple(b.type.shape), b.type.dtype.name) for b in (qbuf, kbuf, vbuf, obuf)},
                         wait_timeout_options(wait_timeout_ns), notes)


def _tma_specs(cfg: AttentionConfig, m: AttentionMatch, qbuf, kbuf, vbuf, obuf) -> tuple[TmaDescriptorSpec, ...]:
    """Q and O as 2-D maps; the gathered K and V as ``[N / L, L, width]``, so that a box of
    ``BN`` rows at a row inside a shard reads rows past the shard's end as zero."""
    E, S, L = cfg.E, cfg.S, m.cond_bound
    out = []
    for param, buf, role, rows in (("tma_q", qbuf, "Q", cfg.BM), ("tma_o", obuf, "O", 64)):
        n, w = buf.type.shape
        dt = buf.type.dtype.name
        out.append(TmaDescriptorSpec(param, buf.name, role, dt, ctype(dt).tma, (w, n), (w * 2,), (E, rows),
                                     (1, 1), SWIZZLE[S],
                                     l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE" if role == "O"
                                     else "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"))
    for param, buf, role in (("tma_k", kbuf, "K"), ("tma_v", vbuf, "V")):
        n, w = buf.type.shape
        dt = buf.type.dtype.name
        out.append(TmaDescriptorSpec(param, buf.name, role, dt, ctype(dt).tma, (w, L, n // L),
                                     (w * 2, L * w * 2), (E, cfg.BN, 1), (1, 1, 1), SWIZZLE[S]))
    q, o, k, v = out
    return (q, k, v, o)
