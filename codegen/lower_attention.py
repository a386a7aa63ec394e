"""Lower the compute part of a flash-attention tile program (:mod:`tldsl.ops.sp_attention`) to
a Hopper (sm_90a) kernel: TMA + WGMMA, warp-specialized, online softmax in registers.

Recognised shape (grid axes, names and the loop nest around the key blocks are free)::

    @tl.compute_part(grid=(cdiv(Sq, BM), heads))
    def attention(pm, h):
        <scalar code>
        q_pos = tl.iota(BM) + Y                            # query positions (causal only)
        qt = tl.load(q, (QR, QC), (BM, D))
        j = tl.iota(BN)
        m = tl.fragment((BM,), tl.float32, fill=INIT)      # running max
        l_sum = tl.fragment((BM,), tl.float32)             # running sum
        acc = tl.fragment((BM, D), tl.float32)
        for ... / if ...:                                  # any nest of scalar loops: the key blocks,
            <scalar code and waits>                        # in the tile program's order, with its waits
            in_shard = (j + KB) < L                        # KB: a loop variable counting up from >= 0
            rows = tl.where(in_shard, j + R0, -1)          # R0 - KB a multiple of L: rows of one shard
            kt = tl.load_rows(k, rows, KC, D)
            vt = tl.load_rows(v, rows, VC, D)
            mask = in_shard[None, :] [& ((j + X)[None, :] <= q_pos[:, None])]
            sc = tl.where(mask, tl.dot(qt, tl.trans(kt)) [* scale], FILL)
            m_old = m[...]; m_new = tl.maximum(m_old, tl.max(sc, 1)); alpha = tl.exp(m_old - m_new)
            p = tl.where(mask, tl.exp(sc - m_new[:, None]), 0.0)
            l_sum[...] = l_sum[...] * alpha + tl.sum(p, 1)
            acc[...] = acc[...] * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m[...] = m_new
        denom = l_sum[...]; denom = tl.where(denom > 0.0, denom, 1.0)
        tl.store(o, (OR, OC), acc[...] / denom[:, None])

Design:

* **Rows of a shard as a 3-D TMA box.** ``load_rows`` with ``where(j + KB < L, j + R0, -1)``
  reads rows ``KB .. KB+BN-1`` of shard ``(R0 - KB) / L``, rows past the shard end as zero. A
  3-D tensor map over the gathered tensor viewed as ``[N / L, L, width]`` gives exactly that:
  box ``(E, BN, 1)`` at ``(col, KB, shard)``; TMA zero-fills what lies past ``L`` and never
  reads it, so no read crosses into rows the tile program did not wait for.
* **Generated control code, fixed math.** The scalar part of the tile program — the loop nest
  over key blocks, its bounds (causal skipping), the waits and every coordinate — is emitted
  as C++ (``Prog::run``), run by the producer (with the waits: acquire loads, then
  ``fence.proxy.async.global`` before the TMA loads) and by the consumers (without). The tile
  math must match the pattern above op by op; anything else is a :class:`LoweringError` at the
  user's line. The C++ template is ``include/tldsl/sm90_attention.hpp``.
* **Pipeline**: a producer warp (TMA, the waits) and one consumer warpgroup per 64 query rows;
  K and V of a block share one of ``stages`` shared-memory stages (separate full barriers, so
  S = Q K^T starts before V lands). With ``overlap`` (default with >= 2 stages) block j issues
  S_j and then P_{j-1} V_{j-1}, so that P V runs on the tensor cores during block j's softmax;
  the first block of a tile issues a P V with P = 0 on its own V stage, which keeps every
  WGMMA out of data-dependent branches (ptxas serialises WGMMAs otherwise). Masks are selects.
* **Simplified against a production FA3-class kernel**: no thread-block clusters / TMA
  multicast of K and V; no ping-pong ordering of the two consumer warpgroups (their softmax
  and WGMMAs interleave only as the warp schedulers find them); the mask is applied with
  selects on every block (no separate unmasked path); exponentials take FMUL + FADD + EX2 per
  score (no scale folded into one FFMA); K and V share a stage and are released together; O is
  staged through the Q buffer, so a persistent CTA's next tile (its Q, then its K/V) waits for
  the previous tile's store; no FP8; D <= 128, BM <= 128.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from ..ir import core
from .lowered import LoweredKernel, kernel_entry, recognises  # noqa: F401
from ..ir.opdefs import NOTIFY_OPS, DATA_OPS, WAIT_OPS
from ..ir.schedule import ComputeSchedule
from ..ir.types import FragmentType, TileType
from .lower_gemm import SMEM_LIMIT, KernelParam, TmaDescriptorSpec
from .scalars import CONTROL_OPS, SCALAR_OPS, LoweringError, ScalarEmitter, cident, marker, needed_ops, wait_call

ORDERS = {"row_major": 0, "swizzled": 1, "comm_aligned": 2}
HEAD_DIMS = (16, 32, 64, 128)
BLOCK_N = (16, 32, 64, 128)
ACC_LIMIT = 128               # fp32 S + O values per consumer thread: (BN + D) / 2

_DTYPE_C = {"f16": "__half", "bf16": "__nv_bfloat16"}
_GMMA_DT = {"f16": "F32F16F16", "bf16": "F32BF16BF16"}
_TMA_DATA_TYPE = {"f16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"}
_SWIZZLE = {32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}
_LOG2E = 1.0 / math.log(2.0)
_PURE_TILE_OPS = frozenset({"full", "iota", "ewise", "cast", "reduce", "expand_dims", "broadcast", "trans"})


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# -- host-side description ----------------------------------------------------------------------

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


def _smem_bytes(BM, BN, D, stages) -> int:
    stage = _round_up(BN * D * 2, 1024)
    used = _round_up(BM * D * 2, 1024) + 2 * stages * stage + (2 + 3 * stages) * 8
    return used + 1024


def _c_float(x: float) -> str:
    """A float constant as an exact C++ literal."""
    return f"{float(np.float32(x)).hex()}f" if x != 0 else "0.0f"


@dataclass(frozen=True)
class LoweredAttention(LoweredKernel):
    """A generated kernel: CUDA source, entry point, launch shape and host-side descriptions."""
    kernel_name: str                 # the IR kernel
    part: str                        # the compute part
    entry: str                       # extern "C" symbol
    source: str                      # one self-contained CUDA C++ translation unit
    control_source: str              # the generated control code alone (struct Prog; plain C++)
    config: AttentionConfig
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    buffers: dict                    # IR buffer name -> (shape, dtype name) of every tensor the kernel reads/writes
    shard_rows: int                  # L: rows per shard of the gathered K / V
    world_size: int
    align_shift: int
    waits: int                       # wait ops in the tile program (compiled into the producer)
    signals: tuple[str, ...]         # signals the waits read (kernel params "sig_<name>")
    tables: tuple[str, ...]          # int tables the control code reads (kernel params "tbl_<name>")
    options: tuple[str, ...] = ()    # extra NVRTC options (defines)
    notes: tuple[str, ...] = field(default=())

    @property
    def grid_tiles(self) -> tuple[int, int]:
        return self.config.grid

    @property
    def num_tiles(self) -> int:
        return self.config.num_tiles


    def describe(self) -> str:
        c = self.config
        lines = [f"{self.entry}: {self.kernel_name}.{self.part}  flash attention {c.in_dtype}->{c.out_dtype}"
                 f"{' causal' if c.causal else ''}, scale {c.scale:.6g}",
                 f"  tile BM={c.BM} BN={c.BN} D={c.D}, {c.stages} stages, order {c.order}, "
                 f"{c.consumer_wgs} consumer warpgroup(s) + 1 producer ({c.threads} threads), "
                 f"{c.acc_per_thread} fp32 acc/thread, smem {c.smem_bytes} B, overlap={c.overlap}",
                 f"  tiles {c.grid[0]}x{c.grid[1]} = {c.num_tiles}, persistent; key shards of {self.shard_rows} rows; "
                 f"{self.waits} wait(s) on {list(self.signals) or 'no signals'}",
                 "  params: " + ", ".join(f"{p.ctype} {p.name}" for p in self.params)]
        for t in self.tma:
            lines.append(f"  {t.param}: {t.buffer} dims={list(t.global_dims)} strides={list(t.global_strides)} "
                         f"box={list(t.box_dims)} {t.swizzle}")
        return "\n".join(lines)


# -- recognising the pattern ----------------------------------------------------------------------

def _describe(op: core.Op | None) -> str:
    if op is None:
        return "a kernel argument or loop variable"
    kind = op.attrs.get("op")
    return f"'{op.name} {kind}'" if kind else f"'{op.name}'"


def _fail(msg: str, op_or_loc=None) -> LoweringError:
    loc = getattr(op_or_loc, "loc", op_or_loc)
    return LoweringError(f"attention lowering: {msg}", loc)


def _def(v: core.Value) -> core.Op | None:
    return v.owner if isinstance(v.owner, core.Op) else None


def _const(v: core.Value):
    op = _def(v)
    if op is not None and op.name == "const":
        return op.attrs["value"]
    return None


def _is_tile(v: core.Value) -> bool:
    return isinstance(v.type, (TileType, FragmentType))


@dataclass
class _Match:
    part: core.Part
    chain: list                     # the for/if ops from the top level down to the block region
    block: core.Block               # the region that holds one key block's math
    q_load: core.Op
    k_load: core.Op
    v_load: core.Op
    store: core.Op
    frags: dict                     # "m" | "l" | "acc" -> frag_alloc op
    cond_bound: int                 # L
    kb: core.Value                  # first row of the block inside its shard
    r0: core.Value                  # first global row of the block
    shard_terms: dict               # value id -> (value, coefficient) of (R0 - KB) / L, "" -> constant
    causal: bool
    key_base: core.Value | None     # X: key position of column 0
    q_base: core.Value | None       # Y: query position of row 0
    scale: float
    fill: float
    init_max: float
    BM: int
    BN: int
    D: int
    matched: set                    # ids of the ops the pattern accounts for


class _Matcher:
    """Matches the dataflow of the flash-attention pattern, recording every op it accounts for."""

    def __init__(self):
        self.matched: set[int] = set()

    def op(self, v: core.Value, name: str, kind: str | None, what: str, user: core.Op) -> core.Op:
        op = _def(v)
        if op is None or op.name != name or (kind is not None and op.attrs.get("op") != kind):
            want = f"'{name} {kind}'" if kind else f"'{name}'"
            raise _fail(f"{what} must be {want}, got {_describe(op)}", op or user)
        self.matched.add(id(op))
        return op

    def pair(self, op: core.Op, first, what: str):
        """Operands (a, b) of a commutative op, ordered so that ``first(a)`` holds."""
        a, b = op.operands
        if first(a):
            return a, b
        if first(b):
            return b, a
        raise _fail(f"{what}: unexpected operands of {_describe(op)}", op)

    def const(self, v: core.Value, what: str, user: core.Op):
        c = _const(v)
        if c is None:
            raise _fail(f"{what} must be a constant", _def(v) or user)
        self.matched.add(id(_def(v)))
        return c

    def iota_plus(self, v: core.Value, n: int, what: str, user: core.Op) -> core.Value:
        """``tl.iota(n) + s`` (either order): returns the scalar ``s``."""
        add = self.op(v, "ewise", "add", what, user)
        a, b = add.operands
        for t, s in ((a, b), (b, a)):
            top = _def(t)
            if top is not None and top.name == "iota" and top.attrs["n"] == n and not _is_tile(s):
                self.matched.add(id(top))
                return s
        raise _fail(f"{what} must be tl.iota({n}) + a scalar", add)


def _frag_of(op: core.Op) -> core.Op | None:
    return _def(op.operands[0])


def match_attention(kernel: core.Kernel, part: core.Part) -> _Match:
    """Recognise the flash-attention pattern in ``part``; raise :class:`LoweringError` at the
    first op that does not fit."""
    if part.role != "compute":
        raise _fail(f"part '{part.name}' is a {part.role} part; the attention lowering lowers compute parts", part)
    if len(part.grid) not in (1, 2):
        raise _fail(f"the grid {part.grid} must be 1-d or 2-d (query blocks, heads)", part)
    parent: dict[int, tuple[core.Block, int, core.Op | None]] = {}

    def index(block, owner):
        for i, op in enumerate(block.ops):
            parent[id(op)] = (block, i, owner)
            for r in op.regions:
                index(r, op)
    index(part.body, None)
    all_ops = list(part.walk())

    # the three fragments, and the key block: the region that writes the accumulator
    allocs = [op for op in part.body.ops if op.name == "frag_alloc"]
    accs = [op for op in allocs if len(op.attrs["shape"]) == 2]
    vecs = [op for op in allocs if len(op.attrs["shape"]) == 1]
    for op in all_ops:
        if op.name == "frag_alloc" and op not in allocs:
            raise _fail("fragments must be allocated at the top level of the compute part", op)
        if op.name in NOTIFY_OPS or op.name in DATA_OPS:
            raise _fail(f"{_describe(op)} in the compute part is not supported (notifies and data primitives "
                        "belong to communication parts)", op)
    if len(accs) != 1 or len(vecs) != 2:
        raise _fail(f"expected one 2-d accumulator and two 1-d fragments (running max, running sum), got "
                    f"{len(accs)} 2-d and {len(vecs)} 1-d fragments", allocs[0] if allocs else part)
    acc = accs[0]
    writes = [op for op in all_ops if op.name == "frag_write" and _frag_of(op) is acc]
    if len(writes) != 1:
        raise _fail(f"the accumulator must be updated exactly once per key block, found {len(writes)} writes",
                    writes[1] if len(writes) > 1 else acc)
    fw_acc = writes[0]
    block = parent[id(fw_acc)][0]
    if block is part.body:
        raise _fail("the accumulator update must sit inside the loop over key blocks", fw_acc)
    chain = []
    b = block
    while b is not part.body:
        owner = next(op for op in all_ops if any(r is b for r in op.regions))
        if owner.name not in CONTROL_OPS:
            raise _fail(f"{_describe(owner)} around the key blocks is not supported", owner)
        chain.append(owner)
        b = parent[id(owner)][0]
    chain.reverse()

    M = _Matcher()
    M.matched.update(id(op) for op in allocs)
    M.matched.add(id(fw_acc))
    acc_shape = acc.attrs["shape"]
    BM, D = acc_shape

    # -- the accumulator update: acc = acc * alpha[:, None] + dot(p.to(v.dtype), v) --
    upd = M.op(fw_acc.operands[1], "ewise", "add", "the accumulator update", fw_acc)
    scaled, pv = M.pair(upd, lambda v: _def(v) is not None and _def(v).name == "ewise", "acc[...] * alpha[:, None]"
                        " + tl.dot(p, v)")
    pv_dot = M.op(pv, "dot", None, "the second term of the accumulator update (P V)", upd)
    mul_acc = M.op(scaled, "ewise", "mul", "acc[...] * alpha[:, None]", upd)
    acc_r, alpha_e = M.pair(mul_acc, lambda v: _def(v) is not None and _def(v).name == "frag_read",
                            "acc[...] * alpha[:, None]")
    acc_read = M.op(acc_r, "frag_read", None, "the accumulator's old value", mul_acc)
    if _frag_of(acc_read) is not acc:
        raise _fail("the accumulator update must scale the accumulator's own value", acc_read)
    alpha_x = M.op(alpha_e, "expand_dims", None, "alpha[:, None]", mul_acc)
    if alpha_x.attrs["axis"] != 1:
        raise _fail("the rescale factor must be broadcast along rows (alpha[:, None])", alpha_x)
    alpha = alpha_x.operands[0]
    v_load = M.op(pv_dot.operands[1], "load_rows", None, "the V operand of tl.dot(P, V)", pv_dot)
    p = pv_dot.operands[0]
    if p.type.dtype != v_load.result.type.dtype or _def(p) is None or _def(p).name == "cast":
        p_cast = M.op(p, "cast", None, "the P operand of tl.dot(P, V) (p.to(v.dtype))", pv_dot)
        if p_cast.attrs["dtype"] != v_load.result.type.dtype:
            raise _fail(f"P must be cast to V's dtype {v_load.result.type.dtype} before tl.dot(P, V), got "
                        f"{p_cast.attrs['dtype']}", p_cast)
        p = p_cast.operands[0]

    # -- the running sum: l = l * alpha + sum(p, 1) --
    vec_writes = [op for op in all_ops if op.name == "frag_write" and _frag_of(op) in vecs]
    fw_l = fw_m = None
    for w in vec_writes:
        d = _def(w.operands[1])
        if d is not None and d.name == "ewise" and d.attrs["op"] == "add":
            fw_l = w
        elif d is not None and d.name == "ewise" and d.attrs["op"] == "max":
            fw_m = w
    if len(vec_writes) != 2 or fw_l is None or fw_m is None:
        raise _fail("expected one update of the running sum (l * alpha + tl.sum(p, 1)) and one of the running "
                    "max (m = tl.maximum(m_old, tl.max(s, 1))) per key block", vec_writes[0] if vec_writes else fw_acc)
    l_frag, m_frag = _frag_of(fw_l), _frag_of(fw_m)
    M.matched.update((id(fw_l), id(fw_m)))
    if l_frag is m_frag:
        raise _fail("the running sum and the running max must be different fragments", fw_m)
    add_l = M.op(fw_l.operands[1], "ewise", "add", "the running-sum update", fw_l)
    mul_l, red_l = M.pair(add_l, lambda v: _def(v) is not None and _def(v).name == "ewise", "l * alpha + sum(p)")
    mul_l_op = M.op(mul_l, "ewise", "mul", "l * alpha", add_l)
    l_r, alpha2 = M.pair(mul_l_op, lambda v: _def(v) is not None and _def(v).name == "frag_read", "l * alpha")
    l_read = M.op(l_r, "frag_read", None, "the running sum's old value", mul_l_op)
    if _frag_of(l_read) is not l_frag or alpha2 is not alpha:
        raise _fail("the running sum must be rescaled by the same alpha as the accumulator", mul_l_op)
    red_sum = M.op(red_l, "reduce", None, "tl.sum(p, 1)", add_l)
    if red_sum.attrs["op"] != "sum" or red_sum.attrs["axis"] != 1 or red_sum.operands[0] is not p:
        raise _fail("the running sum must add tl.sum(p, 1) of the same p that multiplies V", red_sum)

    # -- the running max and alpha --
    m_new = fw_m.operands[1]
    max_op = M.op(m_new, "ewise", "max", "the new running max", fw_m)
    m_r, red_m = M.pair(max_op, lambda v: _def(v) is not None and _def(v).name == "frag_read",
                        "tl.maximum(m_old, tl.max(s, 1))")
    m_read = M.op(m_r, "frag_read", None, "the old running max", max_op)
    if _frag_of(m_read) is not m_frag:
        raise _fail("the new running max must combine the old running max", m_read)
    red_max = M.op(red_m, "reduce", None, "tl.max(s, 1)", max_op)
    if red_max.attrs["op"] != "max" or red_max.attrs["axis"] != 1:
        raise _fail("the running max must take tl.max(scores, 1)", red_max)
    sc = red_max.operands[0]
    exp_a = M.op(alpha, "ewise", "exp", "alpha", mul_acc)
    sub_a = M.op(exp_a.operands[0], "ewise", "sub", "alpha = exp(m_old - m_new)", exp_a)
    ma, mb = sub_a.operands
    ma_op = _def(ma)
    if not (ma_op is not None and ma_op.name == "frag_read" and _frag_of(ma_op) is m_frag) or mb is not m_new:
        raise _fail("alpha must be tl.exp(m_old - m_new)", sub_a)
    M.matched.add(id(ma_op))

    # -- p = where(mask, exp(sc - m_new[:, None]), 0) --
    p_where = M.op(p, "ewise", "where", "p = tl.where(mask, tl.exp(s - m_new[:, None]), 0.0)", red_sum)
    mask, p_exp, p_zero = p_where.operands
    if M.const(p_zero, "the value of masked probabilities", p_where) != 0:
        raise _fail("masked probabilities must be 0.0", p_where)
    exp_p = M.op(p_exp, "ewise", "exp", "the probabilities", p_where)
    sub_p = M.op(exp_p.operands[0], "ewise", "sub", "s - m_new[:, None]", exp_p)
    if sub_p.operands[0] is not sc:
        raise _fail("the probabilities must exponentiate the same scores the running max was taken over", sub_p)
    mx = M.op(sub_p.operands[1], "expand_dims", None, "m_new[:, None]", sub_p)
    if mx.attrs["axis"] != 1 or mx.operands[0] is not m_new:
        raise _fail("the probabilities must subtract m_new[:, None]", mx)

    # -- sc = where(mask, dot(q, trans(k)) [* scale], FILL) --
    sc_where = M.op(sc, "ewise", "where", "the masked scores tl.where(mask, s, FILL)", red_max)
    if sc_where.operands[0] is not mask:
        raise _fail("the scores and the probabilities must be masked with the same mask", sc_where)
    fill = float(M.const(sc_where.operands[2], "the masked score value", sc_where))
    raw = sc_where.operands[1]
    scale = 1.0
    raw_op = _def(raw)
    if raw_op is not None and raw_op.name == "ewise" and raw_op.attrs["op"] == "mul":
        M.matched.add(id(raw_op))
        a, b = raw_op.operands
        ca, cb = _const(a), _const(b)
        if cb is not None and not _is_tile(b):
            raw, scale = a, float(cb)
            M.matched.add(id(_def(b)))
        elif ca is not None and not _is_tile(a):
            raw, scale = b, float(ca)
            M.matched.add(id(_def(a)))
        else:
            raise _fail("the scores may only be scaled by a constant", raw_op)
    qk = M.op(raw, "dot", None, "the scores tl.dot(q, tl.trans(k))", sc_where)
    q_load = M.op(qk.operands[0], "load", None, "the Q operand of tl.dot(q, tl.trans(k))", qk)
    tr = M.op(qk.operands[1], "trans", None, "the K operand tl.trans(k)", qk)
    k_load = M.op(tr.operands[0], "load_rows", None, "the K tile", tr)

    # -- the mask: in_shard[None, :] [& (key_pos[None, :] <= q_pos[:, None])] --
    causal, key_base, q_base = False, None, None
    mask_op = _def(mask)
    if mask_op is not None and mask_op.name == "ewise" and mask_op.attrs["op"] == "and":
        M.matched.add(id(mask_op))
        shard_m, cmp = M.pair(mask_op, lambda v: _def(v) is not None and _def(v).name == "expand_dims",
                              "in_shard[None, :] & causal")
        cmp_op = M.op(cmp, "ewise", None, "the causal comparison", mask_op)
        if cmp_op.attrs["op"] == "le":
            kx, qx = cmp_op.operands
        elif cmp_op.attrs["op"] == "ge":
            qx, kx = cmp_op.operands
        else:
            raise _fail("the causal mask must be key_pos[None, :] <= q_pos[:, None]", cmp_op)
        kxo = M.op(kx, "expand_dims", None, "key_pos[None, :]", cmp_op)
        qxo = M.op(qx, "expand_dims", None, "q_pos[:, None]", cmp_op)
        if kxo.attrs["axis"] != 0 or qxo.attrs["axis"] != 1:
            raise _fail("the causal mask must compare key_pos[None, :] with q_pos[:, None]", cmp_op)
        key_base = M.iota_plus(kxo.operands[0], k_load.attrs["shape"][0],
                               "the key positions (tl.iota(BN) + first key position)", kxo)
        q_base = M.iota_plus(qxo.operands[0], BM, "the query positions (tl.iota(BM) + first query position)", qxo)
        causal = True
    else:
        shard_m = mask
    sm = M.op(shard_m, "expand_dims", None, "the shard mask in_shard[None, :]", sc_where)
    if sm.attrs["axis"] != 0:
        raise _fail("the shard mask must be broadcast along columns (in_shard[None, :])", sm)
    cond = sm.operands[0]

    # -- rows = where(in_shard, j + R0, -1), in_shard = (j + KB) < L; K and V read the same rows --
    BN = k_load.attrs["shape"][0]
    if v_load.operands[1] is not k_load.operands[1]:
        raise _fail("K and V must be gathered with the same row index tile", v_load)
    rows = k_load.operands[1]
    rw = M.op(rows, "ewise", "where", "the gathered rows tl.where(in_shard, j + first_row, -1)", k_load)
    if rw.operands[0] is not cond:
        raise _fail("the gathered rows and the score mask must use the same in-shard condition", rw)
    neg = M.const(rw.operands[2], "the row index of rows outside the shard", rw)
    if not (isinstance(neg, int) and neg < 0):
        raise _fail("rows outside the shard must read as zero (a negative row index)", rw)
    r0 = M.iota_plus(rw.operands[1], BN, "the gathered rows (tl.iota(BN) + first row)", rw)
    lt = M.op(cond, "ewise", "lt", "the in-shard condition (j + first_row_in_shard) < rows_per_shard", rw)
    kb = M.iota_plus(lt.operands[0], BN, "the in-shard condition's key rows (tl.iota(BN) + first row in shard)",
                     lt)
    L = M.const(lt.operands[1], "the shard length in the in-shard condition", lt)
    if not isinstance(L, int) or L <= 0:
        raise _fail(f"the shard length must be a positive int, got {L!r}", lt)
    if _is_tile(kb) or _is_tile(r0):
        raise _fail("the first rows of a key block must be scalars", rw)
    kb_ok = False
    kb_owner = kb.owner
    if isinstance(kb_owner, core.Block):
        loop = next((op for op in chain if op.name == "for" and op.regions[0] is kb_owner), None)
        if loop is not None:
            lo, st = _const(loop.operands[0]), _const(loop.operands[2])
            kb_ok = isinstance(lo, int) and lo >= 0 and isinstance(st, int) and st > 0
    if not kb_ok:
        raise _fail("the first row of a key block inside its shard must be the variable of a loop that counts up "
                    "from a non-negative constant (tl.range(0, hi, BN)), so that no block starts before its shard",
                    lt)
    diff = _sub_affine(_affine(r0), _affine(kb))
    if any((t if k == "" else t[1]) % L for k, t in diff.items()):
        raise _fail(f"the first gathered row minus the first row inside the shard must be a multiple of the shard "
                    f"length {L} (rows of one shard), got {_fmt_affine(diff)}", rw)
    for ld, name in ((k_load, "K"), (v_load, "V")):
        buf = ld.operands[0].owner
        rows_n, width = buf.type.shape
        if ld.attrs["shape"] != (BN, D):
            raise _fail(f"the {name} tile must be {BN} rows x the head dim {D}, got {ld.attrs['shape']}", ld)
        if rows_n % L:
            raise _fail(f"'{buf.name}' has {rows_n} rows, not whole shards of {L} rows", ld)
    if q_load.attrs["shape"] != (BM, D) or len(q_load.operands[0].owner.type.shape) != 2:
        raise _fail(f"the Q tile must be a 2-d load of {BM} rows x the head dim {D}, got {q_load.attrs['shape']}",
                    q_load)

    # -- the epilogue: store(o, (OR, OC), acc / where(l > 0, l, 1)[:, None]) --
    stores = [op for op in all_ops if op.name == "store"]
    if len(stores) != 1:
        raise _fail(f"expected one tl.store of the output, found {len(stores)}", stores[1] if stores else part)
    store = stores[0]
    M.matched.add(id(store))
    out = store.operands[-1]
    out_op = _def(out)
    if out_op is not None and out_op.name == "cast":
        M.matched.add(id(out_op))
        out = out_op.operands[0]
    div = M.op(out, "ewise", "div", "the stored value acc[...] / denom[:, None]", store)
    acc_r2 = M.op(div.operands[0], "frag_read", None, "the normalised accumulator", div)
    if _frag_of(acc_r2) is not acc:
        raise _fail("the output must be the accumulator divided by the running sum", acc_r2)
    den_x = M.op(div.operands[1], "expand_dims", None, "denom[:, None]", div)
    den = M.op(den_x.operands[0], "ewise", "where", "denom = tl.where(l > 0.0, l, 1.0)", den_x)
    gt = M.op(den.operands[0], "ewise", "gt", "the guard l > 0.0", den)
    lr1 = M.op(gt.operands[0], "frag_read", None, "the running sum in the guard", gt)
    lr2 = M.op(den.operands[1], "frag_read", None, "the running sum in the denominator", den)
    if _frag_of(lr1) is not l_frag or _frag_of(lr2) is not l_frag:
        raise _fail("the denominator must be the running sum", den)
    if M.const(gt.operands[1], "the guard's bound", gt) != 0 or M.const(den.operands[2], "the empty-row "
                                                                        "denominator", den) != 1:
        raise _fail("the denominator must be tl.where(l > 0.0, l, 1.0) (a row without keys stores 0)", den)

    # -- fragments' initial values --
    if m_frag.attrs["shape"] != (BM,) or l_frag.attrs["shape"] != (BM,):
        raise _fail(f"the running max and sum must have {BM} rows", m_frag)
    for f in (m_frag, l_frag, acc):
        if f.attrs["dtype"].name != "f32":
            raise _fail("the fragments must be float32", f)
    if l_frag.attrs.get("value", 0) != 0 or acc.attrs.get("value", 0) != 0:
        raise _fail("the running sum and the accumulator must start at 0", l_frag)
    init_max = float(m_frag.attrs.get("value", 0))
    for what, x in (("masked score", fill), ("initial running max", init_max)):
        if not math.isfinite(x * _LOG2E) or not math.isfinite(float(np.float32(x * _LOG2E))):
            raise _fail(f"the {what} {x!r} must be a finite float32 (also after scaling by log2(e))", sc_where)

    # -- placement: per-block ops in the block region, prologue/epilogue at the top level --
    top = part.body
    chain_pos = parent[id(chain[0])][1]
    for op in (q_load, *allocs):
        blk, pos, _ = parent[id(op)]
        if blk is not top or pos > chain_pos:
            raise _fail(f"{_describe(op)} must come before the loop over key blocks, at the top level", op)
    for op in (store, out_op, div, acc_r2, den_x, den, gt, lr1, lr2):
        if op is None:
            continue
        blk, pos, _ = parent[id(op)]
        if blk is not top or pos < chain_pos:
            raise _fail(f"{_describe(op)} must come after the loop over key blocks, at the top level", op)
    per_block = [fw_acc, fw_l, fw_m, acc_read, l_read, m_read, ma_op, k_load, v_load, qk, tr, p_where, sc_where]
    for op in per_block:
        if parent[id(op)][0] is not block:
            raise _fail(f"{_describe(op)} must be in the same loop body as the accumulator update", op)
    for w, reads in ((fw_acc, (acc_read,)), (fw_l, (l_read,)), (fw_m, (m_read, ma_op))):
        for r in reads:
            if parent[id(r)][1] > parent[id(w)][1]:
                raise _fail("a fragment must be read before it is written in a key block", r)
    # register math whose result nothing uses (e.g. the query positions of a non-causal
    # program) is dead and dropped; any other op outside the pattern is an error
    users: dict[int, list[core.Op]] = {}
    for op in all_ops:
        for v in op.operands:
            users.setdefault(v.id, []).append(op)
    dead: set[int] = set()
    changed = True
    while changed:
        changed = False
        for op in all_ops:
            if id(op) in M.matched or id(op) in dead or op.name not in _PURE_TILE_OPS:
                continue
            if all(id(u) in dead for r in op.results for u in users.get(r.id, [])):
                dead.add(id(op))
                changed = True
    for op in all_ops:
        if id(op) in M.matched or id(op) in dead or op.name in SCALAR_OPS or op.name in CONTROL_OPS \
                or op.name in WAIT_OPS:
            continue
        raise _fail(f"{_describe(op)} is outside the flash-attention pattern this lowering recognises", op)
    for op in all_ops:
        if op.name in CONTROL_OPS and op not in chain:
            inner = [o for r in op.regions for o in r.walk() if id(o) in M.matched]
            if inner:
                raise _fail(f"{_describe(inner[0])} inside a loop or condition other than the key-block loop nest",
                            inner[0])
    waits_after = [o for op in top.ops[chain_pos + 1:] for o in [op, *[x for r in op.regions for x in r.walk()]]
                   if o.name in WAIT_OPS]
    if waits_after:
        raise _fail("waits after the loop over key blocks are not supported (the output is stored right after it)",
                    waits_after[0])
    return _Match(part, chain, block, q_load, k_load, v_load, store, {"m": m_frag, "l": l_frag, "acc": acc}, L, kb,
                  r0, {k: v for k, v in diff.items()}, causal, key_base, q_base, scale, fill, init_max, BM, BN, D,
                  M.matched)


def _affine(v: core.Value) -> dict:
    """Affine form of a scalar over opaque leaves: {value id: (value, coeff), "": const}."""
    op = _def(v)
    if op is not None and op.name == "const" and isinstance(op.attrs["value"], int) \
            and not isinstance(op.attrs["value"], bool):
        return {"": op.attrs["value"]}
    if op is not None and op.name == "arith" and op.attrs["op"] in ("add", "sub"):
        a, b = (_affine(x) for x in op.operands)
        return _add_affine(a, b, -1 if op.attrs["op"] == "sub" else 1)
    if op is not None and op.name == "arith" and op.attrs["op"] == "mul":
        a, b = op.operands
        for x, c in ((a, _const(b)), (b, _const(a))):
            if isinstance(c, int) and not isinstance(c, bool):
                return {k: ((t[0], t[1] * c) if k != "" else t * c) for k, t in _affine(x).items()}
    return {v.id: (v, 1)}


def _add_affine(a: dict, b: dict, sign: int = 1) -> dict:
    out = dict(a)
    for k, t in b.items():
        if k == "":
            out[""] = out.get("", 0) + sign * t
        else:
            v, c = out.get(k, (t[0], 0))
            out[k] = (v, c + sign * t[1])
    return {k: t for k, t in out.items() if (t if k == "" else t[1]) != 0}


def _sub_affine(a: dict, b: dict) -> dict:
    return _add_affine(a, b, -1)


def _fmt_affine(f: dict) -> str:
    parts = [f"{t[1]}*{t[0].hint or '%' + str(t[0].id)}" for k, t in f.items() if k != ""]
    if f.get(""):
        parts.append(str(f[""]))
    return " + ".join(parts) or "0"


# -- the control code --------------------------------------------------------------------------

class _Control(ScalarEmitter):
    """C++ for ``Prog::run``: the tile program's scalar code, loops and waits around the key
    blocks, calling ``on_tile`` once and ``on_block`` for each key block. Waits (and the loops
    that hold only waits) are wrapped in ``if constexpr (kWaits)``: the producer runs them, the
    consumers only walk the blocks."""

    what = "the attention lowering"

    def __init__(self, kernel: core.Kernel, m: _Match):
        self.kernel, self.m = kernel, m
        self.signals: list[core.Signal] = []
        self.waits = 0
        self._in_waits = False
        self._block_text: str | None = None
        roots = self._roots()
        super().__init__(needed_ops(m.part.body.ops, lambda op: op.name in WAIT_OPS or id(op) in roots))

    def _roots(self) -> set[int]:
        m = self.m
        vals = [*m.q_load.operands[1:], *m.store.operands[1:3], m.k_load.operands[2], m.v_load.operands[2], m.kb]
        vals += [t[0] for k, t in m.shard_terms.items() if k != ""]
        if m.causal:
            vals += [m.key_base, m.q_base]
        for op in m.chain:
            vals += list(op.operands)
        return {id(v.owner) for v in vals if isinstance(v.owner, core.Op)} | {id(op) for op in m.chain}

    # hooks ------------------------------------------------------------------------------------
    def fail(self, msg: str, op=None) -> LoweringError:
        return _fail(msg, op)

    def pid_expr(self, axis: int, op: core.Op) -> str:
        if axis > 1:
            raise self.fail("the grid is at most 2-d (query blocks, heads)", op)
        return f"pid{axis}"

    def emit_op(self, op: core.Op, ind: str, lines: list[str]) -> None:
        if (op.name in WAIT_OPS or (op.name in CONTROL_OPS and op not in self.m.chain)) and not self._in_waits:
            lines.append(f"{ind}if constexpr (kWaits) {{")
            self._in_waits = True
            try:
                super().emit_op(op, ind + "  ", lines)
            finally:
                self._in_waits = False
            lines.append(f"{ind}}}")
        elif op in self.m.chain:
            if op.name == "for":                     # one key block per iteration: never unrolled
                lines.append(f"{ind}#pragma unroll 1")
            super().emit_op(op, ind, lines)
            if op is self.m.chain[-1]:               # the loop / condition whose body is one key block
                if self._block_text is None:
                    raise self.fail("internal: the key-block call was not emitted", op)
                lines.insert(len(lines) - 1, f"{ind}  {self._block_text}")
                self._block_text = None
        else:
            super().emit_op(op, ind, lines)

    def leave_region(self, block: core.Block) -> None:
        if block is self.m.block:                    # the block's values are still in scope here
            self._block_text = self._block_call()

    def emit_other(self, op: core.Op, ind: str, lines: list[str]) -> None:
        n = op.name
        if n not in WAIT_OPS:
            raise self.fail(f"{_describe(op)} is not supported here", op)
        sig = op.operands[0].owner
        if sig not in self.signals:
            self.signals.append(sig)
        ch, count = self.name(op.operands[1], op), self.name(op.operands[2], op)
        lines.append(ind + wait_call(op, f"sig_{cident(sig.name)}", ch, count))
        self.waits += 1

    # emission ------------------------------------------------------------------------------------
    def emit_run(self, ind: str = "    ") -> list[str]:
        m = self.m
        lines: list[str] = []
        top = m.part.body
        chain0 = top.ops.index(m.chain[0])
        # top-level scalars first: they depend on the grid ids, the rank and tables only
        for op in top.ops:
            if op.name in SCALAR_OPS and op.name != "const" and id(op) in self.needed:
                self.emit_op(op, ind, lines)
        for op in top.ops[:chain0]:                  # waits before the key blocks (before the Q load)
            if id(op) in self.needed and (op.name in WAIT_OPS or op.name in CONTROL_OPS):
                self.emit_op(op, ind, lines)
        q_row, q_col = (self.name(v, m.q_load) for v in m.q_load.operands[1:3])
        o_row, o_col = (self.name(v, m.store) for v in m.store.operands[1:3])
        lines.append(f"{ind}on_tile(tldsl::attn::TileInfo{{{q_row}, {q_col}, {o_row}, {o_col}}});"
                     f"{marker(m.q_load.loc)}")
        self.emit_op(m.chain[0], ind, lines)
        return lines

    def _block_call(self) -> str:
        m = self.m
        kb = self.name(m.kb, m.k_load)
        terms = []
        for k, t in m.shard_terms.items():
            if k == "":
                terms.append(str(t // m.cond_bound))
            else:
                c = t[1] // m.cond_bound
                nm = self.name(t[0], m.k_load)
                terms.append(nm if c == 1 else f"{c} * {nm}")
        shard = " + ".join(terms) if terms else "0"
        k_col, v_col = self.name(m.k_load.operands[2], m.k_load), self.name(m.v_load.operands[2], m.v_load)
        key0 = self.name(m.key_base, m.k_load) if m.causal else "0"
        q0 = self.name(m.q_base, m.k_load) if m.causal else "0"
        return (f"on_block(tldsl::attn::KeyBlock{{{k_col}, {v_col}, {kb}, {shard}, {m.cond_bound} - {kb}, "
                f"{key0}, {q0}}});{marker(m.k_load.loc)}")


# -- configuration ------------------------------------------------------------------------------

def choose_config(m: _Match, sched: ComputeSchedule, grid, in_dtype: str, out_dtype: str, *,
                  stages: int | None = None, overlap: bool | None = None, loc=None) -> AttentionConfig:
    BM, BN, D = m.BM, m.BN, m.D
    if tuple(getattr(sched, "cluster", (1, 1))) != (1, 1):
        raise _fail(f"cluster {sched.cluster}: the attention lowering runs one CTA per tile (use (1, 1))", loc)
    if D not in HEAD_DIMS:
        raise _fail(f"head dim D={D}: the WGMMA kernel supports D in {HEAD_DIMS} (D is the K extent of Q K^T, "
                    "a multiple of 16, and the N extent of P V)", loc)
    if BM not in (64, 128):
        raise _fail(f"BM={BM}: one consumer warpgroup per 64 query rows, so BM must be 64 or 128", loc)
    if BN not in BLOCK_N:
        raise _fail(f"BN={BN}: the key block must be one of {BLOCK_N} (a multiple of the WGMMA K of 16)", loc)
    if (BN + D) // 2 > ACC_LIMIT:
        raise _fail(f"BN={BN} with D={D} needs {(BN + D) // 2} fp32 accumulators per consumer thread (S and O); "
                    f"at most {ACC_LIMIT} fit the register file (BN + D <= 256)", loc)
    if in_dtype not in _DTYPE_C:
        raise _fail(f"q, k and v must be f16 or bf16 for WGMMA, got {in_dtype}", loc)
    if out_dtype not in _DTYPE_C:
        raise _fail(f"o must be f16 or bf16 (it is staged through the Q buffer), got {out_dtype}", loc)
    st = sched.stages if stages is None else int(stages)
    if st < 1:
        raise _fail(f"stages={st}: need at least one", loc)
    if _smem_bytes(BM, BN, D, st) > SMEM_LIMIT:
        raise _fail(f"BM={BM}, BN={BN}, D={D} with {st} stages needs {_smem_bytes(BM, BN, D, st)} bytes of shared "
                    f"memory, more than the {SMEM_LIMIT} an sm_90 block may use: lower `stages` or BN", loc)
    ov = (st >= 2) if overlap is None else bool(overlap)
    if ov and st < 2:
        raise _fail("overlap=True needs at least 2 stages (the previous block's V stays resident while the next "
                    "block's S is computed)", loc)
    wgs = BM // 64
    # producer 40 / consumers 232 registers (setmaxnreg; 128*40 + 256*232 <= 64K). Also with one
    # consumer warpgroup: capped at 232, ptxas allocates the S, P and O fragments without
    # spilling, while with the 255 of a plain 256-thread launch bound it spills a few words.
    regs = (40, 232)
    gm, gn = (grid[0], grid[1]) if len(grid) == 2 else (grid[0], 1)
    return AttentionConfig(BM, BN, D, st, sched.order, sched.group_m, (gm, gn), wgs, regs[0], regs[1], in_dtype,
                           out_dtype, m.causal, ov, m.scale, m.fill, m.init_max)


# -- lowering --------------------------------------------------------------------------------------

def lower_attention(kernel: core.Kernel, part: str | core.Part | None = None, *, stages: int | None = None,
                    overlap: bool | None = None, wait_timeout_ns: int | None = None,
                    entry: str | None = None) -> LoweredAttention:
    """Lower ``kernel``'s flash-attention compute part (the only one, or the one named) to a
    Hopper kernel.

    ``stages`` overrides the compute schedule's pipeline depth; ``overlap`` turns the
    intra-warpgroup overlap (P V of a block during the next block's softmax) on or off (default:
    on with >= 2 stages); ``wait_timeout_ns`` compiles the waits with a timeout that traps."""
    if part is None:
        parts = [p for p in kernel.parts if p.role == "compute"]
        if len(parts) != 1:
            raise _fail(f"kernel '{kernel.name}' has {len(parts)} compute parts; name the one to lower", kernel.loc)
        p = parts[0]
    else:
        p = kernel.part(part) if isinstance(part, str) else part
    sched = kernel.compute_schedule or ComputeSchedule()
    m = match_attention(kernel, p)
    qbuf, kbuf, vbuf, obuf = (m.q_load.operands[0].owner, m.k_load.operands[0].owner, m.v_load.operands[0].owner,
                              m.store.operands[0].owner)
    in_dt = qbuf.type.dtype.name
    for b in (kbuf, vbuf):
        if b.type.dtype.name != in_dt:
            raise _fail(f"q, k and v must share a dtype, got '{qbuf.name}' {in_dt} and '{b.name}' {b.type.dtype}",
                        m.k_load)
    if len(obuf.type.shape) != 2:
        raise _fail(f"the output '{obuf.name}' must be 2-d", m.store)
    cfg = choose_config(m, sched, p.grid, in_dt, obuf.type.dtype.name, stages=stages, overlap=overlap, loc=p.loc)
    for b in (qbuf, kbuf, vbuf, obuf):
        if (b.type.shape[1] * 2) % 16:
            raise _fail(f"TMA needs 16-byte aligned rows: '{b.name}' rows are {b.type.shape[1] * 2} bytes "
                        "(pad the width to a multiple of 8)", m.store if b is obuf else m.k_load)

    ctl = _Control(kernel, m)
    run_lines = ctl.emit_run()
    entry = entry or cident(f"tldsl_{kernel.name}_{p.name}")
    align_shift = int(getattr(p, "align_shift", 0))
    params = [KernelParam(f"tma_{r}", "const __grid_constant__ cute::TmaDescriptor", "tma", f"tma:tma_{r}")
              for r in ("q", "k", "v", "o")]
    params += [KernelParam("rank", "int", "i32", "rank"), KernelParam("launch", "unsigned long long", "u64", "launch")]
    for s in ctl.signals:
        params.append(KernelParam(f"sig_{cident(s.name)}", "const unsigned long long* __restrict__", "ptr",
                                  f"signal:{s.name}"))
    for t in ctl.tables:
        params.append(KernelParam(f"tbl_{cident(t.name)}", "const int* __restrict__", "ptr", f"buffer:{t.name}"))

    tma = _tma_specs(cfg, m, qbuf, kbuf, vbuf, obuf)
    control = _control_source(ctl, run_lines)
    source = _emit_source(kernel, p, m, cfg, entry, params, control)
    options = []
    if wait_timeout_ns is not None:
        options.append(f"-DTLDSL_WAIT_TIMEOUT_NS={int(wait_timeout_ns)}ull")
    buffers = {b.name: (tuple(b.type.shape), b.type.dtype.name) for b in (qbuf, kbuf, vbuf, obuf)}
    notes = []
    if stages is not None and stages != sched.stages:
        notes.append(f"stages {stages} instead of the schedule's {sched.stages}")
    return LoweredAttention(kernel.name, p.name, entry, source, control, cfg, tuple(params), tma, buffers,
                            m.cond_bound, kernel.world_size, align_shift, ctl.waits,
                            tuple(s.name for s in ctl.signals), tuple(t.name for t in ctl.tables), tuple(options),
                            tuple(notes))


def _tma_specs(cfg: AttentionConfig, m: _Match, qbuf, kbuf, vbuf, obuf) -> tuple[TmaDescriptorSpec, ...]:
    E, S, L = cfg.E, cfg.S, m.cond_bound
    out = []
    for param, buf, role, rows in (("tma_q", qbuf, "Q", cfg.BM), ("tma_o", obuf, "O", 64)):
        n, w = buf.type.shape
        dt = buf.type.dtype.name
        out.append(TmaDescriptorSpec(param, buf.name, role, dt, _TMA_DATA_TYPE[dt], (w, n), (w * 2,), (E, rows),
                                     (1, 1), _SWIZZLE[S],
                                     l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE" if role == "O"
                                     else "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"))
    for param, buf, role in (("tma_k", kbuf, "K"), ("tma_v", vbuf, "V")):
        n, w = buf.type.shape
        dt = buf.type.dtype.name
        out.append(TmaDescriptorSpec(param, buf.name, role, dt, _TMA_DATA_TYPE[dt], (w, L, n // L),
                                     (w * 2, L * w * 2), (E, cfg.BN, 1), (1, 1, 1), _SWIZZLE[S]))
    q, o, k, v = out
    return (q, k, v, o)


def _control_source(ctl: _Control, run_lines: list[str]) -> str:
    members = ["  int rank;", "  unsigned long long launch;"]
    members += [f"  const unsigned long long* sig_{cident(s.name)};" for s in ctl.signals]
    members += [f"  const int* tbl_{cident(t.name)};" for t in ctl.tables]
    L = ["// The tile program's control code: coordinates, the loop nest over key blocks and its waits.",
         "// run<true> (the producer) also waits; run<false> (the consumers) only walks the blocks.",
         "struct Prog {",
         f"  static constexpr bool kHasWaits = {'true' if ctl.waits else 'false'};",
         *members,
         "  template <bool kWaits, class OnTile, class OnBlock>",
         "  TLDSL_CONTROL void run(int pid0, int pid1, OnTile&& on_tile, OnBlock&& on_block) const {",
         "    (void)pid0; (void)pid1;",
         *run_lines,
         "  }",
         "};"]
    return "\n".join(L) + "\n"


def _emit_source(kernel, part, m: _Match, cfg: AttentionConfig, entry, params, control: str) -> str:
    dt = _GMMA_DT[cfg.in_dtype]
    gmma_s = f"cute::SM90::GMMA::MMA_64x{cfg.BN}x16_{dt}_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>"
    gmma_o = f"cute::SM90::GMMA::MMA_64x{cfg.D}x16_{dt}_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>"
    digest = hashlib.sha256(repr((kernel.name, part.name, cfg)).encode()).hexdigest()[:12]
    qk_dot = next(op for op in m.block.ops if op.name == "dot")
    L = [
        f"// Generated by tldsl.codegen.lower_attention — do not edit. Kernel '{kernel.name}', compute part "
        f"'{part.name}' ({part.loc}).",
        f"// flash attention: Q '{m.q_load.operands[0].owner.name}', K '{m.k_load.operands[0].owner.name}', "
        f"V '{m.v_load.operands[0].owner.name}' -> '{m.store.operands[0].owner.name}'; "
        f"{cfg.in_dtype}->{cfg.out_dtype}{', causal' if cfg.causal else ''}",
        f"// BM={cfg.BM} BN={cfg.BN} D={cfg.D}, {cfg.stages} stages, order {cfg.order}, key shards of "
        f"{m.cond_bound} rows; config {digest}",
        '#include "tldsl/sm90_attention.hpp"',
        "",
        "namespace {",
        "",
        control,
        "struct Cfg {",
        f"  using Elem = {_DTYPE_C[cfg.in_dtype]};",
        f"  using ElemO = {_DTYPE_C[cfg.out_dtype]};",
        f"  using GmmaS = {gmma_s};{marker(qk_dot.loc)}",
        f"  using GmmaO = {gmma_o};",
        f"  static constexpr int BM = {cfg.BM}, BN = {cfg.BN}, D = {cfg.D};{marker(part.loc)}",
        f"  static constexpr int kStages = {cfg.stages}, kConsumerWGs = {cfg.consumer_wgs};",
        f"  static constexpr int kOrder = {ORDERS[cfg.order]}, kGroupM = {cfg.group_m}, kGridM = {cfg.grid[0]}, "
        f"kGridN = {cfg.grid[1]};",
        f"  static constexpr int kWorldSize = {kernel.world_size}, kAlignShift = {int(getattr(part, 'align_shift', 0))};",
        f"  static constexpr int kProducerRegs = {cfg.producer_regs}, kConsumerRegs = {cfg.consumer_regs};",
        f"  static constexpr bool kCausal = {'true' if cfg.causal else 'false'}, "
        f"kOverlap = {'true' if cfg.overlap else 'false'};",
        f"  static constexpr float kScaleLog2 = {_c_float(cfg.scale * _LOG2E)};   // scale {cfg.scale!r} * log2(e)",
        f"  static constexpr float kFillLog2 = {_c_float(cfg.fill * _LOG2E)};    // masked score {cfg.fill!r}",
        f"  static constexpr float kInitLog2 = {_c_float(cfg.init_max * _LOG2E)};    // initial max {cfg.init_max!r}",
        "};",
        "using Tr = tldsl::sm90::AttnTraits<Cfg>;",
        "// The host computed these (TMA boxes, dynamic shared memory); the template must agree.",
        f"static_assert(Tr::kSmemBytes == {cfg.smem_bytes}, \"host/device shared-memory size mismatch\");",
        f"static_assert(Tr::E == {cfg.E} && Tr::S == {cfg.S}, \"host/device TMA box mismatch\");",
        f"static_assert(Tr::kThreads == {cfg.threads}, \"host/device block size mismatch\");",
        "",
        "}  // namespace",
        "",
    ]
    init = ", ".join(["rank", "launch"] + [p.name for p in params if p.name.startswith(("sig_", "tbl_"))])
    L += kernel_entry(entry, cfg.threads, params, [
        f"  const Prog prog{{{init}}};",
        f"  tldsl::sm90::attention_kernel<Cfg>(&tma_q, &tma_k, &tma_v, &tma_o, prog);{marker(part.loc)}"])
    return "\n".join(L)


def matches(kernel: core.Kernel, part: core.Part) -> bool:
    """Whether :func:`lower_attention` recognises ``part`` (a flash-attention compute part)."""
    return recognises(match_attention, kernel, part)


def lower(kernel: core.Kernel, part: core.Part, **options) -> LoweredAttention:
    return lower_attention(kernel, part, **options)
