"""GEMM + ReduceScatter with the copy engine moving the partial sums (``engine="copy_engine"``).

The SM schedule reserves SMs for the reduce-scatter kernel for the whole GEMM, and its NVLink
and HBM traffic runs beside the GEMM's tiles: on 2x H200 the GEMM of the fused op ran 12–30%
slower than alone. Here the GEMM (the ``gemm_reduce_scatter`` tile program's compute part,
the same generated kernel) gets **every SM**, the copy engine pushes each peer's rows of the
partials as soon as the GEMM has stored them, and this rank's rows are summed once, after the
GEMM, by one elementwise kernel:

1. compute stream: event ``E``; the GEMM of launch ``L`` (partials into the local workspace;
   after each tile's TMA stores, +1 on the ``ready`` counter of every chunk it covers);
2. copy stream (after ``E``): a handshake of stream memory operations — write ``L`` into this
   rank's slot of every peer's symmetric ``arrive`` array, wait until every peer's slot here
   holds ``L`` (every rank finished launch ``L-1``, so its receive buffer is free); then per peer
   ``p`` in ring order (the order the ``comm_aligned`` GEMM stores them), per chunk of ``p``'s
   rows: wait until the chunk's ``ready`` counter reaches ``count * L``, copy the chunk into
   slot ``rank`` of ``p``'s symmetric receive buffer (NVLink, no SM), and after ``p``'s last
   chunk write ``L`` into this rank's slot of ``p``'s ``done`` array;
3. compute stream (after the GEMM): wait until every peer's ``done`` slot here holds ``L``, then
   ``out = partial[own rows] + sum of the received slots`` (fp32 arithmetic, one rounding);
4. the compute stream waits for the copy stream (launch ``L+1`` cannot overwrite the partials
   while they are being copied).

Counters only grow (every wait targets ``count * L``), so nothing is reset and no stale value
can satisfy a wait. Between enqueueing the GEMM and the last copy the host never waits for the
device (garbage collection is paused). Rows are chunked for the copies (``chunks`` per peer,
whole producer tiles each): the first copy starts after a ``1/chunks`` of the peer's rows are
stored, the last ends soon after its rows are, and the host issues few driver calls.
"""
from __future__ import annotations

import gc

from ...errors import InputError
from ..gpu.launch import LaunchCache


def chunk_rows(rows_per_rank: int, tile_rows: int, chunks: int) -> int:
    """Rows per copy: ``rows_per_rank / chunks`` rounded up to whole producer tiles."""
    if chunks < 1:
        raise InputError(f"chunks={chunks}: need at least one copy per peer")
    per = -(-rows_per_rank // chunks)
    return min(rows_per_rank, -(-per // tile_rows) * tile_rows)


class CopyEngineReduceScatter:
    """The copy-engine launch protocol of :class:`~.gemm_rs.MatmulReduceScatter` (see the module
    docstring). Building it is collective (one symmetric workspace)."""

    name = "copy_engine"

    def __init__(self, op, chunks: int = 4):
        import torch
        from .comm_kernel import make_workspace
        self.op = op
        ctx = op.ctx
        W, r = ctx.world_size, ctx.rank
        self.rows = chunk_rows(op.Ms, op.compute.BM, chunks)
        self.tpr = -(-op.Ms // self.rows)
        BM, tn = op.compute.BM, -(-op.N // op.compute.BN)
        # producer tiles (BM rows x full width) overlapping chunk j of a segment: its ready count
        self.counts = []
        for j in range(self.tpr):
            lo, hi = j * self.rows, min(j * self.rows + self.rows, op.Ms)
            self.counts.append(tuple((-(-(s * op.Ms + hi) // BM) - (s * op.Ms + lo) // BM) * tn for s in range(W)))
        pdt = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[op.partial.dtype]
        self.ws = make_workspace(ctx, [("recv", "buffer", (W, op.Ms, op.N), pdt),
                                       ("arrive", "signal", (W,), "u64"),
                                       ("done", "signal", (W,), "u64")], "ptr")      # collective
        self.recv = self.ws.tensor("recv")
        self.eb = op.partial.element_size()
        self.copy_stream = torch.cuda.Stream(device=op.device)
        self._start, self._copied = torch.cuda.Event(), torch.cuda.Event()
        self.order = [(r + s) % W for s in range(1, W)]      # the comm_aligned GEMM's segment order
        self._gemm_launches = LaunchCache()

    # -- a launch ------------------------------------------------------------------------------
    def __call__(self, a, b, out, L: int):
        import torch
        from . import plan_exec
        op = self.op
        cu = plan_exec.load_driver()
        wr = cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        ck = plan_exec.checked
        W, me, Ms, N = op.ctx.world_size, op.ctx.rank, op.Ms, op.N
        cur = torch.cuda.current_stream(op.ctx.device)
        cur_h, cs = cur.cuda_stream, self.copy_stream.cuda_stream
        tl_ = op.timeline
        if tl_ is not None:
            tl_.mark("start", cur, "compute")
        self._start.record(cur)
        ready = op.signals[op.ready]
        gemm = self._gemm_launches.get((a.data_ptr(), b.data_ptr()), lambda: op.gemm.prepare(
            {"a": a, "b": b, "partial": op.partial}, signals={op.ready: ready}, rank=me))
        gc_was_on = gc.isenabled()
        gc.disable()                # the copy stream waits for the GEMM's counters: no host stall in between
        try:
            if op.hooks:
                op._hook("before_compute", cur)
            gemm.launch(cur_h, L)
            if tl_ is not None:
                tl_.mark("gemm done", cur, "compute")
            if op.hooks:
                op._hook("before_comm", self.copy_stream)
            self.copy_stream.wait_event(self._start)
            arrive, done = self.ws.peers("arrive"), self.ws.peers("done")
            for p in self.order:
                ck(cu, cu.cuStreamWriteValue64(cs, arrive[p] + 8 * me, L, wr), f"cuStreamWriteValue64(arrive on {p})")
            for p in self.order:
                ck(cu, cu.cuStreamWaitValue64(cs, arrive[me] + 8 * p, L, geq), f"cuStreamWaitValue64(arrive of {p})")
            if tl_ is not None:
                tl_.mark("barrier", self.copy_stream, "copy")
            recv = self.ws.peers("recv")
            base, ready_ptr, row_bytes = op.partial.data_ptr(), ready.data_ptr(), N * self.eb
            for p in self.order:
                for j in range(self.tpr):
                    lo = j * self.rows
                    n = min(self.rows, Ms - lo)
                    ck(cu, cu.cuStreamWaitValue64(cs, ready_ptr + 8 * (p * self.tpr + j), self.counts[j][p] * L, geq),
                       f"cuStreamWaitValue64(ready {p}/{j})")
                    ck(cu, cu.cuMemcpyAsync(recv[p] + (me * Ms + lo) * row_bytes, base + (p * Ms + lo) * row_bytes,
                                            n * row_bytes, cs), f"cuMemcpyAsync(rows of rank {p})")
                ck(cu, cu.cuStreamWriteValue64(cs, done[p] + 8 * me, L, wr), f"cuStreamWriteValue64(done on {p})")
                if tl_ is not None:
                    tl_.mark(f"rows of {p} sent", self.copy_stream, "copy")
        finally:
            if gc_was_on:
                gc.enable()
        for p in self.order:
            ck(cu, cu.cuStreamWaitValue64(cur_h, done[me] + 8 * p, L, geq), f"cuStreamWaitValue64(done of {p})")
        own = op.partial[me * Ms:(me + 1) * Ms]
        if W == 2:
            torch.add(own, self.recv[self.order[0]], out=out)
        else:
            self.recv[me].copy_(own)
            torch.sum(self.recv, dim=0, out=out)
        if tl_ is not None:
            tl_.mark("reduced", cur, "compute")
        self._copied.record(self.copy_stream)
        cur.wait_event(self._copied)
        return out

    # -- introspection -------------------------------------------------------------------------
    def signal_entries(self) -> list[tuple[str, int, int, str]]:
        me, W = self.op.ctx.rank, self.op.ctx.world_size
        return [("rs_arrive", self.ws.peers("arrive")[me], W,
                 f"rank {me}, symmetric: slot q = the last launch rank q's copy stream started"),
                ("rs_done", self.ws.peers("done")[me], W,
                 f"rank {me}, symmetric: slot q = the last launch whose rows rank q has copied here")]

    def signal_tensors(self) -> dict:
        return {"rs_arrive": self.ws.tensor("arrive"), "rs_done": self.ws.tensor("done")}

    def describe(self) -> str:
        return (f"  copy engine: {self.tpr} chunk(s) of {self.rows} rows per peer, order {self.order}\n"
                + self.ws.describe())
