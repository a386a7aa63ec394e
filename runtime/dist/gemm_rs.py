"""GEMM + ReduceScatter on GPUs: ``out = reduce_scatter(A @ B, "sum", scatter_dim=0)`` — the
semantics of ``torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", scatter_dim=0,
group_name)``: every rank multiplies its own ``A [M, K] @ B [K, N]`` (K = this rank's slice of
a row-parallel layer); rank ``r`` gets rows ``[r*M/W, (r+1)*M/W)`` of the sum over ranks, in A's
dtype.

Two communication engines (the communication schedule's ``engine``):

* ``copy_engine`` (the default, :mod:`.gemm_rs_copy`): the tile program's GEMM on every SM; the
  copy engine pushes each peer's partial rows into its receive buffer as the GEMM stores them
  (stream waits on the GEMM's per-chunk counters); this rank's rows are summed after the GEMM;
* ``sm`` (below): the reduce-scatter is the tile program's communication part, a generated
  kernel on ``sms`` reserved SMs, running beside the GEMM.

With ``engine="sm"``, two generated kernels of the ``tldsl.ops.gemm_reduce_scatter`` tile
program run side by side:

* the **GEMM** (compute part; ``codegen.recipes.gemm``, persistent, on ``SMs - lanes`` CTAs) stores
  partial tiles (A's dtype, or fp32 with ``partial_dtype="f32"``) into a local workspace and,
  after each tile's TMA stores complete, adds 1
  (release) to the ``reduce_scatter_ready`` counter of every communication tile it covers;
* the **reduce-scatter** (communication part; recipe ``sm_comm``, ``lanes`` = the comm
  schedule's ``sms`` CTAs, on a second stream) waits per tile for those counters, adds partial
  tiles along the ring / full mesh through a symmetric staging buffer (peer notifies on the
  symmetric ``reduce_scatter_arrived`` counters) and stores this rank's rows of the sum into
  ``out``.

The SM schedule runs on the fused-op runtime (:class:`_ProgramReduceScatter`,
:mod:`.program_engine`): the traced program's parts as :class:`~.program_op.FusedProgram` runs
any program. Launch ``L`` (counted from 1; counters are never reset, every wait targets
``count * L``, so a value from an earlier launch can never satisfy it):

1. validate the inputs (shapes, dtypes, devices, contiguity, alignment): nothing is enqueued
   for invalid inputs;
2. caller's stream: the **entry handshake** (stream memory operations: ``2L - 1`` into this
   rank's slot on every peer, then a wait for every peer's) — every rank finished launch
   ``L-1``, so the staging slots it is about to overwrite (a peer's receive slots, push; its own
   send slots that peers read, pull) are free;
3. the GEMM and the reduce-scatter of launch ``L``, each on a stream forked from the caller's;
4. the caller's stream joins both, then the **exit handshake** (``2L``): ``out`` is ready, and no
   rank's launch ``L+1`` can overwrite the partials or the staging slots early.

CUDA graphs (both engines): a captured call bakes ``L`` into the graph (the kernels' argument, the
copy engine's memop constants), so it is launch ``L = 1`` of fresh counters, and so is every call of
an op once captured: before step 2 the compute stream runs a barrier of the group, zeroes every
counter of the op (ready, arrivals, done, the handshake's) and runs a second barrier
(:mod:`.fused_op`) — on every replay, on the device. While capturing nothing synchronises and no
stream use is recorded (every side stream is joined back before the call returns).

Building the op is **collective** (symmetric staging buffer and counters, one rendezvous): every
rank of the group must build it, at the same point, before any call. Nothing is allocated
collectively on a call.

Debugging: ``TLDSL_WAIT_TIMEOUT_NS`` (read when the op is built) compiles its kernels with
waits that print their slot address and trap after that long (and, on the SM schedule, makes the
fused-op runtime's host waits give up after as long); :meth:`MatmulReduceScatter.signal_map`
names the address. ``TLDSL_DEBUG=1`` synchronises after each call and prints the counters.
"""
from __future__ import annotations

import math

from ... import env
from ...errors import InputError
from ...ops.weights import check_weight_layout
from ...ir.schedule import CommSchedule, ComputeSchedule
from ..gpu.launch import LaunchCache
from .group import built_alike, dist_context, dtype_name
from .symmetric import Lease
from .engine import EngineOp
from .program_engine import ProgramEngine
from .recipes import choose
from .operands import (check_open, check_operands, check_output, check_progress, check_schedules,
                       check_sizes)

DEFAULT_COMPUTE = ComputeSchedule(tile=(128, 256, 64), stages=4, order="comm_aligned")
DEFAULT_SMS = 16


def default_comm(compute: ComputeSchedule, sms: int | None = None, *, m: int | None = None,
                 k: int | None = None) -> CommSchedule:
    """The default reduce-scatter schedule: the copy engine pushes the partial rows
    (:mod:`.gemm_rs_copy`; the GEMM keeps every SM) — on 2x H200 it beat the SM schedule, NCCL +
    cuBLAS and torch async-TP at every benchmark shape (BENCHMARKS.md). This rank's rows are
    summed after the GEMM (``reduce_in="comm"``): summing them in the GEMM's epilogue
    (``reduce_in="epilogue"``) was measured slower on 2x H200 at every benchmark shape, its
    own-row tiles paying more than the pass it saves (BENCHMARKS.md). ``sms`` given: the SM
    schedule with that many SMs (:func:`default_sm_comm`)."""
    if sms is not None:
        return default_sm_comm(compute, sms, m=m, k=k)
    return CommSchedule(engine="copy_engine", mode="push")


def default_sm_comm(compute: ComputeSchedule, sms: int | None = None, *, m: int | None = None,
                    k: int | None = None) -> CommSchedule:
    """The SM reduce-scatter schedule: ring, push. For the problem ``A [m, k]`` (k this
    rank's slice) when given: a communication-heavy one (``k <= 4096`` and ``m >= 4096``: little
    GEMM work per byte reduced) gets 24 SMs and 32-row communication tiles, the others 16 SMs and
    64-row tiles. Small tiles matter because this rank's own rows are computed last and each
    of their tiles is reduced by one SM after it is stored: the tail after the GEMM is one
    tile's reduction. Measured on 2x H200 (BENCHMARKS.md, tile_m / sms sweeps): 64-row tiles
    beat whole 128-row blocks at every benchmark shape; 24 SMs win only where k is short."""
    heavy = m is not None and k is not None and k <= 4096 and m >= 4096
    n_sms = sms or (24 if heavy else DEFAULT_SMS)
    tile = min(32 if heavy else 64, compute.BM)
    return CommSchedule(engine="sm", mode="push", order="ring", tile_m=tile, sms=n_sms)


def traced_comm(comm: CommSchedule, rows_per_rank: int, compute: ComputeSchedule,
                ce_chunks: int | None = None) -> CommSchedule:
    """The communication schedule the tile program is traced with: for the copy engine
    (:mod:`.gemm_rs_copy`) without ``tile_m``, ``ce_chunks`` copies per peer, each a whole
    number of GEMM tile rows (``None``: :func:`~.gemm_rs_copy.default_chunk_rows`)."""
    if comm.engine != "copy_engine" or comm.tile_m is not None:
        if ce_chunks is not None:       # (given, it would be ignored)
            raise InputError(f"ce_chunks={ce_chunks!r} sets the copies per peer of the copy-engine reduce-scatter "
                             f"without its own tile_m; this schedule is {comm}")
    if comm.engine != "copy_engine":
        return comm
    from .gemm_rs_copy import chunk_rows, default_chunk_rows
    if comm.mode != "push":
        raise InputError(f"the copy-engine reduce-scatter pushes partial rows to their owners: use "
                         f"CommSchedule(engine='copy_engine', mode='push'), got {comm}")
    if comm.tile_m is not None:
        return comm
    tiles = -(-rows_per_rank // compute.BM)
    if ce_chunks is not None and ce_chunks > tiles:     # (each copy is whole GEMM tile rows: it would be capped)
        raise InputError(f"ce_chunks={ce_chunks}: at most {tiles} copies per peer — each copies whole "
                         f"{compute.BM}-row tiles of the GEMM, and this rank's {rows_per_rank} rows are {tiles}")
    rows = default_chunk_rows(rows_per_rank, compute) if ce_chunks is None else \
        chunk_rows(rows_per_rank, compute.BM, ce_chunks)
    return comm.with_(tile_m=rows)


def epilogue_compute(rows_per_rank: int) -> ComputeSchedule:
    """:data:`DEFAULT_COMPUTE` for ``reduce_in="epilogue"``: its groups of tile rows within one
    rank's rows (``group_m`` dividing this rank's tile rows), so that every rank reaches its own
    rows last: an own tile waits for its peers' copies, and the tile program refuses orders that
    leave ranks waiting on each other in a cycle (this one never does, at any world size)."""
    tiles = -(-rows_per_rank // DEFAULT_COMPUTE.BM)
    return DEFAULT_COMPUTE.with_(group_m=math.gcd(DEFAULT_COMPUTE.group_m, tiles))


def check_problem(m: int, k: int, n: int, world_size: int, dtype) -> str:
    """Shape rules of the op, checked when it is built; returns the IR dtype name."""
    dt = dtype_name(dtype, "GEMM+ReduceScatter")
    check_sizes("GEMM+ReduceScatter", M=m, K=k, N=n)
    if not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world size {world_size!r} must be a positive int")
    if m % world_size:
        raise InputError(f"M={m} rows cannot be scattered evenly over {world_size} ranks "
                         f"(M must be divisible by the world size)")
    if k % 8:
        raise InputError(f"K={k}: A's rows must be a multiple of 16 bytes for TMA (K a multiple of 8)")
    if n % 8:
        raise InputError(f"N={n}: B's and the output's rows must be a multiple of 16 bytes for TMA "
                         f"(N a multiple of 8)")
    return dt


def validate_operands(a, b, *, m: int, k: int, n: int, dtype, device: int | None = None, op: str = "MatmulReduceScatter",
                      weights: str = "kn"):
    """Every problem with ``A [m, k]`` and ``B [k, n]`` (``weights="nk"``: ``[n, k]``) at once, as one
    InputError (nothing runs)."""
    check_operands(op, (("A", a, (m, k)), ("B", b, (n, k) if weights == "nk" else (k, n))), dtype, device)


class MatmulReduceScatter(EngineOp):
    """``reduce_scatter(A @ B, "sum", scatter_dim=0)`` for a fixed ``A [m, k]``, ``B [k, n]``, dtype.

    ``m`` is the full row count (every rank's A has ``m`` rows; the output ``m / W``), ``k``
    this rank's slice of the reduction dimension. ``compute`` / ``comm``: the tile program's
    schedules (default: :data:`DEFAULT_COMPUTE`, :func:`default_comm`; ``engine="sm"``: the SM
    schedule of :func:`default_sm_comm`). ``partial_dtype``:
    ``"out"`` (default: each rank's product rounded to A's dtype before the sum, the numerics
    of NCCL + cuBLAS and torch async-TP, half the traffic) or ``"f32"`` (fp32 partials).
    ``engine``: a shortcut for the default schedule of that engine. ``ce_chunks``: with the
    copy engine, the copies per peer (each a whole number of GEMM tile rows; default: up to 4,
    never two in one group of tile rows that the compute order finishes together).
    ``hooks``: optional callables ``hooks['before_compute'](op, launch, stream)`` /
    ``hooks['before_comm'](...)`` run on the host just before the GEMM / the communication is
    enqueued (the distributed checks use them to inject stragglers). ``weights``: ``"kn"`` (B is
    ``[k, n]``) or ``"nk"`` (B is ``[n, k]``, a torch Linear's weight, read K-major by the GEMM with
    no copy: the SM schedule on the fused-op runtime, the default there; the copy-engine path takes
    B ``[k, n]`` only).
    """

    def __init__(self, m: int, k: int, n: int, dtype="bfloat16", *, group=None, compute: ComputeSchedule | None = None,
                 comm: CommSchedule | None = None, reduce_op: str = "sum", scatter_dim: int = 0, progress=None,
                 partial_dtype: str = "out", ce_chunks: int | None = None, engine: str | None = None,
                 weights: str = "kn"):
        import torch
        import tldsl as tl
        from ...codegen import lower
        from ...ops.gemm_reduce_scatter import gemm_reduce_scatter

        with built_alike("MatmulReduceScatter", group) as build:      # every rank leaves it alike (group.py)
            check_weight_layout("MatmulReduceScatter", weights)
            self.weights = weights
            if weights == "nk" and (engine == "copy_engine" or (comm is not None and comm.engine != "sm")):
                raise InputError("MatmulReduceScatter: weights='nk' runs the SM schedule on the fused-op runtime; the "
                                 "copy-engine path takes B [k, n] only (pass engine='sm' or leave it out)")
            if reduce_op != "sum":
                raise InputError(f"reduce_op={reduce_op!r}: only 'sum' is supported")
            if scatter_dim != 0:
                raise InputError(f"scatter_dim={scatter_dim}: only 0 (rows) is supported")
            check_schedules("MatmulReduceScatter", compute, comm)
            check_progress("MatmulReduceScatter", progress)
            if ce_chunks is not None:
                check_sizes("MatmulReduceScatter", ce_chunks=ce_chunks)
            self._closed = False
            self.ctx = dist_context(group)
            W = self.ctx.world_size
            dt = check_problem(m, k, n, W, dtype)
            m, k, n = int(m), int(k), int(n)                  # (numpy integers too)
            self.M, self.K, self.N = m, k, n
            self._tensor_type, self._a_size = torch.Tensor, torch.Size((m, k))
            self._b_size = torch.Size((n, k) if weights == "nk" else (k, n))
            self.Ms = m // W
            self.dtype = torch.bfloat16 if dt == "bf16" else torch.float16
            self.compute = compute or DEFAULT_COMPUTE
            if engine not in (None, "sm", "copy_engine"):
                raise InputError(f"engine={engine!r}: choose 'copy_engine' or 'sm'")
            if comm is not None and engine is not None and comm.engine != engine:
                raise InputError(f"engine={engine!r} contradicts the communication schedule {comm}")
            self.comm = comm or (default_sm_comm(self.compute, m=m, k=k) if engine == "sm" or weights == "nk"
                                 else default_comm(self.compute, m=m, k=k))
            if compute is None and self.comm.reduce_in == "epilogue":
                self.compute = epilogue_compute(self.Ms)
            trace_comm = traced_comm(self.comm, self.Ms, self.compute, ce_chunks)

            ir_dt = tl.bfloat16 if dt == "bf16" else tl.float16
            spec = tl.TensorSpec
            if partial_dtype not in ("out", "f32"):
                raise InputError(f"partial_dtype={partial_dtype!r}: choose 'out' (partials in A's dtype, as NCCL + "
                                 f"cuBLAS and torch async-TP) or 'f32' (fp32 partials, twice the traffic)")
            self.partial_dtype = partial_dtype
            build.config = dict(M=m, K=k, N=n, dtype=dt, compute=self.compute, comm=trace_comm,
                                partial_dtype=partial_dtype)
            self.ir = gemm_reduce_scatter.trace(W, spec((m, k), ir_dt), spec(tuple(self._b_size), ir_dt),
                                                spec((self.Ms, n), ir_dt), compute=self.compute, comm=trace_comm,
                                                partial_dtype=partial_dtype, weights=weights)
            self.wait_timeout_ns = env.wait_timeout_ns()     # TLDSL_WAIT_TIMEOUT_NS, checked
            opts = {"wait_timeout_ns": self.wait_timeout_ns} if self.wait_timeout_ns is not None else {}
            self.lowered_gemm = lower(self.ir, "gemm", **opts)
        # every symmetric block of the op, from here on: freed by close() only (symmetric.py)
        self._lease = Lease(self.ctx, f"MatmulReduceScatter({m}, {k}, {n})", self)
        self.debug = bool(env.get("TLDSL_DEBUG"))
        self.timeline = None        # a PhaseTimeline: the next calls mark their phases on it
        self.hooks: dict = {}
        self.launches = 0
        self._engine = None
        self.device = torch.device("cuda", self.ctx.device)
        (self.ready,) = [s.name for s in self.ir.signals if s.type.scope.value != "symmetric"]
        recipe = choose("MatmulReduceScatter", self.comm)
        engine_cls = _ProgramReduceScatter if recipe is None else recipe.engine_class()
        self._engine = engine_cls(self, trace_comm, progress)       # collective
        #: the lowered parts and the SMs the communication kernel keeps (the copy engine's: 0)
        self.lowered_gemm, self.lowered_comm, self.lanes = self._engine.parts()

    # -- what FusedOp's repr, card and describe() say of it ----------------------------------------
    def _problem(self) -> str:
        b = f"B [{self.N}, {self.K}]^T" if self.weights == "nk" else f"B [{self.K}, {self.N}]"
        return f"A [{self.M}, {self.K}] @ {b} -> out [{self.Ms}, {self.N}] {self.dtype}"

    def _facts(self) -> list:
        return [("A", [self.M, self.K]), ("B", list(self._b_size)), ("out", [self.Ms, self.N]), ("dtype", self.dtype)]

    # -- a launch --------------------------------------------------------------------------------
    def __call__(self, a, b, *, out=None):
        """This rank's rows of ``sum_r A_r @ B_r``: ``[M / W, N]`` in A's dtype (written into
        ``out`` when given: contiguous, that shape and dtype, on this device)."""
        dev, dt = self.ctx.device, self.dtype
        tensor = self._tensor_type
        if self._closed:
            check_open("MatmulReduceScatter", True)
        if (type(a) is not tensor or type(b) is not tensor or a.shape != self._a_size or b.shape != self._b_size
                or a.dtype != dt or b.dtype != dt or a.get_device() != dev or b.get_device() != dev
                or not a.is_contiguous() or not b.is_contiguous() or a.data_ptr() % 16 or b.data_ptr() % 16
                or a.requires_grad or b.requires_grad):
            # the common case above in a few compares (the host's time before the GEMM is the op's);
            # anything else (a subclass, a view, a wrong operand) gets the full check and its error
            validate_operands(a, b, m=self.M, k=self.K, n=self.N, dtype=dt, device=dev, weights=self.weights)
        if out is not None:
            check_output("MatmulReduceScatter", out, (self.Ms, self.N), dt, dev, (("A", a), ("B", b)))
        return self._finish(self._engine(a, b, out))

    def _finish(self, out):
        if self.debug and not self._capture:
            import torch
            torch.cuda.synchronize()
            print(f"[rank {self.ctx.rank}] gemm_rs launch {self.launches}: done; counters {self.signal_counters()}",
                  flush=True)
        return out

    def compute_only(self, a, b):
        """Only this op's GEMM (same kernel, schedule and SM count) into its partial workspace,
        notifying scratch counters: what the fused op would cost if communication were free.
        For benchmarks and diagnosis; the op's own counters are not touched."""
        import torch
        check_open("MatmulReduceScatter", self._closed)
        validate_operands(a, b, m=self.M, k=self.K, n=self.N, dtype=self.dtype, device=self.ctx.device,
                          weights=self.weights)
        if getattr(self, "_scratch", None) is None:
            # the op's buffers, its counters replaced by scratch ones: notifies land there, and
            # waits (the epilogue sum's) find their counts already reached
            bufs, sigs = self._engine.gemm_buffers(a, b, torch.empty((self.Ms, self.N), dtype=self.dtype,
                                                                     device=self.device))
            self._scratch = (bufs, {nm: torch.zeros_like(t) if nm == self.ready else torch.full_like(t, 1 << 62)
                                    for nm, t in sigs.items()})
            self._compute_only = LaunchCache()
        bufs, sigs = self._scratch
        bufs = dict(bufs, a=a, b=b)
        gemm = self._engine.compute_gemm
        self._compute_only.get((a.data_ptr(), b.data_ptr()), lambda: gemm.prepare(bufs, sigs, rank=self.ctx.rank, hold=False)
                               ).launch(torch.cuda.current_stream(self.device).cuda_stream, 1)   # like the fused op's GEMM
        return bufs["partial"]


class _ProgramReduceScatter(ProgramEngine):
    """The SM schedule (``engine='sm'``): the ``gemm_reduce_scatter`` tile program on the fused-op
    runtime (:mod:`.program_engine`) — its GEMM on ``SMs - lanes`` CTAs and its generated
    reduce-scatter kernel on ``lanes``, each on a stream of its own, the entry and exit handshakes
    of :class:`~.program_op.FusedProgram` around them."""

    def __init__(self, op, traced_comm: CommSchedule, progress):
        import weakref
        import torch
        import tldsl as tl
        from ...ops.gemm_reduce_scatter import gemm_reduce_scatter
        self.op = weakref.proxy(op)         # no cycle: a dropped op goes at once (its lease warns)
        dt = tl.bfloat16 if op.dtype == torch.bfloat16 else tl.float16
        spec = tl.TensorSpec
        super().__init__(op, gemm_reduce_scatter, {"a": spec((op.M, op.K), dt), "b": spec(tuple(op._b_size), dt),
                                                   "out": spec((op.Ms, op.N), dt)},
                         name="sm", progress=progress, compute=op.compute, comm=traced_comm,
                         partial_dtype=op.partial_dtype, weights=op.weights)
        self._gemm = None

    def parts(self) -> tuple:
        """(lowered GEMM, lowered reduce-scatter kernel, the CTAs that kernel runs on)."""
        lanes = sum(k.ctas for k in self.program.plan.kernels if k.part == "reduce_scatter")
        return self.lowered("gemm"), self.lowered("reduce_scatter"), lanes

    def gemm_buffers(self, a, b, out) -> tuple[dict, dict]:
        """The GEMM's tensors and counters (``compute_only``): the program's partial workspace."""
        ready = self.op.ready
        return {"a": a, "b": b, "partial": self.workspace_tensors()["partial"]}, {ready: self.signals[ready]}

    @property
    def compute_gemm(self):
        """The program's GEMM as a stand-alone kernel on the SMs it gets in the fused launch."""
        if self._gemm is None:
            from ..gpu.gemm import GemmKernel
            self._gemm = GemmKernel(self.lowered("gemm"), reserve_sms=self.reserved_sms("gemm"))
        return self._gemm

    def __call__(self, a, b, out):
        import torch
        op = self.op
        if out is None:
            out = torch.empty((op.Ms, op.N), dtype=op.dtype, device=op.device)
        super().__call__(op, a=a, b=b, out=out)
        return out
