"""AllGather+GEMM on GPUs: the copy engine gathers A shard by shard (stream-ordered peer
copies, each followed by a stream write of its flag), while the generated GEMM — the
AllGather+GEMM tile program's compute part — waits per tile for exactly the flags its rows
need. The GEMM starts on the local shard at once.

Launch protocol (``launch`` = L, counted from 1; flags hold the last launch that wrote them,
so they are never reset and an old value can never satisfy a wait):

1. group barrier: every rank finished launch L-1 (its copies out of our shard are done);
2. copy this call's shard into our symmetric buffer; group barrier: every shard is in place;
3. compute stream: copy our own shard into its rows of A_gathered and write L into its flag
   (a same-GPU copy runs on SMs, so it must finish before the GEMM holds them all); copy
   stream, in ring order: peer copies of shard p (NVLink copy engine) into rows
   [p*Ms, (p+1)*Ms), each followed by writing L into flag p (cuStreamWriteValue64);
4. compute stream: the GEMM, launch index L; it spins (acquire, system scope) on flag p
   before loading rows of shard p;
5. the compute stream waits for the copy stream, so launch L+1 starts after both.
"""
from __future__ import annotations

from ...errors import InputError
from ...ir.schedule import CommSchedule, ComputeSchedule
from ..gpu.device import check
from .group import dist_context

DEFAULT_COMPUTE = ComputeSchedule(tile=(128, 256, 64), stages=4, order="comm_aligned")
_TORCH = {"bf16": "bfloat16", "f16": "float16"}


class AllGatherMatmul:
    """``(A_gathered, A_gathered @ B)`` for a fixed (rows per rank, K, N, dtype).

    Building it is collective (symmetric allocation + rendezvous): every rank of ``group``
    must build it, in the same order as any other collective."""

    def __init__(self, rows_per_rank: int, k: int, n: int, dtype="bfloat16", *, group=None,
                 compute: ComputeSchedule | None = None, comm: CommSchedule | None = None, progress=None):
        import torch
        import torch.distributed._symmetric_memory as symm_mem
        import tldsl as tl
        from ...codegen.lower import lower
        from ..gpu.gemm import GemmKernel
        from ...ops.allgather_gemm import allgather_gemm

        self.ctx = dist_context(group)
        W, r = self.ctx.world_size, self.ctx.rank
        self.Ms, self.K, self.N = int(rows_per_rank), int(k), int(n)
        tdtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        self.dtype = tdtype
        comm = comm or CommSchedule(engine="copy_engine", mode="pull", order="ring")
        if comm.engine != "copy_engine" or comm.mode != "pull":
            raise InputError(f"AllGatherMatmul on GPUs runs the copy-engine pull schedule for now; got {comm}")
        self.comm = comm
        self.compute = compute or DEFAULT_COMPUTE
        ir_dtype = tl.bfloat16 if tdtype == torch.bfloat16 else tl.float16
        spec = tl.TensorSpec
        self.ir = allgather_gemm.trace(W, spec((self.Ms, self.K), ir_dtype), spec((self.K, self.N), ir_dtype),
                                       spec((W * self.Ms, self.N), ir_dtype), compute=self.compute, comm=comm)
        import os
        timeout = os.environ.get("TLDSL_WAIT_TIMEOUT_NS")   # debug: a wait that spins too long reports and traps
        self.lowered = lower(self.ir, "gemm", **({"wait_timeout_ns": int(timeout)} if timeout else {}))
        self.debug = bool(os.environ.get("TLDSL_DEBUG"))
        self.gemm = GemmKernel(self.lowered, progress=progress,
                               reserve_sms=int(os.environ.get("TLDSL_RESERVE_SMS", "0")))
        (self.signal,) = self.lowered.signals
        dev = torch.device("cuda", self.ctx.device)
        # collective points: symmetric shard buffer + rendezvous
        self.shard = symm_mem.empty((self.Ms, self.K), dtype=tdtype, device=dev)
        self.handle = symm_mem.rendezvous(self.shard, self.ctx.group_name)
        self.peer_ptrs = [int(p) for p in self.handle.buffer_ptrs]
        self.flags = torch.zeros(max(W, 1), dtype=torch.int64, device=dev)
        self.copy_stream = torch.cuda.Stream(device=dev)
        self.launches = 0
        self.order = [(r + s) % W for s in range(W)] if comm.order == "ring" else \
            [(r + s) % W for s in range(W)]   # full mesh: the copy engine serialises per stream anyway

    def _check(self, a_shard, b):
        import torch
        for name, t, shape in (("A shard", a_shard, (self.Ms, self.K)), ("B", b, (self.K, self.N))):
            if not isinstance(t, torch.Tensor) or not t.is_cuda:
                raise InputError(f"{name} must be a CUDA tensor")
            if tuple(t.shape) != shape:
                raise InputError(f"{name} has shape {tuple(t.shape)}; this op was built for {shape}")
            if t.dtype != self.dtype:
                raise InputError(f"{name} is {t.dtype}; this op was built for {self.dtype}")
        if not b.is_contiguous():
            raise InputError("B must be contiguous (row-major [K, N])")

    def __call__(self, a_shard, b, *, poison_workspace: bool = False):
        import torch
        from cuda.bindings import driver as cu
        self._check(a_shard, b)
        self.launches += 1
        L = self.launches
        W = self.ctx.world_size
        cur = torch.cuda.current_stream()
        es = self.shard.element_size()
        a_full = torch.empty((W * self.Ms, self.K), dtype=self.dtype, device=self.shard.device)
        if poison_workspace:
            a_full.fill_(float("nan"))
        self.handle.barrier(channel=0)              # peers are done reading our shard (launch L-1)
        self.shard.copy_(a_shard)
        self.handle.barrier(channel=0)              # every shard of launch L is in place
        # Our own shard: a same-GPU copy, which the driver runs as an SM kernel; it must not
        # run beside the persistent GEMM (which holds every SM while it waits), so it goes on
        # the compute stream, before the GEMM, with its flag.
        me = self.ctx.rank
        a_full[me * self.Ms:(me + 1) * self.Ms].copy_(a_shard)
        check(cu.cuStreamWriteValue64(cur.cuda_stream, self.flags.data_ptr() + 8 * me, L,
                                      cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
              "cuStreamWriteValue64(own flag)")
        self.copy_stream.wait_stream(cur)
        cs = self.copy_stream.cuda_stream
        if self.debug:
            torch.cuda.synchronize()
            print(f"[rank {self.ctx.rank}] launch {L}: shards in place; flags {self.flags.tolist()}", flush=True)
        nbytes = self.Ms * self.K * es
        for p in self.order:
            if p == me:
                continue
            dst = a_full.data_ptr() + p * nbytes
            check(cu.cuMemcpyAsync(dst, self.peer_ptrs[p], nbytes, cs), "cuMemcpyAsync(shard)")
            check(cu.cuStreamWriteValue64(cs, self.flags.data_ptr() + 8 * p, L,
                                          cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
                  "cuStreamWriteValue64(flag)")
        c = torch.empty((W * self.Ms, self.N), dtype=self.dtype, device=self.shard.device)
        self.gemm({"a_gathered": a_full, "b": b, "c": c}, signals={self.signal: self.flags},
                  launch_index=L, rank=self.ctx.rank)
        cur.wait_stream(self.copy_stream)
        a_full.record_stream(self.copy_stream)
        if self.debug:
            torch.cuda.synchronize()
            print(f"[rank {self.ctx.rank}] launch {L}: done; flags {self.flags.tolist()}", flush=True)
        return a_full, c
