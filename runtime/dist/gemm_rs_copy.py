"""GEMM + ReduceScatter with the copy engine moving the partial sums (``engine="copy_engine"``).

The SM schedule reserves SMs for the reduce-scatter kernel for the whole GEMM, and its NVLink
and HBM traffic runs beside the GEMM's tiles: on 2x H200 the GEMM of the fused op ran 12–30%
slower than alone. Here the GEMM (the ``gemm_reduce_scatter`` tile program's compute part,
the same generated kernel) gets **every SM**, the copy engine pushes each peer's rows of the
partials as soon as the GEMM has stored them, and this rank's rows are summed once, after the
GEMM, by one elementwise kernel:

The tile program says it all (``tldsl.collectives.reduce_scatter`` with
``CommSchedule(engine="copy_engine", mode="push", tile_m=rows per copy)``): its copy-engine
part waits for the GEMM's counters of a chunk of a peer's rows, copies the chunk into block
``rank`` of the peer's symmetric receive buffer and notifies the peer; its SM part sums this
rank's rows once every peer's chunks are in. The simulator checks that program (races,
deadlocks, results); here it runs as:

1. compute stream: event ``E``; the GEMM of launch ``L`` (partials into the local workspace;
   after each tile's TMA stores, +1 on the ``ready`` counter of every chunk it covers);
2. copy stream (after ``E``): a handshake of stream memory operations — write ``L`` into this
   rank's slot of every peer's symmetric ``handshake_arrive`` array, wait until every peer's
   slot here holds ``L`` (every rank finished launch ``L-1``, so its receive buffer is free);
   then the copy-engine part's plan for this rank (:func:`~tldsl.codegen.recipes.copy_engine.plan_copy_engine`),
   in its order: per chunk a stream wait for ``count * L`` on its ``ready`` counter and one
   NVLink copy; the plan's notifies of one peer are coalesced into its last (the stream is in
   order), which writes the launch's final count ``chunks * L`` into this rank's slot of the
   peer's ``reduce_scatter_done``;
3. the sum part's work, ``out = partial[own rows] + (received blocks, summed in the tile
   program's order)`` (for two ranks one elementwise kernel, fp32 arithmetic, one rounding),
   once every peer's slot here holds its final count: for all but this rank's last chunk on a
   side stream, after stream waits on the GEMM's counters of those chunks — its kernel gets the
   SMs the GEMM's CTAs free as they finish, during the GEMM's last, partial wave (it cannot take
   an SM the GEMM still needs: every GEMM CTA is resident from the start, one per SM, before
   any of these counters moves); the last chunk on the compute stream after the GEMM. Where
   this rank's rows are small (under ``EARLY_SUM_BYTES``) the extra host calls cost more than
   the overlap gains, and all of the sum runs after the GEMM;
4. the compute stream waits for the copy stream (launch ``L+1`` cannot overwrite the partials
   while they are being copied).

Summing in the epilogue (``CommSchedule(..., reduce_in="epilogue")``; M/W whole GEMM tiles): there is no
step 3. The GEMM's tiles of this rank's own rows (computed last in the ``comm_aligned`` order)
wait in their epilogue until every peer's final count is here, add the received blocks to their
accumulators and store the sum straight into ``out``; the other tiles are stored into the
partials and notified as before. No pass over this rank's rows after the GEMM, and the GEMM
reads each received row once, as its tile is stored. The handshake also orders the receive
buffer: a peer's copies of launch ``L`` start after this rank's GEMM of launch ``L-1`` (which
read that buffer) is done.

Counters only grow (every wait targets ``count * L``), so nothing is reset and no stale value
can satisfy a wait — except in a CUDA graph, whose memops carry the captured ``L``: there every
launch is ``L = 1`` after the counters are zeroed between two barriers on the device
(:mod:`.fused_op`), and the early sum's side stream, which otherwise starts on its counter waits
alone, first waits for the call's start (a stale count of the previous launch would satisfy them). Between enqueueing the GEMM and the last copy the host never waits for the
device (garbage collection is paused). Rows are chunked for the copies (``tile_m``; by default
up to 4 per peer, whole producer tiles each, and no smaller than a group of tile rows of the
compute order — :func:`default_chunk_rows`): the first copy starts after a quarter of the peer's
rows are stored, and the host issues few driver calls.
"""
from __future__ import annotations

import gc

from ...errors import InputError
from ..gpu.launch import LaunchCache
from ..gpu import plan_exec
from .call_order import CallOrder
from .engine import Engine


EARLY_SUM_BYTES = 32 << 20    # this rank's rows of the partials, from which the early sum pays


def default_chunk_rows(rows_per_rank: int, compute) -> int:
    """Rows per copy by default: up to 4 copies per peer, but never smaller than a group of the
    compute order (``group_m`` tile rows, visited column by column): every tile of a group
    finishes in the same stretch of the GEMM, so smaller chunks would be ready together and
    only add host calls (two per chunk) to a launch whose small shapes wait for the host."""
    rows = chunk_rows(rows_per_rank, compute.BM, 4)
    group = compute.group_m * compute.BM
    if compute.order in ("swizzled", "comm_aligned") and rows < group <= rows_per_rank:
        rows = group
    return rows


def chunk_rows(rows_per_rank: int, tile_rows: int, chunks: int) -> int:
    """Rows per copy: ``rows_per_rank / chunks`` rounded up to whole producer tiles."""
    if chunks < 1:
        raise InputError(f"chunks={chunks}: need at least one copy per peer")
    per = -(-rows_per_rank // chunks)
    return min(rows_per_rank, -(-per // tile_rows) * tile_rows)


class CopyEngineReduceScatter(Engine):
    """The copy-engine launch protocol of :class:`~.gemm_rs.MatmulReduceScatter` (see the module
    docstring): the tile program's copy-engine part, planned for this rank
    (:func:`~tldsl.codegen.recipes.copy_engine.plan_copy_engine`), executed on the copy stream after a
    handshake, then the sum part's work as one elementwise kernel. Building it is collective
    (one symmetric workspace)."""

    name = "copy_engine"

    def __init__(self, op, traced_comm, progress):
        import weakref
        import torch
        from ..gpu.gemm import GemmKernel
        from .comm_kernel import kernel_specs
        self.op = weakref.proxy(op)         # no cycle: a dropped op goes at once (its lease warns)
        ctx = op.ctx
        W, me = ctx.world_size, ctx.rank
        bufs, slots = kernel_specs(op.ir)
        self.partial = torch.empty(bufs["partial"][0], dtype=torch.float32 if op.partial_dtype == "f32" else op.dtype,
                                   device=op.device)
        self.gemm = GemmKernel(op.lowered_gemm, progress=progress)          # every SM
        self.ready = torch.zeros(slots[op.ready], dtype=torch.int64, device=op.device)   # the GEMM's counters
        self.rows = min(op.ir.comm_schedule.tile_m, op.Ms)     # rows per copy (the mapping's tile)
        self.tpr = -(-op.Ms // self.rows)
        self.copy_stream = torch.cuda.Stream(device=op.device)
        self._copied = torch.cuda.Event()
        self._order = CallOrder()
        # the host's work before the GEMM is handed to the driver is on the critical path: the
        # current stream as a raw handle (torch's accessor for it, where this build has one), the
        # call's start as a driver event, the driver and its constants looked up once
        self._cu = plan_exec.load_driver()
        self._consts = plan_exec.driver_constants(self._cu)
        self._raw_stream = plan_exec.raw_stream_getter(torch)
        self._ev_start = plan_exec.driver_event(self._cu, self)
        self._torch, self._dev_index, self._cs = torch, ctx.device, self.copy_stream.cuda_stream
        self._W, self._me, self._arrive = W, me, ()
        self.order = [(me + s) % W for s in range(1, W)]
        self._gemm_launches = LaunchCache()
        recv, done = "reduce_scatter_recv", "reduce_scatter_done"
        self._done = done
        self.fused = op.ir.comm_schedule.reduce_in == "epilogue"    # the GEMM's epilogue sums our rows
        # reduce_in="comm": sum the chunks the GEMM finished first beside its last wave, where this
        # rank's rows are large enough for that to beat the two extra stream waits and launch on the
        # host (2x H200: 2-3% faster from 64 MiB of rows, 0.5-1% at 32 MiB, up to 14% slower at
        # 16 MiB — BENCHMARKS.md)
        self.early_sum = op.Ms * op.N * self.partial.element_size() >= EARLY_SUM_BYTES
        # host order (``probe rs_order``): this rank's arrival written before the GEMM is enqueued
        # (or after it); the sum's waits and kernel enqueued right after the GEMM (or after the copies)
        self.arrive_first = False
        self.sum_first = False
        self.plan, self.steps, self.arrivals, self.ws, self.recv = None, [], [], None, None
        if W > 1:                       # (alone: nothing to move, the sum is this rank's partial)
            self._plan_copies(op, bufs, slots, recv, done)
        torch.cuda.synchronize()

    def _plan_copies(self, op, bufs: dict, slots: dict, recv: str, done: str) -> None:
        """This rank's copy-engine part from the tile program's plan, and its symmetric workspace
        (collective)."""
        import torch
        from ...codegen import lower
        from ...codegen.plan.copy_engine import CeCopy, CeSignalWrite, CeWait
        from .comm_kernel import make_workspace
        ctx = op.ctx
        W, me = ctx.world_size, ctx.rank
        self.plan = lower(op.ir, "reduce_scatter")
        # this rank's stream: (wait, slot, count) / (copy, dest, src byte offset, dst byte offset, bytes) /
        # (notify, dest, slot, per-launch count) — a peer's notifies of one launch coalesced into the
        # last one (the stream is in order, so its value implies every earlier chunk landed)
        self.steps = []
        for a in self.plan.actions[me]:
            if isinstance(a, CeWait):
                if a.signal != op.ready or not a.epoch:
                    raise InputError(f"copy-engine reduce-scatter: unexpected wait {a}")
                self.steps.append(("wait", a.slot, a.count))
            elif isinstance(a, CeCopy):
                if a.src != "partial" or a.src_rank != me or a.dst != recv or \
                        not a.width_bytes == a.src_pitch == a.dst_pitch:
                    raise InputError(f"copy-engine reduce-scatter: unexpected copy {a}")
                self.steps.append(("copy", a.dst_rank, a.src_byte_offset, a.dst_byte_offset, a.nbytes))
            elif isinstance(a, CeSignalWrite):
                if a.signal != done or a.add:         # (its notifies are absolute values: one writer a slot)
                    raise InputError(f"copy-engine reduce-scatter: unexpected notify {a}")
                if a.index == a.per_launch:
                    self.steps.append(("notify", a.rank, a.slot, a.per_launch))
        # what this rank's sum waits for: every peer's last notify of its slot here
        self.arrivals = [(p, w.per_launch) for p in range(W) if p != me for w in self.plan.actions[p]
                         if isinstance(w, CeSignalWrite) and w.rank == me and w.index == w.per_launch]
        # ... and the GEMM's counters of this rank's own chunks: the producer tiles covering a chunk
        # are the same whoever sends it, so the peers' plans (their waits for the copies of these
        # rows) give the counts
        own = {a.slot: a.count for p in range(W) if p != me for a in self.plan.actions[p]
               if isinstance(a, CeWait) and me * self.tpr <= a.slot < (me + 1) * self.tpr}
        self.own_chunks = [(own[me * self.tpr + j], j * self.rows, min((j + 1) * self.rows, op.Ms))
                           for j in range(self.tpr)]
        self.sum_stream = torch.cuda.Stream(device=op.device)
        self._sum_views: dict = {}
        self._summed = torch.cuda.Event()
        pdt = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[self.partial.dtype]
        if bufs[recv] != ((W * op.Ms, op.N), pdt) or slots[done] != W:
            raise InputError(f"copy-engine reduce-scatter: unexpected workspace {bufs[recv]}, {slots[done]}")
        self.ws = make_workspace(ctx, [(recv, "buffer", (W, op.Ms, op.N), pdt),
                                       (done, "signal", (W,), "u64"),
                                       ("handshake_arrive", "signal", (W,), "u64")], "ptr", lease=op._lease)
        self.recv = self.ws.tensor(recv)
        self._recv_peers = self.ws.peers(recv)
        self._arrive = self.ws.peers("handshake_arrive")

    def gemm_buffers(self, a, b, out) -> tuple[dict, dict]:
        """The GEMM's tensors and counters: with the epilogue sum also ``out``, the receive
        buffer it adds from and the ``done`` counters it waits on."""
        op = self.op
        bufs = {"a": a, "b": b, "partial": self.partial}
        sigs = {op.ready: self.ready}
        if self.fused:
            bufs["out"] = out
            if self.recv is not None:
                bufs["reduce_scatter_recv"] = self.recv.view(op.ctx.world_size * op.Ms, op.N)
                sigs[self._done] = self.ws.tensor(self._done)
        return bufs, sigs

    # -- a launch ------------------------------------------------------------------------------
    def __call__(self, a, b, out):
        """Launch ``L`` into ``out`` (``None``: a new tensor, allocated once the GEMM is enqueued
        unless the GEMM's epilogue writes it); returns ``out``. Everything before the GEMM is
        handed to the driver is the op's time when the device is idle: it reads only what
        ``__init__`` looked up, and the copy stream's work waits until the GEMM is enqueued."""
        op = self.op
        L = op._next_launch()
        cu, consts = self._cu, self._consts
        cur_h = self._raw_stream(self._dev_index)
        self._order.follow(cur_h)            # a new stream waits for the previous call's (call_order)
        tl_ = op.timeline
        cur = self._torch.cuda.current_stream(self._dev_index) if (tl_ is not None or op.hooks) else None
        if tl_ is not None:
            tl_.mark("start", cur, "compute")
        res = cu.cuEventRecord(self._ev_start, cur_h)        # the call's start: the copy stream follows it
        if res[0] != consts.success:
            plan_exec.checked(cu, res, "cuEventRecord(start)")
        if out is None and self.fused:
            out = self._new_out()
        gemm = self._gemm_launches.get((a.data_ptr(), b.data_ptr(), out.data_ptr() if self.fused else 0),
                                       lambda: self.gemm.prepare(*self.gemm_buffers(a, b, out), rank=self._me, hold=False))
        gc_was_on = gc.isenabled()
        gc.disable()                # the copy stream waits for the GEMM's counters: no host stall in between
        try:
            if self.arrive_first:
                self._start_copy_stream(L)
            if op.hooks:
                op._hook("before_compute", cur)
            gemm.launch(cur_h, L)
            cur, out, sum_first = self._after_gemm(cur, out, L)
        finally:
            if gc_was_on:
                gc.enable()
        return self._finish(cur, out, sum_first, L)

    def _start_copy_stream(self, L: int) -> None:
        """This rank's half of the handshake: it depends only on this rank's earlier work (the
        call's start), so the host may enqueue it before the GEMM (``arrive_first``) or after."""
        op, cu, cs = self.op, self._cu, self._cs
        if op.hooks:
            op._hook("before_comm", self.copy_stream)
        plan_exec.checked(cu, cu.cuStreamWaitEvent(cs, self._ev_start, 0), "cuStreamWaitEvent(start)")
        if self._W > 1:
            plan_exec.stream_arrive(cu, cs, self._arrive, self._me, L)

    def _after_gemm(self, cur, out, L: int):
        """With the GEMM enqueued: the copy stream's handshake and plan (and, with ``sum_first``,
        the sum) — nothing here waits for the device. Returns (compute stream, out, sum_first)."""
        import torch
        op = self.op
        cu, consts, cs = self._cu, self._consts, self._cs
        wr, geq = consts.write_default, consts.wait_geq
        ck = plan_exec.checked
        W, me = self._W, self._me
        if cur is None:             # the torch stream object, for what follows (off the critical path)
            cur = torch.cuda.current_stream(self._dev_index)
        tl_ = op.timeline
        ready = self.ready
        done = self.ws.peers(self._done) if W > 1 else ()
        if tl_ is not None:
            tl_.mark("gemm done", cur, "compute")
        if out is None:             # only the sum writes it: allocated off the GEMM's critical path
            out = self._new_out()
        sum_first = self.sum_first and not self.fused and W > 1
        if sum_first:                   # the sum's waits and kernel before the copies, on the host
            self._enqueue_sum(cu, cur, out, ready, done, L)
        if not self.arrive_first:
            self._start_copy_stream(L)
        if W > 1:
            plan_exec.stream_await(cu, cs, self._arrive, me, L)
        if tl_ is not None:
            tl_.mark("barrier", self.copy_stream, "copy")
        base, ready_ptr = self.partial.data_ptr(), ready.data_ptr()
        for step in self.steps:                          # the tile program's copy-engine plan
            if step[0] == "wait":
                ck(cu, cu.cuStreamWaitValue64(cs, ready_ptr + 8 * step[1], step[2] * L, geq),
                   f"cuStreamWaitValue64(ready[{step[1]}])")
            elif step[0] == "copy":
                _, dest, src_off, dst_off, n = step
                ck(cu, cu.cuMemcpyAsync(self._recv_peers[dest] + dst_off, base + src_off, n, cs),
                   f"cuMemcpyAsync(rows of rank {dest})")
            else:
                _, dest, slot, per_launch = step
                ck(cu, cu.cuStreamWriteValue64(cs, done[dest] + 8 * slot, per_launch * L, wr),
                   f"cuStreamWriteValue64(done on {dest})")
                if tl_ is not None:
                    tl_.mark(f"rows of {dest} sent", self.copy_stream, "copy")
        return cur, out, sum_first

    def _finish(self, cur, out, sum_first: bool, L: int):
        """The sum after the copies (unless enqueued first) and the compute stream's wait for the
        copy stream; returns the output."""
        if not self.fused and self._W == 1:
            out.copy_(self.partial)
        elif not self.fused and not sum_first:
            self._enqueue_sum(self._cu, cur, out, self.ready,
                              self.ws.peers(self._done) if self._W > 1 else (), L)
        self._copied.record(self.copy_stream)
        cur.wait_event(self._copied)
        return out

    def _new_out(self):
        import torch
        return torch.empty((self.op.Ms, self.op.N), dtype=self.op.dtype, device=self.op.device)

    def _enqueue_sum(self, cu, cur, out, ready, done, L: int) -> None:
        """Step 3 of the launch protocol (module docstring): this rank's rows of the sum, after
        every peer's rows are here — the early chunks on the side stream where that pays."""
        import torch
        from ..gpu import plan_exec
        op = self.op
        ck = plan_exec.checked
        geq = plan_exec.driver_constants(cu).wait_geq
        me, Ms, cur_h, tl_ = op.ctx.rank, op.Ms, cur.cuda_stream, op.timeline
        early = self.early_sum and self.tpr > 1
        if early:
            # All but this rank's last chunk, summed on a side stream once the GEMM has stored
            # them (stream waits on its counters: no SM held while waiting): its kernel runs on
            # the SMs the GEMM's finished CTAs free during its last, partial wave.
            ss = self.sum_stream.cuda_stream
            # counting launches, its waits order it; in graph mode every launch is launch 1 (runtime/dist/
            # fused_op.py), so it must start after the call (a captured side stream must be forked anyway)
            if op._graph:
                ck(cu, cu.cuStreamWaitEvent(ss, self._ev_start, 0), "cuStreamWaitEvent(start, sum stream)")
            for count, lo, hi in self.own_chunks[:-1]:
                ck(cu, cu.cuStreamWaitValue64(ss, ready.data_ptr() + 8 * (me * self.tpr + lo // self.rows),
                                              count * L, geq), "cuStreamWaitValue64(own ready)")
            for p, per_launch in self.arrivals:
                ck(cu, cu.cuStreamWaitValue64(ss, done[me] + 8 * p, per_launch * L, geq),
                   f"cuStreamWaitValue64(done of {p})")
            split = self.own_chunks[-1][1]
            with torch.cuda.stream(self.sum_stream):
                self._sum_rows(out, 0, split)
            if not op._capture:                 # (captured: joined below)
                out.record_stream(self.sum_stream)
            self._summed.record(self.sum_stream)
        for p, per_launch in self.arrivals:
            ck(cu, cu.cuStreamWaitValue64(cur_h, done[me] + 8 * p, per_launch * L, geq),
               f"cuStreamWaitValue64(done of {p})")
        self._sum_rows(out, split if early else 0, Ms)
        if early:
            cur.wait_event(self._summed)
        if tl_ is not None:
            tl_.mark("reduced", cur, "compute")

    def _sum_rows(self, out, lo: int, hi: int) -> None:
        """``out[lo:hi]`` = this rank's rows ``lo:hi`` of the sum, on the current stream, in the tile
        program's association (every schedule's): P[me] + (P[me+1] + (... + P[me-1]))."""
        import torch
        op = self.op
        W, me, Ms = op.ctx.world_size, op.ctx.rank, op.Ms
        views = self._sum_views.get((lo, hi))
        if views is None:               # the workspace views, made once (this runs on the host's critical path)
            views = self._sum_views[lo, hi] = (self.partial[me * Ms + lo:me * Ms + hi],
                                               [self.recv[(me + W - s) % W, lo:hi] for s in range(1, W)])
        own, received = views
        acc = received[0]
        for r in received[1:]:
            acc = r + acc
        torch.add(own, acc, out=out if (lo, hi) == (0, Ms) else out[lo:hi])

    # -- introspection -------------------------------------------------------------------------
    def parts(self) -> tuple:
        """(lowered GEMM, lowered reduce-scatter part: none run as a kernel, SMs it keeps: 0)."""
        return self.op.lowered_gemm, None, 0

    @property
    def signals(self) -> dict:
        out = {self.op.ready: self.ready}
        if self.ws is not None:
            out.update({self._done: self.ws.tensor(self._done), "handshake_arrive": self.ws.tensor("handshake_arrive")})
        return out

    def workspace_tensors(self) -> dict:
        out = {"partial": self.partial}
        if self.recv is not None:
            out["reduce_scatter_recv"] = self.recv
        return out

    def signal_map(self) -> list[tuple[str, int, int, str]]:
        op = self.op
        me, W = op.ctx.rank, op.ctx.world_size
        out = [(op.ready, self.ready.data_ptr(), self.ready.numel(),
                f"rank {me}, local: the GEMM's tiles notify, the copy stream waits; slot s = partial rows "
                f"[(s // {self.tpr}) * {op.Ms} + (s % {self.tpr}) * {self.rows}, +{self.rows})")]
        if self.ws is None:
            return out
        return out + [(self._done, self.ws.peers(self._done)[me], W,
                       f"rank {me}, symmetric: slot q = chunks rank q has copied here ({self.tpr} per launch)"),
                      ("handshake_arrive", self.ws.peers("handshake_arrive")[me], W,
                       f"rank {me}, symmetric: slot q = the last launch rank q's copy stream started")]

    def describe(self) -> str:
        head = [f"  GEMM on {self.gemm.grid[0]} CTAs, the copy engines reduce-scatter", self.op.lowered_gemm.describe(),
                f"  copy engine: {self.tpr} chunk(s) of {self.rows} rows per peer, order {self.order}; this rank's "
                f"rows summed {'in the GEMM epilogue' if self.fused else 'after the GEMM'}"]
        return "\n".join(head if self.ws is None else head + [self.plan.describe(), self.ws.describe()])

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
