"""The fused ops as torch custom ops, with PyTorch's async-TP signatures, so users can swap
them in for ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``:

    import tldsl.torch_ops  # registers torch.ops.tldsl.*
    a_full, [c] = torch.ops.tldsl.fused_all_gather_matmul(a_shard, [b], 0, group_name)
    out = torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

Each distinct (shapes, dtype, group) builds one op object the first time it is called — a
collective point (symmetric allocation), which every rank reaches because the op itself is
collective — and keeps it until :func:`close_all` (also collective). Fake (meta)
implementations give torch.compile the output shapes.
"""
from __future__ import annotations

import torch

from .errors import InputError
from .runtime.dist.operands import dense

_OPS: dict = {}


def built_ops() -> list:
    """The op objects the torch ops have built so far (one per shapes, dtype and group)."""
    return list(_OPS.values())


def close_all() -> None:
    """Release every op the torch ops built (collective: every rank at the same point, as
    ``torch.distributed.destroy_process_group``); the next call builds afresh."""
    ops = list(_OPS.values())
    _OPS.clear()
    first = None
    for op in ops:                  # every one, even after one fails; then the first error
        try:
            op.close()
        except Exception as e:      # noqa: BLE001 - re-raised below
            first = first or e
    if first is not None:
        raise first


def _group(group_name: str):
    from .runtime.dist.group import resolve_group
    return resolve_group(group_name)


def _check_ag(a_shard: torch.Tensor, bs: list[torch.Tensor], gather_dim: int):
    if gather_dim != 0:
        raise InputError(f"fused_all_gather_matmul gathers along dim 0 (rows of A); got gather_dim={gather_dim}")
    if a_shard.dim() != 2:
        raise InputError(f"A shard must be 2-d [M/W, K], got shape {tuple(a_shard.shape)}")
    if not bs:
        raise InputError("fused_all_gather_matmul needs at least one B")
    for i, b in enumerate(bs):
        if b.dim() != 2 or b.shape[0] != a_shard.shape[1]:
            raise InputError(f"B[{i}] has shape {tuple(b.shape)}; it must be [K={a_shard.shape[1]}, N]")
        if b.dtype != a_shard.dtype:
            raise InputError(f"B[{i}] is {b.dtype} but A is {a_shard.dtype}")
    if a_shard.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"fused ops take bf16 or fp16, got {a_shard.dtype}")


def _check_rs(a: torch.Tensor, b: torch.Tensor, reduce_op: str, scatter_dim: int):
    if reduce_op not in ("sum", "avg"):
        raise InputError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    if scatter_dim != 0:
        raise InputError(f"fused_matmul_reduce_scatter scatters along dim 0; got scatter_dim={scatter_dim}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise InputError(f"A {tuple(a.shape)} @ B {tuple(b.shape)}: need 2-d with matching K")
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"A and B must both be bf16 or fp16, got {a.dtype} and {b.dtype}")


def _check_devices(what: str, tensors) -> None:
    """Every operand on this rank's current GPU, before an op is built for them (building one is
    collective: compiles and allocates symmetric memory)."""
    here = torch.cuda.current_device() if torch.cuda.is_available() else None
    for name, t in tensors:
        if not t.is_cuda:
            raise InputError(f"{what}: {name} must be a CUDA tensor (it is on {t.device})")
        if t.device.index != here:
            raise InputError(f"{what}: {name} is on {t.device}, but this rank's current device is cuda:{here} "
                             f"(torch.cuda.set_device(local_rank) before the call)")


@torch.library.custom_op("tldsl::fused_all_gather_matmul", mutates_args=())
def fused_all_gather_matmul(a_shard: torch.Tensor, bs: list[torch.Tensor], gather_dim: int,
                            group_name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(all_gather(A_shard, dim=0), [A_gathered @ B for B in bs])``: the first product is fused
    with the all-gather (per-tile waits); the others reuse the gathered A."""
    _check_ag(a_shard, bs, gather_dim)
    group = _group(group_name)
    _check_devices("fused_all_gather_matmul", [("A shard", a_shard)] + [(f"B[{i}]", b) for i, b in enumerate(bs)])
    from .runtime.dist import AllGatherMatmul
    key = ("ag", tuple(a_shard.shape), tuple(bs[0].shape), a_shard.dtype, group_name)
    op = _OPS.get(key)
    if op is None:
        op = _OPS[key] = AllGatherMatmul(a_shard.shape[0], a_shard.shape[1], bs[0].shape[1], a_shard.dtype,
                                         group=group)
    a_full, c0 = op(a_shard, dense(bs[0]))            # (a strided or unaligned shard: the op copies it)
    return a_full, [c0] + [torch.mm(a_full, b) for b in bs[1:]]


@fused_all_gather_matmul.register_fake
def _(a_shard, bs, gather_dim, group_name):
    _check_ag(a_shard, bs, gather_dim)
    import torch.distributed as dist
    W = dist.get_world_size(_group(group_name)) if dist.is_initialized() else 1
    a_full = a_shard.new_empty((W * a_shard.shape[0], a_shard.shape[1]))
    return a_full, [a_shard.new_empty((W * a_shard.shape[0], b.shape[1])) for b in bs]


@torch.library.custom_op("tldsl::fused_matmul_reduce_scatter", mutates_args=())
def fused_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, reduce_op: str, scatter_dim: int,
                                group_name: str) -> torch.Tensor:
    """``reduce_scatter(A @ B, reduce_op, dim=0)`` with the reduction fused behind the GEMM."""
    _check_rs(a, b, reduce_op, scatter_dim)
    group = _group(group_name)
    _check_devices("fused_matmul_reduce_scatter", [("A", a), ("B", b)])
    from .runtime.dist import MatmulReduceScatter
    key = ("rs", tuple(a.shape), tuple(b.shape), a.dtype, group_name)
    op = _OPS.get(key)
    if op is None:
        op = _OPS[key] = MatmulReduceScatter(a.shape[0], a.shape[1], b.shape[1], a.dtype, group=group)
    out = op(dense(a), dense(b))
    if reduce_op == "avg":
        out = out / op.ctx.world_size
    return out


@fused_matmul_reduce_scatter.register_fake
def _(a, b, reduce_op, scatter_dim, group_name):
    _check_rs(a, b, reduce_op, scatter_dim)
    import torch.distributed as dist
    W = dist.get_world_size(_group(group_name)) if dist.is_initialized() else 1
    if a.shape[0] % W:
        raise InputError(f"M={a.shape[0]} is not divisible by the world size {W}")
    return a.new_empty((a.shape[0] // W, b.shape[1]))
