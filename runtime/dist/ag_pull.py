"""AllGather+GEMM's direct copy-engine **pull** (a recipe of :mod:`.recipes`): the copy engine
gathers A shard by shard (stream-ordered peer copies, each followed by a stream write of its
flag), while the generated GEMM — the AllGather+GEMM tile program's compute part — waits per tile
for exactly the flags its rows need. The GEMM starts on the local shard at once.

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

CUDA graphs (``torch.cuda.graph``; every staging and handshake of the pull): ``L`` reaches the device as the
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
:func:`~.ag_gemm.default_staging`) there is no step 1: the GEMM reads this rank's rows from the shard itself and,
as it loads them, stores them into slot ``L % 2`` and into A_gathered; once all are stored it
publishes L into this rank's slot on every peer (step 3's handshake, from the device).
"""
from __future__ import annotations

import gc

from ... import env
from ..gpu.launch import LaunchCache
from .call_order import CallOrder
from .engine import Engine
from .operands import dense
from .spare_outputs import SpareOutputs


class PullAllGather(Engine):
    """The direct copy-engine pull of :class:`~.ag_gemm.AllGatherMatmul`, built by the op from
    its :class:`~.ag_gemm.BuildOptions`. It refuses the push's ``pusher`` and column slices,
    settles the pull's defaults on the op — ``op.handshake`` (``"device"``, or ``"memops"`` with
    ``staging="copies"``) and, with ``staging="gemm"`` and no compute schedule given, ``op.compute``
    with this rank's tile rows in one group — and traces and lowers the op's program (``op.ir``,
    ``op.lowered``). Building it is collective (the symmetric slots and arrival array)."""

    name = "copy_engine"

    def __init__(self, op, progress, options):
        import dataclasses
        import weakref
        import torch
        import tldsl as tl
        from ...codegen import lower
        from ...errors import InputError
        from ...ops.allgather_gemm import allgather_gemm
        from ..gpu.gemm import GemmKernel
        from .ag_gemm import DEFAULT_COMPUTE, STAGE_WAVES, stage_columns

        options.refuse_pusher(op.comm)
        if op.comm.col_tile is not None and op.comm.col_tile < op.K:
            raise InputError(f"col_tile={op.comm.col_tile}: the direct copy-engine pull moves whole shards; column "
                             f"slices run on the direct push (mode='push') or ce_executor='plan'")
        staging, stage_waves, enqueue = options.staging, options.stage_waves, options.enqueue
        wait_timeout_ns = options.wait_timeout_ns
        # measured (``probe ag_handshake``): "device" equal or faster at every shape, 8% at the
        # smallest; "memops" where the shard is staged by copies (no kernel to publish the arrival)
        handshake = op.handshake = options.handshake or ("memops" if staging == "copies" else "device")
        if staging == "gemm" and not options.compute_given:
            # all of this rank's tile rows in one group of the order, so the first wave of tiles
            # loads (and stages) every one of them (``probe ag_group``: no slower)
            op.compute = dataclasses.replace(DEFAULT_COMPUTE, group_m=op.Ms // DEFAULT_COMPUTE.BM)
        self.op = weakref.proxy(op)         # no cycle: a dropped op goes at once (its lease warns)
        ctx = op.ctx
        W, r, Ms, K, N = ctx.world_size, ctx.rank, op.Ms, op.K, op.N
        self.handshake, self.staging, self.enqueue = handshake, staging, enqueue
        ir_dtype = tl.bfloat16 if op.dtype == torch.bfloat16 else tl.float16
        spec = tl.TensorSpec
        # staging="gemm": the schedule fuses this rank's rows into the GEMM (it stages the shard
        # into the slot and publishes the arrival; codegen/plan/fused_rows.py)
        traced_comm = op.comm.with_(own_rows="compute") if staging == "gemm" else op.comm
        self.ir = op.ir = allgather_gemm.trace(W, spec((Ms, K), ir_dtype), spec((K, N), ir_dtype),
                                               spec((W * Ms, N), ir_dtype), compute=op.compute, comm=traced_comm)
        opts = {"wait_timeout_ns": wait_timeout_ns} if wait_timeout_ns is not None else {}
        self.lowered = op.lowered = lower(self.ir, "gemm", **opts)
        # with the barrier kernel, one SM stays free of the persistent GEMM: the kernel runs there
        least = 1 if handshake == "kernel" else 0
        self.gemm = GemmKernel(self.lowered, progress=progress,
                               reserve_sms=max(least, int(env.get("TLDSL_RESERVE_SMS", str(least)))))
        (self.signal,) = self.lowered.signals
        dev = torch.device("cuda", ctx.device)
        # collective points: the double-buffered symmetric shard + rendezvous
        self.shards, self.handle = op._lease.empty((2, Ms, K), op.dtype)
        self.peer_ptrs = [int(p) for p in self.handle.buffer_ptrs]
        if handshake in ("memops", "device"):   # slot q: the last launch whose shard rank q has staged
            self.arrive, self._arrive_handle = op._lease.empty((max(W, 1),), torch.int64)
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
        self._blocks_done = None
        if handshake == "device":   # the stager (the staging kernel or the GEMM) publishes the arrival itself:
            self._start = torch.cuda.Event()        # every rank's arrival array, as mapped here
            self._arrive_table = torch.zeros(W, dtype=torch.int64, device=dev)
            self._arrive_table.copy_(torch.tensor(self.arrive_peers, dtype=torch.int64))
        if staging == "gemm":                       # the GEMM stages the shard and publishes the arrival
            self.stage_cols = stage_columns(Ms, N, op.compute, self.gemm.grid[0], stage_waves or STAGE_WAVES)
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
                           wait_timeout_ns)
            self._stager = ShardStager(sm_count(), progress=progress, publish=publish)
        self._spares = SpareOutputs((W * Ms, K), (W * Ms, N), op.dtype, dev, options.spare_outputs)
        self._spare: dict = {}
        self.order = [(r + s) % W for s in range(W)]     # ring (full mesh: the copy engine serialises per stream anyway)

    # -- a launch -----------------------------------------------------------------------------------
    def __call__(self, a_shard, b, *, poison_workspace: bool = False, out=None, return_gathered: bool = True):
        """One launch: ``(A_gathered, C)`` (A_gathered is the call's own tensor either way)."""
        import torch
        from ..gpu import plan_exec
        op = self.op
        cu = plan_exec.load_driver()
        consts = plan_exec.driver_constants(cu)
        write_default = consts.write_default
        op._check(a_shard, b)
        if out is not None:
            op._check_out(out, a_shard, b)
        L = op._next_launch()
        if self.staging == "gemm":
            return self._call_gemm_staged(a_shard, b, out, poison_workspace, L)
        cur, a_full = self._begin(poison_workspace)
        cur_h = cur.cuda_stream
        slot = L % 2
        me = op.ctx.rank
        tl_ = op.timeline
        nbytes = op.Ms * op.K * self.shards.element_size()
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
            {"a_gathered": a_full, "b": b, "c": c}, signals={self.signal: self.flags}, rank=me, hold=False))
        # enqueue="gemm_first" (the default): the GEMM goes first (one driver call: its arguments
        # are prepared), so the GPU computes our own rows while the host enqueues the handshake
        # and the copies; "comm_first": the handshake and copies first, so peers' shards start
        # moving one GEMM launch earlier. Nothing between enqueueing the GEMM and the last copy
        # may wait for the device: no garbage collection (freeing another op's symmetric memory
        # synchronises) — the GEMM spins until the copies land.

        def launch_gemm():
            if op.hooks:
                op._hook("before_compute", cur)
            gemm.launch(cur_h, L)
            if tl_ is not None:
                tl_.mark("gemm done", cur, "compute")

        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            if self.enqueue == "gemm_first":
                launch_gemm()
            if op.hooks:
                op._hook("before_comm", self.copy_stream)
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
        op = self.op
        cur = torch.cuda.current_stream(op.ctx.device)
        self._order.follow(cur.cuda_stream)           # a new stream waits for the previous call's (call_order)
        # allocated at the end of the previous call; none while capturing (a graph's outputs come
        # from its own memory pool: a spare allocated outside it could be freed and reused while
        # the graph still writes it)
        self._spare = self._spares.take(cur.cuda_stream) if not op._capture else {}
        a_full = self._spare.get("a_gathered")
        if a_full is None:
            a_full = self._spares.new("a_gathered")
        if poison_workspace:
            a_full.fill_(float("nan"))
        if op.timeline is not None:
            op.timeline.mark("start", cur, "compute")
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
        op = self.op
        self._copied.record(self.copy_stream)
        cur.wait_event(self._copied)
        self._spare = {}
        if not op._capture:           # (captured: the copy stream is joined above; no spares from the graph's pool)
            a_full.record_stream(self.copy_stream)
            self._spares.refill(cur.cuda_stream, with_c=fresh_c)
        if op.debug and not op._capture:
            torch.cuda.synchronize()
            print(f"[rank {op.ctx.rank}] launch {L}: done; counters {op.signal_counters()}", flush=True)
        return a_full, c

    def _enqueue_pulls(self, cu, a_full, slot: int, L: int, *, wait_arrivals: bool) -> None:
        """The copy stream's part of launch ``L``: per peer in ring order, (with a device-side
        handshake) a wait until the peer has published ``L``, the NVLink copy of its shard from its
        slot into its rows of ``a_full``, and ``L`` into its flag (the GEMM's tiles wait on it)."""
        from ..gpu import plan_exec
        op = self.op
        consts = plan_exec.driver_constants(cu)
        cs, me, tl_ = self.copy_stream.cuda_stream, op.ctx.rank, op.timeline
        nbytes = op.Ms * op.K * a_full.element_size()
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
        from ..gpu import plan_exec
        op = self.op
        cu = plan_exec.load_driver()
        me = op.ctx.rank
        cur, a_full = self._begin(poison_workspace)
        cur_h = cur.cuda_stream
        tl_ = op.timeline
        a_shard = dense(a_shard)            # TMA reads it
        slot = L % 2
        c = self._output_c(out)
        self._start.record(cur)
        gemm = self._gemm_launches.get((a_full.data_ptr(), b.data_ptr(), c.data_ptr(), a_shard.data_ptr(), slot),
                                       lambda: self.gemm.prepare({"a_gathered": a_full, "b": b, "c": c,
                                                                  "a": a_shard, "a_slot": self.shards[slot],
                                                                  "own_cols": self.stage_cols},
                                                                 signals=self._own_signals, rank=me, hold=False))
        gc_was_on = gc.isenabled()
        gc.disable()                # the GEMM spins on the copies' flags: no host stall until they are enqueued
        try:
            if op.hooks:
                op._hook("before_compute", cur)
            gemm.launch(cur_h, L)
            if tl_ is not None:
                tl_.mark("gemm done", cur, "compute")
            if op.hooks:
                op._hook("before_comm", self.copy_stream)
            self.copy_stream.wait_event(self._start)
            self._enqueue_pulls(cu, a_full, slot, L, wait_arrivals=True)
        finally:
            if gc_was_on:
                gc.enable()
        return self._join(cur, a_full, c, L, fresh_c=out is None)

    # -- compute_only -------------------------------------------------------------------------------
    def compute_only_inputs(self, a_gathered) -> tuple[dict, dict]:
        """The GEMM alone: with ``staging="gemm"`` it stages this rank's rows, into scratch — it reads
        them from A_gathered's own rows and stores the same bytes back there, the slot and the
        arrival are scratch. Returns (extra buffers, extra signals)."""
        if self.staging != "gemm":
            return {}, {}
        import torch
        op = self.op
        W, me, dev = op.ctx.world_size, op.ctx.rank, a_gathered.device
        if getattr(self, "_scratch_own", None) is None:
            publish = torch.zeros(W, dtype=torch.int64, device=dev)
            table = torch.full((W,), publish.data_ptr(), dtype=torch.int64, device=dev)
            staged, arrive, arrive_table = self.lowered.row_signals
            self._scratch_own = (torch.empty(op.Ms, op.K, dtype=op.dtype, device=dev), {
                staged: torch.zeros(1, dtype=torch.int64, device=dev),
                arrive: torch.full((W,), 1 << 40, dtype=torch.int64, device=dev),
                arrive_table: table}, publish)
        return (dict(a=a_gathered[me * op.Ms:(me + 1) * op.Ms], a_slot=self._scratch_own[0], own_cols=self.stage_cols),
                self._scratch_own[1])

    # -- introspection ------------------------------------------------------------------------------
    @property
    def signals(self) -> dict:
        out = {self.signal: self.flags}
        if self.handshake in ("memops", "device"):
            out["handshake_arrive"] = self.arrive
        if self.staging == "gemm":
            staged = self.lowered.row_signals[0]
            out[staged] = self._own_signals[staged]
        return out

    def graph_counters(self) -> list:
        out = list(self.signals.values())
        if self._blocks_done is not None:       # the staging kernel's count of finished blocks
            out.append(self._blocks_done)
        return out

    def workspace_tensors(self) -> dict:
        return {"a": self.shards}

    def signal_map(self) -> list[tuple[str, int, int, str]]:
        op = self.op
        out = [(self.signal, self.flags.data_ptr(), self.flags.numel(),
                f"rank {op.ctx.rank}, local: the copy stream writes one flag per shard, the GEMM waits; "
                f"slot s = A_gathered rows [s * {op.Ms}, (s + 1) * {op.Ms})")]
        if self.handshake in ("memops", "device"):
            out.append(("handshake_arrive", self.arrive.data_ptr(), self.arrive.numel(),
                        f"rank {op.ctx.rank}, symmetric: slot q = the last launch rank q staged its shard for; "
                        "this rank's copy stream waits on it"))
        return out

    def describe(self) -> str:
        return (f"  {self.name} (direct pull): handshake {self.handshake}, staging {self.staging}, enqueue "
                f"{self.enqueue}\n" + self.lowered.describe())

    def close(self) -> None:
        """The spare outputs go (the op's close then frees its symmetric memory)."""
        self._spares.clear()
