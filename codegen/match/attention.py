"""Recognising a flash-attention compute part (:mod:`tldsl.ops.sp_attention`) op by op, so that
anything the fixed kernel would not compute is an error at the user's line, not a wrong result.

Recognised shape (grid axes, names and the loop nest around the key blocks are free)::

    @tl.compute_part(grid=(heads, cdiv(Sq, BM)))      # heads outermost, as the op has it (either works)
    def attention(h, pm):
        <scalar code>
        q_pos = tl.iota(BM) + Y                            # query positions (causal only), or two runs:
        #   tl.where(tl.iota(BM) < SPLIT, tl.iota(BM) + Y, tl.iota(BM) + Y1)
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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...ir import core
from ...ir.opdefs import DATA_OPS, NOTIFY_OPS, WAIT_OPS
from ...ir.types import FragmentType, TileType
from ..errors import fail, not_applicable
from ..ir_queries import CONTROL_OPS, SCALAR_OPS, const_value
from .affine import affine, combine, fmt

WHAT = "attention lowering"
LOG2E = 1.0 / math.log(2.0)      # the kernel's softmax runs in base 2: scores and maxima are scaled by it
_PURE_TILE_OPS = frozenset({"full", "iota", "ewise", "cast", "reduce", "expand_dims", "broadcast", "trans"})


def describe(op: core.Op | None) -> str:
    """An op as error messages name it: ``'ewise add'``, ``'load_rows'``."""
    if op is None:
        return "a kernel argument or loop variable"
    kind = op.attrs.get("op")
    return f"'{op.name} {kind}'" if kind else f"'{op.name}'"


def _def(v: core.Value) -> core.Op | None:
    return v.owner if isinstance(v.owner, core.Op) else None


def _made_by(name: str):
    """A test for :meth:`_Matcher.pair`: the value is the result of an op ``name``."""
    return lambda v: _def(v) is not None and _def(v).name == name


def _is_tile(v: core.Value) -> bool:
    return isinstance(v.type, (TileType, FragmentType))


@dataclass
class AttentionMatch:
    """What :func:`match_attention` found: the loads, the store and the fragments of the pattern,
    the key-block loop nest and the scalars the control code computes (names as in the module
    docstring)."""
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
    shard_terms: dict               # R0 - KB as an affine form (match.affine, opaque leaves); a multiple of L
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
    q_split: core.Value | None = None   # SPLIT: rows >= SPLIT of the query block are at Y1 + row, not Y + row
    q_base1: core.Value | None = None   # Y1


class _Matcher:
    """Matches the dataflow of the flash-attention pattern, recording every op it accounts for."""

    def __init__(self):
        self.matched: set[int] = set()

    def op(self, v: core.Value, name: str, kind: str | None, what: str, user: core.Op) -> core.Op:
        op = _def(v)
        if op is None or op.name != name or (kind is not None and op.attrs.get("op") != kind):
            want = f"'{name} {kind}'" if kind else f"'{name}'"
            raise fail(WHAT, f"{what} must be {want}, got {describe(op)}", op or user)
        self.matched.add(id(op))
        return op

    def pair(self, op: core.Op, first, what: str):
        """Operands (a, b) of a commutative op, ordered so that ``first(a)`` holds."""
        a, b = op.operands
        if first(a):
            return a, b
        if first(b):
            return b, a
        raise fail(WHAT, f"{what}: unexpected operands of {describe(op)}", op)

    def const(self, v: core.Value, what: str, user: core.Op):
        c = const_value(v)
        if c is None:
            raise fail(WHAT, f"{what} must be a constant", _def(v) or user)
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
        raise fail(WHAT, f"{what} must be tl.iota({n}) + a scalar", add)


def _query_positions(M: _Matcher, v: core.Value, BM: int, user: core.Op):
    """The query positions of the causal mask: ``tl.iota(BM) + Y`` (one run of positions), or
    ``tl.where(i < SPLIT, i + Y, i + Y1)`` with ``i = tl.iota(BM)`` (rows from two runs, as a
    query block straddling the two chunks of a zig-zag layout has). Returns (Y, SPLIT, Y1);
    SPLIT and Y1 are None for one run."""
    what = "the query positions (tl.iota(BM) + first query position)"
    sel = _def(v)
    if sel is None or sel.name != "ewise" or sel.attrs.get("op") != "where":
        return M.iota_plus(v, BM, what, user), None, None
    M.matched.add(id(sel))
    cond, a, b = sel.operands
    lt = M.op(cond, "ewise", "lt", "the split of the query positions tl.where(i < SPLIT, i + Y, i + Y1) "
                                   "(i = tl.iota(BM))", sel)
    io = M.op(lt.operands[0], "iota", None, "the split's rows tl.iota(BM)", lt)
    split = lt.operands[1]
    if io.attrs["n"] != BM or _is_tile(split):
        raise fail(WHAT, f"the split of the query positions must compare tl.iota({BM}) with a scalar", lt)
    return (M.iota_plus(a, BM, "the query positions before the split (tl.iota(BM) + first position)", sel), split,
            M.iota_plus(b, BM, "the query positions from the split on (tl.iota(BM) + position of row 0)", sel))


def _frag_of(op: core.Op) -> core.Op | None:
    return _def(op.operands[0])


def match_attention(kernel: core.Kernel, part: core.Part) -> AttentionMatch:
    """Recognise the flash-attention pattern in ``part``; raise :class:`LoweringError` at the
    first op that does not fit."""
    if part.role != "compute":
        raise fail(WHAT, f"part '{part.name}' is a {part.role} part; the attention lowering lowers compute parts", part)
    if len(part.grid) not in (1, 2):
        raise fail(WHAT, f"the grid {part.grid} must be 1-d or 2-d (e.g. heads, query blocks)", part)
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
            raise fail(WHAT, "fragments must be allocated at the top level of the compute part", op)
        if op.name in NOTIFY_OPS or op.name in DATA_OPS:
            raise fail(WHAT, f"{describe(op)} in the compute part is not supported (notifies and data primitives "
                             "belong to communication parts)", op)
    if len(accs) != 1 or len(vecs) != 2:
        raise not_applicable(WHAT, f"expected one 2-d accumulator and two 1-d fragments (running max, running sum), "
                             f"got {len(accs)} 2-d and {len(vecs)} 1-d fragments", allocs[0] if allocs else part)
    acc = accs[0]
    writes = [op for op in all_ops if op.name == "frag_write" and _frag_of(op) is acc]
    if len(writes) != 1:
        raise fail(WHAT, f"the accumulator must be updated exactly once per key block, found {len(writes)} writes",
                   writes[1] if len(writes) > 1 else acc)
    fw_acc = writes[0]
    block = parent[id(fw_acc)][0]
    if block is part.body:
        raise fail(WHAT, "the accumulator update must sit inside the loop over key blocks", fw_acc)
    chain = []
    b = block
    while b is not part.body:
        owner = next(op for op in all_ops if any(r is b for r in op.regions))
        if owner.name not in CONTROL_OPS:
            raise fail(WHAT, f"{describe(owner)} around the key blocks is not supported", owner)
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
    scaled, pv = M.pair(upd, _made_by("ewise"), "acc[...] * alpha[:, None]"
                        " + tl.dot(p, v)")
    pv_dot = M.op(pv, "dot", None, "the second term of the accumulator update (P V)", upd)
    mul_acc = M.op(scaled, "ewise", "mul", "acc[...] * alpha[:, None]", upd)
    acc_r, alpha_e = M.pair(mul_acc, _made_by("frag_read"),
                            "acc[...] * alpha[:, None]")
    acc_read = M.op(acc_r, "frag_read", None, "the accumulator's old value", mul_acc)
    if _frag_of(acc_read) is not acc:
        raise fail(WHAT, "the accumulator update must scale the accumulator's own value", acc_read)
    alpha_x = M.op(alpha_e, "expand_dims", None, "alpha[:, None]", mul_acc)
    if alpha_x.attrs["axis"] != 1:
        raise fail(WHAT, "the rescale factor must be broadcast along rows (alpha[:, None])", alpha_x)
    alpha = alpha_x.operands[0]
    v_load = M.op(pv_dot.operands[1], "load_rows", None, "the V operand of tl.dot(P, V)", pv_dot)
    p = pv_dot.operands[0]
    if p.type.dtype != v_load.result.type.dtype or _def(p) is None or _def(p).name == "cast":
        p_cast = M.op(p, "cast", None, "the P operand of tl.dot(P, V) (p.to(v.dtype))", pv_dot)
        if p_cast.attrs["dtype"] != v_load.result.type.dtype:
            raise fail(WHAT, f"P must be cast to V's dtype {v_load.result.type.dtype} before tl.dot(P, V), got "
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
        raise fail(WHAT, "expected one update of the running sum (l * alpha + tl.sum(p, 1)) and one of the running "
                         "max (m = tl.maximum(m_old, tl.max(s, 1))) per key block",
                   vec_writes[0] if vec_writes else fw_acc)
    l_frag, m_frag = _frag_of(fw_l), _frag_of(fw_m)
    M.matched.update((id(fw_l), id(fw_m)))
    if l_frag is m_frag:
        raise fail(WHAT, "the running sum and the running max must be different fragments", fw_m)
    add_l = M.op(fw_l.operands[1], "ewise", "add", "the running-sum update", fw_l)
    mul_l, red_l = M.pair(add_l, _made_by("ewise"), "l * alpha + sum(p)")
    mul_l_op = M.op(mul_l, "ewise", "mul", "l * alpha", add_l)
    l_r, alpha2 = M.pair(mul_l_op, _made_by("frag_read"), "l * alpha")
    l_read = M.op(l_r, "frag_read", None, "the running sum's old value", mul_l_op)
    if _frag_of(l_read) is not l_frag or alpha2 is not alpha:
        raise fail(WHAT, "the running sum must be rescaled by the same alpha as the accumulator", mul_l_op)
    red_sum = M.op(red_l, "reduce", None, "tl.sum(p, 1)", add_l)
    if red_sum.attrs["op"] != "sum" or red_sum.attrs["axis"] != 1 or red_sum.operands[0] is not p:
        raise fail(WHAT, "the running sum must add tl.sum(p, 1) of the same p that multiplies V", red_sum)

    # -- the running max and alpha --
    m_new = fw_m.operands[1]
    max_op = M.op(m_new, "ewise", "max", "the new running max", fw_m)
    m_r, red_m = M.pair(max_op, _made_by("frag_read"),
                        "tl.maximum(m_old, tl.max(s, 1))")
    m_read = M.op(m_r, "frag_read", None, "the old running max", max_op)
    if _frag_of(m_read) is not m_frag:
        raise fail(WHAT, "the new running max must combine the old running max", m_read)
    red_max = M.op(red_m, "reduce", None, "tl.max(s, 1)", max_op)
    if red_max.attrs["op"] != "max" or red_max.attrs["axis"] != 1:
        raise fail(WHAT, "the running max must take tl.max(scores, 1)", red_max)
    sc = red_max.operands[0]
    exp_a = M.op(alpha, "ewise", "exp", "alpha", mul_acc)
    sub_a = M.op(exp_a.operands[0], "ewise", "sub", "alpha = exp(m_old - m_new)", exp_a)
    ma, mb = sub_a.operands
    ma_op = _def(ma)
    if not (ma_op is not None and ma_op.name == "frag_read" and _frag_of(ma_op) is m_frag) or mb is not m_new:
        raise fail(WHAT, "alpha must be tl.exp(m_old - m_new)", sub_a)
    M.matched.add(id(ma_op))

    # -- p = where(mask, exp(sc - m_new[:, None]), 0) --
    p_where = M.op(p, "ewise", "where", "p = tl.where(mask, tl.exp(s - m_new[:, None]), 0.0)", red_sum)
    mask, p_exp, p_zero = p_where.operands
    if M.const(p_zero, "the value of masked probabilities", p_where) != 0:
        raise fail(WHAT, "masked probabilities must be 0.0", p_where)
    exp_p = M.op(p_exp, "ewise", "exp", "the probabilities", p_where)
    sub_p = M.op(exp_p.operands[0], "ewise", "sub", "s - m_new[:, None]", exp_p)
    if sub_p.operands[0] is not sc:
        raise fail(WHAT, "the probabilities must exponentiate the same scores the running max was taken over", sub_p)
    mx = M.op(sub_p.operands[1], "expand_dims", None, "m_new[:, None]", sub_p)
    if mx.attrs["axis"] != 1 or mx.operands[0] is not m_new:
        raise fail(WHAT, "the probabilities must subtract m_new[:, None]", mx)

    # -- sc = where(mask, dot(q, trans(k)) [* scale], FILL) --
    sc_where = M.op(sc, "ewise", "where", "the masked scores tl.where(mask, s, FILL)", red_max)
    if sc_where.operands[0] is not mask:
        raise fail(WHAT, "the scores and the probabilities must be masked with the same mask", sc_where)
    fill = float(M.const(sc_where.operands[2], "the masked score value", sc_where))
    raw = sc_where.operands[1]
    scale = 1.0
    raw_op = _def(raw)
    if raw_op is not None and raw_op.name == "ewise" and raw_op.attrs["op"] == "mul":
        M.matched.add(id(raw_op))
        a, b = raw_op.operands
        ca, cb = const_value(a), const_value(b)
        if cb is not None and not _is_tile(b):
            raw, scale = a, float(cb)
            M.matched.add(id(_def(b)))
        elif ca is not None and not _is_tile(a):
            raw, scale = b, float(ca)
            M.matched.add(id(_def(a)))
        else:
            raise fail(WHAT, "the scores may only be scaled by a constant", raw_op)
    qk = M.op(raw, "dot", None, "the scores tl.dot(q, tl.trans(k))", sc_where)
    q_load = M.op(qk.operands[0], "load", None, "the Q operand of tl.dot(q, tl.trans(k))", qk)
    tr = M.op(qk.operands[1], "trans", None, "the K operand tl.trans(k)", qk)
    k_load = M.op(tr.operands[0], "load_rows", None, "the K tile", tr)

    # -- the mask: in_shard[None, :] [& (key_pos[None, :] <= q_pos[:, None])] --
    causal, key_base, q_base, q_split, q_base1 = False, None, None, None, None
    mask_op = _def(mask)
    if mask_op is not None and mask_op.name == "ewise" and mask_op.attrs["op"] == "and":
        M.matched.add(id(mask_op))
        shard_m, cmp = M.pair(mask_op, _made_by("expand_dims"),
                              "in_shard[None, :] & causal")
        cmp_op = M.op(cmp, "ewise", None, "the causal comparison", mask_op)
        if cmp_op.attrs["op"] == "le":
            kx, qx = cmp_op.operands
        elif cmp_op.attrs["op"] == "ge":
            qx, kx = cmp_op.operands
        else:
            raise fail(WHAT, "the causal mask must be key_pos[None, :] <= q_pos[:, None]", cmp_op)
        kxo = M.op(kx, "expand_dims", None, "key_pos[None, :]", cmp_op)
        qxo = M.op(qx, "expand_dims", None, "q_pos[:, None]", cmp_op)
        if kxo.attrs["axis"] != 0 or qxo.attrs["axis"] != 1:
            raise fail(WHAT, "the causal mask must compare key_pos[None, :] with q_pos[:, None]", cmp_op)
        key_base = M.iota_plus(kxo.operands[0], k_load.attrs["shape"][0],
                               "the key positions (tl.iota(BN) + first key position)", kxo)
        q_base, q_split, q_base1 = _query_positions(M, qxo.operands[0], BM, qxo)
        causal = True
    else:
        shard_m = mask
    sm = M.op(shard_m, "expand_dims", None, "the shard mask in_shard[None, :]", sc_where)
    if sm.attrs["axis"] != 0:
        raise fail(WHAT, "the shard mask must be broadcast along columns (in_shard[None, :])", sm)
    cond = sm.operands[0]

    # -- rows = where(in_shard, j + R0, -1), in_shard = (j + KB) < L; K and V read the same rows --
    BN = k_load.attrs["shape"][0]
    if v_load.operands[1] is not k_load.operands[1]:
        raise fail(WHAT, "K and V must be gathered with the same row index tile", v_load)
    rows = k_load.operands[1]
    rw = M.op(rows, "ewise", "where", "the gathered rows tl.where(in_shard, j + first_row, -1)", k_load)
    if rw.operands[0] is not cond:
        raise fail(WHAT, "the gathered rows and the score mask must use the same in-shard condition", rw)
    neg = M.const(rw.operands[2], "the row index of rows outside the shard", rw)
    if not (isinstance(neg, int) and neg < 0):
        raise fail(WHAT, "rows outside the shard must read as zero (a negative row index)", rw)
    r0 = M.iota_plus(rw.operands[1], BN, "the gathered rows (tl.iota(BN) + first row)", rw)
    lt = M.op(cond, "ewise", "lt", "the in-shard condition (j + first_row_in_shard) < rows_per_shard", rw)
    kb = M.iota_plus(lt.operands[0], BN, "the in-shard condition's key rows (tl.iota(BN) + first row in shard)",
                     lt)
    L = M.const(lt.operands[1], "the shard length in the in-shard condition", lt)
    if not isinstance(L, int) or L <= 0:
        raise fail(WHAT, f"the shard length must be a positive int, got {L!r}", lt)
    if _is_tile(kb) or _is_tile(r0):
        raise fail(WHAT, "the first rows of a key block must be scalars", rw)
    kb_ok = False
    kb_owner = kb.owner
    if isinstance(kb_owner, core.Block):
        loop = next((op for op in chain if op.name == "for" and op.regions[0] is kb_owner), None)
        if loop is not None:
            lo, st = const_value(loop.operands[0]), const_value(loop.operands[2])
            kb_ok = isinstance(lo, int) and lo >= 0 and isinstance(st, int) and st > 0
    if not kb_ok:
        raise fail(WHAT, "the first row of a key block inside its shard must be the variable of a loop that counts up "
                         "from a non-negative constant (tl.range(0, hi, BN)), so that no block starts before its shard",
                   lt)
    diff = combine(affine(r0, opaque=True), affine(kb, opaque=True), -1)
    if any(c % L for c in diff.values()):
        raise fail(WHAT, f"the first gathered row minus the first row inside the shard must be a multiple of the shard "
                         f"length {L} (rows of one shard), got {fmt(diff)}", rw)
    for ld, name in ((k_load, "K"), (v_load, "V")):
        buf = ld.operands[0].owner
        rows_n, width = buf.type.shape
        if ld.attrs["shape"] != (BN, D):
            raise fail(WHAT, f"the {name} tile must be {BN} rows x the head dim {D}, got {ld.attrs['shape']}", ld)
        if rows_n % L:
            raise fail(WHAT, f"'{buf.name}' has {rows_n} rows, not whole shards of {L} rows", ld)
    if q_load.attrs["shape"] != (BM, D) or len(q_load.operands[0].owner.type.shape) != 2:
        raise fail(WHAT, f"the Q tile must be a 2-d load of {BM} rows x the head dim {D}, got {q_load.attrs['shape']}",
                   q_load)

    # -- the epilogue: store(o, (OR, OC), acc / where(l > 0, l, 1)[:, None]) --
    stores = [op for op in all_ops if op.name == "store"]
    if len(stores) != 1:
        raise fail(WHAT, f"expected one tl.store of the output, found {len(stores)}", stores[1] if stores else part)
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
        raise fail(WHAT, "the output must be the accumulator divided by the running sum", acc_r2)
    den_x = M.op(div.operands[1], "expand_dims", None, "denom[:, None]", div)
    den = M.op(den_x.operands[0], "ewise", "where", "denom = tl.where(l > 0.0, l, 1.0)", den_x)
    gt = M.op(den.operands[0], "ewise", "gt", "the guard l > 0.0", den)
    lr1 = M.op(gt.operands[0], "frag_read", None, "the running sum in the guard", gt)
    lr2 = M.op(den.operands[1], "frag_read", None, "the running sum in the denominator", den)
    if _frag_of(lr1) is not l_frag or _frag_of(lr2) is not l_frag:
        raise fail(WHAT, "the denominator must be the running sum", den)
    if M.const(gt.operands[1], "the guard's bound", gt) != 0 or M.const(den.operands[2], "the empty-row "
                                                                        "denominator", den) != 1:
        raise fail(WHAT, "the denominator must be tl.where(l > 0.0, l, 1.0) (a row without keys stores 0)", den)

    # -- fragments' initial values --
    if m_frag.attrs["shape"] != (BM,) or l_frag.attrs["shape"] != (BM,):
        raise fail(WHAT, f"the running max and sum must have {BM} rows", m_frag)
    for f in (m_frag, l_frag, acc):
        if f.attrs["dtype"].name != "f32":
            raise fail(WHAT, "the fragments must be float32", f)
    if l_frag.attrs.get("value", 0) != 0 or acc.attrs.get("value", 0) != 0:
        raise fail(WHAT, "the running sum and the accumulator must start at 0", l_frag)
    init_max = float(m_frag.attrs.get("value", 0))
    for what, x in (("masked score", fill), ("initial running max", init_max)):
        if not math.isfinite(x * LOG2E) or not math.isfinite(float(np.float32(x * LOG2E))):
            raise fail(WHAT, f"the {what} {x!r} must be a finite float32 (also after scaling by log2(e))", sc_where)

    # -- placement: per-block ops in the block region, prologue/epilogue at the top level --
    top = part.body
    chain_pos = parent[id(chain[0])][1]
    for op in (q_load, *allocs):
        blk, pos, _ = parent[id(op)]
        if blk is not top or pos > chain_pos:
            raise fail(WHAT, f"{describe(op)} must come before the loop over key blocks, at the top level", op)
    for op in (store, out_op, div, acc_r2, den_x, den, gt, lr1, lr2):
        if op is None:
            continue
        blk, pos, _ = parent[id(op)]
        if blk is not top or pos < chain_pos:
            raise fail(WHAT, f"{describe(op)} must come after the loop over key blocks, at the top level", op)
    per_block = [fw_acc, fw_l, fw_m, acc_read, l_read, m_read, ma_op, k_load, v_load, qk, tr, p_where, sc_where]
    for op in per_block:
        if parent[id(op)][0] is not block:
            raise fail(WHAT, f"{describe(op)} must be in the same loop body as the accumulator update", op)
    for w, reads in ((fw_acc, (acc_read,)), (fw_l, (l_read,)), (fw_m, (m_read, ma_op))):
        for r in reads:
            if parent[id(r)][1] > parent[id(w)][1]:
                raise fail(WHAT, "a fragment must be read before it is written in a key block", r)
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
        raise fail(WHAT, f"{describe(op)} is outside the flash-attention pattern this lowering recognises", op)
    for op in all_ops:
        if op.name in CONTROL_OPS and op not in chain:
            inner = [o for r in op.regions for o in r.walk() if id(o) in M.matched]
            if inner:
                raise fail(WHAT, f"{describe(inner[0])} inside a loop or condition other than the key-block loop nest",
                           inner[0])
    waits_after = [o for op in top.ops[chain_pos + 1:] for o in [op, *[x for r in op.regions for x in r.walk()]]
                   if o.name in WAIT_OPS]
    if waits_after:
        raise fail(WHAT, "waits after the loop over key blocks are not supported (the output is stored right after it)",
                   waits_after[0])
    return AttentionMatch(part, chain, block, q_load, k_load, v_load, store, {"m": m_frag, "l": l_frag, "acc": acc},
                          L, kb, r0, diff, causal, key_base, q_base, scale, fill, init_max, BM, BN, D, M.matched,
                          q_split, q_base1)
