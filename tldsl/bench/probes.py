"""Probes: small GPU measurements behind design choices, kept runnable so their figures have a command.

    python -m tldsl.bench probe copy_engine                    # one GPU
    python -m tldsl.bench probe epilogue [--shapes MxNxKr,...]  # one GPU
    python -m tldsl.bench probe ag_group [--shapes MxNxK,...]   # one GPU
    python -m tldsl.bench probe ag_gather [--shapes MxNxK,...]  # one GPU
    python -m tldsl.bench probe moe_notifies [--rows qwen3:8192:random,...]  # one GPU
    python -m tldsl.bench probe moe_schedules [--rows ...] [--layer ag|rs] [--schedules 128x256x64:4,...]  # one GPU
    python -m tldsl.bench probe moe_row_copies [--rows mixtral:32768:random,...]  # one GPU
    python -m tldsl.bench probe moe_power [--rows mixtral:32768:random,...] [--seconds 2]  # one GPU
    python -m tldsl.bench probe moe_dram [--rows qwen3:8192:random,...]  # one GPU
    torchrun --nproc_per_node=2 -m tldsl.bench probe rs_reduce_in [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe ag_enqueue [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe ag_staging [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe ag_handshake [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe ag_push [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe ag_spares [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe ag_slices [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe ag_skew [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe rs_order [--shapes MxNxK,...]
    torchrun --nproc_per_node=2 -m tldsl.bench probe rs_early_sum [--shapes MxNxK,...]

* ``copy_engine``: does a same-GPU copy run beside a kernel that holds every SM? Plain
  ``cuMemcpyAsync`` and ``cuMemcpyBatchAsync`` with ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``,
  alone and enqueued on a second stream right after a cuBLAS GEMM: if the copy ends about when the
  GEMM does, it waited for SMs (same-GPU copies are SM kernels), which is why the fused ops stage
  their own rows before their persistent GEMM, never beside it.
* ``epilogue``: GEMM + ReduceScatter's GEMM summing this rank's rows in its epilogue
  (``reduce_in='epilogue'``), with parts of the generated epilogue cut out of its source (the
  waits, the loads, the sums, the own-row branch), against the GEMM that only stores partials
  (``reduce_in='comm'``); waits pre-satisfied, so only the kernel is timed.
* ``ag_group``: AllGather+GEMM's GEMM (its waits satisfied; M, N, K as the GEMM sees them: the
  gathered rows, this rank's columns) with the ``comm_aligned`` order's tile rows grouped by 8
  (the default) or by all of this rank's rows (two ranks), so that the first wave of tiles
  touches every one of this rank's rows, against cuBLAS; timed interleaved.
* ``ag_gather``: what AllGather+GEMM's GEMM pays for storing the A stages it loads into
  A_gathered (``gather_rows``, the copy-engine push): the plain GEMM with the same waits (all
  satisfied), and the gathering GEMM — its producer storing a stage before refilling it (the
  default) with no column storing and with every column storing its share, and a stager thread
  storing each stage as it lands (``GatherRows<W, false>``); one GPU, timed interleaved with
  cuBLAS.
* ``moe_notifies``: MoE+ReduceScatter's grouped GEMM with parts of its per-tile notifies cut out
  (:mod:`.moe_probes`).
* ``moe_schedules``: one MoE layer's grouped GEMM under several compute schedules, timed
  interleaved with ``_grouped_mm`` in one process (:mod:`.moe_probes`).
* ``moe_row_copies``: AllGather+MoE's routed rows gathered by batched copies, one a row, against the
  SMs' gather, alone and beside ``_grouped_mm`` (:mod:`.moe_probes`).
* ``moe_power``: MoE+ReduceScatter's grouped GEMM, combine and both, and ``_grouped_mm``, each
  launched back to back while nvidia-smi samples the SM clock, the power and the software power
  cap (:mod:`.moe_power`): a GEMM at the cap pays for work beside it in energy.
* ``moe_dram``: the least bytes MoE+ReduceScatter's grouped GEMM and combine move through DRAM,
  moved as a copy, as a read pass then a write pass, and as one pass in the pair's own mix of
  reads and writes, timed interleaved with the pair and ``_grouped_mm`` (:mod:`.moe_dram`).
* ``rs_reduce_in``: the whole op both ways in one process, timed interleaved, with one launch's
  phases each (device times; host enqueue times in parentheses).
* ``ag_enqueue``: AllGather+GEMM with the host enqueueing the GEMM first (the default) or the
  handshake and copies first, timed the same way.
* ``ag_staging``: AllGather+GEMM staging its shard with one pass of the staging kernel before
  the GEMM, or by the GEMM itself as it loads this rank's rows (``staging="gemm"``, spread over
  the tiles of two waves or of one), timed the same way. (Earlier runs compared the kernel with
  two ``cuMemcpyAsync`` and a stream write, ``staging="copies"``.)
* ``ag_handshake``: AllGather+GEMM's handshake as stream memory operations enqueued after the
  GEMM (``memops``) or published by the staging kernel itself (``device``; the copy stream's
  waits and copies enqueued after the GEMM, or between the staging and the GEMM), timed the
  same way.
* ``ag_push``: AllGather+GEMM pulling the shards (each rank stages its shard into symmetric
  memory — by the staging kernel, or by its GEMM — and the peers' copy engines pull it) against
  pushing them whole (each rank's copy engine writes its shard straight from its tensor into the
  peers' landing buffers; the GEMM reads its own rows from the shard and stores every row into
  A_gathered; the op's default where rows are whole tiles, now in column slices: ``ag_slices``) — telling the peers a landing slot is free at the next launch's start on the
  copy stream (the default) or right after the GEMM, and with the pushes enqueued before the
  GEMM — timed the same way.
* ``ag_spares``: AllGather+GEMM allocating its outputs in each call, or ending each call by
  allocating the next call's (spare outputs, the default up to 256 MiB of them), timed the same way.
* ``ag_slices``: AllGather+GEMM's copy-engine push moving each shard whole or in column slices of
  ``col_tile`` columns (2048, and 1024: the default), each behind its own flag, the GEMM waiting for a slice
  only when its K loop reaches it (a late peer's first slice starts the tiles that need it),
  timed the same way.
* ``ag_skew``: how much a rank starting late slows its peer: AllGather+GEMM's push with whole
  shards and in column slices, timed per call as the benchmark does (every rank released by a
  barrier and a synchronise), each call's host start on both ranks recorded (one host clock);
  the early rank's median time per bin of the two ranks' start skew.
* ``rs_order``: GEMM+ReduceScatter (copy engine) with its defaults; with 4 copies per peer even
  where a group of tile rows holds several (the earlier default); with the sum's waits and kernel
  enqueued before the copies; with this rank's half of the handshake enqueued before the GEMM;
  and that with the GEMM's tile rows grouped by one copy chunk (so the chunks finish one after
  another), timed the same way.
* ``rs_early_sum``: GEMM+ReduceScatter (copy engine, sum after the GEMM) summing the chunks the
  GEMM finished first on a side stream beside its last wave (the default from 32 MiB of this
  rank's rows), or all after it.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys

from .copies import batch_copies
from .dist import bench_interleaved
from .gemm import lower_with_waits, parse_shapes
from .timing import interleaved_ms, median_ms


# -- AG+GEMM's tile-row groups ----------------------------------------------------------------------

def probe_ag_group(shapes, iters=30, out=sys.stdout):
    import dataclasses
    import torch
    from tldsl.runtime.gpu import GemmKernel, require_gpu
    from tldsl.runtime.dist.ag_gemm import DEFAULT_COMPUTE
    require_gpu()
    print("| M x N x K | group 8 ms | group = own rows ms | cuBLAS ms |", file=out)
    print("|---|---|---|---|", file=out)
    for (M, N, K) in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        fns = []
        for g in (DEFAULT_COMPUTE.group_m, max(1, (M // 2) // DEFAULT_COMPUTE.BM)):
            lw, _ = lower_with_waits(M, N, K, dataclasses.replace(DEFAULT_COMPUTE, group_m=g))
            kern = GemmKernel(lw)
            sig = {s: torch.full((4096,), 1 << 40, device="cuda", dtype=torch.int64) for s in lw.signals}
            c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            fns.append(lambda kern=kern, sig=sig, c=c: kern({"a_gathered": a, "b": b, "c": c}, signals=sig))
        fns.append(lambda: torch.matmul(a, b))
        t = interleaved_ms(fns, iters)
        print(f"| {M}x{N}x{K} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} |", file=out, flush=True)


def probe_ag_gather(shapes, iters=30, out=sys.stdout):
    import dataclasses
    import torch
    import tldsl as tl
    from tldsl.codegen import lower_gemm
    from tldsl.ops.allgather_gemm import allgather_gemm
    from tldsl.runtime.gpu import GemmKernel, require_gpu
    from tldsl.runtime.dist.ag_gemm import DEFAULT_COMPUTE
    require_gpu()
    W, bf = 2, tl.bfloat16
    print("| M x N x K | plain ms | gathering on refill, no column stores ms | on refill, every column ms "
          "| stager thread, every column ms | cuBLAS ms |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    for (M, N, K) in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        def traced(own_rows):
            return allgather_gemm.trace(W, tl.TensorSpec((M // W, K), bf), tl.TensorSpec((K, N), bf),
                                        tl.TensorSpec((M, N), bf), compute=DEFAULT_COMPUTE,
                                        comm=tl.CommSchedule(engine="copy_engine", mode="push", own_rows=own_rows))
        ir = traced("comm")
        lg = lower_gemm(traced("compute"), "gemm")      # gather_rows: the schedule fuses this rank's rows
        stager = dataclasses.replace(lg, source=lg.source.replace("GatherRows<Cfg::kWorldSize>",
                                                                  "GatherRows<Cfg::kWorldSize, false>"))
        assert stager.source != lg.source
        plain, gather, staging = GemmKernel(lower_gemm(ir, "gemm")), GemmKernel(lg), GemmKernel(stager)
        sig = {s: torch.full((W,), 1 << 40, device="cuda", dtype=torch.int64) for s in plain.lowered.signals}
        c, copy = torch.empty(M, N, device="cuda", dtype=torch.bfloat16), torch.empty_like(a)
        gn = -(-N // DEFAULT_COMPUTE.BN)
        # prepared launches, as the op makes them: one driver call each (no descriptors encoded per call)
        runs = [plain.prepare({"a_gathered": a, "b": b, "c": c}, signals=sig, rank=1)]
        for kern, cols in ((gather, 0), (gather, gn), (staging, gn)):
            runs.append(kern.prepare({"a_gathered": a, "b": b, "c": c, lg.tma_buffer("tma_a_own"): a[M // W:],
                                      lg.tma_buffer("tma_a_copy"): copy, "own_cols": cols}, signals=sig, rank=1))
        fns = [lambda run=run: run.launch(torch.cuda.current_stream().cuda_stream, 1) for run in runs]
        fns.append(lambda: torch.matmul(a, b))
        t = interleaved_ms(fns, iters)
        print(f"| {M}x{N}x{K} | " + " | ".join(f"{x:.3f}" for x in t) + " |", file=out, flush=True)


# -- copy engine ------------------------------------------------------------------------------------

def probe_copy_engine(out=sys.stdout):
    import torch
    from cuda.bindings import driver as cu
    torch.cuda.set_device(0)
    main = torch.cuda.Stream()              # batch copies refuse the legacy default stream
    side = torch.cuda.Stream()
    overlap = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    print("| MiB | copy | alone us | GB/s | beside a GEMM: GEMM ms | copy ends ms after the GEMM starts |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    with torch.cuda.stream(main):
        for mib in (16, 64, 128):
            n = mib * 2**20 // 2
            a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            d = torch.empty_like(a)
            copies = {"cuMemcpyAsync": lambda h: cu.cuMemcpyAsync(d.data_ptr(), a.data_ptr(), 2 * n, h),
                      "cuMemcpyBatchAsync + PREFER_OVERLAP": lambda h: batch_copies(cu, [d.data_ptr()], [a.data_ptr()], [2 * n],
                                                                                    h, overlap)}
            for name, copy in copies.items():
                d.zero_()
                copy(main.cuda_stream)
                torch.cuda.synchronize()
                if not torch.equal(d, a):
                    raise RuntimeError(f"{name} copied wrong data")
                alone = median_ms(lambda: copy(main.cuda_stream), 30)
                ends, gemms = [], []
                for _ in range(5):
                    torch.cuda.synchronize()
                    g0, g1, c1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                    g0.record(main)
                    x @ x
                    g1.record(main)
                    copy(side.cuda_stream)
                    c1.record(side)
                    torch.cuda.synchronize()
                    gemms.append(g0.elapsed_time(g1))
                    ends.append(g0.elapsed_time(c1))
                print(f"| {mib} | {name} | {1e3 * alone:.1f} | {mib * 2**20 / alone / 1e6:.0f} | "
                      f"{statistics.median(gemms):.3f} | {statistics.median(ends):.3f} |", file=out, flush=True)


# -- the epilogue sum, taken apart ---------------------------------------------------------------------

def _rs_gemm(M, N, Kr, reduce_in, W=2):
    import tldsl as tl
    from tldsl.codegen import lower
    from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
    from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE, traced_comm
    Ms = M // W
    comm = traced_comm(tl.CommSchedule(engine="copy_engine", mode="push", reduce_in=reduce_in), Ms, DEFAULT_COMPUTE)
    ir = gemm_reduce_scatter.trace(W, tl.TensorSpec((M, Kr), tl.bfloat16), tl.TensorSpec((Kr, N), tl.bfloat16),
                                   tl.TensorSpec((Ms, N), tl.bfloat16), compute=DEFAULT_COMPUTE, comm=comm,
                                   partial_dtype="out")
    return lower(ir, "gemm")


def epilogue_ablations(source: str) -> dict[str, str]:
    """The epilogue-sum GEMM's source with parts cut out (for timing only: the results of the
    cut variants are wrong by design)."""
    out = {"fused": source}
    out["no waits"] = re.sub(r"\n\s*tldsl::wait_at_least<[^\n]*", "", source)
    out["no loads"] = re.sub(r"(f\.v\d+) = tldsl::sm90::epi_load2\([^;]*;", r"\1 = {};", out["no waits"])
    out["no sums"] = re.sub(r"ctx\.apply\(.*?\n\s*\}\);\n", "\n", out["no waits"], flags=re.S)
    out["no own-row stores"] = re.sub(r"ctx\.template store<([^>]*)>\(&tma_out", r"if (false) ctx.template store<\1>(&tma_out",
                                      out["no sums"])
    return out


def probe_epilogue(shapes, iters=30, out=sys.stdout):
    import dataclasses
    import torch
    from tldsl.runtime.gpu import GemmKernel
    W = 2
    names = ["reduce_in=comm", "fused", "no waits", "no loads", "no sums", "no own-row stores"]
    print("| M x N x K per rank | " + " | ".join(f"{n} ms" for n in names) + " |", file=out)
    print("|---" * (len(names) + 1) + "|", file=out)
    for (M, N, Kr) in shapes:
        dt = torch.bfloat16
        a, b = torch.randn(M, Kr, device="cuda", dtype=dt), torch.randn(Kr, N, device="cuda", dtype=dt)
        partial, res = torch.empty(M, N, device="cuda", dtype=dt), torch.empty(M // W, N, device="cuda", dtype=dt)
        recv = torch.randn(M, N, device="cuda", dtype=dt)
        ready = torch.zeros(4096, device="cuda", dtype=torch.int64)
        done = torch.full((W,), 1 << 62, device="cuda", dtype=torch.int64)        # every wait already satisfied
        plain = GemmKernel(_rs_gemm(M, N, Kr, "comm"))
        fns = {"reduce_in=comm": lambda: plain({"a": a, "b": b, "partial": partial},
                                               signals={"reduce_scatter_ready": ready})}
        lg = _rs_gemm(M, N, Kr, "epilogue")
        for name, src in epilogue_ablations(lg.source).items():
            k = GemmKernel(dataclasses.replace(lg, source=src))
            fns[name] = (lambda k=k: k({"a": a, "b": b, "partial": partial, "out": res, "reduce_scatter_recv": recv},
                                       signals={"reduce_scatter_ready": ready, "reduce_scatter_done": done}))
        # two rounds, each variant's median, the better round kept (clock drift falls on all alike)
        rounds = [{n: median_ms(f, iters) for n, f in fns.items()} for _ in range(2)]
        best = {n: min(r[n] for r in rounds) for n in fns}
        assert list(fns) == names
        print(f"| {M}x{N}x{Kr} | " + " | ".join(f"{best[n]:.3f}" for n in fns) + " |", file=out, flush=True)


def _interleaved_ops(make, variants, shapes, iters, out):
    """``make(name, M, N, K)`` -> (the op with its operands bound, cuBLAS on the same problem) for
    each variant name; times each op, its GEMM alone and cuBLAS interleaved, and prints one
    launch's phases of each (rank 0)."""
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist.timeline import PhaseTimeline
    dist.init_process_group("nccl")
    r = dist.get_rank()
    torch.cuda.set_device(r)
    try:
        for (M, N, K) in shapes:
            torch.manual_seed(1 + r)
            ops, cublas = {}, None
            for name in variants:
                ops[name], cublas = make(name, M, N, K)
            fns = {}
            for name, op in ops.items():
                fns[f"op {name}"] = op
                fns[f"GEMM alone {name}"] = op.compute_only
            fns["cuBLAS"] = cublas
            t = bench_interleaved(fns, iters)
            if r == 0:
                print(f"{M}x{N}x{K}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in t.items()), file=out, flush=True)
            for name, op in ops.items():
                op.timeline = PhaseTimeline()
                torch.cuda.synchronize()
                dist.barrier()
                op()
                torch.cuda.synchronize()
                if r == 0:
                    print(op.timeline.format(f"  [rank 0] {name}: ", host=True), file=out, flush=True)
                op.timeline = None
            for op in ops.values():
                op.close()
            del ops
            torch.cuda.synchronize()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def probe_rs_reduce_in(shapes, iters=20, out=sys.stdout):
    from tldsl.ir.schedule import CommSchedule
    _rs_variants({red: ({"comm": CommSchedule(engine="copy_engine", mode="push", reduce_in=red)}, {})
                  for red in ("epilogue", "comm")}, shapes, iters, out)


def probe_rs_early_sum(shapes, iters=20, out=sys.stdout):
    _rs_variants({"early sum": ({}, {"early_sum": True}), "sum after the GEMM": ({}, {"early_sum": False})},
                 shapes, iters, out)


def _rs_variants(variants: dict, shapes, iters, out):
    """MatmulReduceScatter built with each variant's (keyword arguments, engine attributes),
    timed interleaved."""
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist import MatmulReduceScatter

    def make(name, M, N, K):
        W = dist.get_world_size()
        kwargs, engine_attrs = variants[name]
        if callable(kwargs):            # keyword arguments that depend on the shape
            kwargs = kwargs(M, W)
        a = torch.randn(M, K // W, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K // W, N, device="cuda", dtype=torch.bfloat16)
        op = MatmulReduceScatter(M, K // W, N, torch.bfloat16, **kwargs)
        for attr, value in engine_attrs.items():
            setattr(op._engine, attr, value)
        res = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
        return _Bound(op, a, b, out=res), (lambda: torch.mm(a, b))
    _interleaved_ops(make, tuple(variants), shapes, iters, out)


def probe_rs_order(shapes, iters=20, out=sys.stdout):
    import dataclasses
    from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE
    from tldsl.runtime.dist.gemm_rs_copy import chunk_rows

    def compute_by_chunk(M, W):
        rows = chunk_rows(M // W, DEFAULT_COMPUTE.BM, 4)
        return dataclasses.replace(DEFAULT_COMPUTE, group_m=max(1, min(8, rows // DEFAULT_COMPUTE.BM)))
    _rs_variants({"default": ({}, {}),
                  "4 chunks": ({"ce_chunks": 4}, {}),
                  "sum before the copies": ({}, {"sum_first": True}),
                  "arrive first": ({}, {"arrive_first": True}),
                  "arrive first, group = chunk": (lambda M, W: {"compute": compute_by_chunk(M, W), "ce_chunks": 4},
                                                  {"arrive_first": True})}, shapes, iters, out)


def probe_ag_enqueue(shapes, iters=20, out=sys.stdout):
    _ag_variants({"gemm_first": {"enqueue": "gemm_first"}, "comm_first": {"enqueue": "comm_first"}},
                 shapes, iters, out)


def probe_ag_staging(shapes, iters=20, out=sys.stdout):
    _ag_variants({"staging kernel": {"staging": "kernel"}, "staging by the GEMM, 2 waves": {"staging": "gemm",
                                                                                          "stage_waves": 2},
                  "staging by the GEMM, 1 wave": {"staging": "gemm", "stage_waves": 1}}, shapes, iters, out)


def probe_ag_handshake(shapes, iters=20, out=sys.stdout):
    _ag_variants({"memops": {"handshake": "memops"}, "device": {"handshake": "device"},
                  "device, copies first": {"handshake": "device", "enqueue": "comm_first"}}, shapes, iters, out)


def probe_ag_push(shapes, iters=20, out=sys.stdout):
    from tldsl.ir.schedule import CommSchedule
    push = CommSchedule(engine="copy_engine", mode="push")
    _ag_variants({"pull (default staging)": {"comm": CommSchedule(engine="copy_engine", mode="pull")},
                  "pull, staging kernel": {"staging": "kernel"},
                  "push": {"comm": push, "ce_executor": "direct"},
                  "push, done flag after the GEMM": ({"comm": push, "ce_executor": "direct"},
                                                     {"done_after_gemm": True}),
                  "push, copies first": {"comm": push, "ce_executor": "direct", "enqueue": "comm_first"},
                  "push by the GEMM": {"comm": push, "ce_executor": "direct", "pusher": "gemm"}},
                 shapes, iters, out)


def probe_ag_spares(shapes, iters=20, out=sys.stdout):
    _ag_variants({"push, outputs allocated per call": {"spare_outputs": False},
                  "push, spare outputs": {"spare_outputs": True}}, shapes, iters, out)


def probe_ag_slices(shapes, iters=20, out=sys.stdout):
    from tldsl.ir.schedule import CommSchedule
    push = CommSchedule(engine="copy_engine", mode="push")
    _ag_variants({"push, whole shards": {"comm": push, "ce_executor": "direct"},
                  **{f"push, col_tile {c}": {"comm": push.with_(col_tile=c), "ce_executor": "direct"}
                     for c in (2048, 1024)}},
                 shapes, iters, out)


def probe_ag_skew(shapes, iters=80, out=sys.stdout):
    import torch
    import torch.distributed as dist
    from tldsl.ir.schedule import CommSchedule
    from tldsl.runtime.dist.group import enable_symmetric_memory
    push = CommSchedule(engine="copy_engine", mode="push")
    dist.init_process_group("nccl")
    r, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(r)
    enable_symmetric_memory(dist.group.WORLD.group_name)
    try:
        _skew_table(shapes, iters, out, push, r, W)
    finally:
        dist.destroy_process_group()


def _skew_table(shapes, iters, out, push, r, W):
    import time
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist import AllGatherMatmul
    bins = ((0, 10), (10, 20), (20, 30), (30, 40), (40, 60), (60, float("inf")))
    for (M, N, K) in shapes:
        a = torch.randn(M // W, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N // W, device="cuda", dtype=torch.bfloat16)
        for name, comm in (("whole shards", push), ("col_tile 2048", push.with_(col_tile=2048)),
                           ("col_tile 1024", push.with_(col_tile=1024))):
            op = AllGatherMatmul(M // W, K, N // W, torch.bfloat16, comm=comm, ce_executor="direct")
            for _ in range(5):
                op(a, b)
            mine = []
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                dist.barrier()
                torch.cuda.synchronize()
                h0 = time.perf_counter()          # CLOCK_MONOTONIC: one clock for every rank of the host
                s.record()
                op(a, b)
                e.record()
                torch.cuda.synchronize()
                mine.append((h0 * 1e6, s.elapsed_time(e)))
            every = [None] * W
            dist.all_gather_object(every, mine)
            op.close()
            del op
            if r == 0:
                pts = []                       # (|skew| us, the early rank's ms)
                for i in range(iters):
                    starts = [every[q][i][0] for q in range(W)]
                    early = starts.index(min(starts))
                    pts.append((max(starts) - min(starts), every[early][i][1]))
                cells = []
                for lo, hi in bins:
                    sel = [t for sk, t in pts if lo <= sk < hi]
                    if sel:
                        cells.append(f"skew {lo}-{hi if hi != float('inf') else ''} us: {statistics.median(sel):.3f} ms"
                                     f" (n={len(sel)})")
                print(f"{M}x{N}x{K} {name}: median {statistics.median(t for _, t in pts):.3f} ms; "
                      f"|skew| median {statistics.median(sk for sk, _ in pts):.1f} us; " + "; ".join(cells),
                      file=out, flush=True)


def _ag_variants(variants: dict, shapes, iters, out):
    """AllGatherMatmul built with each variant's keyword arguments (or (keyword arguments, engine
    attributes)), timed interleaved."""
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist import AllGatherMatmul
    made = {}

    def make(name, M, N, K):
        W = dist.get_world_size()
        if (M, N, K) not in made:
            made.clear()
            made[M, N, K] = (torch.randn(M // W, K, device="cuda", dtype=torch.bfloat16),
                             torch.randn(K, N // W, device="cuda", dtype=torch.bfloat16))
        a, b = made[M, N, K]
        full = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        kwargs, attrs = variants[name] if isinstance(variants[name], tuple) else (variants[name], {})
        op = AllGatherMatmul(M // W, K, N // W, torch.bfloat16, **kwargs)
        for attr, value in attrs.items():
            setattr(op._engine, attr, value)
        return _Bound(op, a, b, gemm_a=full), (lambda: torch.mm(full, b))
    _interleaved_ops(make, tuple(variants), shapes, iters, out)


class _Bound:
    """An op with its operands bound: ``(op)()`` runs it, ``compute_only()`` its GEMM alone."""

    def __init__(self, op, a, b, out=None, gemm_a=None):
        self.op, self.a, self.b, self.out, self.gemm_a = op, a, b, out, gemm_a

    def __call__(self):
        return self.op(self.a, self.b, out=self.out) if self.out is not None else self.op(self.a, self.b)

    def compute_only(self):        # AG's GEMM alone takes the gathered A
        return self.op.compute_only(self.a if self.gemm_a is None else self.gemm_a, self.b)

    @property
    def timeline(self):
        return self.op.timeline

    @timeline.setter
    def timeline(self, t):
        self.op.timeline = t

    def close(self):
        self.op.close()


#: every probe's name (the one-GPU ones first; the rest run under torchrun on 2 GPUs)
NAMES = ("copy_engine", "epilogue", "ag_group", "ag_gather", "moe_notifies", "moe_schedules", "moe_row_copies",
         "moe_power", "moe_dram", "rs_reduce_in", "rs_early_sum", "ag_enqueue", "ag_staging", "ag_handshake", "ag_push",
         "ag_spares",
         "ag_slices", "ag_skew", "rs_order")


#: ``--rows``' defaults: the rows that gather in the GEMM, and those whose rows are staged first
SMALL_EXPERT_ROWS = "qwen3:8192:random,deepseek:8192:random,qwen15:8192:random"
STAGED_ROWS = "mixtral:32768:random,stress:8192:random"
#: moe_power's: the rows furthest below ``_grouped_mm`` and a long one
POWER_ROWS = "mixtral:32768:random,deepseek:8192:random,qwen3:8192:random"


def _parsed_rows(ap, text: str) -> list:
    """``--rows`` as ``bench moe``'s rows, or the parser's one-line error naming the bad one."""
    from .baselines import _parse_row
    try:
        return [_parse_row(r) for r in text.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=NAMES)
    ap.add_argument("--shapes", type=parse_shapes, default=None, help="MxNxK,... (epilogue: K per rank)")
    ap.add_argument("--rows", default=None,
                    help="moe_notifies, moe_schedules, moe_row_copies, moe_power, moe_dram: MODEL:TOKENS:ROUTING,... "
                         f"(bench moe's rows; default {SMALL_EXPERT_ROWS} for moe_notifies, moe_schedules and "
                         f"moe_dram, {STAGED_ROWS} for moe_row_copies, "
                         f"{POWER_ROWS} for moe_power)")
    ap.add_argument("--seconds", type=float, default=2.0,
                    help="moe_power: how long each kernel runs back to back (default 2)")
    ap.add_argument("--layer", choices=("ag", "rs"), default="ag",
                    help="moe_schedules: AllGather+MoE's grouped GEMM (ag) or MoE+ReduceScatter's (rs)")
    ap.add_argument("--schedules", default=None,
                    help="moe_schedules: BMxBNxBK:STAGES[:CLUSTER[:GROUP_M]],... (default: "
                         "128x256x64:4,128x256x64:3,128x256x32:8,128x128x64:6)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed calls per variant and round (default: the probe's own — 30 for the one-GPU "
                         "probes but moe_notifies, moe_schedules and moe_dram (20) and moe_row_copies (7), 80 for ag_skew, "
                         "20 for the others; not copy_engine, which times a fixed 30, nor moe_power, which runs "
                         "for --seconds)")
    return ap


def parse_args(argv, ap: argparse.ArgumentParser | None = None):
    """The probe's arguments, checked (a bad one exits with argparse's usage error)."""
    ap = ap or parser()
    args = ap.parse_args(argv)
    if args.rows is None:
        args.rows = {"moe_row_copies": STAGED_ROWS, "moe_power": POWER_ROWS}.get(args.what, SMALL_EXPERT_ROWS)
    if not args.seconds > 0:
        ap.error(f"--seconds must be positive, got {args.seconds:g}")
    if args.iters is not None and args.what in ("copy_engine", "moe_power"):
        ap.error(f"{args.what} takes no --iters ({'it times a fixed 30 calls' if args.what == 'copy_engine' else 'its kernels run for --seconds'})")
    if args.iters is not None and args.iters < 1:
        ap.error(f"--iters must be positive, got {args.iters}")
    return args


def main(argv) -> int:
    ap = parser()
    args = parse_args(argv, ap)
    its = {} if args.iters is None else {"iters": args.iters}
    if args.what == "copy_engine":
        probe_copy_engine()
    elif args.what == "ag_group":
        probe_ag_group(args.shapes or [(4096, 4096, 8192), (8192, 4096, 8192), (16384, 4096, 8192),
                                       (8192, 14336, 8192), (16384, 14336, 8192)], **its)
    elif args.what == "ag_gather":
        probe_ag_gather(args.shapes or [(2048, 4096, 8192), (8192, 4096, 8192), (16384, 4096, 8192),
                                        (2048, 14336, 8192), (8192, 14336, 8192)], **its)
    elif args.what == "moe_notifies":
        from .moe_probes import probe_moe_notifies
        probe_moe_notifies(_parsed_rows(ap, args.rows), **its)
    elif args.what == "moe_schedules":
        from .moe_probes import DEFAULT_SCHEDULES, parse_schedules, probe_moe_schedules, schedule_kernels
        rows = _parsed_rows(ap, args.rows)
        try:
            schedules = parse_schedules(DEFAULT_SCHEDULES if args.schedules is None else args.schedules)
            kernels = [schedule_kernels(r, schedules, args.layer) for r in rows]   # refusals before any launch
        except (argparse.ArgumentTypeError, ValueError) as e:
            ap.error(str(e))
        probe_moe_schedules(rows, schedules, args.layer, kernels=kernels, **its)
    elif args.what == "moe_row_copies":
        from .moe_probes import probe_moe_row_copies
        probe_moe_row_copies(_parsed_rows(ap, args.rows), **its)
    elif args.what == "moe_power":
        from .moe_power import probe_moe_power
        probe_moe_power(_parsed_rows(ap, args.rows), args.seconds)
    elif args.what == "moe_dram":
        from .moe_dram import probe_moe_dram
        probe_moe_dram(_parsed_rows(ap, args.rows), **its)
    elif args.what == "epilogue":
        probe_epilogue(args.shapes or [(16384, 8192, 4096), (2048, 8192, 4096)], **its)
    else:
        import os
        for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
            os.environ.setdefault(k, v)
        rs_shapes = [(2048, 8192, 8192), (16384, 8192, 8192), (2048, 8192, 28672), (16384, 8192, 28672)]
        if args.what == "rs_reduce_in":
            probe_rs_reduce_in(args.shapes or rs_shapes, **its)
        elif args.what == "rs_order":
            probe_rs_order(args.shapes or [(2048, 8192, 8192), (4096, 8192, 8192), (8192, 8192, 8192),
                                           (2048, 8192, 28672), (4096, 8192, 28672)], **its)
        elif args.what == "rs_early_sum":
            probe_rs_early_sum(args.shapes or [(8192, 8192, 8192)] + rs_shapes, **its)
        else:
            probe = {"ag_enqueue": probe_ag_enqueue, "ag_staging": probe_ag_staging,
                     "ag_handshake": probe_ag_handshake, "ag_push": probe_ag_push,
                     "ag_spares": probe_ag_spares, "ag_slices": probe_ag_slices,
                     "ag_skew": probe_ag_skew}[args.what]
            probe(args.shapes or [(2048, 8192, 8192), (4096, 8192, 8192), (8192, 8192, 8192), (16384, 8192, 8192),
                                  (2048, 28672, 8192)], **its)
    return 0
