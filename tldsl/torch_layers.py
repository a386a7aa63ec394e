"""The tensor-parallel MoE layers and sequence-parallel attention as torch custom ops (fake
shapes for torch.compile):

    import tldsl.torch_layers  # registers torch.ops.tldsl.all_gather_moe / moe_reduce_scatter / sp_attention
    h = torch.ops.tldsl.all_gather_moe(x_shard, topk_ids, w1, group_name)          # layer 0
    out = torch.ops.tldsl.moe_reduce_scatter(h, topk_ids, topk_weights, w2, group_name)   # layer 1
    o = torch.ops.tldsl.sp_attention(q, k, v, group_name, is_causal=True, layout="zigzag")

``x_shard [Ms, K]`` this rank's tokens; ``topk_ids`` / ``topk_weights [W*Ms, topk]`` the
caller's router output (the same on every rank); ``w1 [E, K, Nr]`` / ``w2 [E, Nr, K]`` this
rank's slices of every expert. ``h [R_pad, Nr]`` holds the routed rows in expert-sorted order,
every expert's rows padded to a multiple of ``block_m`` (zeros); ``out [Ms, K]`` this rank's
tokens' MoE output summed over the ranks. ``q [S, H, D]``, ``k`` / ``v [S, H_kv, D]``: this
rank's rows of the sequence (``layout``: :func:`tldsl.ops.sp_attention.shard_sequence`); ``o``
is shaped like ``q``. Each distinct (shapes, dtype, group, block_m) builds
one op (:class:`~tldsl.runtime.dist.moe_ops.AllGatherMoE`, ``MoEReduceScatter``,
:class:`~tldsl.runtime.dist.attention_op.SequenceParallelAttention`) the first
time — a collective point — kept, with the GEMM ops of :mod:`tldsl.torch_ops` (importing this
module registers those too), until :func:`tldsl.torch_ops.close_all` (collective too).
"""
from __future__ import annotations

import torch

from .errors import InputError
from .ops.moe import moe_num_tiles
from .torch_ops import _build, _check_devices, _group, _world_size, refuse_autograd
from .torch_ops import built_ops, close_all  # noqa: F401  (one op cache for all)

AG_MOE_SCHEMA = "(Tensor x, Tensor topk_ids, Tensor w1, str group_name, int block_m=128) -> Tensor"
MOE_RS_SCHEMA = ("(Tensor h, Tensor topk_ids, Tensor topk_weights, Tensor w2, str group_name, int block_m=128) "
                 "-> Tensor")


def _check_moe(what: str, acts, topk_ids, w, W: int, block_m: int, *, layer0: bool):
    """``(Ms, topk, E)`` after checking the operands as the op will (before it is built)."""
    if not isinstance(block_m, int) or block_m not in (16, 32, 64, 128, 256):
        raise InputError(f"{what}: block_m must be 16, 32, 64, 128 or 256, got {block_m!r}")
    for name, t in (("activations", acts), ("topk_ids", topk_ids), ("weights", w)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    if acts.dim() != 2 or w.dim() != 3:
        raise InputError(f"{what}: activations must be 2-d and the expert weights 3-d [E, ., .], got "
                         f"{tuple(acts.shape)} and {tuple(w.shape)}")
    if acts.dtype not in (torch.bfloat16, torch.float16) or w.dtype != acts.dtype:
        raise InputError(f"{what}: bf16 or fp16 activations and weights of the same dtype, got {acts.dtype} "
                         f"and {w.dtype}")
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise InputError(f"{what}: topk_ids must be int32 or int64 [tokens, topk], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    from .runtime.dist.moe_ops import check_moe_sizes
    T, topk = topk_ids.shape
    E = w.shape[0]
    if layer0:
        Ms = acts.shape[0]
        check_moe_sizes(Ms, topk, E, f"{what}: ")          # the op's own check of its sizes
        if T != W * Ms:
            raise InputError(f"{what}: topk_ids has {T} tokens; {W} ranks x {Ms} rows of x make {W * Ms}")
        if w.shape[1] != acts.shape[1]:
            raise InputError(f"{what}: x is {tuple(acts.shape)} but w1 is {tuple(w.shape)}: w1 must be [E, K, Nr]")
    else:
        if T % W:
            raise InputError(f"{what}: {T} tokens do not divide among {W} ranks")
        Ms = T // W
        check_moe_sizes(Ms, topk, E, f"{what}: ")          # the op's own check of its sizes
        R = moe_num_tiles(T * topk, E, block_m) * block_m
        if tuple(acts.shape) != (R, w.shape[1]):
            raise InputError(f"{what}: h must be [{R}, {w.shape[1]}] ({T} tokens x top-{topk} routed rows of {E} "
                             f"experts padded to block_m={block_m}: what all_gather_moe returns), got "
                             f"{tuple(acts.shape)}")
    return Ms, topk, E


@torch.library.custom_op("tldsl::all_gather_moe", mutates_args=(), schema=AG_MOE_SCHEMA)
def all_gather_moe(x, topk_ids, w1, group_name, block_m=128):
    """Layer 0: ``all_gather(x)`` routed by ``topk_ids`` through this rank's expert slices ``w1``,
    the gather overlapped with the grouped GEMM tile by tile."""
    import tldsl as tl
    from .runtime.dist.moe_ops import DEFAULT_AG_COMPUTE, AllGatherMoE
    W = _world_size(group_name)
    Ms, topk, E = _check_moe("all_gather_moe", x, topk_ids, w1, W, block_m, layer0=True)
    _check_devices("all_gather_moe", [("x", x), ("topk_ids", topk_ids), ("w1", w1)])
    key = ("ag_moe", tuple(x.shape), tuple(w1.shape), x.dtype, topk, group_name, block_m)
    # the op's measured default where its BM is the one asked for; else that BM on 128-column tiles
    compute = None if block_m == DEFAULT_AG_COMPUTE.tile[0] else tl.ComputeSchedule(tile=(block_m, 128, 64))
    op = _build(key, lambda: AllGatherMoE(x, w1, topk, _group(group_name), compute=compute))
    h, _ = op(x.contiguous(), topk_ids.contiguous(), w1.contiguous())
    return h


@all_gather_moe.register_fake
def _(x, topk_ids, w1, group_name, block_m=128):
    W = _world_size(group_name)
    Ms, topk, E = _check_moe("all_gather_moe", x, topk_ids, w1, W, block_m, layer0=True)
    return x.new_empty((moe_num_tiles(W * Ms * topk, E, block_m) * block_m, w1.shape[2]))


def _check_topk_weights(topk_weights, topk_ids) -> None:
    """``topk_weights`` shaped like ``topk_ids``, in a float dtype the tile program reads."""
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or \
            topk_weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InputError(f"moe_reduce_scatter: topk_weights must be float32, bfloat16 or float16 "
                         f"{tuple(topk_ids.shape)} (topk_ids' shape), got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")


@torch.library.custom_op("tldsl::moe_reduce_scatter", mutates_args=(), schema=MOE_RS_SCHEMA)
def moe_reduce_scatter(h, topk_ids, topk_weights, w2, group_name, block_m=128):
    """Layer 1: ``h @ w2[expert]``, the top-k weighted sum per token and the reduce-scatter of the
    tokens, the combine and the scatter overlapped with the grouped GEMM's tiles."""
    import tldsl as tl
    from .ir.types import dtype_of
    from .runtime.dist.moe_ops import DEFAULT_RS_COMPUTE, MoEReduceScatter
    W = _world_size(group_name)
    Ms, topk, E = _check_moe("moe_reduce_scatter", h, topk_ids, w2, W, block_m, layer0=False)
    _check_topk_weights(topk_weights, topk_ids)
    _check_devices("moe_reduce_scatter", [("h", h), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                                          ("w2", w2)])
    key = ("moe_rs", tuple(h.shape), tuple(w2.shape), h.dtype, topk, topk_weights.dtype, group_name, block_m)
    # the op's measured default where its BM is the one asked for; else that BM on 128-column tiles
    compute = None if block_m == DEFAULT_RS_COMPUTE.tile[0] else tl.ComputeSchedule(tile=(block_m, 128, 64))
    op = _build(key, lambda: MoEReduceScatter(w2, Ms, topk, _group(group_name), compute=compute,
                                              weights_dtype=dtype_of(topk_weights.dtype)))
    return op(h.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), w2.contiguous())


@moe_reduce_scatter.register_fake
def _(h, topk_ids, topk_weights, w2, group_name, block_m=128):
    W = _world_size(group_name)
    Ms, topk, E = _check_moe("moe_reduce_scatter", h, topk_ids, w2, W, block_m, layer0=False)
    _check_topk_weights(topk_weights, topk_ids)
    return h.new_empty((Ms, w2.shape[2]))


SP_ATTENTION_SCHEMA = ("(Tensor q, Tensor k, Tensor v, str group_name, bool is_causal=False, "
                       "str layout='contiguous', float? scale=None) -> Tensor")


def _check_attention(q, k, v, is_causal, layout, scale) -> float | None:
    """``scale`` as the op takes it (None or a finite float), after checking the operands as the
    op will (before it is built): the arguments by the op's own check
    (:func:`tldsl.ops.sp_attention.check_arguments`), so the fake kernel torch.compile traces with
    accepts nothing the op refuses."""
    from .ops.sp_attention import check_arguments, check_scale
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or 0 in t.shape:
            raise InputError(f"sp_attention: {name} must be a 3-d tensor [S, heads, D] (no dimension 0), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise InputError(f"sp_attention: k and v must be [S={q.shape[0]}, kv_heads, D={q.shape[2]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputError(f"sp_attention: bf16 or fp16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    S, heads, D = q.shape
    check_arguments(S, heads * D, heads, k.shape[1], is_causal, layout, scale)
    return check_scale(scale, "sp_attention: ")


@torch.library.custom_op("tldsl::sp_attention", mutates_args=(), schema=SP_ATTENTION_SCHEMA)
def sp_attention(q, k, v, group_name, is_causal=False, layout="contiguous", scale=None):
    """This rank's queries attending to every rank's keys and values (gathered tile by tile while
    attention runs), with the causal mask on the global positions of ``layout``."""
    from .runtime.dist.attention_op import SequenceParallelAttention
    scale = _check_attention(q, k, v, is_causal, layout, scale)
    _check_devices("sp_attention", [("q", q), ("k", k), ("v", v)])
    key = ("sp_attention", tuple(q.shape), tuple(k.shape), q.dtype, is_causal, layout, scale, group_name)
    op = _build(key, lambda: SequenceParallelAttention(q, k, q.shape[1], _group(group_name), kv_heads=k.shape[1],
                                                       causal=is_causal, layout=layout, scale=scale))
    return op(q.contiguous(), k.contiguous(), v.contiguous())


@sp_attention.register_fake
def _(q, k, v, group_name, is_causal=False, layout="contiguous", scale=None):
    _check_attention(q, k, v, is_causal, layout, scale)
    return torch.empty_like(q)


for _name in ("all_gather_moe", "moe_reduce_scatter", "sp_attention"):
    refuse_autograd(_name)
