"""The fused MoE and attention ops in the layer benchmark (``tldsl.bench baselines ... --fused``):
each op built for a row, its output checked against the sequential layer's on the same inputs
(so a figure is never of a wrong result), then timed beside it.

The layouts differ only where the fused ops pad: :class:`~tldsl.runtime.dist.AllGatherMoE`
returns the routed rows in expert-sorted order with every expert starting at a multiple of the
compute tile's ``BM`` (:func:`padded_rows` maps the sequential layer's rows there), and
:class:`~tldsl.runtime.dist.MoEReduceScatter` takes them so.

The MoE ops are timed as a serving loop runs them, with ``validate_ids=False``: the ids'
host check (the default) reads the device every call — a synchronisation that leaves the GPU
idle while the host enqueues the next call, which torch's sequential layer never does. The
routing kernels still flag a bad id; the checked call reads their flag (``check_routing``).
"""
from __future__ import annotations

#: the largest error a fused op's output may have: relative L2 (``||got - want|| / ||want||``) and
#: the largest element's, over the reference's RMS. Both sides are bf16 / fp16 outputs of fp32
#: accumulations rounded at different points (both MoE+RS layers round the grouped GEMM's rows to
#: the operands' dtype before the weighted sum; the fused op sums them in fp32 and, with its default
#: partial, rounds each rank's sum before the reduce-scatter adds them), so single elements differ by
#: a few output ulps of the largest values; a misplaced row or tile moves the L2 error to order 1.
REL_TOL = 1e-2
MAX_TOL = 0.25


def padded_rows(rows, topk_ids, num_experts: int, block_m: int, num_tiles: int):
    """``rows [T*k, N]`` in expert-sorted order (``baselines.route``'s) as the fused MoE ops lay
    them out: ``[num_tiles * block_m, N]``, expert ``e``'s rows from a multiple of ``block_m``,
    the rest zero. Returns ``(padded, dest)``: ``dest[i]`` is sorted row ``i``'s padded row."""
    import torch
    dev = rows.device
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m
    pad_start = (torch.cumsum(tiles, 0) - tiles) * block_m
    start = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(num_experts, device=dev), counts)
    i = torch.arange(rows.shape[0], device=dev)
    dest = pad_start[expert] + (i - start[expert])
    out = torch.zeros((num_tiles * block_m, rows.shape[1]), dtype=rows.dtype, device=dev)
    out[dest] = rows
    return out, dest


def errors(got, want) -> tuple[float, float]:
    """(relative L2 error, largest error over the RMS of ``want``), in fp32."""
    g, w = got.float(), want.float()
    rms = float(w.pow(2).mean().sqrt()) or 1.0
    d = g - w
    return float(d.pow(2).mean().sqrt()) / rms, float(d.abs().max()) / rms


def check(name: str, got, want) -> float:
    """The relative L2 error of ``got``; a :class:`RuntimeError` past :data:`REL_TOL` or an
    element past :data:`MAX_TOL` — on every rank alike where ranks run it (no figure of a wrong
    result is printed, and no rank goes on into the timing alone)."""
    l2, worst = errors(got, want)
    ok = l2 <= REL_TOL and worst <= MAX_TOL
    if not _everywhere(ok):
        raise RuntimeError(f"{name}: the fused op's output differs from the sequential layer's"
                           + (f": relative L2 error {l2:.3g} (tolerance {REL_TOL}), largest {worst:.3g} x RMS "
                              f"(tolerance {MAX_TOL})" if not ok else " on another rank"))
    return l2


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the default group (itself, without one)."""
    import torch
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def _checked(op, name: str, got, want) -> None:
    """:func:`check`, closing the op (collectively, every rank) before a failure is raised."""
    try:
        check(name, got, want)
    except RuntimeError:
        op.close()
        raise


def ag_moe_op(x_shard, topk_ids, w1, reference, **op_kw):
    """AllGatherMoE for these inputs (``op_kw``: its keyword arguments, e.g. ``sm_split``),
    checked against ``reference`` (the sequential layer's ``[T*k, N/W]``); returns ``(op,
    call)``: ``call()`` runs one launch."""
    from ..runtime.dist import AllGatherMoE
    op = AllGatherMoE(x_shard, w1, topk_ids.shape[1], **{"validate_ids": False, **op_kw})
    h, tables = op(x_shard, topk_ids, w1)
    op.check_routing(tables)
    _, dest = padded_rows(reference, topk_ids, op.num_experts, op.block_m, op.num_tiles)
    _checked(op, "AllGatherMoE", h[dest], reference)
    return op, lambda: op(x_shard, topk_ids, w1)


def moe_rs_op(h, topk_ids, topk_weights, w2, reference, **op_kw):
    """MoEReduceScatter for the sequential layer's input ``h [T*k, N/W]`` (padded here as
    AllGatherMoE lays it out), checked against ``reference`` (this rank's tokens)."""
    from ..runtime.dist import MoEReduceScatter
    import torch.distributed as dist
    T, k = topk_ids.shape
    op = MoEReduceScatter(w2, T // dist.get_world_size(), k, **{"validate_ids": False, **op_kw})
    padded, _ = padded_rows(h, topk_ids, op.num_experts, op.block_m, op.num_tiles)
    tables = op.routing(topk_ids)
    _checked(op, "MoEReduceScatter", op(padded, topk_ids, topk_weights, w2, tables=tables), reference)
    op.check_routing(tables)
    return op, lambda: op(padded, topk_ids, topk_weights, w2)


def sp_attention_op(q, k, v, *, causal: bool, layout: str, reference, comm=None):
    """SequenceParallelAttention for ``q [S, Hq, D]``, ``k``/``v [S, Hkv, D]`` (``comm``: its
    communication schedule, None for the op's default), checked against ``reference``."""
    from ..runtime.dist import SequenceParallelAttention
    op = SequenceParallelAttention(q, k, q.shape[1], kv_heads=k.shape[1], causal=causal, layout=layout,
                                   **({"comm": comm} if comm is not None else {}))
    _checked(op, "SequenceParallelAttention", op(q, k, v), reference)
    return op, lambda: op(q, k, v)
