"""The drop-in torch ops on GPUs, beside PyTorch's own async-TP ops (run under torchrun):

    torchrun --nproc_per_node=2 -m tldsl.checks.torch_ops_check [--iters 3]

For bf16 and fp16, with odd rows per rank (the pull) and whole tiles (the default push):
``torch.ops.tldsl.fused_all_gather_matmul(a, [b0, b1], 0, group)`` — the gathered A bit for bit
NCCL's all-gather, every product against an fp32 matmul, the outputs shaped as
``torch.ops.symm_mem.fused_all_gather_matmul``'s — and ``torch.ops.tldsl.fused_matmul_reduce_scatter``
with ``"sum"`` and ``"avg"`` against NCCL's reduce-scatter of the products
(:func:`~.dist_check.rs_reference`), shaped as async-TP's; each call with fresh inputs and the
ops' workspaces refilled with noise first; inputs also given as strided and unaligned views (the
ops copy them); N-d A (``[batch, seq, hidden]``) with every gather / scatter dim (the last
one too) and ``return_A=False``, element-wise against torch's ops on the same inputs, shapes and
strides equal; and both ops traced by ``torch.compile`` (``aot_eager``: the fake
implementations give the shapes, the real ones run). One PASS/FAIL line
per check; exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import sys

from .dist_check import compare, rs_reference


def _noise_in_workspaces():
    """Refill every built op's workspaces with noise: a result must not depend on them."""
    from tldsl import torch_ops
    for op in torch_ops.built_ops():
        for t in op.workspace_tensors().values():
            if t.dtype.is_floating_point:
                t.normal_()
            else:
                t.random_(0, 1 << 30)


def _views(torch, x, how: str):
    """``x`` as a strided (a column window of a wider tensor) or unaligned (starting 2 bytes into
    an allocation) view with the same values."""
    if how == "strided":
        wide = torch.empty(x.shape[0], x.shape[1] + 8, dtype=x.dtype, device=x.device)
        wide[:, :x.shape[1]] = x
        return wide[:, :x.shape[1]]
    raw = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    v = raw[1:].view(x.shape)
    v.copy_(x)
    return v


def check_all_gather(torch, dist, gname, dt, rows, k, ns, how, compiled=False):
    W = dist.get_world_size()
    a = torch.randn(rows, k, device="cuda", dtype=dt)
    bs = [torch.randn(k, n, device="cuda", dtype=dt) / 8 for n in ns]
    a_in = a if how == "dense" else _views(torch, a, how)
    b_in = [bs[0] if how == "dense" else _views(torch, bs[0], how)] + bs[1:]
    _noise_in_workspaces()
    torch.cuda.synchronize()
    dist.barrier()
    fn = lambda x, ys: torch.ops.tldsl.fused_all_gather_matmul(x, ys, 0, gname)      # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got_a, got_cs = fn(a_in, b_in)
    ref_a = torch.empty(W * rows, k, device="cuda", dtype=dt)
    dist.all_gather_into_tensor(ref_a, a)
    theirs_a, theirs_cs = torch.ops.symm_mem.fused_all_gather_matmul(a, bs, gather_dim=0, group_name=gname)
    problems = []
    if not torch.equal(got_a, ref_a):
        problems.append("gathered A differs from NCCL's all-gather")
    if [tuple(got_a.shape)] + [tuple(c.shape) for c in got_cs] != \
            [tuple(theirs_a.shape)] + [tuple(c.shape) for c in theirs_cs]:
        problems.append("outputs shaped unlike torch async-TP's")
    for i, (c, b) in enumerate(zip(got_cs, bs)):
        res = compare(c, ref_a.float() @ b.float())
        if not res["ok"]:
            problems.append(f"C[{i}]: {res['detail']}")
    return problems


def check_reduce_scatter(torch, dist, gname, dt, m, k, n, how, reduce_op, compiled=False):
    W = dist.get_world_size()
    a = torch.randn(m, k, device="cuda", dtype=dt)
    b = torch.randn(k, n, device="cuda", dtype=dt) / 8
    a_in, b_in = (a, b) if how == "dense" else (_views(torch, a, how), _views(torch, b, how))
    _noise_in_workspaces()
    torch.cuda.synchronize()
    dist.barrier()
    fn = lambda x, y: torch.ops.tldsl.fused_matmul_reduce_scatter(x, y, reduce_op, 0, gname)      # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = fn(a_in, b_in)
    slack, ref = rs_reference(a, b, W)
    if reduce_op == "avg":
        ref, slack = ref / W, slack / W
    theirs = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, reduce_op, scatter_dim=0, group_name=gname)
    problems = []
    if tuple(got.shape) != tuple(theirs.shape) or got.dtype != theirs.dtype:
        problems.append(f"output {tuple(got.shape)} {got.dtype}, async-TP's {tuple(theirs.shape)} {theirs.dtype}")
    res = compare(got, ref, slack=slack)
    if not res["ok"]:
        problems.append(res["detail"])
    return problems


def check_nd_all_gather(torch, dist, gname, dt, shape, gather_dim, return_A):
    """An N-d shard gathered along ``gather_dim``: ours beside torch's on the same inputs."""
    W = dist.get_world_size()
    last = gather_dim % len(shape) == len(shape) - 1
    a = torch.randn(*shape, device="cuda", dtype=dt)
    b = torch.randn(shape[-1] * (W if last else 1), 264, device="cuda", dtype=dt) / 8
    _noise_in_workspaces()
    got_a, (got_c,) = torch.ops.tldsl.fused_all_gather_matmul(a, [b], gather_dim, gname, return_A=return_A)
    theirs_a, (theirs_c,) = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim, gname, return_A=return_A)
    problems = []
    if (got_a is None) != (theirs_a is None) or (got_a is not None and not torch.equal(got_a, theirs_a)):
        problems.append("gathered A differs from torch's")
    for name, ours, theirs in (("A", got_a, theirs_a), ("C", got_c, theirs_c)):
        if ours is not None and theirs is not None and (ours.shape, ours.stride()) != (theirs.shape, theirs.stride()):
            problems.append(f"{name} {tuple(ours.shape)} strides {ours.stride()}, torch's {tuple(theirs.shape)} "
                            f"strides {theirs.stride()}")
    res = compare(got_c, theirs_c.float())
    if not res["ok"]:
        problems.append(f"C: {res['detail']}")
    return problems


def check_nd_reduce_scatter(torch, dist, gname, dt, shape, scatter_dim, reduce_op):
    """An N-d A reduce-scattered along ``scatter_dim``: ours beside torch's on the same inputs."""
    a = torch.randn(*shape, device="cuda", dtype=dt)
    b = torch.randn(shape[-1], 264, device="cuda", dtype=dt) / 8
    _noise_in_workspaces()
    got = torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, reduce_op, scatter_dim, gname)
    theirs = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, reduce_op, scatter_dim, gname)
    if (got.shape, got.stride(), got.dtype) != (theirs.shape, theirs.stride(), theirs.dtype):
        return [f"output {tuple(got.shape)} strides {got.stride()} {got.dtype}, torch's {tuple(theirs.shape)} "
                f"strides {theirs.stride()} {theirs.dtype}"]
    res = compare(got, theirs.float())
    return [] if res["ok"] else [res["detail"]]


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node=2 -m tldsl.checks.torch_ops_check")
    ap.add_argument("--iters", type=int, default=3, help="calls per check, each with fresh inputs")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    import tldsl.torch_ops  # noqa: F401 - registers torch.ops.tldsl.*
    from tldsl.runtime.dist.group import init_ranks
    gname = init_ranks()
    r, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7 + r)
    rows, k, n, n2 = 4091, 1032, 3000, 520           # odd rows per rank; K, N whole 16-byte rows
    checks = []
    for dt in (torch.bfloat16, torch.float16):
        for ag_rows, path in ((rows, "pull"), (1024, "push")):      # whole tiles per rank: the default push
            for how in ("dense", "strided", "unaligned"):
                checks.append((f"fused_all_gather_matmul {dt} {how}, {ag_rows} rows per rank ({path})",
                               lambda dt=dt, how=how, ag_rows=ag_rows:
                               check_all_gather(torch, dist, gname, dt, ag_rows, k, (n, n2), how)))
        for op in ("sum", "avg"):
            checks.append((f"fused_matmul_reduce_scatter {op} {dt}",
                           lambda dt=dt, op=op: check_reduce_scatter(torch, dist, gname, dt, W * rows, k, n,
                                                                     "dense", op)))
        checks.append((f"fused_matmul_reduce_scatter sum {dt} unaligned",
                       lambda dt=dt: check_reduce_scatter(torch, dist, gname, dt, W * rows, k, n, "unaligned", "sum")))
    for gd in (0, 1, -1):                            # [batch, seq, hidden]: batch, sequence, hidden (unfused)
        for ret in (True, False):
            checks.append((f"fused_all_gather_matmul [2, 1536, 1032] bf16 gather_dim={gd} return_A={ret}",
                           lambda gd=gd, ret=ret: check_nd_all_gather(torch, dist, gname, torch.bfloat16,
                                                                      (2, 1536, 1032), gd, ret)))
    for sd in (0, 1, 2):
        checks.append((f"fused_matmul_reduce_scatter [{2 * W}, 3072, 1032] bf16 scatter_dim={sd}",
                       lambda sd=sd: check_nd_reduce_scatter(torch, dist, gname, torch.bfloat16, (2 * W, 3072, 1032),
                                                             sd, "sum")))
    checks.append(("torch.compile(fused_all_gather_matmul)",
                   lambda: check_all_gather(torch, dist, gname, torch.bfloat16, rows, k, (n,), "dense", True)))
    checks.append(("torch.compile(fused_matmul_reduce_scatter)",
                   lambda: check_reduce_scatter(torch, dist, gname, torch.bfloat16, W * rows, k, n, "dense", "sum",
                                                True)))
    failed = 0
    for name, fn in checks:
        problems = []
        for _ in range(args.iters):
            problems += fn()
        ok = torch.tensor([0.0 if problems else 1.0], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        passed = ok.item() > 0.5
        failed += not passed
        if r == 0 or problems:
            mine = f" [rank {r}] " + "; ".join(problems[:3]) if problems else ""
            print(f"torch_ops_check {name}: {'PASS' if passed else 'FAIL'} ({args.iters} calls){mine}", flush=True)
    tldsl.torch_ops.close_all()                      # collective: every rank, same point
    torch.cuda.synchronize()
    dist.barrier()
    if r == 0:
        print(f"torch_ops_check: {'all passed' if not failed else f'{failed} check(s) FAILED'}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
