"""Lower the compute part of a GEMM-shaped tile program to a Hopper (sm_90a) CUDA kernel.

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
  ``comm_aligned`` per rank), and later epilogues will notify after their stores;
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

from ..ir import core
from ..ir import types as T
from .lowered import LoweredKernel, kernel_entry, recognises  # noqa: F401
from ..ir.opdefs import DEFAULT_MEMORY_SCOPE, NOTIFY_OPS, WAIT_OPS
from ..ir.schedule import ComputeSchedule
from .scalars import CONTROL_OPS, SCALAR_OPS, LoweringError, ScalarEmitter, cident as _cident, marker as _marker
from .scalars import needed_ops, wait_call

SMEM_LIMIT = 232448           # dynamic shared memory per block on sm_90 (227 KiB)
ACC_LIMIT = 128               # fp32 accumulators per consumer thread we allow (register file)
ORDERS = {"row_major": 0, "swizzled": 1, "comm_aligned": 2}

_DTYPE_C = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float"}
_DTYPE_GMMA = {"f16": "F32F16F16", "bf16": "F32BF16BF16"}
_DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
_TMA_DATA_TYPE = {"f16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
                  "f32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"}
_SWIZZLE = {32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}




# -- host-side description ----------------------------------------------------------------------

@dataclass(frozen=True)
class TmaDescriptorSpec:
    """Arguments of ``cuTensorMapEncodeTiled`` for one kernel parameter (dims innermost first,
    strides in bytes for dims 1..rank-1, as the driver API takes them)."""
    param: str                      # kernel parameter, e.g. "tma_a"
    buffer: str                     # IR buffer it describes
    role: str                       # "A" | "B" | "C"
    dtype: str                      # IR dtype name
    data_type: str                  # CUtensorMapDataType enumerator name
    global_dims: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dims: tuple[int, ...]
    element_strides: tuple[int, ...]
    swizzle: str
    interleave: str = "CU_TENSOR_MAP_INTERLEAVE_NONE"
    l2_promotion: str = "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"
    oob_fill: str = "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"   # out-of-bounds elements read as zero

    @property
    def rank(self) -> int:
        return len(self.global_dims)

    def encode(self, address: int) -> bytes:
        """The 128-byte ``CUtensorMap`` for a tensor at device ``address`` (needs the CUDA driver)."""
        from cuda.bindings import driver as cu
        err, tmap = cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, self.data_type), self.rank, address,
            [cu.cuuint64_t(x) for x in self.global_dims], [cu.cuuint64_t(x) for x in self.global_strides],
            [cu.cuuint32_t(x) for x in self.box_dims], [cu.cuuint32_t(x) for x in self.element_strides],
            getattr(cu.CUtensorMapInterleave, self.interleave), getattr(cu.CUtensorMapSwizzle, self.swizzle),
            getattr(cu.CUtensorMapL2promotion, self.l2_promotion), getattr(cu.CUtensorMapFloatOOBfill, self.oob_fill))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled({self.param}) failed: {err}")
        import ctypes
        return ctypes.string_at(tmap.getPtr(), 128)


@dataclass(frozen=True)
class KernelParam:
    """One entry of the flat ``extern "C"`` parameter list, in order."""
    name: str
    ctype: str          # C++ spelling
    kind: str           # "tma" | "i32" | "u64" | "ptr"
    source: str         # what the runtime passes: "tma:<param>", "M", "N", "K", "rank", "launch",
                        # "signal:<name>" (this rank's copy), "buffer:<name>" (a table's address)
    value: int | None = None   # the value fixed by the trace (M, N, K), else None


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

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumer_wgs)

    @property
    def elem_bytes(self) -> int:
        return _DTYPE_BYTES[self.in_dtype]

    @property
    def out_bytes(self) -> int:
        return _DTYPE_BYTES[self.out_dtype]

    # swizzle widths (bytes) and chunk widths (elements) of the A, B and C shared-memory tiles
    @property
    def SA(self) -> int: return min(128, self.BK * self.elem_bytes)
    @property
    def EA(self) -> int: return self.SA // self.elem_bytes
    @property
    def SB(self) -> int: return min(128, self.BN * self.elem_bytes)
    @property
    def EB(self) -> int: return self.SB // self.elem_bytes
    @property
    def SC(self) -> int: return min(128, self.BN * self.out_bytes)
    @property
    def EC(self) -> int: return self.SC // self.out_bytes
    @property
    def acc_per_thread(self) -> int:
        return (self.BM // (64 * self.consumer_wgs)) * self.BN // 2

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory the launch must request (mirrors GemmTraits::kSmemBytes)."""
        return _smem_bytes(self.BM, self.BN, self.BK, self.stages, self.consumer_wgs, self.epi_buffers,
                           self.elem_bytes, self.out_bytes)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _smem_bytes(BM, BN, BK, stages, wgs, epi_buffers, eb, ob) -> int:
    stage_a, stage_b = BM * BK * eb, BK * BN * eb
    epi_buf = _round_up(64 * min(128, BN * ob), 1024)
    off_c = _round_up(stages * (stage_a + stage_b), 1024)
    used = off_c + wgs * epi_buffers * epi_buf + 2 * stages * 8
    return used + 1024


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
    waits: int                       # number of wait ops in the tile program's prologue
    signals: tuple[str, ...]         # signals the waits read (kernel params "sig_<name>")
    options: tuple[str, ...] = ()    # extra NVRTC options (defines)
    notes: tuple[str, ...] = field(default=())
    notifies: int = 0                # notify ops in the tile program's epilogue (after the store)
    notify_signals: tuple[str, ...] = ()   # signals they add to (params "sig_<name>" / "sig_<name>_peers")
    epilogue_waits: int = 0          # waits in a generated epilogue (before its sums)
    data_buffers: tuple[tuple[str, tuple[int, ...], str], ...] = ()   # (name, shape, dtype) it loads: "data:<name>"
    own_rows: bool = False           # this rank's rows of A read from "a_shard", staged into "a_slot" and A
    gather_rows: bool = False        # this rank's rows of A read from "a_shard", every row stored into "a_copy"
    push_rows: bool = False          # gather_rows, and this rank's rows pushed into every peer's landing buffer

    @property
    def num_tiles(self) -> int:
        return self.grid_tiles[0] * self.grid_tiles[1]

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
        lines = [f"{self.entry}: {self.kernel_name}.{self.part}  C[{self.M}x{self.N}] = A[{self.M}x{self.K}] @ "
                 f"B[{self.K}x{self.N}]  {c.in_dtype}->{c.out_dtype}",
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
        for t in self.tma:
            lines.append(f"  {t.param}: {t.buffer} dims={list(t.global_dims)} strides={list(t.global_strides)} "
                         f"box={list(t.box_dims)} {t.swizzle}")
        return "\n".join(lines)


# -- recognising the GEMM ----------------------------------------------------------------------

def _fail(msg: str, op_or_loc=None) -> LoweringError:
    loc = getattr(op_or_loc, "loc", op_or_loc)
    return LoweringError(f"GEMM lowering: {msg}", loc)


class _Affine:
    """Affine forms over the grid ids and the K-loop variable: {symbol: coeff, "": const}."""

    def __init__(self, ivars: dict[int, str]):
        self.ivars = ivars

    def __call__(self, v: core.Value) -> dict[str, int] | None:
        if v.id in self.ivars:
            return {self.ivars[v.id]: 1}
        op = v.owner
        if not isinstance(op, core.Op):
            return None
        if op.name == "const":
            val = op.attrs["value"]
            return {"": int(val)} if isinstance(val, int) and not isinstance(val, bool) else None
        if op.name == "program_id":
            return {f"pid{op.attrs['axis']}": 1}
        if op.name == "arith" and op.attrs["op"] in ("add", "sub", "mul"):
            a, b = self(op.operands[0]), self(op.operands[1])
            if a is None or b is None:
                return None
            kind = op.attrs["op"]
            if kind == "add":
                return _norm({k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)})
            if kind == "sub":
                return _norm({k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)})
            ca, cb = _const_of(a), _const_of(b)
            if ca is not None:
                return _norm({k: ca * x for k, x in b.items()})
            if cb is not None:
                return _norm({k: cb * x for k, x in a.items()})
        return None


def _norm(d: dict[str, int]) -> dict[str, int]:
    return {k: x for k, x in d.items() if x != 0}


def _const_of(d: dict[str, int]) -> int | None:
    if set(d) <= {""}:
        return d.get("", 0)
    return None


def _const_value(v: core.Value):
    op = v.owner
    if isinstance(op, core.Op) and op.name == "const":
        return op.attrs["value"]
    return None


@dataclass
class _Match:
    a: core.Buffer
    b: core.Buffer
    c: core.Buffer
    prologue: list[core.Op]
    loop: core.Op
    dot: core.Op
    store: core.Op
    out_dtype: str
    frag: core.Op
    epilogue: list[core.Op] = field(default_factory=list)   # after the store: index code + notifies
    extras: list[core.Op] = field(default_factory=list)     # a generated epilogue's other stores (sums)


def _buffer_of(v: core.Value, what: str, op) -> core.Buffer:
    if not isinstance(v.owner, core.Buffer):
        raise _fail(f"{what} must be a kernel tensor (argument or workspace)", op)
    return v.owner


def match_gemm(kernel: core.Kernel, part: core.Part) -> _Match:
    """Check that ``part`` is the recognised GEMM; raise :class:`LoweringError` at the op that is not."""
    ops = part.body.ops
    fa = [i for i, op in enumerate(ops) if op.name == "frag_alloc"]
    if len(fa) != 1:
        raise _fail(f"expected exactly one tl.fragment accumulator in compute part '{part.name}', "
                    f"found {len(fa)}", part)
    i0 = fa[0]
    prologue, rest = ops[:i0], ops[i0:]
    allowed_pro = {"const", "program_id", "rank", "arith", "select", "for", "if", "load_scalar"} | WAIT_OPS
    for op in prologue:
        for sub in [op, *[o for r in op.regions for o in r.walk()]]:
            if sub.name not in allowed_pro:
                raise _fail(f"'{sub.name}' before the accumulator is not supported by the GEMM lowering "
                            "(only index arithmetic, loops and waits may precede it)", sub)
    frag = rest[0]
    if frag.result.type.dtype.name != "f32" or frag.attrs.get("value", 0) != 0:
        raise _fail("the accumulator must be an f32 fragment initialised to 0", frag)
    # after the first top-level store: the epilogue (index code and notifies only)
    si = next((i for i, op in enumerate(rest) if op.name == "store"), None)
    if si is None and any(op.name == "if" for op in rest):
        return _match_split(part, prologue, rest, frag)
    epilogue = rest[si + 1:] if si is not None else []
    rest = rest[:si + 1] if si is not None else rest
    allowed_epi = SCALAR_OPS | CONTROL_OPS | NOTIFY_OPS
    for op in epilogue:
        for sub in [op, *[o for r in op.regions for o in r.walk()]]:
            if sub.name not in allowed_epi:
                raise _fail(f"'{sub.name}' after the tile's store is not supported by the GEMM lowering (only "
                            "index arithmetic, loops, conditions and notifies may follow the store)", sub)
    loop = _k_loop(rest, frag)
    tail = [op for op in rest[1:] if op is not loop and op.name not in ("const", "arith")]
    names = [op.name for op in tail]
    if names not in (["frag_read", "cast", "store"], ["frag_read", "store"]):
        raise _fail("after the K loop expected `tl.store(c, (pm*BM, pn*BN), acc)` and nothing else, got "
                    f"{names}", tail[0] if tail else loop)
    store = tail[-1]
    if tail[0].operands[0] is not frag.result:
        raise _fail("the store must write the accumulator", store)
    la, lb, dot = _k_body(loop, frag)
    a, b = _buffer_of(la.operands[0], "A", la), _buffer_of(lb.operands[0], "B", lb)
    c = _buffer_of(store.operands[0], "C", store)
    out_dtype = c.type.dtype.name
    return _Match(a, b, c, prologue, loop, dot, store, out_dtype, frag, epilogue)


def _k_loop(rest: list[core.Op], frag: core.Op) -> core.Op:
    loops = [op for op in rest if op.name == "for"]
    if len(loops) != 1:
        raise _fail(f"expected one tl.range K loop after the accumulator, found {len(loops)}", frag)
    return loops[0]


def _is_stage_wait(op: core.Op) -> bool:
    """A wait in the K loop (maybe under conditions, with its index code): run by the producer
    before it loads the step's stage — e.g. a column-sliced all-gather's ``wait_cols``."""
    if op.name in WAIT_OPS:
        return True
    if op.name not in CONTROL_OPS:
        return False
    subs = [o for r in op.regions for o in r.walk()]
    return (any(o.name in WAIT_OPS for o in subs)
            and all(o.name in SCALAR_OPS | CONTROL_OPS | WAIT_OPS for o in subs))


def _k_body(loop: core.Op, frag: core.Op):
    """The K-loop body's A load, B load and dot (checked: ``acc += tl.dot(load A, load B)``)."""
    # the K-loop body: load A, load B, dot, frag_read, add, frag_write (+ index arithmetic and
    # the stage waits before the loads)
    body = [op for op in loop.regions[0].ops if op.name not in ("const", "arith") and not _is_stage_wait(op)]
    names = [op.name for op in body]
    # `acc += tl.dot(la, lb)`, `acc.write(tl.dot(la, lb, acc.read()))` and
    # `acc.write(acc.read() + tl.dot(la, lb))` trace to the same ops, the read placed differently
    if sorted(names) != sorted(["load", "load", "dot", "frag_read", "ewise", "frag_write"]) or \
            names[-2:] != ["ewise", "frag_write"] or names.index("dot") < max(i for i, n in enumerate(names)
                                                                            if n == "load"):
        raise _fail("the K loop must be `acc += tl.dot(tl.load(a, ...), tl.load(b, ...))`, got "
                    f"{names}", loop)
    dot, fr = body[names.index("dot")], body[names.index("frag_read")]
    add, fw = body[-2], body[-1]
    la, lb = (v.owner for v in dot.operands[:2])
    loads = [op for op in body if op.name == "load"]
    if la not in loads or lb not in loads or la is lb:
        raise _fail("tl.dot must multiply the two tiles loaded in the loop, A first", dot)
    if add.attrs.get("op") != "add" or {add.operands[0].id, add.operands[1].id} != {fr.result.id, dot.result.id}:
        raise _fail("the loop must accumulate: acc += tl.dot(...)", add)
    if fr.operands[0] is not frag.result or fw.operands[0] is not frag.result or fw.operands[1] is not add.result:
        raise _fail("the loop must read and write the same accumulator", fw)
    return la, lb, dot


#: what a generated epilogue may contain besides index code: stores, their elementwise values
#: (the accumulator, loaded tiles, adds, casts), waits before them and notifies after them
_EPILOGUE_OPS = SCALAR_OPS | CONTROL_OPS | NOTIFY_OPS | WAIT_OPS | {"store", "frag_read", "load", "ewise", "cast"}
_EPILOGUE_EWISE = {"add": "__fadd_rn", "sub": "__fsub_rn", "mul": "__fmul_rn"}


def _acc_value(v: core.Value, frag: core.Op) -> bool:
    """Whether ``v`` is the accumulator itself (read, maybe cast)."""
    op = v.owner
    if isinstance(op, core.Op) and op.name == "cast":
        op = op.operands[0].owner
    return isinstance(op, core.Op) and op.name == "frag_read" and op.operands[0] is frag.result


def _match_split(part: core.Part, prologue, rest, frag) -> _Match:
    """A tile program whose code after the K loop chooses per tile what to store (e.g. GEMM +
    ReduceScatter summing in the epilogue: other ranks' rows into the partials, then notified;
    this rank's rows, after waits, plus the tiles peers sent, into the output). The first store
    of the accumulator itself is C's (at the tile's place: the GEMM's output); after it may come
    one more store, of an elementwise expression of the accumulator and loaded tiles."""
    loop = _k_loop(rest, frag)
    post = rest[rest.index(loop) + 1:]
    stores: list[core.Op] = []

    def walk(ops, in_loop):
        for op in ops:
            if op.name not in _EPILOGUE_OPS:
                raise _fail(f"'{op.name}' after the K loop is not supported by the GEMM lowering (a generated "
                            "epilogue has stores of the accumulator and loaded tiles, waits, notifies and index "
                            "code)", op)
            if op.name == "store":
                if in_loop:
                    raise _fail("a store in a loop after the K loop is not supported by the GEMM lowering", op)
                stores.append(op)
            for r in op.regions:
                walk(r.ops, in_loop or op.name == "for")
    walk(post, False)
    main = [st for st in stores if _acc_value(st.operands[-1], frag)][:1]     # the first: C
    if not main:
        raise _fail("a generated GEMM epilogue needs a store of the accumulator itself (the GEMM's output C)",
                    stores[0] if stores else loop)
    extras = [st for st in stores if st is not main[0]]
    if len(extras) > 1 or (extras and stores[-1] is not extras[0]):
        raise _fail("a generated GEMM epilogue may store one elementwise sum of the accumulator, after its store "
                    "of the accumulator itself", extras[-1] if extras else main[0])
    la, lb, dot = _k_body(loop, frag)
    a, b = _buffer_of(la.operands[0], "A", la), _buffer_of(lb.operands[0], "B", lb)
    c = _buffer_of(main[0].operands[0], "C", main[0])
    return _Match(a, b, c, prologue, loop, dot, main[0], c.type.dtype.name, frag, post, extras)


def _check_shapes(kernel: core.Kernel, part: core.Part, m: _Match, sched: ComputeSchedule):
    BM, BN, BK = sched.tile
    a, b, c = m.a.type, m.b.type, m.c.type
    if len(a.shape) != 2 or len(b.shape) != 2 or len(c.shape) != 2:
        raise _fail("A, B and C must be 2-d", m.dot)
    M, K = a.shape
    K2, N = b.shape
    if K2 != K or tuple(c.shape) != (M, N):
        raise _fail(f"shapes do not form a GEMM: A {list(a.shape)}, B {list(b.shape)}, C {list(c.shape)}", m.dot)
    la, lb = m.dot.operands[0].owner, m.dot.operands[1].owner
    if la.attrs["shape"] != (BM, BK) or lb.attrs["shape"] != (BK, BN) or m.frag.attrs["shape"] != (BM, BN):
        raise _fail(f"tile shapes A {la.attrs['shape']}, B {lb.attrs['shape']}, acc {m.frag.attrs['shape']} do "
                    f"not match the compute schedule's tile {(BM, BN, BK)}", m.dot)
    lo, hi, st = (_const_value(v) for v in m.loop.operands)
    if (lo, hi, st) != (0, K, BK):
        raise _fail(f"the K loop must be tl.range(0, {K}, {BK}) (K of A/B, step BK), got ({lo}, {hi}, {st})", m.loop)
    iv = m.loop.regions[0].args[0]
    aff = _Affine({iv.id: "k"})
    want = {"a": ({"pid0": BM}, {"k": 1}), "b": ({"k": 1}, {"pid1": BN}), "c": ({"pid0": BM}, {"pid1": BN})}
    for key, op, offs in (("a", la, la.operands[1:]), ("b", lb, lb.operands[1:]),
                          ("c", m.store, m.store.operands[1:3])):
        got = tuple(aff(v) for v in offs)
        if got != want[key]:
            raise _fail(f"{key.upper()} tile offsets must be {_fmt_aff(want[key])} (grid ids pid0, pid1; "
                        f"K loop variable k), got {_fmt_aff(got)}", op)
    if tuple(part.grid) != (-(-M // BM), -(-N // BN)):
        raise _fail(f"the grid must be (cdiv(M, BM), cdiv(N, BN)) = {(-(-M // BM), -(-N // BN))}, "
                    f"got {part.grid}", part)
    in_dt = a.dtype.name
    if in_dt != b.dtype.name or in_dt not in _DTYPE_GMMA:
        raise _fail(f"A and B must both be f16 or both bf16 for WGMMA, got {a.dtype} and {b.dtype}", m.dot)
    if m.out_dtype not in _DTYPE_C:
        raise _fail(f"C must be f16, bf16 or f32, got {c.dtype}", m.store)
    eb, ob = _DTYPE_BYTES[in_dt], _DTYPE_BYTES[m.out_dtype]
    for name, pitch in (("A", K * eb), ("B", N * eb), ("C", N * ob)):
        if pitch % 16:
            raise _fail(f"TMA needs 16-byte aligned rows: {name}'s row pitch is {pitch} bytes "
                        f"(pad K and N to multiples of {16 // eb})", m.dot)
    for st in m.extras:
        _check_epilogue_store(st, m, aff, sched, ob)
    return M, N, K


def _check_epilogue_store(st: core.Op, m: _Match, aff: "_Affine", sched: ComputeSchedule, c_bytes: int):
    """A generated epilogue's sum store: a 2-d TMA-storable buffer, the tile's columns, a value
    built from the accumulator and (BM, BN) tiles loaded at the tile's columns."""
    BM, BN, _ = sched.tile
    buf = _buffer_of(st.operands[0], "an epilogue store's target", st)
    dt = buf.type.dtype.name
    if len(buf.type.shape) != 2 or dt not in _DTYPE_C:
        raise _fail(f"an epilogue store needs a 2-d f16 / bf16 / f32 tensor, got '{buf.name}' "
                    f"{list(buf.type.shape)} {dt}", st)
    if buf.type.shape[1] * _DTYPE_BYTES[dt] % 16:
        raise _fail(f"TMA needs 16-byte aligned rows: '{buf.name}' rows are {buf.type.shape[1] * _DTYPE_BYTES[dt]} "
                    "bytes", st)
    if 64 * min(128, BN * _DTYPE_BYTES[dt]) > _round_up(64 * min(128, BN * c_bytes), 1024):
        raise _fail(f"the epilogue stages '{buf.name}' ({dt}) in C's buffers, which are too small for it at BN={BN}; "
                    "store the sum in a type no wider than C's", st)
    col = aff(st.operands[2])
    if col != {"pid1": BN}:
        raise _fail(f"an epilogue store must write the tile's columns (pid1*BN), got {_fmt_aff((col,))}", st)

    def check(v: core.Value):
        op = v.owner
        if _acc_value(v, m.frag) and op.name == "frag_read":
            return
        if not isinstance(op, core.Op):
            raise _fail("an epilogue value must be computed from the accumulator and loaded tiles", st)
        if op.name == "cast":
            check(op.operands[0])
        elif op.name == "ewise":
            if op.attrs["op"] not in _EPILOGUE_EWISE:
                raise _fail(f"elementwise '{op.attrs['op']}' in a GEMM epilogue: only {sorted(_EPILOGUE_EWISE)} "
                            "are lowered", op)
            for x in op.operands:
                if not isinstance(x.type, T.TileType):
                    raise _fail("scalars in an epilogue sum are not lowered", op)
                check(x)
        elif op.name == "load":
            lb = _buffer_of(op.operands[0], "an epilogue load's source", op)
            ldt = lb.type.dtype.name
            if len(lb.type.shape) != 2 or ldt not in _DTYPE_C or lb.type.shape[1] % 2:
                raise _fail(f"an epilogue load needs a 2-d f16 / bf16 / f32 tensor with an even row length, got "
                            f"'{lb.name}' {list(lb.type.shape)} {ldt}", op)
            if tuple(op.attrs["shape"]) != (BM, BN):
                raise _fail(f"an epilogue load must read a whole ({BM}, {BN}) tile, got {op.attrs['shape']}", op)
            if aff(op.operands[2]) != {"pid1": BN}:
                raise _fail(f"an epilogue load must read the tile's columns (pid1*BN), got "
                            f"{_fmt_aff((aff(op.operands[2]),))}", op)
        else:
            raise _fail(f"'{op.name}' in an epilogue sum: the GEMM lowering adds loaded tiles to the accumulator", op)
    if tuple(st.operands[-1].type.shape) != (BM, BN):
        raise _fail(f"an epilogue store must write a whole ({BM}, {BN}) tile", st)
    check(st.operands[-1])


def _fmt_aff(forms) -> str:
    def one(f):
        if f is None:
            return "<not affine>"
        parts = [f"{v}*{k}" if k and v != 1 else (k or str(v)) for k, v in sorted(f.items())]
        return " + ".join(parts) or "0"
    return "(" + ", ".join(one(f) for f in forms) + ")"


def choose_config(sched: ComputeSchedule, in_dtype: str, out_dtype: str, *, cluster=None, loc=None,
                  clusters_lowered=((1, 1), (2, 1))) -> GemmConfig:
    BM, BN, BK = sched.tile
    cl = tuple(cluster if cluster is not None else getattr(sched, "cluster", (1, 1)))
    if BM < 64:
        raise _fail(f"BM={BM}: WGMMA works on 64-row blocks, so BM must be 64, 128 or 256", loc)
    if BK < 16:
        raise _fail(f"BK={BK}: WGMMA consumes K in steps of 16, so BK must be >= 16", loc)
    if BN < 16:
        raise _fail(f"BN={BN}: this lowering needs BN >= 16", loc)
    if cl not in clusters_lowered:
        raise _fail(f"cluster {cl}: this lowering supports {list(clusters_lowered)}", loc)
    wgs = 2 if BM >= 128 else 1
    cfg = dict(BM=BM, BN=BN, BK=BK, stages=sched.stages, order=sched.order, group_m=sched.group_m, cluster=cl,
               consumer_wgs=wgs, in_dtype=in_dtype, out_dtype=out_dtype)
    acc = (BM // (64 * wgs)) * BN // 2
    if acc > ACC_LIMIT:
        raise _fail(f"tile {sched.tile} needs {acc} fp32 accumulators per consumer thread; at most {ACC_LIMIT} fit "
                    "the register file with two consumer warpgroups (use BM*BN <= 128*256)", loc)
    eb, ob = _DTYPE_BYTES[in_dtype], _DTYPE_BYTES[out_dtype]
    for bufs in (2, 1):
        if _smem_bytes(BM, BN, BK, sched.stages, wgs, bufs, eb, ob) <= SMEM_LIMIT:
            break
    else:
        need = _smem_bytes(BM, BN, BK, sched.stages, wgs, 1, eb, ob)
        raise _fail(f"tile {sched.tile} with {sched.stages} stages needs {need} bytes of shared memory, more than "
                    f"the {SMEM_LIMIT} an sm_90 block may use: lower `stages` or the tile", loc)
    regs = (40, 232) if wgs == 2 else (0, 0)
    return GemmConfig(**cfg, epi_buffers=bufs, producer_regs=regs[0], consumer_regs=regs[1])


# -- emitting C++ ------------------------------------------------------------------------------

class _SyncEmitter(ScalarEmitter):
    """C++ for one end of a GEMM tile: only the sync ops of ``roots`` (waits before the tile's
    loads, notifies after its stores), the index code that feeds them and the loops and
    conditions around them, in program order (see :mod:`.scalars`)."""

    roots: frozenset = frozenset()
    what = "the GEMM lowering"

    def __init__(self, kernel: core.Kernel, ops: list[core.Op]):
        super().__init__(needed_ops(ops, lambda op: op.name in self.roots))
        self.kernel = kernel
        self.ops = ops
        self.signals: list[core.Signal] = []        # this rank's copy: params sig_<name>
        self.peer_signals: list[core.Signal] = []   # every rank's copy: params sig_<name>_peers

    def fail(self, msg, op=None):
        return _fail(msg, op)

    def pid_expr(self, axis, op):
        if axis > 1:
            raise _fail("the GEMM grid is 2-d", op)
        return f"pid{axis}"

    def emit(self, indent: str = "    ") -> list[str]:
        return super().emit(self.ops, indent)

    def _use(self, sig: core.Signal, peers: bool = False):
        lst = self.peer_signals if peers else self.signals
        if sig not in lst:
            lst.append(sig)

    def wait_statement(self, op) -> str:
        """A wait op on this rank's copy of its signal (a ``sig_<name>`` parameter)."""
        sig = op.operands[0].owner
        self._use(sig)
        return wait_call(op, f"sig_{_cident(sig.name)}", self.name(op.operands[1], op), self.name(op.operands[2], op))

    def notify_add(self, op) -> tuple[str, str]:
        """A notify op as (its scope, the relaxed add at that scope): on this rank's copy of the
        signal, or through the table of every rank's copies when it targets another rank."""
        n = op.name
        sig = op.operands[0].owner
        ch = self.name(op.operands[1], op)
        scope = op.attrs.get("scope", DEFAULT_MEMORY_SCOPE[n])
        cscope = "tldsl::kScopeSys" if scope == "sys" else "tldsl::kScopeGpu"
        if n == "producer_tile_notify" or _is_this_rank(op.operands[2]):
            self._use(sig)
            slot = f"sig_{_cident(sig.name)} + {ch}"
        else:
            self._use(sig, peers=True)
            slot = f"sig_{_cident(sig.name)}_peers[{self.name(op.operands[2], op)}] + {ch}"
        return scope, f"tldsl::red_relaxed_add<{cscope}>({slot}, 1ull);  // {n}{_marker(op.loc)}"


class _WaitEmitter(_SyncEmitter):
    """The tile program's prologue: the waits a tile's loads depend on."""

    roots = WAIT_OPS

    def __init__(self, kernel: core.Kernel, ops: list[core.Op]):
        super().__init__(kernel, ops)
        self.waits = 0

    def emit_other(self, op, ind, lines):
        n = op.name
        if n not in WAIT_OPS:
            raise _fail(f"'{n}' is not supported in the GEMM prologue", op)
        lines.append(ind + self.wait_statement(op))
        self.waits += 1


class _StageWaitEmitter(_WaitEmitter):
    """The waits in the K loop (``TileWaits::stage``): run by the producer before it loads the
    stage of K offset ``k0`` (the loop variable), with the prologue's index code they use."""

    def __init__(self, kernel: core.Kernel, m: "_Match"):
        body = list(m.loop.regions[0].ops)
        ops = [op for op in m.prologue if op.name in SCALAR_OPS] + body
        super().__init__(kernel, ops)
        # the roots: the loop's waits only (the prologue's own run before the tile)
        roots = {id(o) for op in body for o in [op, *[x for r in op.regions for x in r.walk()]] if o.name in WAIT_OPS}
        self.needed = needed_ops(ops, lambda op: id(op) in roots)
        self.bind(m.loop.regions[0].args[0], "k0")

    def emit_other(self, op, ind, lines):
        super().emit_other(op, ind, lines)
        lines.append(ind + "++waited;")


class _NotifyEmitter(_SyncEmitter):
    """The tile program's epilogue: the notifies after a tile's store (e.g. GEMM +
    ReduceScatter's ``notify_rows``). Run by one thread once the tile's TMA stores are
    complete, after one ``fence.acq_rel`` at the widest scope of the notifies; each notify is
    then a relaxed (strong) atomic add at its own scope — together a release pattern."""

    roots = NOTIFY_OPS

    def __init__(self, kernel: core.Kernel, ops: list[core.Op]):
        super().__init__(kernel, ops)
        self.notifies = 0
        self.sys_scope = False

    def emit_other(self, op, ind, lines):
        n = op.name
        if n not in NOTIFY_OPS:
            raise _fail(f"'{n}' after the tile's store is not supported by the GEMM lowering (only index "
                        "arithmetic, loops and notifies may follow the store)", op)
        scope, add = self.notify_add(op)
        self.sys_scope |= scope == "sys"
        lines.append(ind + add)
        self.notifies += 1


class _EpilogueEmitter(_SyncEmitter):
    """A generated epilogue (the tile program's code after the K loop, when it chooses per tile
    what to store): run by every consumer thread with the template's ``EpilogueCtx``. The store
    of the accumulator becomes ``ctx.store`` (then, when notifies follow, ``ctx.release``: the
    tile's stores complete, a fence at their widest scope); waits spin on every thread (acquire:
    the loads after them see what the waited-for writers wrote); a sum store becomes
    ``ctx.apply`` (per accumulator pair: the elementwise expression, with guarded L2 loads)
    then ``ctx.store`` of the sum; notifies add on one thread."""

    roots = NOTIFY_OPS | WAIT_OPS | {"store"}

    def __init__(self, kernel: core.Kernel, ops: list[core.Op], m: _Match):
        super().__init__(kernel, ops)
        self.m = m
        self.waits = self.notifies = 0
        notifies = [op for op in _all_ops(ops) if op.name in NOTIFY_OPS]
        self.has_notifies = bool(notifies)
        self.notify_scope_sys = any(op.attrs.get("scope", DEFAULT_MEMORY_SCOPE[op.name]) == "sys" for op in notifies)
        self.waited: list[core.Signal] = []
        self.loaded: list[core.Buffer] = []       # params buf_<name>
        self.stored: list[core.Buffer] = []       # sum stores' targets: params tma_<name>
        self.stores_done = 0

    def emit_other(self, op, ind, lines):
        n = op.name
        mk = _marker(op.loc)
        if n in ("frag_read", "load", "ewise", "cast"):
            return                                   # part of a store's value: emitted there
        if n in WAIT_OPS:
            if op.operands[0].owner not in self.waited:
                self.waited.append(op.operands[0].owner)
            lines.append(ind + self.wait_statement(op))      # every thread: each acquires what it loads
            self.waits += 1
            return
        if n in NOTIFY_OPS:
            if not self.stores_done:
                raise _fail("a notify before the tile's store in a generated GEMM epilogue", op)
            lines.append(f"{ind}if (ctx.notifier()) {self.notify_add(op)[1]}")
            self.notifies += 1
            return
        if n != "store":
            raise _fail(f"'{n}' is not supported in a generated GEMM epilogue", op)
        buf = op.operands[0].owner
        row, col = self.name(op.operands[1], op), self.name(op.operands[2], op)
        et = _DTYPE_C[buf.type.dtype.name]
        self.stores_done += 1
        if op is self.m.store:
            lines.append(f"{ind}ctx.template store<{et}>(&tma_c, {col}, {row});  // store {buf.name}{mk}")
            if self.has_notifies:
                scope = "tldsl::kScopeSys" if self.notify_scope_sys else "tldsl::kScopeGpu"
                lines.append(f"{ind}ctx.template release<{scope}>();")
            return
        if buf not in self.stored:
            self.stored.append(buf)
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
                  f"{ind}ctx.template store<{et}>(&tma_{_cident(buf.name)}, {col}, {row});  // store {buf.name}{mk}"]

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
            return inner if rdt == "f32" else f"tldsl::sm90::epi_round<{_DTYPE_C[rdt]}>({inner})"
        if op.name == "ewise":
            a, b = (self._expr(o, half, x, at) for o in op.operands)
            e = f"{_EPILOGUE_EWISE[op.attrs['op']]}({a}, {b})"
            return e if rdt == "f32" else f"tldsl::sm90::epi_round<{_DTYPE_C[rdt]}>({e})"
        if op.name == "load":
            buf = op.operands[0].owner
            if buf not in self.loaded:
                self.loaded.append(buf)
            rows, cols = buf.type.shape
            r0, c0 = self.name(op.operands[1], at), self.name(op.operands[2], at)
            load = f"tldsl::sm90::epi_load2(buf_{_cident(buf.name)}, {r0} + r, {c0} + c, {rows}, {cols})"
            ptype = f"tldsl::sm90::EpiPair<{_DTYPE_C[buf.type.dtype.name]}>::type"
            if (ptype, load) not in self._fetches:
                self._fetches.append((ptype, load))
            return f"tldsl::sm90::epi_{half}(f.v{self._fetches.index((ptype, load))})"
        raise _fail(f"'{op.name}' in a GEMM epilogue sum", op)


def _is_this_rank(v: core.Value) -> bool:
    """Whether a rank operand is ``tl.rank()`` itself (the access is local)."""
    return isinstance(v.owner, core.Op) and v.owner.name == "rank"


def lower_gemm(kernel: core.Kernel, part: str | core.Part | None = None, *, cluster=None,
               wait_timeout_ns: int | None = None, entry: str | None = None, own_rows: bool = False,
               gather_rows: bool = False, push_rows: bool = False) -> LoweredGemm:
    """Lower ``kernel``'s compute part (the only one, or the one named) to a Hopper GEMM kernel.

    ``cluster`` overrides the schedule's cluster shape (``ComputeSchedule.cluster`` when the
    schedule has one, else ``(1, 1)``); ``wait_timeout_ns`` compiles the waits with a timeout
    that traps (debugging hangs). ``own_rows`` (AllGather+GEMM, the runtime's staging="gemm"):
    this rank's rows of A (``[rank * M/W, (rank + 1) * M/W)``, whole tiles) are read from the
    tensor ``a_shard`` instead of A, without their waits, and the GEMM stages them itself as it
    loads them — into ``a_slot`` (the symmetric slot peers pull from) and A, spread over the
    first ``own_cols`` tile columns (a launch argument) — counting staged tiles in ``own_staged`` and publishing the launch into slot ``rank`` of every
    peer's arrival array (``own_arrive_peers``: their addresses; ``own_arrive``: this rank's,
    waited on before the slot is overwritten): ``tldsl::sm90::OwnRows``. ``gather_rows``
    (AllGather+GEMM with the copy engines pushing the shards): this rank's rows of A are read
    from ``a_shard`` without their waits, every other row from A itself (the landing buffer the
    peers push into), and the GEMM stores every A stage it loads — spread over the first
    ``own_cols`` tile columns — into ``a_copy`` (the gathered A the op returns):
    ``tldsl::sm90::GatherRows``. ``push_rows`` (with ``gather_rows``; no copy engine): the GEMM
    also stores this rank's stages into every peer's landing buffer (``push_landing_<q>``: peer
    ``(rank + 1 + q) % W``'s, both slots, ``[2 M, K]``; rows of the slot ``launch % 2``), counts its
    storing tiles in ``push_count`` and, with the launch's last, writes ``launch`` into slot
    ``rank`` of every peer's flag array (``push_flag_peers``: their addresses) — the flag the
    peers' GEMMs wait on, as the copy engine's push writes it."""
    if part is None:
        parts = [p for p in kernel.parts if p.role == "compute"]
        if len(parts) != 1:
            raise _fail(f"kernel '{kernel.name}' has {len(parts)} compute parts; name the one to lower", kernel.loc)
        p = parts[0]
    else:
        p = kernel.part(part) if isinstance(part, str) else part
    if p.role != "compute":
        raise _fail(f"part '{p.name}' is a {p.role} part; lower_gemm lowers compute parts", p)
    sched = kernel.compute_schedule or ComputeSchedule()
    m = match_gemm(kernel, p)
    M, N, K = _check_shapes(kernel, p, m, sched)
    in_dt = m.a.type.dtype.name
    cfg = choose_config(sched, in_dt, m.out_dtype, cluster=cluster, loc=p.loc)
    em = _WaitEmitter(kernel, m.prologue)
    wait_lines = em.emit("    ")
    sm = _StageWaitEmitter(kernel, m)
    stage_lines = sm.emit("    ")
    # the epilogue's index code may use values of the prologue or between the loop and the store
    between = [op for op in p.body.ops[len(m.prologue):] if op.name in SCALAR_OPS and op not in m.epilogue]
    if m.extras:
        ne = _EpilogueEmitter(kernel, list(m.prologue) + between + list(m.epilogue), m)
        notify_lines = ne.emit("      ")
    else:
        ne = _NotifyEmitter(kernel, list(m.prologue) + between + list(m.epilogue))
        notify_lines = ne.emit("    ")

    entry = entry or _cident(f"tldsl_{kernel.name}_{p.name}")
    align_shift = int(getattr(p, "align_shift", 0))
    params = [KernelParam("tma_a", "const __grid_constant__ cute::TmaDescriptor", "tma", "tma:tma_a"),
              KernelParam("tma_b", "const __grid_constant__ cute::TmaDescriptor", "tma", "tma:tma_b"),
              KernelParam("tma_c", "const __grid_constant__ cute::TmaDescriptor", "tma", "tma:tma_c"),
              KernelParam("M", "int", "i32", "M", M), KernelParam("N", "int", "i32", "N", N),
              KernelParam("K", "int", "i32", "K", K), KernelParam("rank", "int", "i32", "rank"),
              KernelParam("launch", "unsigned long long", "u64", "launch")]
    ep_waited = list(getattr(ne, "waited", ()))
    notified = [s for s in ne.signals if _notifies_signal(m.epilogue, s)]
    waited_sigs = list(em.signals) + [s for s in sm.signals if s not in em.signals]
    for s in waited_sigs:   # waited on (and maybe notified): this rank's copy
        ctype = ("unsigned long long* __restrict__" if s in notified
                 else "const unsigned long long* __restrict__")
        params.append(KernelParam(f"sig_{_cident(s.name)}", ctype, "ptr", f"signal:{s.name}"))
    for s in ne.signals:   # in the epilogue only: notified (or waited on, by a generated epilogue)
        if s not in waited_sigs:
            ctype = "unsigned long long* __restrict__" if s in notified else "const unsigned long long*"
            params.append(KernelParam(f"sig_{_cident(s.name)}", ctype, "ptr", f"signal:{s.name}"))
    for s in ne.peer_signals:
        params.append(KernelParam(f"sig_{_cident(s.name)}_peers", "unsigned long long* const* __restrict__", "ptr",
                                  f"peer_signals:{s.name}"))
    tables = list(em.tables) + [t for t in sm.tables if t not in em.tables]
    tables += [t for t in ne.tables if t not in tables]
    for t in tables:
        params.append(KernelParam(f"tbl_{_cident(t.name)}", "const int* __restrict__", "ptr", f"buffer:{t.name}"))
    data = []
    if m.extras:      # a generated epilogue: its sum stores' descriptors, the tensors it loads
        for b in ne.stored:
            params.append(KernelParam(f"tma_{_cident(b.name)}", "const __grid_constant__ cute::TmaDescriptor", "tma",
                                      f"tma:tma_{_cident(b.name)}"))
        for b in ne.loaded:   # peers write these during the kernel: plain (L2) loads, never the read-only path
            params.append(KernelParam(f"buf_{_cident(b.name)}", f"const {_DTYPE_C[b.type.dtype.name]}*", "ptr",
                                      f"data:{b.name}"))
            data.append((b.name, tuple(b.type.shape), b.type.dtype.name))

    tma = _tma_specs(cfg, m, M, N, K) + tuple(_store_spec(cfg, b) for b in getattr(ne, "stored", ()))
    if own_rows and gather_rows:
        raise _fail("own_rows and gather_rows are two ways to load this rank's rows: choose one", p)
    if push_rows and not gather_rows:
        raise _fail("push_rows: the GEMM pushes the rows it gathers; lower with gather_rows=True", p)
    if own_rows or gather_rows:
        tma += _own_rows(kernel, p, m, cfg, M, K, ne, params, "gather_rows" if gather_rows else "own_rows")
    if push_rows:
        _check_push_order(kernel, p, sched, M, cfg)
        tma += _push_rows(kernel, cfg, M, K, params)
    source = _emit_source(kernel, p, m, cfg, entry, params, em, wait_lines, align_shift, M, N, K, ne, notify_lines,
                          own_rows, gather_rows, push_rows, sm, stage_lines)
    options = []
    if wait_timeout_ns is not None:
        options.append(f"-DTLDSL_WAIT_TIMEOUT_NS={int(wait_timeout_ns)}ull")
    notified_names = [s.name for s in notified] + [s.name for s in ne.peer_signals if s not in notified]
    waited = waited_sigs + [s for s in ep_waited if s not in waited_sigs]
    return LoweredGemm(kernel.name, p.name, entry, source, cfg, tuple(params), tma, M, N, K,
                       tuple(p.grid), kernel.world_size, align_shift, em.waits + sm.waits,
                       tuple(s.name for s in waited), tuple(options),
                       notifies=ne.notifies, notify_signals=tuple(notified_names),
                       epilogue_waits=getattr(ne, "waits", 0), data_buffers=tuple(data), own_rows=own_rows,
                       gather_rows=gather_rows, push_rows=push_rows)


_OWN_ROW_PARAMS = (("own_staged", "unsigned long long* __restrict__"), ("own_arrive", "const unsigned long long*"),
                   ("own_arrive_peers", "unsigned long long* const* __restrict__"))
#: the scalar an ``own_rows`` GEMM takes: how many tile columns share the staging (``scalar:own_cols``)
OWN_COLS = "own_cols"
#: the int64 tensors an ``own_rows`` GEMM takes among its signals (``signal:<name>`` parameters)
OWN_ROW_SIGNALS = tuple(name for name, _ in _OWN_ROW_PARAMS)
#: the buffer a ``gather_rows`` GEMM stores every A stage into (the gathered A the op returns)
GATHER_COPY = "a_copy"


def _own_rows(kernel, part, m: _Match, cfg: GemmConfig, M: int, K: int, ne, params: list, what: str) -> tuple:
    """``own_rows`` / ``gather_rows``: check the GEMM can load this rank's rows from its shard
    and store the A stages itself, add the parameters, and return the TMA descriptors of the
    shard and of where the stages go (A's boxes: a stage is stored as it was loaded) — the slot
    (``own_rows``, this rank's rows) or the gathered copy (``gather_rows``, every row)."""
    W = kernel.world_size
    if M % W or (M // W) % cfg.BM:
        raise _fail(f"{what}: this rank's rows of '{m.a.name}' (M/W = {M}/{W}) must be whole {cfg.BM}-row tiles",
                    part)
    if cfg.cluster != (1, 1):
        raise _fail(f"{what}: the GEMM stores A stages without thread-block clusters (got {cfg.cluster})", part)
    if ne.notifies or m.extras:
        raise _fail(f"{what}: the GEMM must not notify or run a generated epilogue (AllGather+GEMM's compute "
                    "part does neither)", part)
    grid = "const __grid_constant__ cute::TmaDescriptor"
    eb, rows = cfg.elem_bytes, M // W

    def a_like(param, buf, nrows):
        return TmaDescriptorSpec(param, buf, "A", cfg.in_dtype, _TMA_DATA_TYPE[cfg.in_dtype], (K, nrows), (K * eb,),
                                 (cfg.EA, cfg.BM), (1, 1), _SWIZZLE[cfg.SA])
    if what == "gather_rows":
        params += [KernelParam("tma_a_own", grid, "tma", "tma:tma_a_own"),
                   KernelParam("tma_a_copy", grid, "tma", "tma:tma_a_copy")]
        params.append(KernelParam(OWN_COLS, "int", "i32", f"scalar:{OWN_COLS}"))
        return a_like("tma_a_own", "a_shard", rows), a_like("tma_a_copy", GATHER_COPY, M)
    params += [KernelParam("tma_a_own", grid, "tma", "tma:tma_a_own"),
               KernelParam("tma_a_slot", grid, "tma", "tma:tma_a_slot")]
    params += [KernelParam(name, ctype, "ptr", f"signal:{name}") for name, ctype in _OWN_ROW_PARAMS]
    params.append(KernelParam(OWN_COLS, "int", "i32", f"scalar:{OWN_COLS}"))
    return a_like("tma_a_own", "a_shard", rows), a_like("tma_a_slot", "a_slot", rows)


#: the counter and the peer table a ``push_rows`` GEMM takes among its signals (``signal:<name>``)
PUSH_ROW_SIGNALS = ("push_count", "push_flag_peers")


def push_landing(q: int) -> str:
    """The buffer a ``push_rows`` GEMM pushes into for its ``q``-th peer (ring order after it)."""
    return f"push_landing_{q}"


def _check_push_order(kernel, part, sched, M: int, cfg: GemmConfig) -> None:
    """``push_rows``: every rank's GEMM waits for the others' pushes, and a CTA publishes its
    pushes only as it leaves this rank's rows — so every CTA must visit all its tiles of this
    rank's rows before any other: the ``comm_aligned`` order (it starts at this rank's rows) with
    those rows whole groups of ``group_m`` tile rows (a group straddling them would interleave
    this rank's tiles with a peer's in one CTA's sequence: a cross-rank deadlock)."""
    rows = M // kernel.world_size // cfg.BM
    if sched.order != "comm_aligned" or int(getattr(part, "align_shift", 0)) != 0 or rows % sched.group_m:
        raise _fail(f"push_rows: each CTA must push its tiles of this rank's rows before it waits for a peer's, so the "
                    f"order must be 'comm_aligned' starting at this rank's rows with its {rows} tile rows whole groups "
                    f"(group_m dividing {rows}); got order={sched.order!r}, group_m={sched.group_m}", part)


def _push_rows(kernel, cfg: GemmConfig, M: int, K: int, params: list) -> tuple:
    """``push_rows``: the parameters and the descriptors of the peers' landing buffers (both
    slots, ``[2 M, K]``; stored with A's boxes, as the stages were loaded)."""
    W = kernel.world_size
    grid = "const __grid_constant__ cute::TmaDescriptor"
    specs = []
    for q in range(W - 1):
        params.append(KernelParam(f"tma_push_{q}", grid, "tma", f"tma:tma_push_{q}"))
        specs.append(TmaDescriptorSpec(f"tma_push_{q}", push_landing(q), "A", cfg.in_dtype, _TMA_DATA_TYPE[cfg.in_dtype],
                                       (K, 2 * M), (K * cfg.elem_bytes,), (cfg.EA, cfg.BM), (1, 1), _SWIZZLE[cfg.SA]))
    params += [KernelParam("push_count", "unsigned long long* __restrict__", "ptr", "signal:push_count"),
               KernelParam("push_flag_peers", "unsigned long long* const* __restrict__", "ptr",
                           "signal:push_flag_peers")]
    return tuple(specs)


def _all_ops(ops):
    """Every op of ``ops`` and of the regions nested in them, in program order."""
    for x in ops:
        yield x
        for r in x.regions:
            yield from r.walk()


def _notifies_signal(ops, sig) -> bool:
    return any(op.name in NOTIFY_OPS and op.operands[0].owner is sig for op in _all_ops(ops))


def _store_spec(cfg: GemmConfig, buf: core.Buffer) -> TmaDescriptorSpec:
    """The TMA descriptor of a generated epilogue's sum store (64-row boxes, like C's)."""
    dt = buf.type.dtype.name
    ob = _DTYPE_BYTES[dt]
    rows, cols = buf.type.shape
    sc = min(128, cfg.BN * ob)
    return TmaDescriptorSpec(f"tma_{_cident(buf.name)}", buf.name, "C", dt, _TMA_DATA_TYPE[dt], (cols, rows),
                             (cols * ob,), (sc // ob, 64), (1, 1), _SWIZZLE[sc],
                             l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE")


def _tma_specs(cfg: GemmConfig, m: _Match, M: int, N: int, K: int) -> tuple[TmaDescriptorSpec, ...]:
    eb, ob = cfg.elem_bytes, cfg.out_bytes
    a = TmaDescriptorSpec("tma_a", m.a.name, "A", cfg.in_dtype, _TMA_DATA_TYPE[cfg.in_dtype], (K, M), (K * eb,),
                          (cfg.EA, cfg.BM), (1, 1), _SWIZZLE[cfg.SA])
    b = TmaDescriptorSpec("tma_b", m.b.name, "B", cfg.in_dtype, _TMA_DATA_TYPE[cfg.in_dtype], (N, K), (N * eb,),
                          (cfg.EB, cfg.BK), (1, 1), _SWIZZLE[cfg.SB])
    c = TmaDescriptorSpec("tma_c", m.c.name, "C", cfg.out_dtype, _TMA_DATA_TYPE[cfg.out_dtype], (N, M), (N * ob,),
                          (cfg.EC, 64), (1, 1), _SWIZZLE[cfg.SC], l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE")
    return (a, b, c)


def gemm_cfg_fields(cfg: GemmConfig, gmma: str, world_size: int, align_shift: int,
                    dot_mk: str = "", part_mk: str = "") -> list[str]:
    """The opening of the ``struct Cfg`` every WGMMA GEMM template (plain and grouped) reads:
    element types, GMMA atom, tile, pipeline, tile order and register split."""
    return [
        "struct Cfg {",
        f"  using ElemAB = {_DTYPE_C[cfg.in_dtype]};",
        f"  using ElemC = {_DTYPE_C[cfg.out_dtype]};",
        f"  using Gmma = {gmma};{dot_mk}",
        f"  static constexpr int BM = {cfg.BM}, BN = {cfg.BN}, BK = {cfg.BK};{part_mk}",
        f"  static constexpr int kStages = {cfg.stages}, kConsumerWGs = {cfg.consumer_wgs}, "
        f"kEpiBuffers = {cfg.epi_buffers};",
        f"  static constexpr int kOrder = {ORDERS[cfg.order]}, kGroupM = {cfg.group_m}, "
        f"kWorldSize = {world_size}, kAlignShift = {align_shift};",
        f"  static constexpr int kProducerRegs = {cfg.producer_regs}, kConsumerRegs = {cfg.consumer_regs};",
        f"  static constexpr int kClusterM = {cfg.cluster[0]};",
    ]


def _emit_source(kernel, part, m: _Match, cfg: GemmConfig, entry, params, em: _WaitEmitter, wait_lines,
                 align_shift, M, N, K, ne: _NotifyEmitter | None = None, notify_lines=(), own_rows=False,
                 gather_rows=False, push_rows=False, sm: _StageWaitEmitter | None = None, stage_lines=()) -> str:
    gmma = (f"cute::SM90::GMMA::MMA_64x{cfg.BN}x16_{_DTYPE_GMMA[cfg.in_dtype]}_SS<"
            "cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>")
    part_mk, dot_mk, store_mk = _marker(part.loc), _marker(m.dot.loc), _marker(m.store.loc)
    digest = hashlib.sha256(repr((kernel.name, part.name, cfg)).encode()).hexdigest()[:12]
    L = [
        f"// Generated by tldsl.codegen.lower_gemm — do not edit. Kernel '{kernel.name}', compute part "
        f"'{part.name}' ({part.loc}).",
        f"// C[{M}x{N}] {cfg.out_dtype} = A[{M}x{K}] {cfg.in_dtype} ('{m.a.name}') @ B[{K}x{N}] {cfg.in_dtype} "
        f"('{m.b.name}') -> '{m.c.name}'",
        f"// tile {cfg.BM}x{cfg.BN}x{cfg.BK}, {cfg.stages} stages, order {cfg.order}, cluster {cfg.cluster}; "
        f"config {digest}",
        '#include "tldsl/sm90_gemm.hpp"',
        "",
        "namespace {",
        "",
        *gemm_cfg_fields(cfg, gmma, kernel.world_size, align_shift, dot_mk, part_mk),
        "};",
        "using Tr = tldsl::sm90::GemmTraits<Cfg>;",
        "// The host computed these (TMA boxes, dynamic shared memory); the template must agree.",
        f"static_assert(Tr::kSmemBytes == {cfg.smem_bytes}, \"host/device shared-memory size mismatch\");",
        f"static_assert(Tr::EA == {cfg.EA} && Tr::EB == {cfg.EB} && Tr::EC == {cfg.EC}, "
        "\"host/device TMA box mismatch\");",
        f"static_assert(Tr::kThreads == {cfg.threads}, \"host/device block size mismatch\");",
        "",
    ]
    staged = sm is not None and sm.waits > 0
    if em.waits or staged:
        sigs = list(em.signals) + [s for s in (sm.signals if staged else ()) if s not in em.signals]
        tbls = list(em.tables) + [t for t in (sm.tables if staged else ()) if t not in em.tables]
        members = ["  int rank;", "  unsigned long long launch;"]
        members += [f"  const unsigned long long* sig_{_cident(s.name)};" for s in sigs]
        members += [f"  const int* tbl_{_cident(t.name)};" for t in tbls]
        stage = ["  // the waits in the K loop, run by the producer before it loads the stage at K offset k0;",
                 "  // returns how many ran (the producer then fences before its TMA reads)",
                 "  __device__ __forceinline__ int stage(int pid0, int pid1, int k0) const {",
                 "    (void)pid0; (void)pid1; (void)k0;",
                 "    int waited = 0;",
                 *stage_lines,
                 "    return waited;",
                 "  }"] if staged else \
                ["  __device__ __forceinline__ int stage(int, int, int) const { return 0; }"]
        L += ["// The tile program's waits, run by the producer before each tile's TMA loads.",
              "struct TileWaits {",
              f"  static constexpr bool kEnabled = {'true' if em.waits else 'false'};",
              f"  static constexpr bool kStaged = {'true' if staged else 'false'};",
              *members,
              "  __device__ __forceinline__ void operator()(int pid0, int pid1) const {",
              "    (void)pid0; (void)pid1;",
              *wait_lines,
              "  }",
              *stage,
              "};",
              ""]
        init = ["rank", "launch"] + [f"sig_{_cident(s.name)}" for s in sigs] + \
               [f"tbl_{_cident(t.name)}" for t in tbls]
        waits_expr = "TileWaits{" + ", ".join(init) + "}"
    else:
        waits_expr = "tldsl::sm90::NoWaits{}"
    notifies_arg = ""
    if isinstance(ne, _EpilogueEmitter):
        c = _cident
        fields = [("int rank", "rank"), ("unsigned long long launch", "launch"),
                  ("const cute::TmaDescriptor* tma_c_ptr", "&tma_c")]      # (member, its value in the kernel)
        fields += [(f"{'' if _notifies_signal(m.epilogue, s) else 'const '}unsigned long long* sig_{c(s.name)}",
                    f"sig_{c(s.name)}") for s in ne.signals]
        fields += [(f"unsigned long long* const* sig_{c(s.name)}_peers", f"sig_{c(s.name)}_peers")
                   for s in ne.peer_signals]
        fields += [(f"const int* tbl_{c(t.name)}", f"tbl_{c(t.name)}") for t in ne.tables]
        fields += [(f"const cute::TmaDescriptor* tma_{c(b.name)}_ptr", f"&tma_{c(b.name)}") for b in ne.stored]
        fields += [(f"const {_DTYPE_C[b.type.dtype.name]}* buf_{c(b.name)}", f"buf_{c(b.name)}") for b in ne.loaded]
        members = [f"  {decl};" for decl, _ in fields]
        init = [value for _, value in fields]
        aliases = ["    const cute::TmaDescriptor& tma_c = *tma_c_ptr;"] + \
                  [f"    const cute::TmaDescriptor& tma_{_cident(b.name)} = *tma_{_cident(b.name)}_ptr;" for b in ne.stored]
        L += ["// The tile program's code after the K loop, run by every consumer thread: which stores a tile",
              "// makes (the accumulator into C; or, after waits, its elementwise sum with loaded tiles),",
              "// and the notifies after the accumulator's store.",
              "struct TileEpilogue {",
              "  static constexpr bool kEnabled = true;",
              *members,
              "  template <class Ctx>",
              "  __device__ __forceinline__ void operator()(Ctx& ctx, int pid0, int pid1) const {",
              "    (void)pid0; (void)pid1;",
              *aliases,
              "    {",
              *notify_lines,
              "    }",
              "  }",
              "};",
              ""]
        notifies_arg = ", tldsl::sm90::NoNotifies{}, TileEpilogue{" + ", ".join(init) + "}"
    elif ne is not None and ne.notifies:
        members = ["  int rank;"]
        members += [f"  unsigned long long* sig_{_cident(s.name)};" for s in ne.signals]
        members += [f"  unsigned long long* const* sig_{_cident(s.name)}_peers;" for s in ne.peer_signals]
        members += [f"  const int* tbl_{_cident(t.name)};" for t in ne.tables]
        scope = "tldsl::kScopeSys" if ne.sys_scope else "tldsl::kScopeGpu"
        L += ["// The tile program's notifies after its store, run by one consumer thread once the tile's",
              "// TMA stores are complete, after fence.acq_rel at kScope (each add is then a release).",
              "struct TileNotifies {",
              "  static constexpr bool kEnabled = true;",
              f"  static constexpr int kScope = {scope};",
              *members,
              "  __device__ __forceinline__ void operator()(int pid0, int pid1) const {",
              "    (void)pid0; (void)pid1;",
              *notify_lines,
              "  }",
              "};",
              ""]
        init = ["rank"] + [f"sig_{_cident(s.name)}" for s in ne.signals] + \
               [f"sig_{_cident(s.name)}_peers" for s in ne.peer_signals] + [f"tbl_{_cident(t.name)}" for t in ne.tables]
        notifies_arg = ", TileNotifies{" + ", ".join(init) + "}"
    if own_rows:      # no notifies, no generated epilogue (checked): the plain store, then this rank's rows
        notifies_arg = (", tldsl::sm90::NoNotifies{}, tldsl::sm90::NoEpilogue{}, tldsl::sm90::OwnRows<Cfg::kWorldSize>{"
                        "&tma_a_own, &tma_a_slot, " + ", ".join(n for n, _ in _OWN_ROW_PARAMS) + f", launch, {OWN_COLS}}}")
    if gather_rows and not push_rows:   # the same, every row's stages stored into the gathered copy
        notifies_arg = (", tldsl::sm90::NoNotifies{}, tldsl::sm90::NoEpilogue{}, "
                        f"tldsl::sm90::GatherRows<Cfg::kWorldSize>{{&tma_a_own, &tma_a_copy, {OWN_COLS}}}")
    if push_rows:     # ... and this rank's rows pushed into the peers' landing buffers, then published
        pushes = ", ".join(f"&tma_push_{q}" for q in range(kernel.world_size - 1)) or "nullptr"
        notifies_arg = (", tldsl::sm90::NoNotifies{}, tldsl::sm90::NoEpilogue{}, "
                        "tldsl::sm90::GatherRows<Cfg::kWorldSize, true, true>{&tma_a_own, &tma_a_copy, "
                        f"{OWN_COLS}, {{{pushes}}}, push_count, push_flag_peers, launch, "
                        "int(launch & 1ull) * M, (unsigned long long)(M / Cfg::kWorldSize / Cfg::BM) * "
                        f"(unsigned long long)({OWN_COLS} < (N + Cfg::BN - 1) / Cfg::BN ? {OWN_COLS} : "
                        "(N + Cfg::BN - 1) / Cfg::BN)}")
    L += ["}  // namespace", ""]
    L += kernel_entry(entry, cfg.threads, params, [
        "  (void)launch;",
        f"  tldsl::sm90::gemm_kernel<Cfg>(&tma_a, &tma_b, &tma_c, M, N, K, rank, {waits_expr}{notifies_arg});{dot_mk}",
        f"  // stores: {m.c.name}{store_mk}"])
    return "\n".join(L)


def matches(kernel: core.Kernel, part: core.Part) -> bool:
    """Whether :func:`lower_gemm` recognises ``part`` (a GEMM-shaped compute part)."""
    return recognises(match_gemm, kernel, part)


def lower(kernel: core.Kernel, part: core.Part, **options) -> LoweredGemm:
    return lower_gemm(kernel, part, **options)
