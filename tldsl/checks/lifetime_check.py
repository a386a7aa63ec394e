"""Symmetric memory is freed at explicit collective points only, on GPUs (run under torchrun):
for each op and engine, ``close()`` gives the op's symmetric memory back to the driver then and
there, and an op dropped without ``close()`` keeps it — through garbage collection — until
``release_unclosed()`` frees it. Measured with the driver's free-memory count (torch's symmetric
memory sits outside its caching allocator; NVSHMEM's heap is reserved up front, so there the
ledger and the heap's free calls are what is checked).

    torchrun --nproc_per_node=2 -m tldsl.checks.lifetime_check

One PASS/FAIL line per case; exit status 1 on any failure.
"""
from __future__ import annotations

import gc
import sys
import warnings

from .verdict import no_flags, report


def builds(torch):
    """(name, build, (rows, K, N) of the call's A and B): shapes whose symmetric memory is
    64 MiB or more per rank, so the driver's count shows it plainly."""
    from tldsl.ir.schedule import CommSchedule
    from tldsl.runtime.dist import AllGatherMatmul, MatmulReduceScatter
    W = torch.distributed.get_world_size()
    bf = torch.bfloat16
    return [
        ("AllGatherMatmul, the default push", lambda: AllGatherMatmul(2048, 8192, 2048, bf), (2048, 8192, 2048)),
        ("AllGatherMatmul, the pull", lambda: AllGatherMatmul(
            4091, 8192, 2048, bf, comm=CommSchedule(engine="copy_engine", mode="pull")), (4091, 8192, 2048)),
        ("AllGatherMatmul, the SM push", lambda: AllGatherMatmul(
            2048, 8192, 2048, bf, comm=CommSchedule(engine="sm", mode="push", tile_m=128, sms=8)), (2048, 8192, 2048)),
        ("AllGatherMatmul, the SM push over NVSHMEM", lambda: AllGatherMatmul(
            1024, 4096, 2048, bf, comm=CommSchedule(engine="sm", mode="push", tile_m=128, sms=8,
                                                    transport="nvshmem")), (1024, 4096, 2048)),
        ("MatmulReduceScatter, the default copy engine", lambda: MatmulReduceScatter(4096 * W, 2048, 8192, bf),
         (4096 * W, 2048, 8192)),
        ("MatmulReduceScatter, the SM push", lambda: MatmulReduceScatter(4096 * W, 2048, 8192, bf, engine="sm"),
         (4096 * W, 2048, 8192)),
    ]


def _free_bytes(torch, dist) -> int:
    """The driver's free memory once every rank got here (a peer's free of its own mapping of
    our memory counts too: torch's symmetric memory is imported by every peer)."""
    torch.cuda.synchronize()
    dist.barrier()
    return torch.cuda.mem_get_info()[0]


def _lease(op):
    """The lease holding the op's symmetric memory: its own, or — a schedule run as its tile
    program on the fused-op runtime — the program's (the op's own is then empty)."""
    from tldsl.runtime.dist.program_engine import ProgramEngine
    engine = getattr(op, "_engine", None)
    return engine.program._lease if isinstance(engine, ProgramEngine) else op._lease


def _held(op) -> tuple[int, int]:
    """(bytes of torch symmetric memory, blocks) the op's lease holds."""
    from tldsl.runtime.dist import symmetric as sym
    blocks = sym._LEDGER[_lease(op).key].blocks
    return sum(b.tensor.untyped_storage().nbytes() for b in blocks if b.tensor is not None), len(blocks)


def _fresh(build, torch, dist, shape):
    """An op built and called three times; the bytes and blocks its lease holds, its key, and
    the driver's free memory now."""
    op = build()
    rows, k, n = shape
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        op(a, b)
    held, blocks = _held(op)
    return op, held, blocks, _lease(op).key, _free_bytes(torch, dist)


def check(name, build, shape, torch, dist) -> list[tuple[str, bool, str]]:
    from tldsl.runtime.dist import symmetric as sym
    MiB = 2 ** 20
    out = []
    # close(): freed then and there, nothing lingers, nothing warns
    op, held, blocks, key, before = _fresh(build, torch, dist, shape)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        op.close()
    back = _free_bytes(torch, dist) - before
    warned = [str(w.message) for w in seen if issubclass(w.category, sym.SymmetricMemoryWarning)]
    good = key not in sym._LEDGER and not warned and back >= 0.95 * held
    out.append((f"{name}: close() frees", good, f"{blocks} block(s), {held / MiB:.1f} MiB of torch symmetric memory "
                f"held, {back / MiB:.1f} MiB back to the driver at close(){'; ' + warned[0] if warned else ''}"))
    del op
    # dropped without close(): through the collector nothing goes; release_unclosed() frees it
    op, held, blocks, key, before = _fresh(build, torch, dist, shape)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del op
        gc.collect()
    kept = before - _free_bytes(torch, dist)
    warned = any(issubclass(w.category, sym.SymmetricMemoryWarning) and "dropped without close" in str(w.message)
                 for w in seen)
    state = sym._LEDGER[key].state if key in sym._LEDGER else "freed"
    before = _free_bytes(torch, dist)
    n = sym.release_unclosed()
    back = _free_bytes(torch, dist) - before
    good = warned and state == "dropped" and abs(kept) < max(0.05 * held, 8 * MiB) and n == 1 and \
        key not in sym._LEDGER and back >= 0.95 * held
    out.append((f"{name}: dropped, kept until release_unclosed()", good,
                f"warned {warned}, ledger '{state}', {kept / MiB:+.1f} MiB freed by the drop and gc.collect(); "
                f"release_unclosed() freed {n} lease(s), {back / MiB:.1f} MiB back of {held / MiB:.1f}"))
    return out


def run(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from tldsl.runtime.dist.group import init_ranks
    init_ranks()
    results = []
    for name, build, shape in builds(torch):
        try:
            results += check(name, build, shape, torch, dist)
        except Exception as e:      # noqa: BLE001 - a failed case is reported, the others still run
            results.append((name, False, f"{type(e).__name__}: {e}"))
    return report("lifetime_check", results)


if __name__ == "__main__":
    no_flags("lifetime_check", __doc__)
    sys.exit(run())
