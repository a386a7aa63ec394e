"""CUDA-event timing on one GPU, shared by the GEMM benchmark and the probes (the distributed
benchmarks time every rank together: :func:`tldsl.bench.dist.bench_interleaved`)."""
from __future__ import annotations

import statistics


def median_ms(fn, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn`` over ``iters`` launches, timed with CUDA events."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def interleaved_ms(fns, iters: int, warmup: int = 5) -> list[float]:
    """Median ms of each function, timed alternately launch by launch so that clock and
    thermal drift hit all of them alike."""
    import torch
    for _ in range(warmup):
        for f in fns:
            f()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(iters):
        for f, ts in zip(fns, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end))
    return [statistics.median(ts) for ts in times]
