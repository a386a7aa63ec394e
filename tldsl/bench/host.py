"""Where a fused launch's time goes on the host (run under torchrun).

    torchrun --nproc_per_node=2 -m tldsl.bench host [--shape 2048x8192x8192]

For each fused op (AG+GEMM with its default schedule, without spare outputs and pulling; GEMM+RS): the host time of one
call with the device idle before it (the benchmark's condition) and, within it, the host time
until the op's first kernel is handed to the driver and until that call returned (torch.mm's
whole call beside it, for scale), the time per launch back to back, and three phase timelines with the host time at which each phase was enqueued
(:meth:`~tldsl.runtime.dist.timeline.PhaseTimeline.format` with ``host=True``). Where a
phase's device time equals its host time, the device was waiting for the host: the launch is
host-bound, and shaving Python off the launch path moves the op's time one for one.
"""
from __future__ import annotations

import os
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


def parse_args(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="torchrun ... -m tldsl.bench host")
    ap.add_argument("--shape", default="2048x8192x8192", help="global MxNxK")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)
    args = parse_args(argv)
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
    from tldsl.ir.schedule import CommSchedule
    from tldsl.runtime.gpu import launch as launch_mod
    pull = CommSchedule(engine="copy_engine", mode="pull")
    ops = {"ag_gemm (default)": (lambda: AllGatherMatmul(M // W, K, N // W, dt), (a, b)),
           "ag_gemm (no spare outputs)": (lambda: AllGatherMatmul(M // W, K, N // W, dt, spare_outputs=False), (a, b)),
           "ag_gemm pull": (lambda: AllGatherMatmul(M // W, K, N // W, dt, comm=pull), (a, b)),
           "gemm_rs": (lambda: MatmulReduceScatter(M, K // W, N, dt), (a2, b2))}
    mm = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        mm.append(1e3 * (time.perf_counter() - t0))
    mm.sort()
    print(f"[rank {r}] torch.mm {M}x{N // W}x{K}: host ms per call (idle device) median {mm[len(mm) // 2]:.3f}",
          flush=True)
    first = []                          # host time of the call's first prepared kernel launch: (entered, returned)
    real_launch = launch_mod.PreparedLaunch.launch

    def timed_launch(self, stream, launch_index=None):
        t = time.perf_counter()
        real_launch(self, stream, launch_index)
        if first and first[-1] is None:
            first[-1] = (t, time.perf_counter())
    for name, (make, call_args) in ops.items():
        op = make()
        for _ in range(10):
            op(*call_args)
        host, to_launch, launched = [], [], []
        launch_mod.PreparedLaunch.launch = timed_launch
        try:
            for _ in range(30):
                torch.cuda.synchronize()
                dist.barrier()
                first.append(None)
                t0 = time.perf_counter()
                op(*call_args)
                host.append(1e3 * (time.perf_counter() - t0))
                if first[-1] is not None:
                    to_launch.append(1e3 * (first[-1][0] - t0))
                    launched.append(1e3 * (first[-1][1] - t0))
        finally:
            launch_mod.PreparedLaunch.launch = real_launch
        torch.cuda.synchronize()
        host.sort(), to_launch.sort(), launched.sort()
        kernel = (f"; first kernel handed to the driver at {to_launch[len(to_launch) // 2]:.3f}, enqueued at "
                  f"{launched[len(launched) // 2]:.3f}" if to_launch else "")
        print(f"[rank {r}] {args.shape} {name} ({getattr(op, 'engine', '')}): host ms per call (idle device) median "
              f"{host[len(host) // 2]:.3f}, min {host[0]:.3f}{kernel}; back to back "
              f"{_event_ms(lambda: op(*call_args), 50):.3f} ms per launch", flush=True)
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
    return 0

