"""Where a fused launch's time goes on the host (run under torchrun).

    torchrun --nproc_per_node=2 -m tldsl.bench_host [--shape 2048x8192x8192]

For each fused op (AG+GEMM with either handshake, GEMM+RS): the host time of one call with the
device idle before it (the benchmark's condition), the time per launch back to back, and
three phase timelines with the host time at which each phase was enqueued
(:meth:`~tldsl.runtime.dist.timeline.PhaseTimeline.format` with ``host=True``). Where a
phase's device time equals its host time, the device was waiting for the host: the launch is
host-bound, and shaving Python off the launch path moves the op's time one for one.
"""
from __future__ import annotations

import os
import sys
import time


def _event_ms(fn, n: int = 20) -> float:
    import torch
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def main(argv=None) -> None:
    import argparse
    import torch
    import torch.distributed as dist
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    ap = argparse.ArgumentParser(prog="torchrun ... -m tldsl.bench_host")
    ap.add_argument("--shape", default="2048x8192x8192", help="global MxNxK")
    args = ap.parse_args(argv)
    M, N, K = (int(x) for x in args.shape.lower().split("x"))
    dist.init_process_group("nccl")
    r, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", r)))
    from tldsl.runtime.dist import AllGatherMatmul, MatmulReduceScatter
    from tldsl.runtime.dist.timeline import PhaseTimeline
    dt = torch.bfloat16
    a = torch.randn(M // W, K, device="cuda", dtype=dt)
    b = torch.randn(K, N // W, device="cuda", dtype=dt)
    a2 = torch.randn(M, K // W, device="cuda", dtype=dt)
    b2 = torch.randn(K // W, N, device="cuda", dtype=dt)
    ops = {"ag_gemm handshake=memops": (lambda: AllGatherMatmul(M // W, K, N // W, dt, handshake="memops"), (a, b)),
           "ag_gemm handshake=kernel": (lambda: AllGatherMatmul(M // W, K, N // W, dt, handshake="kernel"), (a, b)),
           "gemm_rs": (lambda: MatmulReduceScatter(M, K // W, N, dt), (a2, b2))}
    for name, (make, call_args) in ops.items():
        op = make()
        for _ in range(10):
            op(*call_args)
        host = []
        for _ in range(30):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            op(*call_args)
            host.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        host.sort()
        print(f"[rank {r}] {args.shape} {name}: host ms per call (idle device) median {host[len(host) // 2]:.3f}, "
              f"min {host[0]:.3f}; back to back {_event_ms(lambda: op(*call_args), 50):.3f} ms per launch", flush=True)
        for i in range(3):
            op.timeline = PhaseTimeline()
            torch.cuda.synchronize()
            dist.barrier()
            op(*call_args)
            torch.cuda.synchronize()
            print(op.timeline.format(f"[rank {r}] {name} #{i}: ", host=True), flush=True)
            op.timeline = None
        op.close()
        del op
        torch.cuda.synchronize()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
