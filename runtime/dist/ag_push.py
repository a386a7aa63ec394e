"""AllGather+GEMM with the copy engines **pushing** the shards (``CommSchedule(engine="copy_engine",
mode="push")``, the direct executor): nothing is staged before the GEMM, and no host call
stands between a launch's start and its shard moving.

Every rank's copy stream writes its shard, straight from the caller's tensor, into its rows of
every peer's **landing buffer** (symmetric, double-buffered: slot ``L % 2``), and then ``L`` into
its flag there (``cuStreamWriteValue64`` on the peer's symmetric flag array). The generated GEMM
(``gather_rows``, ``tldsl::sm90::GatherRows``: the program is traced with ``own_rows='compute'``,
which fuses this rank's rows into the GEMM — codegen/plan/fused_rows.py) reads this rank's rows from the shard
itself (no waits), every peer's rows from the landing slot once its flag holds ``L`` (system-scope
acquire), and stores every A stage it loads into the A_gathered the op returns — spread over the
tile columns, by the producer as it is about to refill that stage (no extra thread; a stager
thread storing each stage as it lands, ``GatherRows<W, false>``, is kept for ``probe ag_gather``).

Launch ``L`` (counted from 1; counters hold the last launch that wrote them and only grow):

1. compute stream: the GEMM (every SM);
2. copy stream, after the call's start: per peer ``p`` in ring order, wait until ``p``'s GEMM of
   launch ``L-2`` is done (``consumed[p] >= L-2``: it read landing slot ``L % 2``), push the shard
   into ``p``'s slot ``L % 2``, write ``L`` into ``p``'s flag ``rank``; then ``L-1`` into this
   rank's slot of every peer's ``consumed`` array (this rank's GEMM of launch ``L-1``, before the
   call's start on the compute stream, no longer reads landing slot ``(L-1) % 2``);
3. the compute stream waits for the copy stream — nothing follows the GEMM on it.

Deadlock-free: launch ``L``'s waits need only the copy streams of the peers' launch ``L-1``,
which wait for nothing of launch ``L``. Both the "done" promise (written at launch ``L``'s copy
stream about launch ``L-1``'s GEMM) and the counters assume the launches run in call order:
a call on another stream than the previous one first waits for it (:mod:`.call_order`). The
protocol runs on two simulated ranks under random schedules in tests/test_dist_protocols.py. Needs whole ``BM``-row tiles per rank and no clusters
(the GEMM tells this rank's tiles from the peers' by their rows).

CUDA graphs: the flags' values, the ``consumed`` waits and the landing slot all come from ``L``,
baked into a captured graph; a captured call (and every call once captured) is therefore launch
``L = 1``, after a barrier of the group, every counter here (flags, consumed, the pushing GEMM's
count) zeroed on the device and a second barrier, all on the compute stream (:mod:`.fused_op`):
every replay starts from counters that say "no launch yet", and the first barrier replaces the
``consumed`` waits (every rank's previous launch has ended).

Column slices (``comm.col_tile``, the default's :data:`~.ag_gemm.DEFAULT_COL_TILE`): each push is one
2-D copy per slice of ``col_tile`` columns, each followed by the flag's count of slices landed,
``slices * (L - 1) + j + 1``; the GEMM waits for a slice only when its K loop reaches it (the tile
program's ``wait_cols``), so a peer that starts late holds the GEMM up by its first slice, not its
whole shard.

``pusher="gemm"`` (correct on GPUs, slower than the copy engine: ``probe ag_push``): no copy engine and no copy stream. The GEMM
(``push_rows``: traced with ``engine='compute'``, ``GatherRows<W, true, true>``) stores each stage of this rank's
rows it loads into every peer's landing slot ``L % 2`` too, and the launch's last pushed tile
writes ``L`` into this rank's flag on every peer — the same flag, the same waits. Its CTAs must
push all their tiles of this rank's rows before they wait for a peer's (the ``comm_aligned`` order
with this rank's rows whole groups: checked when lowering). The slot needs no ``consumed`` wait:
launch ``L`` runs after this rank's launch ``L-1``, which waited for every peer's push of ``L-1``,
made by the peer's GEMM ``L-1``, which started after the peer's GEMM ``L-2`` (the slot's last
reader) had finished. The launch is one driver call: nothing of the shard's path waits for the
host once the GEMM is enqueued.
"""
from __future__ import annotations

import dataclasses
import gc
import math

from ...errors import InputError
from ..gpu.launch import LaunchCache
from ..gpu import plan_exec
from .call_order import CallOrder
from .engine import Engine
from .operands import dense
from .spare_outputs import SpareOutputs


class PushAllGather(Engine):
    """The direct copy-engine push path of :class:`~.ag_gemm.AllGatherMatmul`, built by the op
    from its :class:`~.ag_gemm.BuildOptions`: it refuses the pull's options, reports no staging
    (``op.staging = None``), gives ``op.compute`` this rank's tile rows as whole groups where the
    GEMM pushes and no compute schedule was given, and traces and lowers the op's program
    (``op.ir``, ``op.lowered``)."""

    name = "copy_engine-push"

    def __init__(self, op, progress, options):
        """``options`` (:class:`~.ag_gemm.BuildOptions`): ``pusher`` — who writes this rank's shard
        into the peers' landing buffers: ``"copy_engine"`` (the measured default: the copy stream,
        after the GEMM is enqueued) or ``"gemm"`` (the GEMM itself, as it loads the shard: the
        schedule's ``engine='compute'``; no copy stream, no host call but the GEMM's launch; correct
        on GPUs, slower: ``probe ag_push``); ``enqueue``, ``spare_outputs``. The pull's options
        (staging, handshake, stage waves) are refused: the push stages nothing and needs no handshake."""
        import torch
        import tldsl as tl
        from ...codegen import lower
        from ...ops.allgather_gemm import allgather_gemm
        from ..gpu.gemm import GemmKernel
        import weakref

        for what, given in (("staging", options.staging_given), ("handshake", options.handshake),
                            ("stage_waves", options.stage_waves)):
            if given is not None:
                raise InputError(f"{what}={given!r}: the copy-engine push stages nothing and needs no handshake "
                                 f"(each rank pushes its shard from its own tensor)")
        pusher, enqueue, spare_outputs = options.pusher or "copy_engine", options.enqueue, options.spare_outputs
        wait_timeout_ns = options.wait_timeout_ns
        if pusher == "gemm" and op.ctx.world_size == 1:
            raise InputError("pusher='gemm': the GEMM pushes this rank's rows to its peers, and a group of one "
                             "rank has none (leave pusher unset: the copy engine's push, which has nothing to "
                             "copy either)")
        if pusher == "gemm" and not options.compute_given:
            # the GEMM publishes its pushes as each CTA leaves this rank's rows: those rows must
            # be whole groups of the order (lower_gemm's push_rows check)
            c0 = op.compute
            op.compute = dataclasses.replace(c0, group_m=math.gcd(op.Ms // c0.BM, c0.group_m))
        op.staging = None                   # (nothing staged: the op reports none)
        self.op = weakref.proxy(op)         # no cycle: a dropped op goes at once (its lease warns)
        ctx = op.ctx
        W, Ms, K, N = ctx.world_size, op.Ms, op.K, op.N
        compute = op.compute
        if Ms % compute.BM or compute.cluster != (1, 1):
            raise InputError(f"copy-engine push (direct): this rank's {Ms} rows must be whole {compute.BM}-row tiles "
                             f"and the GEMM must run without clusters; use ce_executor='plan'")
        self.enqueue = enqueue
        ir_dtype = tl.bfloat16 if op.dtype == torch.bfloat16 else tl.float16
        spec = tl.TensorSpec
        opts = {"wait_timeout_ns": wait_timeout_ns} if wait_timeout_ns else {}
        if pusher not in ("copy_engine", "gemm"):
            raise InputError(f"pusher={pusher!r}: choose 'copy_engine' or 'gemm'")
        self.pusher = pusher
        self.name = "copy_engine-push" if pusher == "copy_engine" else "gemm-push"
        #: column slices (``comm.col_tile``): the shard moves in this many copies of ``col_tile``
        #: columns, each followed by its flag write, and the GEMM waits per slice
        col_tile = op.comm.col_tile
        self.slices = 1 if col_tile is None or col_tile >= K else -(-K // col_tile)
        self.col_tile = K if self.slices == 1 else col_tile
        if pusher == "gemm" and self.slices > 1:
            raise InputError(f"pusher='gemm' pushes whole tiles of rows and publishes them once: it takes no column "
                             f"slices (col_tile={col_tile}); use pusher='copy_engine' with col_tile")
        # the schedule fuses this rank's rows into the GEMM (it reads them from the shard and stores
        # every row it loads into A_gathered; codegen/plan/fused_rows.py) — and, pusher="gemm", the
        # push itself (engine "compute")
        gathering = op.comm.with_(own_rows="compute")
        self._gathering_comm = gathering
        traced = gathering if pusher == "copy_engine" else gathering.with_(engine="compute", col_tile=None)
        self.ir = allgather_gemm.trace(W, spec((Ms, K), ir_dtype), spec((K, N), ir_dtype),
                                       spec((W * Ms, N), ir_dtype), compute=compute, comm=traced)
        op.ir = self.ir
        self._specs = (W, spec((Ms, K), ir_dtype), spec((K, N), ir_dtype), spec((W * Ms, N), ir_dtype), compute)
        self.lowered = op.lowered = lower(self.ir, "gemm", **opts)
        # the IR's names of the shard the GEMM reads and of the gathered output it stores
        self.shard_name, self.copy_name = self.lowered.tma_buffer("tma_a_own"), self.lowered.tma_buffer("tma_a_copy")
        self.gemm = GemmKernel(self.lowered, progress=progress)
        #: the GEMM alone (``compute_only``) must not push: the plain gathering GEMM, built on first use
        self._plain_gemm = None if pusher == "gemm" else self.gemm
        self._lowering_opts, self._progress = opts, progress
        (self.signal,) = self.lowered.signals
        #: tile columns sharing the stores of A_gathered (column j stores the stages k % cols == j):
        #: every column, so each tile adds the fewest stores to its own loads
        self.cols = -(-N // compute.BN)
        dev = torch.device("cuda", ctx.device)
        # collective points: the double-buffered landing buffer, the flags and the consumed counters
        self.landing, self._landing_handle = op._lease.empty((2, W * Ms, K), op.dtype)
        self.landing_peers = [int(p) for p in self._landing_handle.buffer_ptrs]
        self.counters, self._counter_handle = op._lease.empty((2, max(W, 1)), torch.int64)   # [flags, consumed]
        self.counters.zero_()
        base = [int(p) for p in self._counter_handle.buffer_ptrs]
        self.flags, self.consumed = self.counters[0], self.counters[1]
        self.flag_peers = base
        self.consumed_peers = [p + 8 * max(W, 1) for p in base]
        # every rank's counters are zero before any peer's first write into them
        self._counter_handle.barrier(channel=0)
        self.copy_stream = torch.cuda.Stream(device=dev)
        self._cs = self.copy_stream.cuda_stream
        self._torch, self._dev, self._dev_index = torch, dev, ctx.device
        self._tensor_type = torch.Tensor         # (a subclass or anything else: the full check)
        self._a_shape, self._b_shape = torch.Size((Ms, K)), torch.Size((K, N))
        self._full_shape, self._c_shape = (W * Ms, K), (W * Ms, N)
        self._cu = plan_exec.load_driver()
        self._consts = plan_exec.driver_constants(self._cu)
        # the launch's host path works on raw handles: the current stream's and two driver events
        # (start of the call, end of the copies)
        self._raw_stream = plan_exec.raw_stream_getter(torch)
        self._ev_start = plan_exec.driver_event(self._cu, self)
        self._ev_copied = plan_exec.driver_event(self._cu, self)
        self._gemm_launches = LaunchCache(16)
        self._order = CallOrder()
        self._spares = SpareOutputs(self._full_shape, self._c_shape, op.dtype, dev, spare_outputs)
        #: where this rank tells its peers its GEMM is done with a landing slot: False (the default)
        #: on the next launch's copy stream, behind its pushes (nothing after the GEMM on the
        #: compute stream, nothing before a push); True right after the GEMM on the compute stream
        #: (kept to measure against: ``probe ag_push``)
        self.done_after_gemm = False
        self.order = [(ctx.rank + s) % W for s in range(1, W)]          # ring order, peers only
        self._plan_addresses(W, ctx.rank, Ms, K, self.landing.element_size())
        self._gemm_pushes = pusher == "gemm"
        if self._gemm_pushes:
            # what the GEMM pushes into and publishes with: every peer's landing buffer (both slots,
            # ring order), every rank's flag array as mapped here, this rank's count of pushed tiles
            from ...codegen.plan.gemm import push_landing
            self._push_buffers = {push_landing(q): self._landing_handle.get_buffer(p, (2 * W * Ms, K), op.dtype)
                                  for q, p in enumerate(self.order)}
            flag_table = torch.zeros(max(W, 1), dtype=torch.int64, device=dev)
            flag_table.copy_(torch.tensor(self.flag_peers, dtype=torch.int64))
            count, table = self.lowered.row_signals                      # by the IR's names
            self._push_signals = {self.signal: self.flags, count: torch.zeros(1, dtype=torch.int64, device=dev),
                                  table: flag_table}

    # -- a launch ---------------------------------------------------------------------------------
    def _plan_addresses(self, W: int, me: int, Ms: int, K: int, elem: int) -> None:
        """Every address a launch's driver calls use, computed once: per peer (in ring order) the
        consumed slot waited on here, where this rank's shard lands in each landing slot, and the
        flag written there; this rank's slot of every peer's consumed array."""
        self._nbytes = Ms * K * elem
        slot_bytes = W * self._nbytes
        consumed = self.consumed.data_ptr()
        self._peer_plan = [(p, consumed + 8 * p,
                            (self.landing_peers[p] + me * self._nbytes,
                             self.landing_peers[p] + slot_bytes + me * self._nbytes),
                            self.flag_peers[p] + 8 * me) for p in self.order]
        self._consumed_writes = [self.consumed_peers[p] + 8 * me for p in self.order]
        # column slices: per slice its byte offset in a row and its 2-D copy (both pitches a row of
        # K; the source address set per call), per (peer, landing slot)
        self._slice_plan = None
        if self.slices > 1:
            cu = self._cu
            pitch = K * elem
            self._slice_plan = {}
            for p, _, dst, _ in self._peer_plan:
                for slot in (0, 1):
                    copies = []
                    for j in range(self.slices):
                        c0 = j * self.col_tile
                        width = min(self.col_tile, K - c0) * elem
                        m = cu.CUDA_MEMCPY2D()
                        m.srcMemoryType = m.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
                        m.srcXInBytes = m.srcY = m.dstXInBytes = m.dstY = 0
                        m.srcPitch = m.dstPitch = pitch
                        m.dstDevice = dst[slot] + c0 * elem
                        m.WidthInBytes, m.Height = width, Ms
                        copies.append((c0 * elem, m))
                    self._slice_plan[(p, slot)] = copies

    def __call__(self, a_shard, b, *, poison_workspace: bool = False, out=None, return_gathered: bool = True):
        """One launch (``return_gathered``: A_gathered is the call's own tensor either way). The host's work before the GEMM is enqueued is on the critical path (the
        device is idle when a call starts), so it is kept to checks, one event and one driver
        call: the outputs were allocated at the end of the previous call (:mod:`.spare_outputs`),
        every address is precomputed, and driver results are checked without building messages
        unless one failed."""
        op, torch = self.op, self._torch
        dt = op.dtype
        tensor = self._tensor_type
        if (type(a_shard) is not tensor or type(b) is not tensor
                or a_shard.shape != self._a_shape or b.shape != self._b_shape or a_shard.dtype != dt or b.dtype != dt
                or a_shard.get_device() != self._dev_index or b.get_device() != self._dev_index
                or not b.is_contiguous() or b.data_ptr() % 16 or op._closed or a_shard.requires_grad
                or b.requires_grad):
            op._check(a_shard, b)            # the precise error
        if out is not None:
            op._check_out(out, a_shard, b)
        L = op._next_launch()
        capture = op._capture
        cu, consts = self._cu, self._consts
        ok = consts.success
        cur_h = self._raw_stream(self._dev_index)
        self._order.follow(cur_h)            # a new stream waits for the previous call's (call_order)
        tl_, hooks = op.timeline, op.hooks
        cur = torch.cuda.current_stream(self._dev_index) if (tl_ is not None or hooks) else None
        # allocated at the end of the previous call (spare_outputs); none while capturing a graph
        spare = self._spares.take(cur_h) if not capture else {}
        a_full = spare.get("a_gathered")
        if a_full is None:
            a_full = self._spares.new("a_gathered")
        if poison_workspace:
            a_full.fill_(float("nan"))
        if tl_ is not None:
            tl_.mark("start", cur, "compute")
        a_shard = dense(a_shard)            # TMA and the copy engine read it
        slot = L & 1
        c = out if out is not None else spare.get("c")
        if c is None:
            c = self._spares.new("c")
        if self._gemm_pushes:
            return self._launch_pushing_gemm(a_shard, b, a_full, c, cur, cur_h, L, out is None and not capture)
        res = cu.cuEventRecord(self._ev_start, cur_h)        # the call's start: the copies read a_shard after it
        if res[0] != ok:
            plan_exec.checked(cu, res, "cuEventRecord(start)")
        src = a_shard.data_ptr()
        gemm = self._gemm_launches.get(
            (a_full.data_ptr(), b.data_ptr(), c.data_ptr(), src, slot),
            lambda: self.gemm.prepare({"a_gathered": self.landing[slot], "b": b, "c": c, self.shard_name: a_shard,
                                       self.copy_name: a_full, "own_cols": self.cols},
                                      signals={self.signal: self.flags}, rank=op.ctx.rank, hold=False))
        gc_was_on = gc.isenabled()
        gc.disable()                # the GEMM spins on the peers' flags: no host stall until the pushes are enqueued
        try:
            if self.enqueue == "gemm_first":
                self._launch_gemm(gemm, cur, cur_h, L)
            if hooks:
                op._hook("before_comm", self.copy_stream)
            cs = self._cs
            res = cu.cuStreamWaitEvent(cs, self._ev_start, 0)
            if res[0] != ok:
                plan_exec.checked(cu, res, "cuStreamWaitEvent(start)")
            done, nbytes, wr, geq = max(L - 2, 0), self._nbytes, consts.write_default, consts.wait_geq
            for p, consumed, dst, flag in self._peer_plan:
                r1 = cu.cuStreamWaitValue64(cs, consumed, done, geq)
                if self._slice_plan is None:
                    r2 = cu.cuMemcpyAsync(dst[slot], src, nbytes, cs)
                    r3 = cu.cuStreamWriteValue64(cs, flag, L, wr)
                else:
                    r2, r3 = self._push_slices(cs, p, slot, src, flag, L)
                if r1[0] != ok or r2[0] != ok or r3[0] != ok:
                    for res, what in ((r1, f"cuStreamWaitValue64(rank {p} done with launch {L - 2})"),
                                      (r2, f"cuMemcpyAsync / cuMemcpy2DAsync(our shard to rank {p})"),
                                      (r3, f"cuStreamWriteValue64(our flag on rank {p})")):
                        plan_exec.checked(cu, res, what)
                if tl_ is not None:
                    tl_.mark(f"shard pushed to {p}", self.copy_stream, "copy")
            if not self.done_after_gemm:
                # behind the pushes (never delaying them): this rank's GEMM of launch L-1, before the
                # call's start, no longer reads its landing slot
                self._tell_done(cs, L - 1)
            if self.enqueue == "comm_first":
                self._launch_gemm(gemm, cur, cur_h, L)
            if self.done_after_gemm:
                # after the GEMM: it no longer reads landing slot L % 2 (peers push launch L+2 there)
                self._tell_done(cur_h, L)
        finally:
            if gc_was_on:
                gc.enable()
        # the compute stream waits for the copies (they read a_shard); A_gathered and C are
        # written by the GEMM on the compute stream itself
        r1 = cu.cuEventRecord(self._ev_copied, self._cs)
        r2 = cu.cuStreamWaitEvent(cur_h, self._ev_copied, 0)
        if r1[0] != ok or r2[0] != ok:
            plan_exec.checked(cu, r1, "cuEventRecord(copied)")
            plan_exec.checked(cu, r2, "cuStreamWaitEvent(copied)")
        # the next call's outputs, now that everything of this one is enqueued
        if not capture:
            self._spares.refill(cur_h, with_c=out is None)
        elif op.debug:
            return a_full, c
        if op.debug:
            torch.cuda.synchronize()
            print(f"[rank {op.ctx.rank}] ag_gemm push launch {L}: done; counters {op.signal_counters()}", flush=True)
        return a_full, c

    def _push_slices(self, cs: int, p: int, slot: int, src: int, flag: int, L: int):
        """The shard into peer ``p``'s landing slot in column slices, each followed by the flag's
        count of slices landed, ``slices * (L - 1) + j + 1`` (counters only grow: the GEMM's wait for
        slice ``j`` targets exactly that). Returns the first failing (copy, write) results, or the last."""
        cu, ok, wr = self._cu, self._consts.success, self._consts.write_default
        base = self.slices * (L - 1)
        r2 = r3 = (ok,)
        for j, (offset, m) in enumerate(self._slice_plan[(p, slot)]):
            m.srcDevice = src + offset
            r2 = cu.cuMemcpy2DAsync(m, cs)
            r3 = cu.cuStreamWriteValue64(cs, flag, base + j + 1, wr)
            if r2[0] != ok or r3[0] != ok:
                break
        return r2, r3

    def _launch_pushing_gemm(self, a_shard, b, a_full, c, cur, cur_h: int, L: int, fresh_c: bool):
        """``pusher="gemm"``: the launch is the GEMM alone — it pushes this rank's rows into the
        peers' landing slot ``L % 2`` and publishes them itself (``GatherRows<W, true, true>``); the
        slot is free by call order (see that template). Nothing runs on the copy stream."""
        op = self.op
        slot = L & 1
        gemm = self._gemm_launches.get(
            (a_full.data_ptr(), b.data_ptr(), c.data_ptr(), a_shard.data_ptr(), slot),
            lambda: self.gemm.prepare({"a_gathered": self.landing[slot], "b": b, "c": c, self.shard_name: a_shard,
                                       self.copy_name: a_full, "own_cols": self.cols, **self._push_buffers},
                                      signals=self._push_signals, rank=op.ctx.rank, hold=False))
        if op.hooks:
            op._hook("before_comm", cur)        # (the GEMM is the communication too)
        self._launch_gemm(gemm, cur, cur_h, L)
        if op._capture:
            return a_full, c
        self._spares.refill(cur_h, with_c=fresh_c)
        if op.debug:
            self._torch.cuda.synchronize()
            print(f"[rank {op.ctx.rank}] ag_gemm gemm-push launch {L}: done; counters {op.signal_counters()}",
                  flush=True)
        return a_full, c

    @property
    def compute_gemm(self):
        """The GEMM that ``compute_only`` times: the launch's, or (when the GEMM pushes) the same
        gathering GEMM without the pushes."""
        if self._plain_gemm is None:
            from ...codegen import lower
            from ..gpu.gemm import GemmKernel
            from ...ops.allgather_gemm import allgather_gemm
            W, a, b, c, compute = self._specs          # the same GEMM, gathering without pushing
            plain = allgather_gemm.trace(W, a, b, c, compute=compute, comm=self._gathering_comm)
            self._plain_gemm = GemmKernel(lower(plain, "gemm", **self._lowering_opts), progress=self._progress)
        return self._plain_gemm

    def _launch_gemm(self, gemm, cur, cur_h: int, L: int) -> None:
        op = self.op
        if op.hooks:
            op._hook("before_compute", cur)
        gemm.launch(cur_h, L)
        if op.timeline is not None:
            op.timeline.mark("gemm done", cur, "compute")

    def _tell_done(self, stream: int, launch: int) -> None:
        """``launch`` into this rank's slot of every peer's ``consumed`` array, on ``stream``."""
        cu, consts = self._cu, self._consts
        for addr in self._consumed_writes:
            res = cu.cuStreamWriteValue64(stream, addr, launch, consts.write_default)
            if res[0] != consts.success:
                plan_exec.checked(cu, res, "cuStreamWriteValue64(this rank done, on a peer)")

    # -- introspection ----------------------------------------------------------------------------
    def compute_only_inputs(self, a_gathered) -> tuple[dict, dict]:
        """The GEMM alone: this rank's rows read from A_gathered itself, the gathered copy into scratch."""
        import torch
        op = self.op
        me = op.ctx.rank
        if getattr(self, "_scratch_copy", None) is None or self._scratch_copy.shape != a_gathered.shape:
            self._scratch_copy = torch.empty_like(a_gathered)
        return {self.shard_name: a_gathered[me * op.Ms:(me + 1) * op.Ms], self.copy_name: self._scratch_copy,
                "own_cols": self.cols}, {}

    def graph_counters(self) -> list:
        """Every counter a launch waits on or writes (reset at the start of a captured launch)."""
        out = [self.counters]                       # flags and consumed
        if self._gemm_pushes:
            out.append(self._push_signals[self.lowered.row_signals[0]])
        return out

    @property
    def signals(self) -> dict:
        if self._gemm_pushes:
            count = self.lowered.row_signals[0]
            return {self.signal: self.flags, count: self._push_signals[count]}
        return {self.signal: self.flags, "push_consumed": self.consumed}

    def workspace_tensors(self) -> dict:
        return {"landing": self.landing}

    def signal_map(self):
        op = self.op
        writer = "copy stream" if not self._gemm_pushes else "GEMM (its last pushed tile)"
        flags = (self.signal, self.flags.data_ptr(), self.flags.numel(),
                 f"rank {op.ctx.rank}, symmetric: peer p's {writer} writes slot p once its shard landed; the GEMM "
                 f"waits; slot s = landing rows [s * {op.Ms}, (s + 1) * {op.Ms})")
        if self._gemm_pushes:
            name = self.lowered.row_signals[0]
            count = self._push_signals[name]
            return [flags, (name, count.data_ptr(), 1,
                            f"rank {op.ctx.rank}: this rank's storing tiles pushed to the peers, all launches")]
        return [flags, ("push_consumed", self.consumed.data_ptr(), self.consumed.numel(),
                        f"rank {op.ctx.rank}, symmetric: slot p = the last launch rank p's GEMM finished; this rank's "
                        "copy stream waits on it before pushing into p's landing slot")]

    def describe(self) -> str:
        who = "copy engine" if not self._gemm_pushes else "GEMM (as it loads it; no copy engine)"
        return (f"  {self.name} (direct): GEMM on {self.gemm.grid[0]} CTAs, every shard pushed by its owner's "
                f"{who} into the peers' landing buffer {tuple(self.landing.shape)}; A_gathered stored by the "
                f"GEMM over {self.cols} tile column(s); "
                + ("the next call's outputs allocated at the end of each call\n" if self._spares.enabled
                   else "outputs allocated per call\n") + self.lowered.describe())

    def close(self) -> None:
        """The spare outputs go (the op's close then frees its symmetric memory)."""
        self._spares.clear()
