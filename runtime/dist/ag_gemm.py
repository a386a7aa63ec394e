"""AllGather+GEMM on GPUs: the copy engine gathers A shard by shard (stream-ordered peer
copies, each followed by a stream write of its flag), while the generated GEMM — the
AllGather+GEMM tile program's compute part — waits per tile for exactly the flags its rows
need. The GEMM starts on the local shard at once.

The default where this rank's rows are whole tiles (and nothing asks for the pull's options:
:func:`default_push`) is the copy engines **pushing** the shards, :mod:`.ag_push`: no staging
at all, each rank's shard copied straight from its tensor into the peers' landing buffers, the
GEMM gathering A_gathered as it loads. Elsewhere, the pull described here.

Pull launch protocol (``launch`` = L, counted from 1; flags hold the last launch that wrote them,
so they are never reset and an old value can never satisfy a wait). Our shard is staged in a
double-buffered symmetric buffer, slot ``L % 2``:

1. compute stream: this call's shard into slot ``L % 2`` and into its rows of A_gathered, and
   L into its flag — one pass of the staging kernel (:mod:`.staging`); same-GPU copies run on
   SMs, so they must finish before the persistent GEMM holds them; record that point for the
   copy stream;
2. compute stream, at once: the GEMM, launch index L (on every SM but one when the barrier
   is a kernel, which runs beside it there); it starts on our own rows and spins (acquire,
   system scope) on flag p before loading rows of shard p;
3. copy stream (after step 1): **one group barrier** — every rank's shard of launch L is
   staged, and every rank finished launch L-1 (so nobody still reads the slot written at
   L+1). ``handshake="device"`` (the default): the staging kernel itself is the barrier (it
   waits for every peer's arrival at L-1 before writing the slot and, once staged, writes L
   into this rank's slot of every peer's symmetric arrival array), so the copy stream —
   ordered after the call's start, not after step 1 — only waits (GEQ) for peer p's slot
   before copying shard p: no host call stands between a peer's staging and its copy;
   ``"memops"``: stream memory operations on the copy stream after step 1 — write L into this
   rank's slot of every peer's arrival array, then wait for every peer's slot here; both use
   no SM, the GEMM takes every SM; ``"kernel"``: torch symmetric memory's barrier kernel.
   Then, in ring order, peer copies of shard p (NVLink copy engine, no SM)
   into rows [p*Ms, (p+1)*Ms), each followed by writing L into flag p
   (``cuStreamWriteValue64``). Between enqueueing the GEMM and the last copy the host never
   waits for the device (garbage collection is paused: freeing symmetric memory synchronises),
   and a launch's host work is a few driver calls: the GEMM's arguments are packed once per set
   of tensor addresses (:class:`~..gpu.launch.LaunchCache`);
4. the compute stream waits for the copy stream, so launch L+1 starts after both.

Slot reuse is safe: we write slot ``L % 2`` after our copy stream passed barrier L-1, which
every peer reaches only after its copy stream finished launch L-2's reads of that slot.

CUDA graphs (``torch.cuda.graph``; every schedule of this module): ``L`` reaches the device as the
GEMM's and the staging kernel's argument, as the constant of the flag writes and arrival waits, and
as the slot's address — all three baked into a captured graph. So a captured call (and every call
of an op once captured) is launch ``L = 1`` of fresh counters: before step 1 its compute stream runs a
barrier of the group, zeroes every counter of the op (flags, arrivals, the staging kernel's block
count, the GEMM's staged count) and runs a second barrier (:mod:`.fused_op`). Every replay does the
same on the device, so its waits are those of a first launch against counters that say so; the
slot is always slot 1, free because the first barrier waits for every rank's previous launch to
end. While capturing: fresh outputs from the graph's pool (no spares), no ``record_stream`` (the
copy stream is joined before the call returns), no wait for the previous eager call's stream.

With ``staging="gemm"`` (the default where the shard still reaches the peers in time:
:func:`default_staging`) there is no step 1: the GEMM reads this rank's rows from the shard itself and,
as it loads them, stores them into slot ``L % 2`` and into A_gathered; once all are stored it
publishes L into this rank's slot on every peer (step 3's handshake, from the device).

That is the direct pull (``engine=None`` / ``"copy_engine"``, pull). Every other schedule is the
``allgather_gemm`` tile program on the fused-op runtime (:class:`_ProgramAllGather`,
:mod:`.program_engine`): ``engine="sm"`` (the generated all-gather kernel on ``sms`` reserved
SMs, push or pull) and the copy engine driven by the codegen plan (``ce_executor="plan"``, and a
push whose rows are not whole tiles).
"""
from __future__ import annotations

import dataclasses

from ...errors import InputError
from ...ir.schedule import CommSchedule, ComputeSchedule
from ..gpu.launch import LaunchCache
from .call_order import CallOrder
from .spare_outputs import SpareOutputs, keep_spares
from .group import built_alike, dist_context, dtype_name
from .operands import check_open, check_operands, check_output, check_sizes, dense
from .fused_op import FusedOp
from .program_engine import ProgramEngine
from .symmetric import Lease

DEFAULT_COMPUTE = ComputeSchedule(tile=(128, 256, 64), stages=4, order="comm_aligned")


class AllGatherMatmul(FusedOp):
    """``(A_gathered, A_gathered @ B)`` for a fixed (rows per rank, K, N, dtype).

    Building it is collective (symmetric allocation + rendezvous): every rank of ``group``
    must build it, in the same order as any other collective."""

    def __init__(self, rows_per_rank: int, k: int, n: int, dtype="bfloat16", *, group=None,
                 compute: ComputeSchedule | None = None, comm: CommSchedule | None = None, progress=None,
                 engine: str | None = None, sms: int | None = None, ce_executor: str | None = None,
                 handshake: str | None = None, enqueue: str = "gemm_first", staging: str | None = None,
                 stage_waves: int | None = None, spare_outputs: bool | None = None, pusher: str | None = None):
        """``engine``: ``None`` / ``"copy_engine"`` (default: the copy engines push where this
        rank's rows are whole tiles and no pull option is given — :func:`default_push` — and pull
        elsewhere) or ``"sm"`` (the generated all-gather kernel on ``sms`` SMs, default 8, the
        GEMM on the others); ``comm`` gives a full schedule instead. ``ce_executor``: ``"direct"`` (the
        measured copy-engine pull path) or ``"plan"`` (the codegen copy-engine plan through
        :class:`~.plan_exec.PlanExecutor`); default: direct, except copy-engine push where this
        rank's rows are not whole tiles (or with clusters), which only the plan runs — the direct
        push is :class:`~.ag_push.PushAllGather`. ``handshake`` (the
        direct path's one barrier per launch): ``"device"`` (the default with the staging kernel:
        that kernel publishes the launch number into this rank's slot on every peer once the
        shard is staged, and the copy stream waits for each peer's slot with a stream memory
        operation), ``"memops"`` (the default with ``staging="copies"``: stream memory operations
        only — the copy stream writes the launch number into a symmetric slot on every peer and
        waits for theirs; neither uses a kernel of its own or an SM, so the GEMM gets every SM)
        or ``"kernel"`` (torch symmetric memory's barrier kernel, on one SM kept free of the GEMM).
        ``enqueue`` (the direct path's host order): ``"gemm_first"`` (the GEMM, then the
        handshake and copies) or ``"comm_first"`` (the reverse: peers' shards move one GEMM launch
        earlier, the GEMM starts one handshake later). ``staging`` (the direct path): ``"kernel"``
        (one pass of :mod:`.staging`'s kernel writes the shard into its symmetric slot and into
        this rank's rows of A_gathered, and this rank's flag), ``"gemm"`` (no pass before the GEMM:
        the GEMM reads this rank's rows from the shard and stores them, as it loads them, into the
        slot and A_gathered — ``tldsl::sm90::OwnRows``; whole tiles of rows per rank, no clusters)
        or ``"copies"`` (two ``cuMemcpyAsync`` and a stream write); default: :func:`default_staging`.
        ``stage_waves`` (``staging="gemm"``): over how many waves of tiles the GEMM spreads the
        staging (default :data:`STAGE_WAVES`; :func:`stage_columns`). ``spare_outputs`` (the
        direct copy-engine push and pull): each call ends by allocating the next call's A_gathered and C,
        so the next GEMM is handed to the driver without waiting for the allocator
        (:mod:`.spare_outputs`); ``None`` (default): where both together are at most
        :data:`~.spare_outputs.SPARE_LIMIT_BYTES`. ``pusher`` (the direct copy-engine push): who writes
        this rank's shard into the peers — ``"copy_engine"`` (default) or ``"gemm"`` (the GEMM as it
        loads it: :class:`~.ag_push.PushAllGather`; correct on GPUs but slower: ``probe ag_push``).
        The default push moves each shard in column slices (:func:`default_col_tile`; a ``comm``
        with its own ``col_tile`` decides by hand)."""
        import torch
        import tldsl as tl
        from ...codegen import lower
        from ..gpu.gemm import GemmKernel
        from ...ops.allgather_gemm import allgather_gemm

        with built_alike("AllGatherMatmul", group) as build:      # every rank leaves it alike (group.py)
            check_sizes("AllGatherMatmul", rows_per_rank=rows_per_rank, k=k, n=n)
            if k % 8 or n % 8:
                raise InputError(f"AllGatherMatmul: K={k} and N={n} must be multiples of 8 (A's, B's and C's rows "
                                 f"whole 16-byte units for TMA)")
            self._closed = False
            self.ctx = dist_context(group)
            W, r = self.ctx.world_size, self.ctx.rank
            self.Ms, self.K, self.N = int(rows_per_rank), int(k), int(n)
            tdtype = torch.bfloat16 if dtype_name(dtype, "AllGather+GEMM") == "bf16" else torch.float16
            self.dtype = tdtype
            keep_spares(spare_outputs, 0)       # (its type checked before anything is built)
            if comm is None and default_push(self.Ms, compute, engine, sms, ce_executor, staging, handshake,
                                             stage_waves):
                comm = push_comm(self.K, compute, pusher)
            comm = resolve_comm(comm, engine, sms, compute or DEFAULT_COMPUTE)
            self.hooks: dict = {}
            self.timeline = None        # a PhaseTimeline: the next calls mark their phases on it
            self._engine = None
            if ce_executor not in (None, "direct", "plan"):
                raise InputError(f"ce_executor={ce_executor!r}: choose 'direct' or 'plan'")
            c0 = compute or DEFAULT_COMPUTE
            push = comm.engine == "copy_engine" and comm.mode == "push"
            if ce_executor is None:
                ce_executor = "plan" if push and (self.Ms % c0.BM or c0.cluster != (1, 1)) else "direct"
            staging_given = staging
            if staging is None:
                staging, planned_waves = default_staging(self.Ms, self.N, self.K, W, compute, comm, handshake, enqueue,
                                                         ce_executor)
                if staging == "gemm" and stage_waves is None:
                    stage_waves = planned_waves
            if handshake not in (None, "kernel", "memops", "device"):
                raise InputError(f"handshake={handshake!r}: choose 'memops', 'device' or 'kernel'")
            if handshake == "device" and staging == "copies":
                raise InputError(f"handshake='device' is the staging kernel's own handshake; staging={staging!r} "
                                 f"has none")
            if enqueue not in ("gemm_first", "comm_first"):
                raise InputError(f"enqueue={enqueue!r}: choose 'gemm_first' or 'comm_first'")
            if staging not in ("kernel", "copies", "gemm"):
                raise InputError(f"staging={staging!r}: choose 'kernel', 'copies' or 'gemm'")
            if stage_waves is not None and (staging != "gemm" or not isinstance(stage_waves, int) or stage_waves < 1):
                raise InputError(f"stage_waves={stage_waves!r}: a positive int, with staging='gemm' (got {staging!r})")
            if staging == "gemm":
                if handshake not in (None, "device"):
                    raise InputError(f"staging='gemm': the GEMM publishes the launch's arrival itself (handshake "
                                     f"'device'), not {handshake!r}")
                bm = (compute or DEFAULT_COMPUTE).BM
                if self.Ms % bm or (compute is not None and compute.cluster != (1, 1)):
                    raise InputError(f"staging='gemm': this rank's {self.Ms} rows must be whole {bm}-row tiles and the "
                                     f"GEMM must run without clusters; use staging='kernel'")
                if enqueue != "gemm_first":
                    raise InputError("staging='gemm': nothing is staged before the GEMM, so the GEMM goes first")
            self.enqueue, self.staging = enqueue, staging
            build.config = dict(    # as given where the op treats "not given" apart (compute, staging)
                rows_per_rank=self.Ms, K=self.K, N=self.N, dtype=tdtype, compute=compute, comm=comm,
                ce_executor=ce_executor, staging=staging, staging_given=staging_given, handshake=handshake,
                enqueue=enqueue, pusher=pusher, stage_waves=stage_waves, spare_outputs=spare_outputs)
        # every symmetric block of the op, from here on: freed by close() only (symmetric.py)
        self._lease = Lease(self.ctx, f"AllGatherMatmul({self.Ms}, {self.K}, {self.N})", self)
        if push and ce_executor == "direct":
            for what, given in (("staging", staging_given), ("handshake", handshake), ("stage_waves", stage_waves)):
                if given is not None:
                    raise InputError(f"{what}={given!r}: the copy-engine push stages nothing and needs no handshake "
                                     f"(each rank pushes its shard from its own tensor)")
            from .ag_push import PushAllGather
            import math
            import os
            timeout = os.environ.get("TLDSL_WAIT_TIMEOUT_NS")
            if pusher == "gemm" and W == 1:
                raise InputError("pusher='gemm': the GEMM pushes this rank's rows to its peers, and a group of one "
                                 "rank has none (leave pusher unset: the copy engine's push, which has nothing to "
                                 "copy either)")
            if pusher == "gemm" and compute is None:
                # the GEMM publishes its pushes as each CTA leaves this rank's rows: those rows must
                # be whole groups of the order (lower_gemm's push_rows check)
                c0 = dataclasses.replace(c0, group_m=math.gcd(self.Ms // c0.BM, c0.group_m))
            self.comm, self.compute, self.handshake, self.staging = comm, c0, None, None
            self.launches, self.debug = 0, bool(os.environ.get("TLDSL_DEBUG"))
            self._engine = PushAllGather(self, progress, int(timeout) if timeout else None, enqueue, spare_outputs,
                                         pusher or "copy_engine")
            return
        if pusher is not None:
            raise InputError(f"pusher={pusher!r}: only the direct copy-engine push has a pusher to choose (this "
                             f"schedule: {comm}, ce_executor={ce_executor!r})")
        if comm.engine == "sm" or push or ce_executor == "plan":
            # no direct path takes this schedule: the tile program on the fused-op runtime
            if spare_outputs:
                raise InputError("spare_outputs=True: the direct copy-engine push and pull keep spare outputs; "
                                 f"this schedule ({comm}, ce_executor={ce_executor!r}) allocates per call")
            if handshake is not None:
                raise InputError(f"handshake={handshake!r} applies to the direct copy-engine pull path; this "
                                 f"schedule ({comm}, ce_executor={ce_executor!r}) runs on the fused-op runtime, whose "
                                 f"handshakes are stream memory operations")
            self.handshake = None
            self.comm = comm
            self.compute = compute or DEFAULT_COMPUTE
            import os
            self.launches, self.debug = 0, bool(os.environ.get("TLDSL_DEBUG"))
            self._engine = _ProgramAllGather(self, tdtype, progress)
            return
        if comm.engine != "copy_engine" or comm.mode != "pull":
            raise InputError(f"AllGatherMatmul on GPUs runs the copy-engine pull schedule for now; got {comm}")
        if comm.col_tile is not None and comm.col_tile < self.K:
            raise InputError(f"col_tile={comm.col_tile}: the direct copy-engine pull moves whole shards; column "
                             f"slices run on the direct push (mode='push') or ce_executor='plan'")
        # measured (``probe ag_handshake``): "device" equal or faster at every shape, 8% at the
        # smallest; "memops" where the shard is staged by copies (no kernel to publish the arrival)
        handshake = self.handshake = handshake or ("memops" if staging == "copies" else "device")
        self.comm = comm
        # staging="gemm": all of this rank's tile rows in one group of the order, so the first wave
        # of tiles loads (and stages) every one of them (``probe ag_group``: no slower)
        self.compute = compute or (DEFAULT_COMPUTE if staging != "gemm" else
                                   dataclasses.replace(DEFAULT_COMPUTE, group_m=self.Ms // DEFAULT_COMPUTE.BM))
        ir_dtype = tl.bfloat16 if tdtype == torch.bfloat16 else tl.float16
        spec = tl.TensorSpec
        # staging="gemm": the schedule fuses this rank's rows into the GEMM (it stages the shard
        # into the slot and publishes the arrival; codegen/plan/fused_rows.py)
        traced_comm = comm.with_(own_rows="compute") if staging == "gemm" else comm
        self.ir = allgather_gemm.trace(W, spec((self.Ms, self.K), ir_dtype), spec((self.K, self.N), ir_dtype),
                                       spec((W * self.Ms, self.N), ir_dtype), compute=self.compute, comm=traced_comm)
        import os
        timeout = os.environ.get("TLDSL_WAIT_TIMEOUT_NS")   # debug: a wait that spins too long reports and traps
        self.lowered = lower(self.ir, "gemm", **({"wait_timeout_ns": int(timeout)} if timeout else {}))
        self.debug = bool(os.environ.get("TLDSL_DEBUG"))
        # with the barrier kernel, one SM stays free of the persistent GEMM: the kernel runs there
        least = 1 if handshake == "kernel" else 0
        self.gemm = GemmKernel(self.lowered, progress=progress,
                               reserve_sms=max(least, int(os.environ.get("TLDSL_RESERVE_SMS", str(least)))))
        (self.signal,) = self.lowered.signals
        dev = torch.device("cuda", self.ctx.device)
        # collective points: the double-buffered symmetric shard + rendezvous
        self.shards, self.handle = self._lease.empty((2, self.Ms, self.K), tdtype)
        self.peer_ptrs = [int(p) for p in self.handle.buffer_ptrs]
        if handshake in ("memops", "device"):   # slot q: the last launch whose shard rank q has staged
            self.arrive, self._arrive_handle = self._lease.empty((max(W, 1),), torch.int64)
            self.arrive.zero_()
            self.arrive_peers = [int(p) for p in self._arrive_handle.buffer_ptrs]
        # load the barrier kernel now (collective, like the construction): a module CUDA loads
        # lazily while a GEMM spins beside it would wait for that GEMM. It also orders every
        # rank's zeroed arrival slots before any peer's first write into them.
        self.handle.barrier(channel=0)
        self.flags = torch.zeros(max(W, 1), dtype=torch.int64, device=dev)
        self.copy_stream = torch.cuda.Stream(device=dev)
        self._staged, self._copied = torch.cuda.Event(), torch.cuda.Event()   # reused every launch
        self._gemm_launches = LaunchCache(16)      # prepared GEMM launches by tensor addresses (and slot)
        self._order = CallOrder()
        if handshake == "device":   # the stager (the staging kernel or the GEMM) publishes the arrival itself:
            self._start = torch.cuda.Event()        # every rank's arrival array, as mapped here
            self._arrive_table = torch.zeros(W, dtype=torch.int64, device=dev)
            self._arrive_table.copy_(torch.tensor(self.arrive_peers, dtype=torch.int64))
        if staging == "gemm":                       # the GEMM stages the shard and publishes the arrival
            self.stage_cols = stage_columns(self.Ms, self.N, self.compute, self.gemm.grid[0],
                                            stage_waves or STAGE_WAVES)
            staged, arrive, arrive_table = self.lowered.row_signals      # by the IR's names
            self._own_signals = {self.signal: self.flags, staged: torch.zeros(1, dtype=torch.int64, device=dev),
                                 arrive: self.arrive, arrive_table: self._arrive_table}
        if staging == "kernel":
            from ..gpu.device import sm_count
            from .staging import ShardStager
            publish = None
            if handshake == "device":           # the staging kernel publishes this rank's arrival itself
                self._blocks_done = torch.zeros(1, dtype=torch.int64, device=dev)
                publish = (self.arrive.data_ptr(), self._arrive_table.data_ptr(), r, W, self._blocks_done.data_ptr(),
                           int(timeout) if timeout else None)
            self._stager = ShardStager(sm_count(), progress=progress, publish=publish)
        self._spares = SpareOutputs((W * self.Ms, self.K), (W * self.Ms, self.N), tdtype, dev, spare_outputs)
        self._spare: dict = {}
        self.launches = 0
        self.order = [(r + s) % W for s in range(W)] if comm.order == "ring" else \
            [(r + s) % W for s in range(W)]   # full mesh: the copy engine serialises per stream anyway

    def _check(self, a_shard, b):
        """Every problem with the operands, before anything is enqueued (the A shard may be a
        strided or unaligned view: the op copies it first)."""
        check_open("AllGatherMatmul", self._closed)
        check_operands("AllGatherMatmul", (("A shard", a_shard, (self.Ms, self.K)), ("B", b, (self.K, self.N))),
                       self.dtype, self.ctx.device, strided_ok=("A shard",))

    def __call__(self, a_shard, b, *, poison_workspace: bool = False, out=None, return_gathered: bool = True):
        """``(A_gathered, C)``. ``out``: optional C tensor to write ([W*Ms, N], contiguous).
        ``return_gathered=False``: ``(None, C)`` — on the schedules the fused-op runtime runs,
        the gathered rows then stay in the op's buffer, not copied out of it (the hand-built
        paths gather into a tensor of the call's own: nothing to save there)."""
        if isinstance(self._engine, ProgramEngine):         # (the program path: _ProgramAllGather)
            return self._engine(a_shard, b, poison_workspace=poison_workspace, out=out,
                                return_gathered=bool(return_gathered))
        a_full, c = self._gather_and_multiply(a_shard, b, poison_workspace, out)
        return (a_full if return_gathered else None), c

    def _gather_and_multiply(self, a_shard, b, poison_workspace: bool, out):
        """The hand-built paths' call: ``(A_gathered, C)``."""
        if self._engine is not None:        # (first: the push's host path is the op's time)
            return self._engine(a_shard, b, poison_workspace=poison_workspace, out=out)
        import gc
        import torch
        from ..gpu import plan_exec
        cu = plan_exec.load_driver()
        consts = plan_exec.driver_constants(cu)
        write_default = consts.write_default
        self._check(a_shard, b)
        if out is not None:
            self._check_out(out, a_shard, b)
        L = self._next_launch()
        if self.staging == "gemm":
            return self._call_gemm_staged(a_shard, b, out, poison_workspace, L)
        cur, a_full = self._begin(poison_workspace)
        cur_h = cur.cuda_stream
        slot = L % 2
        me = self.ctx.rank
        tl_ = self.timeline
        nbytes = self.Ms * self.K * self.shards.element_size()
        if not a_shard.is_contiguous():
            a_shard = a_shard.contiguous()
        src = a_shard.data_ptr()
        # Our shard into the symmetric slot and into our own rows of A_gathered, and our flag.
        # Same-GPU copies run on SMs, so before the GEMM on the compute stream: they must not
        # queue behind the persistent GEMM, which holds the SMs while it waits. The copy stream
        # (handshake, peers' shards) starts once the slot holds our shard.
        slot_ptr, own_rows, own_flag = self.peer_ptrs[me] + slot * nbytes, a_full.data_ptr() + me * nbytes, \
            self.flags.data_ptr() + 8 * me
        device = self.handshake == "device"
        if device:
            # the copy stream's waits and copies are enqueued before the staging finishes: they
            # follow the compute stream's earlier work (A_gathered's memory may be in use there)
            self._start.record(cur)             # the copy stream waits for it once the staging is enqueued
            if src % 16:                        # the publishing kernel must run: an aligned copy
                a_shard = a_shard.clone()
                src = a_shard.data_ptr()
        one_pass = self.staging == "kernel" and self._stager.usable(src, slot_ptr, own_rows, nbytes)
        if one_pass:
            self._stager.prepare(cu, src, slot_ptr, own_rows, nbytes, own_flag).launch(cur_h, L)
        else:
            plan_exec.checked(cu, cu.cuMemcpyAsync(slot_ptr, src, nbytes, cur_h), "cuMemcpyAsync(stage our shard)")
        if device:
            self.copy_stream.wait_event(self._start)
        else:
            self._staged.record(cur)
            self.copy_stream.wait_event(self._staged)
        if not one_pass:
            plan_exec.checked(cu, cu.cuMemcpyAsync(own_rows, src, nbytes, cur_h), "cuMemcpyAsync(our rows)")
            plan_exec.checked(cu, cu.cuStreamWriteValue64(cur_h, own_flag, L, write_default),
                              "cuStreamWriteValue64(own flag)")
        if tl_ is not None:
            tl_.mark("staged", cur, "compute")
        cs = self.copy_stream.cuda_stream
        c = self._output_c(out)
        gemm = self._gemm_launches.get((a_full.data_ptr(), b.data_ptr(), c.data_ptr()), lambda: self.gemm.prepare(
            {"a_gathered": a_full, "b": b, "c": c}, signals={self.signal: self.flags}, rank=me))
        # enqueue="gemm_first" (the default): the GEMM goes first (one driver call: its arguments
        # are prepared), so the GPU computes our own rows while the host enqueues the handshake
        # and the copies; "comm_first": the handshake and copies first, so peers' shards start
        # moving one GEMM launch earlier. Nothing between enqueueing the GEMM and the last copy
        # may wait for the device: no garbage collection (freeing another op's symmetric memory
        # synchronises) — the GEMM spins until the copies land.

        def launch_gemm():
            if self.hooks:
                self._hook("before_compute", cur)
            gemm.launch(cur_h, L)
            if tl_ is not None:
                tl_.mark("gemm done", cur, "compute")

        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            if self.enqueue == "gemm_first":
                launch_gemm()
            if self.hooks:
                self._hook("before_comm", self.copy_stream)
            # every shard of launch L staged; launch L-1 done everywhere
            if self.handshake == "kernel":
                with torch.cuda.stream(self.copy_stream):
                    self.handle.barrier(channel=0)
            elif not device:
                plan_exec.stream_handshake(cu, cs, self.arrive_peers, me, L)
            if tl_ is not None and not device:
                tl_.mark("barrier", self.copy_stream, "copy")
            self._enqueue_pulls(cu, a_full, slot, L, wait_arrivals=device)
            if self.enqueue == "comm_first":
                launch_gemm()
        finally:
            if gc_was_on:
                gc.enable()
        return self._join(cur, a_full, c, L, fresh_c=out is None)

    def _begin(self, poison_workspace: bool):
        """A launch's start on the host: the compute stream, a fresh A_gathered (NaN-filled with
        ``poison_workspace``) and the timeline's first mark."""
        import torch
        cur = torch.cuda.current_stream(self.ctx.device)
        self._order.follow(cur.cuda_stream)           # a new stream waits for the previous call's (call_order)
        # allocated at the end of the previous call; none while capturing (a graph's outputs come
        # from its own memory pool: a spare allocated outside it could be freed and reused while
        # the graph still writes it)
        self._spare = self._spares.take(cur.cuda_stream) if not self._capture else {}
        a_full = self._spare.get("a_gathered")
        if a_full is None:
            a_full = self._spares.new("a_gathered")
        if poison_workspace:
            a_full.fill_(float("nan"))
        if self.timeline is not None:
            self.timeline.mark("start", cur, "compute")
        return cur, a_full

    def _output_c(self, out):
        """C: the caller's ``out``, else the spare the previous call allocated, else a new one."""
        if out is not None:
            return out
        c = self._spare.get("c")
        return c if c is not None else self._spares.new("c")

    def _join(self, cur, a_full, c, L: int, fresh_c: bool = True):
        """The end of launch ``L``: the compute stream waits for the copy stream (launch ``L+1``
        starts after both), A_gathered, written on the copy stream, is marked in use there, and
        the next call's outputs are allocated (:mod:`.spare_outputs`; ``fresh_c``: this call
        allocated its C, i.e. no ``out=``)."""
        import torch
        self._copied.record(self.copy_stream)
        cur.wait_event(self._copied)
        self._spare = {}
        if not self._capture:           # (captured: the copy stream is joined above; no spares from the graph's pool)
            a_full.record_stream(self.copy_stream)
            self._spares.refill(cur.cuda_stream, with_c=fresh_c)
        if self.debug and not self._capture:
            torch.cuda.synchronize()
            print(f"[rank {self.ctx.rank}] launch {L}: done; counters {self.signal_counters()}", flush=True)
        return a_full, c

    def _enqueue_pulls(self, cu, a_full, slot: int, L: int, *, wait_arrivals: bool) -> None:
        """The copy stream's part of launch ``L``: per peer in ring order, (with a device-side
        handshake) a wait until the peer has published ``L``, the NVLink copy of its shard from its
        slot into its rows of ``a_full``, and ``L`` into its flag (the GEMM's tiles wait on it)."""
        from ..gpu import plan_exec
        consts = plan_exec.driver_constants(cu)
        cs, me, tl_ = self.copy_stream.cuda_stream, self.ctx.rank, self.timeline
        nbytes = self.Ms * self.K * a_full.element_size()
        for p in self.order:
            if p == me:
                continue
            if wait_arrivals:
                plan_exec.checked(cu, cu.cuStreamWaitValue64(cs, self.arrive.data_ptr() + 8 * p, L, consts.wait_geq),
                                  f"cuStreamWaitValue64(arrival of rank {p})")
            plan_exec.checked(cu, cu.cuMemcpyAsync(a_full.data_ptr() + p * nbytes, self.peer_ptrs[p] + slot * nbytes,
                                                   nbytes, cs), f"cuMemcpyAsync(shard of rank {p})")
            plan_exec.checked(cu, cu.cuStreamWriteValue64(cs, self.flags.data_ptr() + 8 * p, L, consts.write_default),
                              f"cuStreamWriteValue64(flag of rank {p})")
            if tl_ is not None:
                tl_.mark(f"shard {p} copied", self.copy_stream, "copy")

    def _call_gemm_staged(self, a_shard, b, out, poison_workspace: bool, L: int):
        """``staging="gemm"``: no staging pass. The GEMM reads this rank's rows from the shard,
        stores them (as it loads them) into the symmetric slot ``L % 2`` and into A_gathered, and
        publishes the launch into this rank's slot of every peer's arrival array once all are
        stored (``tldsl::sm90::OwnRows``); the copy stream, ordered after the call's start, waits
        for each peer's arrival and copies its shard, then writes its flag."""
        import gc
        from ..gpu import plan_exec
        cu = plan_exec.load_driver()
        me = self.ctx.rank
        cur, a_full = self._begin(poison_workspace)
        cur_h = cur.cuda_stream
        tl_ = self.timeline
        a_shard = dense(a_shard)            # TMA reads it
        slot = L % 2
        c = self._output_c(out)
        self._start.record(cur)
        gemm = self._gemm_launches.get((a_full.data_ptr(), b.data_ptr(), c.data_ptr(), a_shard.data_ptr(), slot),
                                       lambda: self.gemm.prepare({"a_gathered": a_full, "b": b, "c": c,
                                                                  "a": a_shard, "a_slot": self.shards[slot],
                                                                  "own_cols": self.stage_cols},
                                                                 signals=self._own_signals, rank=me))
        gc_was_on = gc.isenabled()
        gc.disable()                # the GEMM spins on the copies' flags: no host stall until they are enqueued
        try:
            if self.hooks:
                self._hook("before_compute", cur)
            gemm.launch(cur_h, L)
            if tl_ is not None:
                tl_.mark("gemm done", cur, "compute")
            if self.hooks:
                self._hook("before_comm", self.copy_stream)
            self.copy_stream.wait_event(self._start)
            self._enqueue_pulls(cu, a_full, slot, L, wait_arrivals=True)
        finally:
            if gc_was_on:
                gc.enable()
        return self._join(cur, a_full, c, L, fresh_c=out is None)

    def _release(self) -> None:
        if self._engine is not None:
            self._engine.close()
        else:
            self._spares.clear()

    def _check_out(self, out, a_shard, b):
        check_output("AllGatherMatmul", out, (self.ctx.world_size * self.Ms, self.N), self.dtype, self.ctx.device,
                     (("the A shard", a_shard), ("B", b)))

    def compute_only(self, a_gathered, b, *, out=None):
        """Only this op's GEMM (same kernel, schedule and SM count) on an already gathered A,
        its waits satisfied by scratch counters: what the fused op would cost if communication
        were free. For benchmarks and diagnosis; the op's own counters are not touched. Its host
        path is as lean as the op's (checks, one allocation, one driver call), so that timing it
        beside the op compares the GPUs' work."""
        import torch
        check_open("AllGatherMatmul", self._closed)
        W = self.ctx.world_size
        want = (W * self.Ms, self.K)
        if not isinstance(a_gathered, torch.Tensor) or a_gathered.shape != want or \
                a_gathered.dtype != self.dtype or not a_gathered.is_contiguous():
            raise InputError(f"A_gathered must be a contiguous {want} tensor of {self.dtype}")
        if not isinstance(b, torch.Tensor) or b.shape != (self.K, self.N) or b.dtype != self.dtype or \
                b.get_device() != self.ctx.device or \
                a_gathered.get_device() != self.ctx.device or not b.is_contiguous():
            self._check(a_gathered[:self.Ms], b)
        c = torch.empty((W * self.Ms, self.N), dtype=self.dtype, device=a_gathered.device) if out is None else out
        if getattr(self, "_compute_only", None) is None:
            self._compute_only = LaunchCache()
        self._compute_only.get((a_gathered.data_ptr(), b.data_ptr(), c.data_ptr()),
                               lambda: self._prepare_compute_only(a_gathered, b, c)).launch(
            torch.cuda.current_stream(self.ctx.device).cuda_stream, 1)      # launched like the fused op's GEMM
        return c

    def _prepare_compute_only(self, a_gathered, b, c):
        """The GEMM alone's prepared launch: scratch counters that satisfy every wait (and, for
        the GEMMs that load this rank's rows from the shard, scratch for what they store)."""
        import torch
        W = self.ctx.world_size
        gemm, sig = ((getattr(self._engine, "compute_gemm", None) or self._engine.gemm, self._engine.signal)
                     if self._engine is not None else (self.gemm, self.signal))
        slots = self.signal_tensors()[sig].numel()
        if getattr(self, "_scratch", None) is None or self._scratch.numel() != slots:
            self._scratch = torch.full((slots,), 1 << 40, dtype=torch.int64, device=a_gathered.device)
        buffers, signals = {"a_gathered": a_gathered, "b": b, "c": c}, {sig: self._scratch}
        if hasattr(self._engine, "compute_only_buffers"):       # the push path's GEMM: its extra tensors
            buffers.update(self._engine.compute_only_buffers(a_gathered))
        if self.staging == "gemm" and self._engine is None:
            # the GEMM staging this rank's rows, into scratch: it reads them from A_gathered's own
            # rows and stores the same bytes back there, the slot and the arrival are scratch
            me, dev = self.ctx.rank, a_gathered.device
            if getattr(self, "_scratch_own", None) is None:
                publish = torch.zeros(W, dtype=torch.int64, device=dev)
                table = torch.full((W,), publish.data_ptr(), dtype=torch.int64, device=dev)
                staged, arrive, arrive_table = self.lowered.row_signals
                self._scratch_own = (torch.empty(self.Ms, self.K, dtype=self.dtype, device=dev), {
                    staged: torch.zeros(1, dtype=torch.int64, device=dev),
                    arrive: torch.full((W,), 1 << 40, dtype=torch.int64, device=dev),
                    arrive_table: table}, publish)
            buffers.update(a=a_gathered[me * self.Ms:(me + 1) * self.Ms], a_slot=self._scratch_own[0],
                           own_cols=self.stage_cols)
            signals.update(self._scratch_own[1])
        return gemm.prepare(buffers, signals=signals, rank=self.ctx.rank)

    # -- hooks and introspection (every engine) ---------------------------------------------------
    def _hook(self, name, stream):
        h = self.hooks.get(name)
        if h is not None:
            h(self, self.launches, stream)

    @property
    def engine(self) -> str:
        """``copy_engine`` (the direct pull path), ``copy_engine-push`` (the direct push path),
        ``gemm-push`` (the direct push, the GEMM pushing), ``copy_engine-plan`` or ``sm``."""
        return self._engine.name if self._engine is not None else "copy_engine"

    def workspace_tensors(self) -> dict:
        """The data workspaces a launch overwrites (the distributed checks fill them with noise)."""
        self._check_open()                              # (its views went with close())
        if self._engine is not None:
            return self._engine.workspace_tensors()
        return {"a": self.shards}

    def signal_map(self) -> list[tuple[str, int, int, str]]:
        """``(signal, address, slots, note)`` of this rank's counters (decodes a device
        ``wait timed out: slot 0x...`` line, see :func:`~.comm_kernel.explain_address`)."""
        self._check_open()                              # (its views went with close())
        if self._engine is not None:
            return self._engine.signal_map()
        out = [(self.signal, self.flags.data_ptr(), self.flags.numel(),
                f"rank {self.ctx.rank}, local: the copy stream writes one flag per shard, the GEMM waits; "
                f"slot s = A_gathered rows [s * {self.Ms}, (s + 1) * {self.Ms})")]
        if self.handshake in ("memops", "device"):
            out.append(("handshake_arrive", self.arrive.data_ptr(), self.arrive.numel(),
                        f"rank {self.ctx.rank}, symmetric: slot q = the last launch rank q staged its shard for; "
                        "this rank's copy stream waits on it"))
        return out

    def _graph_counters(self) -> list:
        if self._engine is not None:
            return self._engine.graph_counters()
        out = list(self.signal_tensors().values())
        if getattr(self, "_blocks_done", None) is not None:     # the staging kernel's count of finished blocks
            out.append(self._blocks_done)
        return out

    def signal_tensors(self) -> dict:
        """This rank's counter tensors (int64 CUDA), by signal name."""
        self._check_open()                              # (its views went with close())
        if self._engine is not None:
            return dict(self._engine.signals)
        out = {self.signal: self.flags}
        if self.handshake in ("memops", "device"):
            out["handshake_arrive"] = self.arrive
        if self.staging == "gemm":
            staged = self.lowered.row_signals[0]
            out[staged] = self._own_signals[staged]
        return out

    # -- what FusedOp's repr, card and describe() say of it ----------------------------------------
    def _problem(self) -> str:
        return f"A shard [{self.Ms}, {self.K}] @ B [{self.K}, {self.N}] {self.dtype}"

    def _facts(self) -> list:
        return [("A shard", [self.Ms, self.K]), ("B", [self.K, self.N]), ("dtype", self.dtype),
                ("engine", self.engine)]

    def _describe_head(self) -> str:
        return f"; engine {self.engine}"

    def _describe_body(self) -> list[str]:
        return [self._engine.describe() if self._engine is not None else self.lowered.describe()]


DEFAULT_SM_LANES = 8

#: staging="gemm": the staging is spread over the tile columns of this many waves of the GEMM
#: (``probe ag_staging``: one wave as fast as two or faster, and the shard reaches the peers earlier)
STAGE_WAVES = 1
#: the machine figures the default staging is planned with (2x H200): NVLink copy-engine
#: bandwidth one way (BENCHMARKS.md, 366 GB/s) and dense bf16 FLOP/s per SM (cuBLAS ~764 TFLOP/s
#: over 132 SMs)
NVLINK_BYTES_PER_S = 366e9
SM_FLOPS = 5.8e12


#: the copy-engine push schedule (the direct path, :mod:`.ag_push`)
PUSH = CommSchedule(engine="copy_engine", mode="push", order="ring")


#: columns per slice of the default push (``CommSchedule.col_tile``): measured (BENCHMARKS.md) as
#: fast as whole shards or faster (``probe ag_slices``; 2048 columns within noise of it) and less
#: slowed where a peer starts late (``probe ag_skew`` at 2048x8192x8192, a peer 30-40 us late:
#: +23 us, whole shards +40 us); every benchmark row <= 1.05x ideal in five full runs with it
DEFAULT_COL_TILE = 1024


def default_col_tile(k: int, compute: ComputeSchedule) -> int | None:
    """The default push's column slices: :data:`DEFAULT_COL_TILE` columns where the shard is wider
    and the compute tile's K step divides it; whole shards (None) otherwise."""
    if k <= DEFAULT_COL_TILE or DEFAULT_COL_TILE % compute.BK:
        return None
    return DEFAULT_COL_TILE


def push_comm(k: int, compute: ComputeSchedule | None, pusher: str | None = None) -> CommSchedule:
    """The default push's communication schedule: whole shards where the GEMM pushes them
    (``pusher="gemm"``), else the copy engines' column slices (:func:`default_col_tile`)."""
    return PUSH if pusher == "gemm" else PUSH.with_(col_tile=default_col_tile(k, compute or DEFAULT_COMPUTE))


def default_comm(rows_per_rank: int, k: int, compute: ComputeSchedule | None = None, *,
                 pusher: str | None = None, handshake: str | None = None) -> CommSchedule:
    """The communication schedule of an op built with no ``comm`` (and these options): the push
    where :func:`default_push` allows it, else the copy-engine pull."""
    if default_push(rows_per_rank, compute, None, None, None, None, handshake, None):
        return push_comm(k, compute, pusher)
    return resolve_comm(None, None, None, compute or DEFAULT_COMPUTE)


def default_push(rows_per_rank: int, compute: ComputeSchedule | None, engine, sms, ce_executor, staging, handshake,
                 stage_waves) -> bool:
    """Whether an op built without a communication schedule pushes: the direct copy-engine push
    runs where this rank's rows are whole tiles and the GEMM has no clusters, and nothing asks
    for the pull path's own options (staging, handshake, the plan executor, SMs). Measured
    (``probe ag_push``, BENCHMARKS.md): faster than or equal to the pull at every benchmark shape,
    up to 10% at the smallest."""
    c = compute or DEFAULT_COMPUTE
    pull_options = (staging, handshake, stage_waves, sms)
    return (engine in (None, "copy_engine") and ce_executor != "plan" and all(o is None for o in pull_options)
            and rows_per_rank % c.BM == 0 and c.cluster == (1, 1))


def default_staging(rows_per_rank: int, n: int, k: int, world_size: int, compute: ComputeSchedule | None,
                    comm: CommSchedule, handshake, enqueue: str, ce_executor: str) -> tuple[str, int | None]:
    """``("gemm", waves)`` where the GEMM can stage this rank's rows (the direct copy-engine pull
    path, whole tiles of rows per rank, no clusters, the GEMM enqueued first, the ``comm_aligned``
    order that computes this rank's rows first, in one group — the default schedule for this
    staging) and the shard, staged over the GEMM's first :data:`STAGE_WAVES` waves of tiles and
    then copied, still reaches the peers before they have computed their own rows (half of the
    GEMM's waves; times in tile times, with a tenth of one to spare); ``("kernel", None)``
    otherwise. Measured (``probe ag_staging``): the GEMM staging is faster exactly where this
    holds."""
    from ..gpu.device import sm_count
    c = compute or DEFAULT_COMPUTE
    direct = comm.engine == "copy_engine" and comm.mode == "pull" and ce_executor == "direct"
    if not direct or handshake not in (None, "device") or enqueue != "gemm_first" or rows_per_rank % c.BM \
            or c.cluster != (1, 1) or c.order != "comm_aligned":    # (this rank's rows first: the plan's premise)
        return "kernel", None
    if compute is not None and compute.group_m * c.BM < rows_per_rank:
        return "kernel", None       # a given schedule whose first wave does not reach all of this rank's rows
    tiles = -(-world_size * rows_per_rank // c.BM) * -(-n // c.BN)
    half = tiles / sm_count() / 2                                   # waves before the peers need the shard
    tile_s = 2 * c.BM * c.BN * k / SM_FLOPS
    copy = rows_per_rank * k * 2 / NVLINK_BYTES_PER_S / tile_s      # the copy, in tile times
    if half >= STAGE_WAVES + copy + 0.1:
        return "gemm", STAGE_WAVES
    return "kernel", None


def stage_columns(rows_per_rank: int, n: int, compute: ComputeSchedule, ctas: int, waves: int = STAGE_WAVES) -> int:
    """staging="gemm": how many tile columns of each of this rank's tile rows share its staging
    (column j stores the A stages k with k % cols == j). With all of this rank's tile rows in one
    group of the order, the first ``ctas`` tiles cover ``ctas // rows`` columns of every row: the
    staging is spread over the first ``waves`` waves of tiles — few enough that the shard is
    published early in the GEMM, enough that no tile adds much store traffic to its own."""
    tile_rows = -(-rows_per_rank // compute.BM)
    tile_cols = -(-n // compute.BN)
    return max(1, min(tile_cols, waves * ctas // tile_rows))


def resolve_comm(comm: CommSchedule | None, engine: str | None, sms: int | None,
                 compute: ComputeSchedule) -> CommSchedule:
    """The communication schedule from ``comm`` and / or the ``engine`` / ``sms`` shortcuts."""
    if engine not in (None, "copy_engine", "sm"):
        raise InputError(f"engine={engine!r}: choose 'copy_engine' or 'sm'")
    if comm is not None:
        if engine is not None and comm.engine != engine:
            raise InputError(f"engine={engine!r} contradicts the communication schedule {comm}")
        if sms is not None and comm.sms != sms:
            raise InputError(f"sms={sms} contradicts the communication schedule {comm}")
        return comm
    if engine == "sm":
        return CommSchedule(engine="sm", mode="pull", order="ring", tile_m=compute.BM, sms=sms or DEFAULT_SM_LANES)
    if sms is not None:
        raise InputError(f"sms={sms}: the copy engine uses no SMs (pass engine='sm')")
    return CommSchedule(engine="copy_engine", mode="pull", order="ring")


class _ProgramAllGather(ProgramEngine):
    """AG+GEMM's schedules without a direct path — the generated all-gather kernel on ``sms``
    reserved SMs (``engine='sm'``, push or pull) and the codegen copy-engine plan (``ce_executor=
    'plan'``, and a push whose rows are not whole tiles) — as the ``allgather_gemm`` tile program
    on the fused-op runtime (:mod:`.program_engine`): its protocol (entry handshake, every part
    with the launch's epoch, exit handshake) is :class:`~.program_op.FusedProgram` 's. The
    gathered rows land in the program's symmetric ``a_gathered``; each call returns a copy of
    them (the next launch overwrites the buffer), or nothing where the caller does not want them."""

    def __init__(self, op, tdtype, progress):
        import weakref
        import torch
        import tldsl as tl
        from ...ops.allgather_gemm import allgather_gemm
        self.op = weakref.proxy(op)         # no cycle: a dropped op goes at once (its lease warns)
        self.mode = op.comm.mode
        W = op.ctx.world_size
        dt = tl.bfloat16 if tdtype == torch.bfloat16 else tl.float16
        spec = tl.TensorSpec
        super().__init__(op, allgather_gemm, {"a": spec((op.Ms, op.K), dt), "b": spec((op.K, op.N), dt),
                                              "c": spec((W * op.Ms, op.N), dt)},
                         name="sm" if op.comm.engine == "sm" else "copy_engine-plan", progress=progress,
                         compute=op.compute, comm=op.comm)
        op.ir, op.lowered = self.ir, self.lowered("gemm")
        (self.signal,) = op.lowered.signals
        self._gemm = None
        self._order = CallOrder()

    @property
    def compute_gemm(self):
        """The program's GEMM as a stand-alone kernel on the SMs it gets in the fused launch
        (``AllGatherMatmul.compute_only``)."""
        if self._gemm is None:
            from ..gpu.gemm import GemmKernel
            self._gemm = GemmKernel(self.lowered("gemm"), reserve_sms=self.reserved_sms("gemm"))
        return self._gemm

    def __call__(self, a_shard, b, *, poison_workspace: bool = False, return_gathered: bool = True, out=None):
        import torch
        op = self.op
        op._check(a_shard, b)
        if out is not None:
            op._check_out(out, a_shard, b)
        gathered = self.workspace_tensors()["a_gathered"]
        # after the previous call, whatever its stream: the program orders its launches, but this
        # call's poisoning and the previous call's copy of the gathered rows are the op's own
        self._order.follow(self.program.device.origin())
        if poison_workspace:
            gathered.fill_(float("nan"))
        c = out if out is not None else torch.empty((op.ctx.world_size * op.Ms, op.N), dtype=op.dtype,
                                                    device=gathered.device)
        super().__call__(op, a=dense(a_shard), b=b, c=c)
        if op.debug and not op._capture:
            torch.cuda.synchronize()
            print(f"[rank {op.ctx.rank}] ag_gemm {self.name}-{self.mode} launch {op.launches}: done; counters "
                  f"{self.program.signal_counters()}", flush=True)
        return (gathered.clone() if return_gathered else None), c
