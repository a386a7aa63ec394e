"""CUDA-event timing on one GPU, shared by the GEMM benchmark and the probes (the distributed
benchmarks time every rank together: :func:`tldsl.bench.dist.bench_interleaved`)."""
from __future__ import annotations

import contextlib
import random
import statistics


def on_device() -> str:
    """`` on <the GPU's name>`` for a benchmark's header (a table's figures compare only with figures
    from the same kind of card), or nothing where torch sees no GPU."""
    try:
        import torch
        return f" on {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    except ImportError:
        return ""


def median_ms(fn, iters: int, warmup: int = 5, sleep_cycles: int = 0) -> float:
    """Median milliseconds of ``fn`` over ``iters`` launches, timed with CUDA events.
    ``sleep_cycles``: each timed launch queued behind a GPU sleep that long, so that a host
    enqueue slower than the device (tens of thousands of copies) is not timed as device time."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if sleep_cycles:
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_of(nbytes: int):
    """A device-to-device copy moving ``nbytes`` in all, half read and half written: what a pass
    that must move those bytes is bound by (a memory-bound program, the MoE combine or row gather),
    timed beside it."""
    import torch
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def launch_order(n: int, run: int = 0) -> list[int]:
    """The order ``interleaved_ms`` launches ``n`` functions in, every round of a timing: as given
    for ``run`` 0, else a permutation drawn with ``run`` as the seed. Rounds repeat back to back,
    so the function launched before each (whose L2 lines and clocks it inherits) only changes
    with the permutation."""
    if run == 0:
        return list(range(n))
    return random.Random(run).sample(range(n), n)


def interleaved_ms(fns, iters: int, warmup: int = 5, run: int = 0) -> list[float]:
    """Median ms of each function (in ``fns``' order), timed alternately launch by launch so that
    clock and thermal drift hit all of them alike; each round launches them in
    :func:`launch_order` for ``run``."""
    import torch
    order = launch_order(len(fns), run)
    for _ in range(warmup):
        for i in order:
            fns[i]()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(iters):
        for i in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[i]()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return [statistics.median(ts) for ts in times]


@contextlib.contextmanager
def fresh_placement(run: int, step_mib: int = 3):
    """For a benchmark's ``run``-th repeat: the CUDA caching allocator's free blocks handed back
    to the driver, then ``run * step_mib + 1`` MiB held for the block, so that the tensors the run
    allocates come from new driver allocations, after a ballast of another size — most likely at
    other addresses than the last run's (the driver places them). A kernel's time can depend on
    where its operands lie; one placement is one draw."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ballast = torch.empty((run * step_mib + 1) << 20, dtype=torch.uint8, device="cuda")
    try:
        yield
    finally:
        del ballast
