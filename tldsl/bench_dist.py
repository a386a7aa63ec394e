"""Distributed benchmarks (run under torchrun): our fused ops beside the peers, one run.

    torchrun --nproc_per_node=2 -m tldsl.bench ag_gemm [--shapes MxNxK,...] [--iters 20]

Columns: ours, sequential NCCL all-gather + cuBLAS, PyTorch async-TP
(``torch.ops.symm_mem.fused_all_gather_matmul``), NCCL comm alone, cuBLAS GEMM alone,
ideal = max(comm, gemm), and ratios. M, N, K are the global sizes: A shards are
[M/W, K], B is the column shard [K, N/W] (tensor-parallel MLP up-projection).
Each time is the median over iterations of the slowest rank (barrier before each).
"""
from __future__ import annotations

import statistics
import sys

AG_SHAPES = [(m, n, 8192) for n in (28672, 8192) for m in (2048, 4096, 8192, 16384)]


def _bench(fn, iters=20, warm=5):
    import torch
    import torch.distributed as dist
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    t = torch.tensor([statistics.median(ts)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_ag_gemm(shapes, iters, out=sys.stdout):
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist import AllGatherMatmul
    r, W = dist.get_rank(), dist.get_world_size()
    gname = dist.group.WORLD.group_name
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        enable_symm_mem_for_group(gname)
    except Exception:   # noqa: BLE001 - newer torch needs no enabling
        pass
    dt = torch.bfloat16
    rows = []
    for (M, N, K) in shapes:
        torch.manual_seed(1234 + r)
        a = torch.randn(M // W, K, device="cuda", dtype=dt)
        b = torch.randn(K, N // W, device="cuda", dtype=dt)
        ag = torch.empty(M, K, device="cuda", dtype=dt)
        op = AllGatherMatmul(M // W, K, N // W, dt)
        # correctness first: against NCCL all-gather + cuBLAS, workspace poisoned
        got_a, got_c = op(a, b, poison_workspace=True)
        dist.all_gather_into_tensor(ag, a)
        ref = torch.mm(ag, b)
        torch.cuda.synchronize()
        ok_a = torch.equal(got_a, ag)
        err = (got_c.float() - ref.float()).abs().max().item()
        ok = ok_a and err <= 2e-2 * ref.float().abs().max().item() + 1e-2 and not torch.isnan(got_c).any().item()
        t_ag = _bench(lambda: dist.all_gather_into_tensor(ag, a), iters)
        t_gemm = _bench(lambda: torch.mm(ag, b), iters)
        t_seq = _bench(lambda: (dist.all_gather_into_tensor(ag, a), torch.mm(ag, b)), iters)
        try:
            t_atp = _bench(lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0,
                                                                              group_name=gname), iters)
        except Exception as ex:   # noqa: BLE001
            print(f"# async-TP failed: {ex!r:.200}", file=sys.stderr)
            t_atp = float("nan")
        t_ours = _bench(lambda: op(a, b), iters)
        ideal = max(t_ag, t_gemm)
        rows.append(dict(M=M, N=N, K=K, W=W, ours=t_ours, seq=t_seq, asynctp=t_atp, comm=t_ag, gemm=t_gemm,
                         ideal=ideal, correct=ok, max_err=err))
        if r == 0:
            print(f"# {M}x{N}x{K}: ours {t_ours:.3f} ms, seq {t_seq:.3f}, async-TP {t_atp:.3f}, ideal {ideal:.3f}"
                  f"{'' if ok else '  WRONG RESULT'}", file=out, flush=True)
        del op
    if r == 0:
        print("\n| M | N | K | ours ms | NCCL+cuBLAS seq ms | torch async-TP ms | NCCL AG ms | cuBLAS GEMM ms | "
              "ideal ms | ours/ideal | ours/seq | ours/async-TP | correct |", file=out)
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
        for d in rows:
            print(f"| {d['M']} | {d['N']} | {d['K']} | {d['ours']:.3f} | {d['seq']:.3f} | {d['asynctp']:.3f} | "
                  f"{d['comm']:.3f} | {d['gemm']:.3f} | {d['ideal']:.3f} | {d['ours'] / d['ideal']:.3f} | "
                  f"{d['ours'] / d['seq']:.3f} | {d['ours'] / d['asynctp']:.3f} | {'yes' if d['correct'] else 'NO'} |",
                  file=out)
    return rows


def main(what, argv):
    import argparse
    import os
    import torch
    import torch.distributed as dist
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    ap = argparse.ArgumentParser(prog=f"torchrun ... -m tldsl.bench {what}")
    ap.add_argument("--shapes", default=None, help="MxNxK,... (global sizes)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else AG_SHAPES
    try:
        if what == "ag_gemm":
            bench_ag_gemm(shapes, args.iters)
        else:
            raise SystemExit(f"unknown distributed benchmark {what!r}")
    finally:
        dist.destroy_process_group()
    return 0
