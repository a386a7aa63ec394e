"""Ranks that build a fused op differently, or call one after ``close()``, on GPUs (run under
torchrun): every rank must raise an InputError — none may hang in the op's collectives. And the
inputs an op copies rather than refuses: an unaligned A shard on every AllGather+GEMM path
(the default push, the pull, the SM push) gives the right result.

    torchrun --nproc_per_node=2 -m tldsl.checks.build_check

One PASS/FAIL line per case; exit status 1 on any failure.
"""
from __future__ import annotations

import sys

from .dist_check import compare
from .verdict import no_flags, report


def cases(torch, r: int):
    """(name, build, what every rank's error must say) — rank 0 and the others differ."""
    from tldsl.runtime.dist import AllGatherMatmul, MatmulReduceScatter
    return [
        ("AllGatherMatmul, dtypes differ",
         lambda: AllGatherMatmul(1024, 1024, 1024, torch.bfloat16 if r == 0 else torch.float16),
         "the ranks built it differently — dtype"),
        ("AllGatherMatmul, one rank's K is invalid",
         lambda: AllGatherMatmul(1024, 1024 if r == 0 else 1020, 1024, torch.bfloat16),
         "K=1020" if r else "could not build it"),
        ("MatmulReduceScatter, K differs",
         lambda: MatmulReduceScatter(2048, 1024 if r == 0 else 2048, 1024, torch.bfloat16),
         "the ranks built it differently — K"),
    ]


def run(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from tldsl.errors import InputError
    from tldsl.runtime.dist import AllGatherMatmul
    from tldsl.runtime.dist.group import init_ranks
    init_ranks()
    r = dist.get_rank()
    results = []
    for name, build, want in cases(torch, r):
        try:
            build()
            results.append((name, False, "built"))
        except InputError as e:
            results.append((name, want in str(e), str(e)))
    from tldsl.ir.schedule import CommSchedule
    W = dist.get_world_size()
    for name, kw in (("the default push", {}), ("the pull", {"comm": CommSchedule(engine="copy_engine", mode="pull")}),
                     ("the SM push", {"comm": CommSchedule(engine="sm", mode="push", tile_m=128, sms=8)})):
        op = AllGatherMatmul(1024, 1024, 512, torch.bfloat16, **kw)
        a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) / 8
        raw = torch.empty(a.numel() + 1, device="cuda", dtype=torch.bfloat16)
        shard = raw[1:].view(1024, 1024)            # 2 bytes past an aligned start
        shard.copy_(a)
        got_a, got_c = op(shard, b)
        ref_a = torch.empty(W * 1024, 1024, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(ref_a, a)
        res = compare(got_c, ref_a.float() @ b.float())
        good = torch.equal(got_a, ref_a) and res["ok"]
        results.append((f"an unaligned A shard, {name}", good, "right" if good else res["detail"] or "A differs"))
        torch.cuda.synchronize()
        op.close()
    op = AllGatherMatmul(1024, 1024, 1024, torch.bfloat16)
    op.close()
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    try:
        op(x, x)
        results.append(("a call after close()", False, "ran"))
    except InputError as e:
        results.append(("a call after close()", "was closed" in str(e), str(e)))
    return report("build_check", results)


if __name__ == "__main__":
    no_flags("build_check", __doc__)
    sys.exit(run())
