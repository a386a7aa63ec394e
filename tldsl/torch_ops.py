"""The fused ops as torch custom ops, with PyTorch's async-TP signatures, so users can swap
them in for ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``:

    import tldsl.torch_ops  # registers torch.ops.tldsl.*
    a_full, [c] = torch.ops.tldsl.fused_all_gather_matmul(a_shard, [b], 0, group_name)
    out = torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

They take what torch's take: an N-d ``A`` (``[batch, seq, hidden]``), any ``gather_dim`` /
``scatter_dim`` and ``return_A``, and return the same shapes and strides (a superset: negative
dims are accepted too, counted from the end, where torch's CUDA path refuses them)
(:mod:`tldsl.torch_layouts`). A gather or scatter along a dim of rows runs fused; along the
last dim (K of the gather, N of the scatter) there are no row blocks to overlap, and it runs
as torch's own path for it does: one collective (NCCL), then the products.

Each distinct (shapes, dtype, group) builds one op object the first time it is called — a
collective point (symmetric allocation), which every rank reaches because the op itself is
collective — and keeps it until :func:`close_all` (also collective). Fake (meta)
implementations give torch.compile the output shapes.

CUDA graphs: a call can be captured in ``torch.cuda.graph`` and replayed once its op exists — per
call the torch ops only check shapes on the host, view or copy tensors on the stream and call the op,
whose launches are capturable (runtime/dist/fused_op.py); the last-dim paths call NCCL, which
captures too. Building an op cannot be captured (it allocates symmetric memory, rendezvouses and
synchronises): a capture that would build one is refused — call the op once eagerly first (the
warm-up ``torch.cuda.graph``'s documentation asks for anyway).
"""
from __future__ import annotations

import torch

from .errors import InputError
from .runtime.dist.operands import check_no_grad, dense
from .torch_layouts import as_row_blocks, check_scatter_divides, gathered, normalize_dim, scattered

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


def _build(key, make):
    """The op for ``key``, built by ``make()`` the first time — never while capturing a CUDA graph."""
    op = _OPS.get(key)
    if op is None:
        from .runtime.dist import call_order
        if call_order.capturing():
            raise InputError(f"torch.ops.tldsl: the first call for these shapes ({key[1]} @ {key[2]}, {key[3]}) is "
                             f"being captured in a CUDA graph, but building the op (symmetric memory, a collective "
                             f"rendezvous, a synchronisation) cannot be captured: call it once before capturing")
        op = _OPS[key] = make()
    return op


def _check_ag(a_shard: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, world_size: int) -> int:
    """The normalised gather dim, after checking the operands as torch's op would."""
    if not isinstance(a_shard, torch.Tensor) or a_shard.dim() < 2:
        raise InputError(f"A shard must be a tensor of at least 2 dims [..., K], got "
                         f"{tuple(a_shard.shape) if isinstance(a_shard, torch.Tensor) else type(a_shard).__name__}")
    g = normalize_dim(gather_dim, a_shard.dim(), "gather_dim")
    if not bs:
        raise InputError("fused_all_gather_matmul needs at least one B")
    K = a_shard.shape[-1] * (world_size if g == a_shard.dim() - 1 else 1)    # gathering K: B has every rank's
    for i, b in enumerate(bs):
        if b.dim() != 2 or b.shape[0] != K:
            raise InputError(f"B[{i}] has shape {tuple(b.shape)}; it must be [K={K}, N]")
        if b.dtype != a_shard.dtype:
            raise InputError(f"B[{i}] is {b.dtype} but A is {a_shard.dtype}")
    if a_shard.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"fused ops take bf16 or fp16, got {a_shard.dtype}")
    return g


def _check_rs(a: torch.Tensor, b: torch.Tensor, reduce_op: str, scatter_dim: int, world_size: int) -> int:
    """The normalised scatter dim, after checking the operands as torch's op would."""
    if reduce_op not in ("sum", "avg"):
        raise InputError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    if a.dim() < 2 or b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise InputError(f"A {tuple(a.shape)} @ B {tuple(b.shape)}: need A of at least 2 dims, a 2-d B and matching K")
    d = normalize_dim(scatter_dim, a.dim(), "scatter_dim")
    if d == a.dim() - 1:
        if b.shape[1] % world_size:
            raise InputError(f"fused_matmul_reduce_scatter: the last dim (N = {b.shape[1]}) is scattered over "
                             f"{world_size} ranks; it must divide")
    else:
        check_scatter_divides(a, d, world_size)
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"A and B must both be bf16 or fp16, got {a.dtype} and {b.dtype}")
    return d


def _world_size(group_name: str) -> int:
    """The group's size (1 without torch.distributed: the fake kernels' shapes)."""
    import torch.distributed as dist
    return dist.get_world_size(_group(group_name)) if dist.is_initialized() else 1


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


#: the autograd kernels of :func:`refuse_autograd` (registrations live as long as their Library)
_AUTOGRAD = torch.library.Library("tldsl", "IMPL")


def refuse_autograd(name: str) -> None:
    """Make ``torch.ops.tldsl.<name>`` refuse operands that require grad while autograd records
    (:func:`~tldsl.runtime.dist.operands.check_no_grad`), before anything is built or launched:
    the ops have no backward, and torch's generated autograd kernel would run the op and fail only
    in ``backward()``. Registered per device's autograd key (a key's own kernel takes precedence
    over the ``Autograd`` alias custom_op registers); otherwise the op runs below autograd, as
    custom_op's kernel runs it where nothing requires grad."""
    from torch._C import _after_autograd_keyset, _AutoDispatchBelowAutograd
    op = getattr(torch.ops.tldsl, name).default
    params = [a.name for a in op._schema.arguments]

    def no_grad_kernel(keyset, *args, **kwargs):
        named = []
        for p, v in zip(params, args):
            named += [(f"{p}[{i}]", t) for i, t in enumerate(v)] if isinstance(v, (list, tuple)) else [(p, v)]
        check_no_grad(f"torch.ops.tldsl.{name}", named)
        with _AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _after_autograd_keyset, *args, **kwargs)
    for key in ("AutogradCPU", "AutogradCUDA", "AutogradMeta"):
        _AUTOGRAD.impl(name, no_grad_kernel, key, with_keyset=True)


#: torch's own schemas (torch.ops.symm_mem.*), names included: a call written for theirs runs on ours
AG_SCHEMA = "(Tensor A, Tensor[] Bs, int gather_dim, str group_name, *, bool return_A=True) -> (Tensor?, Tensor[])"
RS_SCHEMA = "(Tensor A, Tensor B, str reduce_op, int scatter_dim, str group_name) -> Tensor"


@torch.library.custom_op("tldsl::fused_all_gather_matmul", mutates_args=(), schema=AG_SCHEMA)
def fused_all_gather_matmul(A, Bs, gather_dim, group_name, *, return_A=True):
    """``(all_gather(A_shard, gather_dim), [A_gathered @ B for B in bs])`` (``None`` for the first
    with ``return_A=False``): the first product is fused with the all-gather (per-tile waits) along
    any dim but the last; the others reuse the gathered A."""
    a_shard, bs = A, Bs
    W = _world_size(group_name)
    g = _check_ag(a_shard, bs, gather_dim, W)
    group = _group(group_name)
    _check_devices("fused_all_gather_matmul", [("A shard", a_shard)] + [(f"B[{i}]", b) for i, b in enumerate(bs)])
    if g == a_shard.dim() - 1:
        return _all_gather_last_dim(a_shard, bs, group, W, return_A)
    a2d, blocks = as_row_blocks(a_shard, g)
    from .runtime.dist import AllGatherMatmul
    key = ("ag", tuple(a2d.shape), tuple(bs[0].shape), a_shard.dtype, group_name)
    op = _build(key, lambda: AllGatherMatmul(a2d.shape[0], a2d.shape[1], bs[0].shape[1], a_shard.dtype, group=group))
    # (a strided or unaligned shard: the op copies it). The gathered A leaves the op only where it
    # is returned or multiplied again: otherwise its rows stay in the op's buffer (no [M, K] copy)
    a_full, c0 = op(a2d, dense(bs[0]), return_gathered=bool(return_A) or len(bs) > 1)
    outs = [c0] + [torch.mm(a_full, b) for b in bs[1:]]
    return (gathered(a_full, blocks, W) if return_A else None), [gathered(c, blocks, W) for c in outs]


def _all_gather_last_dim(a_shard, bs, group, W: int, return_A: bool):
    """Gathering K: no row blocks to overlap with. One all-gather of the flattened shards, then
    ``cat(shards, -1) @ B`` — torch's own path for this dim."""
    import torch.distributed as dist
    flat = a_shard.flatten(0, -2).contiguous()
    every = flat.new_empty((W * flat.shape[0], flat.shape[1]))
    dist.all_gather_into_tensor(every, flat, group=group)
    a_mm = torch.cat(every.chunk(W), dim=-1)
    lead = tuple(a_shard.shape[:-1])
    return (a_mm.view(*lead, -1) if return_A else None), [torch.mm(a_mm, b).view(*lead, -1) for b in bs]


@fused_all_gather_matmul.register_fake
def _(A, Bs, gather_dim, group_name, *, return_A=True):
    a_shard, bs = A, Bs
    W = _world_size(group_name)
    g = _check_ag(a_shard, bs, gather_dim, W)
    if g == a_shard.dim() - 1:
        lead = tuple(a_shard.shape[:-1])
        a_full = a_shard.new_empty((*lead, W * a_shard.shape[-1]))
        return (a_full if return_A else None), [a_shard.new_empty((*lead, b.shape[1])) for b in bs]
    a2d, blocks = as_row_blocks(a_shard, g)
    a_full = gathered(a2d.new_empty((W * a2d.shape[0], a2d.shape[1])), blocks, W)
    return (a_full if return_A else None), [gathered(a2d.new_empty((W * a2d.shape[0], b.shape[1])), blocks, W)
                                            for b in bs]


@torch.library.custom_op("tldsl::fused_matmul_reduce_scatter", mutates_args=(), schema=RS_SCHEMA)
def fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    """``reduce_scatter(A @ B, reduce_op, scatter_dim)`` with the reduction fused behind the GEMM
    along any dim but the last."""
    a, b = A, B
    W = _world_size(group_name)
    d = _check_rs(a, b, reduce_op, scatter_dim, W)
    group = _group(group_name)
    _check_devices("fused_matmul_reduce_scatter", [("A", a), ("B", b)])
    if d == a.dim() - 1:
        return _reduce_scatter_last_dim(a, b, reduce_op, group, W)
    a2d, blocks = as_row_blocks(a, d)
    from .runtime.dist import MatmulReduceScatter
    key = ("rs", tuple(a2d.shape), tuple(b.shape), a.dtype, group_name)
    op = _build(key, lambda: MatmulReduceScatter(a2d.shape[0], a2d.shape[1], b.shape[1], a.dtype, group=group))
    out = op(dense(a2d), dense(b))
    if reduce_op == "avg":
        out = out / W
    return scattered(out, blocks, W)


def _reduce_scatter_last_dim(a, b, reduce_op: str, group, W: int):
    """Scattering N: no row blocks to overlap with. The product, then one reduce-scatter of its
    column blocks (rank r's block: columns ``[r N/W, (r+1) N/W)``) — torch's own path for this dim."""
    import torch.distributed as dist
    full = torch.mm(a.flatten(0, -2), b)
    P, n = full.shape[0], b.shape[1] // W
    blocks = full.view(P, W, n).movedim(1, 0).contiguous().view(W * P, n)
    out = full.new_empty((P, n))
    dist.reduce_scatter_tensor(out, blocks, group=group)
    if reduce_op == "avg":
        out = out / W
    return out.view(*a.shape[:-1], n)


@fused_matmul_reduce_scatter.register_fake
def _(A, B, reduce_op, scatter_dim, group_name):
    a, b = A, B
    W = _world_size(group_name)
    d = _check_rs(a, b, reduce_op, scatter_dim, W)
    shape = [*a.shape[:-1], b.shape[1]]
    shape[d] //= W
    return a.new_empty(shape)


refuse_autograd("fused_all_gather_matmul")
refuse_autograd("fused_matmul_reduce_scatter")
