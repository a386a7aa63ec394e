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

Launch protocol (launch ``L`` counted from 1; counters are never reset, every wait targets
``count * L``, so a value from an earlier launch can never satisfy it):

1. validate the inputs (shapes, dtypes, devices, contiguity, alignment): nothing is enqueued
   for invalid inputs;
2. compute stream: record event ``E`` (inputs ready; launch ``L-1`` finished on this rank, since
   the compute stream waited for the communication stream at the end of ``L-1``), then the
   GEMM of launch ``L``;
3. communication stream: wait ``E``; **group barrier** (torch symmetric memory's stream barrier:
   every rank finished launch ``L-1``'s communication, so the staging slots it is about to
   overwrite — a peer's receive slots (push) or its own send slots that peers read (pull) — are
   free); the reduce-scatter kernel of launch ``L``;
4. the compute stream waits for the communication stream (``out`` is ready for the caller, and
   launch ``L+1`` cannot overwrite the partials or the staging slots early).

Producers are enqueued before their consumers (the GEMM before the reduce-scatter that waits for
it), so once a kernel that spins is enqueued, everything it waits for on this rank is enqueued
too: a host-side stall in between (torch frees symmetric memory with a device synchronise) can
never wait for a spinning kernel.

CUDA graphs (both engines): a captured call bakes ``L`` into the graph (the kernels' argument, the
copy engine's memop constants), so it is launch ``L = 1`` of fresh counters, and so is every call of
an op once captured: before step 2 the compute stream runs a barrier of the group, zeroes every
counter of the op (ready, arrivals, done, the handshake's) and runs a second barrier
(:mod:`.fused_op`) — on every replay, on the device. While capturing nothing synchronises and no
stream use is recorded (every side stream is joined back before the call returns).

Building the op is **collective** (symmetric staging buffer and counters, one rendezvous): every
rank of the group must build it, at the same point, before any call. Nothing is allocated
collectively on a call.

Debugging: ``TLDSL_WAIT_TIMEOUT_NS`` (read when the op is built) compiles both kernels with
waits that print their slot address and trap after that long, and gives the group barrier a
timeout; :meth:`MatmulReduceScatter.signal_map` names the address. ``TLDSL_DEBUG=1``
synchronises after each call and prints the counters.
"""
from __future__ import annotations

import os

from ...errors import InputError
from ...ir.schedule import CommSchedule, ComputeSchedule
from ..gpu.launch import LaunchCache
from .call_order import CallOrder
from .group import built_alike, dist_context, dtype_name
from .symmetric import Lease
from .fused_op import FusedOp
from .operands import check_open, check_operands, check_output, check_sizes

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
    if comm.engine != "copy_engine":
        return comm
    from .gemm_rs_copy import chunk_rows, default_chunk_rows
    if comm.mode != "push":
        raise InputError(f"the copy-engine reduce-scatter pushes partial rows to their owners: use "
                         f"CommSchedule(engine='copy_engine', mode='push'), got {comm}")
    if comm.tile_m is not None:
        return comm
    rows = default_chunk_rows(rows_per_rank, compute) if ce_chunks is None else \
        chunk_rows(rows_per_rank, compute.BM, ce_chunks)
    return comm.with_(tile_m=rows)


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


def validate_operands(a, b, *, m: int, k: int, n: int, dtype, device: int | None = None, op: str = "MatmulReduceScatter"):
    """Every problem with ``A [m, k]`` and ``B [k, n]`` at once, as one InputError (nothing runs)."""
    check_operands(op, (("A", a, (m, k)), ("B", b, (k, n))), dtype, device)


class MatmulReduceScatter(FusedOp):
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
    enqueued (the distributed checks use them to inject stragglers).
    """

    def __init__(self, m: int, k: int, n: int, dtype="bfloat16", *, group=None, compute: ComputeSchedule | None = None,
                 comm: CommSchedule | None = None, reduce_op: str = "sum", scatter_dim: int = 0, progress=None,
                 partial_dtype: str = "out", ce_chunks: int | None = None, engine: str | None = None):
        import torch
        import tldsl as tl
        from ...codegen import lower
        from ...ops.gemm_reduce_scatter import gemm_reduce_scatter
        from ..gpu.gemm import GemmKernel
        from .comm_kernel import CommKernel, kernel_specs, make_workspace

        with built_alike("MatmulReduceScatter", group) as build:      # every rank leaves it alike (group.py)
            if reduce_op != "sum":
                raise InputError(f"reduce_op={reduce_op!r}: only 'sum' is supported")
            if scatter_dim != 0:
                raise InputError(f"scatter_dim={scatter_dim}: only 0 (rows) is supported")
            self._closed = False
            self.ctx = dist_context(group)
            W, r = self.ctx.world_size, self.ctx.rank
            dt = check_problem(m, k, n, W, dtype)
            m, k, n = int(m), int(k), int(n)                  # (numpy integers too)
            self.M, self.K, self.N = m, k, n
            self._tensor_type, self._a_size, self._b_size = torch.Tensor, torch.Size((m, k)), torch.Size((k, n))
            self.Ms = m // W
            self.dtype = torch.bfloat16 if dt == "bf16" else torch.float16
            self.compute = compute or DEFAULT_COMPUTE
            if engine not in (None, "sm", "copy_engine"):
                raise InputError(f"engine={engine!r}: choose 'copy_engine' or 'sm'")
            if comm is not None and engine is not None and comm.engine != engine:
                raise InputError(f"engine={engine!r} contradicts the communication schedule {comm}")
            self.comm = comm or (default_sm_comm(self.compute, m=m, k=k) if engine == "sm"
                                 else default_comm(self.compute, m=m, k=k))
            copy_engine = self.comm.engine == "copy_engine"
            trace_comm = traced_comm(self.comm, self.Ms, self.compute, ce_chunks)

            ir_dt = tl.bfloat16 if dt == "bf16" else tl.float16
            spec = tl.TensorSpec
            if partial_dtype not in ("out", "f32"):
                raise InputError(f"partial_dtype={partial_dtype!r}: choose 'out' (partials in A's dtype, as NCCL + "
                                 f"cuBLAS and torch async-TP) or 'f32' (fp32 partials, twice the traffic)")
            self.partial_dtype = partial_dtype
            build.config = dict(M=m, K=k, N=n, dtype=dt, compute=self.compute, comm=trace_comm,
                                partial_dtype=partial_dtype)
            self.ir = gemm_reduce_scatter.trace(W, spec((m, k), ir_dt), spec((k, n), ir_dt), spec((self.Ms, n), ir_dt),
                                                compute=self.compute, comm=trace_comm, partial_dtype=partial_dtype)
            timeout = os.environ.get("TLDSL_WAIT_TIMEOUT_NS")
            self.wait_timeout_ns = int(timeout) if timeout else None
            opts = {"wait_timeout_ns": self.wait_timeout_ns} if timeout else {}
            self.lowered_gemm = lower(self.ir, "gemm", **opts)
        # every symmetric block of the op, from here on: freed by close() only (symmetric.py)
        self._lease = Lease(self.ctx, f"MatmulReduceScatter({m}, {k}, {n})", self)
        self.debug = bool(os.environ.get("TLDSL_DEBUG"))
        self.timeline = None        # a PhaseTimeline: the next calls mark their phases on it
        self.hooks: dict = {}
        self.launches = 0
        self._engine = None
        bufs, slots = kernel_specs(self.ir)
        dev = self.device = torch.device("cuda", self.ctx.device)
        self.partial = torch.empty(bufs["partial"][0], dtype=torch.float32 if partial_dtype == "f32" else self.dtype,
                                   device=dev)
        (self.ready,) = [s.name for s in self.ir.signals if s.type.scope.value != "symmetric"]
        if copy_engine:
            from .gemm_rs_copy import CopyEngineReduceScatter
            self.lanes, self.lowered_comm, self.comm_kernel, self.ws = 0, None, None, None
            self.sym_bufs, self.sym_sigs = [], []
            self.gemm = GemmKernel(self.lowered_gemm, progress=progress)          # every SM
            self.signals = {self.ready: torch.zeros(slots[self.ready], dtype=torch.int64, device=dev)}
            self._engine = CopyEngineReduceScatter(self, bufs, slots)                # collective
            torch.cuda.synchronize()
            return
        self.lowered_comm = lower(self.ir, "reduce_scatter", **opts)
        self.lanes = self.lowered_comm.grid()[0]
        # compile and load both kernels before the collective allocation: a compile error then
        # fails every rank at the same point instead of leaving peers in a rendezvous
        comp_comm = self.lowered_comm.compile(progress=progress)
        self.gemm = GemmKernel(self.lowered_gemm, progress=progress, reserve_sms=self.lanes)
        sym_bufs = [b.name for b in self.ir.buffers if b.symmetric]
        sym_sigs = [s.name for s in self.ir.signals if s.type.scope.value == "symmetric"]
        specs = [(nm, "buffer", bufs[nm][0], bufs[nm][1]) for nm in sym_bufs] + \
                [(nm, "signal", (slots[nm],), "u64") for nm in sym_sigs]
        self.ws = make_workspace(self.ctx, specs, self.comm.transport, lease=self._lease) if specs else None
        self.signals = {nm: (self.ws.tensor(nm) if nm in sym_sigs else torch.zeros(slots[nm], dtype=torch.int64,
                                                                                     device=dev))
                        for nm in slots}
        self.comm_kernel = CommKernel(self.lowered_comm, rank=r, world_size=W, buffers=bufs, signal_slots=slots,
                                      peers={nm: self.ws.peers(nm) for nm in sym_bufs},
                                      peer_signals={nm: self.ws.peers(nm) for nm in sym_sigs}, compiled=comp_comm,
                                      nvshmem=getattr(self.ws, "nv", None))
        self.sym_bufs, self.sym_sigs = sym_bufs, sym_sigs
        self.comm_stream = torch.cuda.Stream(device=dev)
        self._start, self._done = torch.cuda.Event(), torch.cuda.Event()      # reused every launch
        self._gemm_launches, self._comm_launches = LaunchCache(), LaunchCache()
        self._order = CallOrder()
        torch.cuda.synchronize()

    # -- introspection (debugging and the distributed checks) -------------------------------------
    def workspace_tensors(self) -> dict:
        """The data workspaces a launch overwrites (partials, symmetric staging slots)."""
        self._check_open()                              # (its views went with close())
        out = {"partial": self.partial}
        if self._engine is not None and self._engine.recv is not None:
            out["reduce_scatter_recv"] = self._engine.recv
        for nm in self.sym_bufs:
            out[nm] = self.ws.tensor(nm)
        return out

    def signal_map(self) -> list[tuple[str, int, int, str]]:
        """``(signal, address, slots, note)`` of this rank's counters, to decode a device
        ``wait timed out: slot 0x...`` line (:func:`~.comm_kernel.explain_address`)."""
        self._check_open()                              # (its views went with close())
        traced = self.ir.comm_schedule                  # the copy engine's carries its rows per copy
        tile = self.Ms if traced.tile_m is None else min(traced.tile_m, self.Ms)
        tpr = -(-self.Ms // tile)
        out = []
        for nm, t in self.signals.items():
            if nm in self.sym_sigs:
                note = (f"symmetric: peers' reduce-scatter notifies, this rank's reduce-scatter waits; "
                        f"slot s = step s // {tpr}, tile s % {tpr} ({tile} rows)")
            else:
                waiter = "the copy stream" if self._engine is not None else "the reduce-scatter"
                note = (f"local: the GEMM's tiles notify, {waiter} waits; slot s = partial rows "
                        f"[(s // {tpr}) * {self.Ms} + (s % {tpr}) * {tile}, +{tile})")
            out.append((nm, t.data_ptr(), t.numel(), f"rank {self.ctx.rank}, {note}"))
        if self._engine is not None:
            out += self._engine.signal_entries()
        return out

    def signal_tensors(self) -> dict:
        """This rank's counter tensors (int64 CUDA), by signal name."""
        self._check_open()                              # (its views went with close())
        out = dict(self.signals)
        if self._engine is not None:
            out.update(self._engine.signal_tensors())
        return out

    # -- what FusedOp's repr, card and describe() say of it ----------------------------------------
    def _problem(self) -> str:
        return f"A [{self.M}, {self.K}] @ B [{self.K}, {self.N}] -> out [{self.Ms}, {self.N}] {self.dtype}"

    def _facts(self) -> list:
        return [("A", [self.M, self.K]), ("B", [self.K, self.N]), ("out", [self.Ms, self.N]), ("dtype", self.dtype)]

    def _describe_body(self) -> list[str]:
        lines = [f"  GEMM on {self.gemm.grid[0]} CTAs, reduce-scatter on {self.lanes}", self.lowered_gemm.describe()]
        if self._engine is not None:
            return lines + [self._engine.describe()]
        lines.append(self.lowered_comm.describe())
        if self.ws is not None:
            lines.append(self.ws.describe())
        return lines

    def _hook(self, name, stream):
        h = self.hooks.get(name)
        if h is not None:
            h(self, self.launches, stream)

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
                or not a.is_contiguous() or not b.is_contiguous() or a.data_ptr() % 16 or b.data_ptr() % 16):
            # the common case above in a few compares (the host's time before the GEMM is the op's);
            # anything else (a subclass, a view, a wrong operand) gets the full check and its error
            validate_operands(a, b, m=self.M, k=self.K, n=self.N, dtype=dt, device=dev)
        if out is not None:
            check_output("MatmulReduceScatter", out, (self.Ms, self.N), dt, dev, (("A", a), ("B", b)))
        L = self._next_launch()
        if self._engine is not None:
            return self._finish(self._engine(a, b, out, L))     # allocates `out` once the GEMM is enqueued
        if out is None:
            import torch
            out = torch.empty((self.Ms, self.N), dtype=self.dtype, device=self.device)
        self._launch_sm(a, b, out, L)
        return self._finish(out)

    def _finish(self, out):
        if self.debug and not self._capture:
            import torch
            torch.cuda.synchronize()
            print(f"[rank {self.ctx.rank}] gemm_rs launch {self.launches}: done; counters {self.signal_counters()}",
                  flush=True)
        return out

    def _launch_sm(self, a, b, out, L):
        """The SM schedule's launch (module docstring)."""
        import torch
        cur = torch.cuda.current_stream(self.device)
        self._order.follow(cur.cuda_stream)           # a new stream waits for the previous call's (call_order)
        tl_ = self.timeline
        if tl_ is not None:
            tl_.mark("start", cur, "compute")
        ev = self._start
        ev.record(cur)
        if self.hooks:
            self._hook("before_compute", cur)
        # arguments packed once per set of tensor addresses; a launch only sets the epoch
        gemm = self._gemm_launches.get((a.data_ptr(), b.data_ptr()), lambda: self.gemm.prepare(
            {"a": a, "b": b, "partial": self.partial}, signals={self.ready: self.signals[self.ready]},
            rank=self.ctx.rank))
        gemm.launch(cur.cuda_stream, L)
        if tl_ is not None:
            tl_.mark("gemm done", cur, "compute")
        if self.hooks:
            self._hook("before_comm", self.comm_stream)
        self.comm_stream.wait_event(ev)
        if self.ws is not None:
            self._barrier(self.comm_stream)
        if tl_ is not None:
            tl_.mark("barrier", self.comm_stream, "comm")
        comm = self._comm_launches.get(out.data_ptr(), lambda: self.comm_kernel.prepare(
            dict({"partial": self.partial, "out": out}, **{nm: self.ws.tensor(nm) for nm in self.sym_bufs}),
            self.signals))
        comm.launch(self.comm_stream.cuda_stream, L)
        if tl_ is not None:
            tl_.mark("reduce-scatter done", self.comm_stream, "comm")
        self._done.record(self.comm_stream)
        cur.wait_event(self._done)
        if not self._capture:               # (captured: the stream is joined just above)
            out.record_stream(self.comm_stream)

    def compute_only(self, a, b):
        """Only this op's GEMM (same kernel, schedule and SM count) into its partial workspace,
        notifying scratch counters: what the fused op would cost if communication were free.
        For benchmarks and diagnosis; the op's own counters are not touched."""
        import torch
        check_open("MatmulReduceScatter", self._closed)
        validate_operands(a, b, m=self.M, k=self.K, n=self.N, dtype=self.dtype, device=self.ctx.device)
        if getattr(self, "_scratch", None) is None:
            # the op's buffers, its counters replaced by scratch ones: notifies land there, and
            # waits (the epilogue sum's) find their counts already reached
            bufs, sigs = (self._engine.gemm_buffers(a, b, torch.empty((self.Ms, self.N), dtype=self.dtype,
                                                                      device=self.device))
                          if self._engine is not None else ({"a": a, "b": b, "partial": self.partial},
                                                            {self.ready: self.signals[self.ready]}))
            self._scratch = (bufs, {nm: torch.zeros_like(t) if nm == self.ready else torch.full_like(t, 1 << 62)
                                    for nm, t in sigs.items()})
            self._compute_only = LaunchCache()
        bufs, sigs = self._scratch
        bufs = dict(bufs, a=a, b=b)
        self._compute_only.get((a.data_ptr(), b.data_ptr()), lambda: self.gemm.prepare(bufs, sigs, rank=self.ctx.rank)
                               ).launch(torch.cuda.current_stream(self.device).cuda_stream, 1)   # like the fused op's GEMM
        return self.partial

    def _barrier(self, stream):
        timeout = max(1, -(-self.wait_timeout_ns // 1_000_000)) if self.wait_timeout_ns else None
        self.ws.barrier(stream, timeout_ms=timeout)

    def _release(self) -> None:
        if self.ws is not None:
            self.ws.close()
        if self._engine is not None and self._engine.ws is not None:
            self._engine.ws.close()
