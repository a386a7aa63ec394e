"""The sequential baselines the fused MoE and attention ops are timed against (run under torchrun).

What a user without tldsl runs for the same layer, one step after the other on one stream:

* ``ag_moe`` — NCCL all-gather of the token shards, the routed rows gathered in expert-sorted
  order, ``torch._grouped_mm`` with this rank's slice of the (gate + up fused) expert weights;
* ``moe_rs`` — ``torch._grouped_mm`` of the expert-sorted rows with this rank's slice of the
  down-projection, the top-k weighted sum per token, NCCL reduce-scatter of the tokens;
* ``sp_attention`` — NCCL all-gather of K and V, then torch SDPA (its default backend) for this
  rank's queries: causal masks are lower-right over the keys up to the rank's last query (the
  same mask as the global causal one), for both sequence layouts (``contiguous``: rank ``r``
  holds rows ``[r*S, (r+1)*S)``; ``zigzag``: the sequence in ``2W`` chunks, rank ``r`` holds
  chunks ``r`` and ``2W-1-r``, so every rank does the same causal work).

    torchrun --nproc_per_node=2 -m tldsl.bench baselines ag_moe [--models mixtral:8192:random,qwen15:8192:random ...] [--iters 20]
    torchrun --nproc_per_node=2 -m tldsl.bench baselines moe_rs
    torchrun --nproc_per_node=2 -m tldsl.bench baselines sp_attention [--seqs 4096,8192] [--causal] [--gqa]

``--timeline`` (with ``--fused``): after each row's timing, one more call of every fused op with its
phases marked, every rank printing on stderr when each part started and ended on its stream and
when the host had enqueued it (:class:`~tldsl.runtime.dist.timeline.PhaseTimeline`): where the
device time equals the host time the GPU waited for the host.

``--fused`` adds the fused op (AllGatherMoE, MoEReduceScatter, SequenceParallelAttention) to each
row: its output is checked against the sequential layer's on the same inputs first
(:mod:`.fused_layers`), then it is timed in the same interleaved rounds — so one command checks
and times each op. ``--sm-split work,even`` builds the fused MoE op once per way its compute
kernels share the SMs (by estimated work, the default, or evenly: ``FusedProgram``'s
``sm_split``), each checked, all timed in the same rounds, one table row each; for ``moe_rs``,
``--partial out,f32`` likewise builds it with its partials in the operands' dtype (the op's
default) and in fp32; for ``sp_attention``, ``--comm default,copy_engine/pull,sm/128x8`` builds
SequenceParallelAttention once per way of gathering K and V (:func:`comm_schedule`).

Each row: the sequential layer, its communication alone, its compute alone, ideal =
max(comm, compute), and sequential / ideal — every column timed interleaved in one run
(:func:`tldsl.bench.dist.bench_interleaved`, the slowest rank's median). The routing of a
row is top-k of random logits (``random``), Zipf-skewed (``zipf``) or every token on the same
experts (``one``); the routing tables (sort, counts, offsets) are computed on the GPU inside
the timed layer, as a user's layer computes them.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from ..collectives import PARTIAL_DTYPES

#: MoE models of the benchmark: hidden size, expert FFN size, experts, top-k
MOE_MODELS = {
    "mixtral": (4096, 14336, 8, 2),
    "qwen15": (2048, 1408, 60, 4),
    "qwen3": (2048, 768, 128, 8),
    "deepseek": (2048, 1408, 64, 6),
    "stress": (8192, 8192, 32, 3),
}
#: (model, tokens across the ranks, routing) rows run by default
MOE_ROWS = [("mixtral", 2048, "random"), ("mixtral", 8192, "random"), ("mixtral", 32768, "random"),
            ("qwen15", 8192, "random"), ("qwen3", 8192, "random"), ("deepseek", 8192, "random"),
            ("stress", 8192, "random"), ("mixtral", 8192, "zipf"), ("mixtral", 8192, "one")]
ROUTINGS = ("random", "zipf", "one")
LAYOUTS = ("contiguous", "zigzag")
#: how a fused MoE op's compute kernels may share the SMs (``runtime/gpu/sm_split.SPLITS``), each
#: with its chained parts where the op puts them (no suffix), or as asked
#: (``runtime/gpu/run_plan.CHAINS``): after their producer (``/after``: MoEReduceScatter's combine
#: behind its grouped GEMM, AllGatherMoE's staged GEMM behind its row gather), beside it
#: (``/beside``) or folded into one kernel (``/folded``)
SM_SPLITS = ("work", "even", "work/after", "even/after", "work/beside", "even/beside", "work/folded", "even/folded")


#: ``--comm`` (sp_attention): how the fused op gathers K and V — its own default, the copy engines
#: pushing or pulling whole shards, or SM kernels: ``sm/ROWSxLANES`` (rows a communication tile,
#: ``shard`` for a whole shard; lanes = SMs), optionally ``/push``
COMM_HELP = "default, copy_engine/push, copy_engine/pull, sm/ROWSxLANES[/push] (ROWS an int or 'shard')"


def comm_schedule(spec: str):
    """The ``tl.CommSchedule`` of a ``--comm`` spec (:data:`COMM_HELP`); None for ``default`` (the
    op's own). Raises ValueError naming the spec."""
    import tldsl as tl
    parts = spec.split("/")
    try:
        if parts == ["default"]:
            return None
        if parts[0] == "copy_engine" and len(parts) == 2 and parts[1] in ("push", "pull"):
            return tl.CommSchedule(engine="copy_engine", mode=parts[1])
        if parts[0] == "sm" and len(parts) in (2, 3) and parts[2:] in ([], ["push"], ["pull"]):
            rows, lanes = parts[1].split("x")
            return tl.CommSchedule(tile_m=None if rows == "shard" else int(rows), sms=int(lanes),
                                   mode=parts[2] if len(parts) == 3 else "pull")
    except (ValueError, tl.ScheduleError) as e:
        raise ValueError(f"--comm {spec!r}: {e}") from None
    raise ValueError(f"--comm {spec!r}: one of {COMM_HELP}")


def _layout_kw(variant: str) -> dict:
    """The fused op's keyword arguments of an ``--sm-split`` variant (``SPLIT[/CHAIN]``)."""
    split, _, chain = variant.partition("/")
    return {"sm_split": split, **({"chain": chain} if chain else {})}


# -- the routing, as a user's layer computes it on the GPU ------------------------------------------

def route(topk_ids, num_experts: int):
    """``(order, offsets)`` of a routing ``topk_ids [T, k]``: ``order`` lists the routed rows
    ``t*k + j`` sorted by expert (stable: tokens increase inside an expert), ``offsets`` the
    int32 end row of every expert's group (``torch._grouped_mm``'s ``offs``). No host sync."""
    import torch
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    return order, torch.cumsum(counts, 0).to(torch.int32)


def random_topk(num_tokens: int, num_experts: int, topk: int, kind: str, *, device, seed: int = 0):
    """``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``: top-k of random logits
    (``random``), of logits with a Zipf-like bias towards low expert ids (``zipf``), or the same
    ``k`` experts for every token (``one``); weights are the softmax of the chosen logits."""
    import torch
    if kind not in ROUTINGS:
        raise ValueError(f"routing: one of {', '.join(ROUTINGS)}, got {kind!r}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if kind == "zipf":
        logits = logits + 2.0 * torch.log(1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32))
    if kind == "one":
        logits = logits * 0 + torch.linspace(1.0, 0.0, num_experts)
    vals, ids = torch.topk(logits, topk, dim=1)
    return ids.to(torch.int32).to(device), torch.softmax(vals, dim=1).to(device)


# -- the three layers ---------------------------------------------------------------------------------

def _all_gather(x, group):
    import torch
    import torch.distributed as dist
    W = dist.get_world_size(group)
    out = torch.empty((W * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x, group):
    import torch
    import torch.distributed as dist
    W = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // W, *x.shape[1:]), dtype=x.dtype, device=x.device)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x.contiguous(), group=group)
    return out


def ag_moe(x_shard, topk_ids, w1, group=None):
    """AllGather + MoE, sequentially: ``h [T*k, N/W]`` in expert-sorted order (``route``'s),
    for token shards ``x_shard [T/W, K]`` and this rank's ``w1 [E, K, N/W]``."""
    import torch
    x = _all_gather(x_shard, group)
    order, offs = route(topk_ids, w1.shape[0])
    rows = x.index_select(0, order // topk_ids.shape[1])
    return torch._grouped_mm(rows, w1, offs=offs)


def moe_rs(h, topk_ids, topk_weights, w2, group=None):
    """MoE + ReduceScatter, sequentially: ``h [T*k, N/W]`` in expert-sorted order times this
    rank's ``w2 [E, N/W, K]``, the top-k weighted sum per token (fp32), and the reduce-scatter
    over the ranks: this rank's tokens ``[T/W, K]`` in ``h``'s dtype."""
    import torch
    order, offs = route(topk_ids, w2.shape[0])
    y = torch._grouped_mm(h, w2, offs=offs)
    T, k = topk_ids.shape
    weighted = y.float() * topk_weights.reshape(-1).index_select(0, order)[:, None]
    out = torch.zeros((T, w2.shape[2]), dtype=torch.float32, device=h.device)
    out.index_add_(0, order // k, weighted)
    return _reduce_scatter(out.to(h.dtype), group)


def zigzag_positions(rank: int, world_size: int, rows: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two global row ranges ``[start, end)`` a rank holds in the zig-zag layout: the
    sequence of ``world_size * rows`` rows in ``2 * world_size`` chunks of ``rows // 2``
    (``rows`` even), chunks ``rank`` and ``2W-1-rank``."""
    if rows % 2:
        raise ValueError(f"zigzag: rows per rank must be even (two chunks), got {rows}")
    c = rows // 2
    return (rank * c, (rank + 1) * c), ((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c)


def _unzigzag(kv, world_size: int):
    """Gathered zig-zag shards ``[W*S, ...]`` (rank order) -> the sequence in global order."""
    import torch
    S = kv.shape[0] // world_size
    c = S // 2
    chunks = [None] * (2 * world_size)
    for r in range(world_size):
        (a, _), (b, _) = zigzag_positions(r, world_size, S)
        chunks[a // c] = kv[r * S: r * S + c]
        chunks[b // c] = kv[r * S + c: (r + 1) * S]
    return torch.cat(chunks, 0)


def sp_attention(q, k_shard, v_shard, *, causal: bool, layout: str = "contiguous", group=None):
    """Sequence-parallel attention, sequentially: all-gather K and V, then SDPA for this rank's
    queries. ``q [S, Hq, D]``, ``k_shard``/``v_shard [S, Hkv, D]`` (``Hkv`` dividing ``Hq``: GQA);
    returns ``[S, Hq, D]``. Causal masks are the global ones, written as lower-right masks over the
    keys up to each query block's last position."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {', '.join(LAYOUTS)}, got {layout!r}")
    W, r = dist.get_world_size(group), dist.get_rank(group)
    k, v = _all_gather(k_shard, group), _all_gather(v_shard, group)
    S = q.shape[0]
    if layout == "zigzag":
        k, v = _unzigzag(k, W), _unzigzag(v, W)
        blocks = [(slice(0, S // 2), zigzag_positions(r, W, S)[0]), (slice(S // 2, S), zigzag_positions(r, W, S)[1])]
    else:
        blocks = [(slice(0, S), (r * S, (r + 1) * S))]
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for rows, (_, end) in blocks:
        qb = q[rows].transpose(0, 1).unsqueeze(0)                       # [1, Hq, Sq, D]
        keys = end if causal else k.shape[0]
        kb, vb = (t[:keys].transpose(0, 1).unsqueeze(0) for t in (k, v))
        mask = causal_lower_right(qb.shape[2], keys) if causal else None
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(outs, 0) if len(outs) > 1 else outs[0]


# -- the benchmark --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoERow:
    model: str
    tokens: int
    routing: str

    def sizes(self, world_size: int):
        hidden, ffn, E, topk = MOE_MODELS[self.model]
        if self.tokens % world_size or (2 * ffn) % world_size or ffn % world_size:
            raise ValueError(f"{self}: tokens and the FFN size must divide by {world_size} ranks")
        return hidden, ffn, E, topk


def _moe_inputs(row: MoERow, W: int, rank: int, what: str, dtype):
    import torch
    hidden, ffn, E, topk = row.sizes(W)
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    ids, wts = random_topk(row.tokens, E, topk, row.routing, device="cuda", seed=7)
    if what == "ag_moe":
        x = torch.randn(row.tokens // W, hidden, generator=g).to("cuda", dtype)
        w = (torch.randn(E, hidden, 2 * ffn // W, generator=g) / hidden ** 0.5).to("cuda", dtype)
        return x, ids, wts, w
    h = torch.randn(row.tokens * topk, ffn // W, generator=g).to("cuda", dtype)
    w = (torch.randn(E, ffn // W, hidden, generator=g) / ffn ** 0.5).to("cuda", dtype)
    return h, ids, wts, w


def bench_moe(what: str, rows, iters: int, out=sys.stdout, dtype_name: str = "bfloat16",
              fused: bool = False, sm_splits=("work",), partials=("out",), timeline: bool = False) -> list[dict]:
    """Time one MoE baseline (``ag_moe`` or ``moe_rs``) per row, with its parts alone; with
    ``fused``, the fused op too (:mod:`.fused_layers`: checked against the baseline first), once
    per SM split of ``sm_splits`` (timed as ``tldsl/<split>``) and (``moe_rs``) per partial dtype of
    ``partials`` (past one: timed as ``tldsl/<split>, partial <dtype>``)."""
    import torch
    import torch.distributed as dist
    from . import fused_layers
    from .dist import bench_interleaved, mark_phases
    W, rank, dtype = dist.get_world_size(), dist.get_rank(), getattr(torch, dtype_name)
    if what != "moe_rs":
        partials = ("out",)            # (AllGather+MoE has no partial: one variant per split)
    variants = [(split, p, f"tldsl/{split}" + (f", partial {p}" if len(partials) > 1 else ""))
                for split in sm_splits for p in partials]
    results = []
    for row in rows:
        a, ids, wts, w = _moe_inputs(row, W, rank, what, dtype)
        order, offs = route(ids, w.shape[0])
        k = ids.shape[1]
        ops = {}
        if what == "ag_moe":
            gathered = _all_gather(a, None)
            fns = {"sequential": lambda: ag_moe(a, ids, w),
                   "comm": lambda: _all_gather(a, None),
                   # compute alone: the row gather and the grouped GEMM on already gathered tokens
                   "compute": lambda: torch._grouped_mm(gathered.index_select(0, order // k), w, offs=offs)}
        else:
            flat_w = wts.reshape(-1).index_select(0, order)[:, None]
            partial = torch.empty(row.tokens, w.shape[2], dtype=dtype, device="cuda")

            def combine():
                out = torch.zeros((row.tokens, w.shape[2]), dtype=torch.float32, device="cuda")
                return out.index_add_(0, order // k, torch._grouped_mm(a, w, offs=offs).float() * flat_w)
            fns = {"sequential": lambda: moe_rs(a, ids, wts, w),
                   "comm": lambda: _reduce_scatter(partial, None),
                   "compute": combine}           # the grouped GEMM and the weighted top-k sum
        flops = 2 * ids.numel() * w.shape[1] * w.shape[2]          # the routed rows only
        try:                        # (the ops built so far are closed whatever fails, a later one's check too)
            for split, p, key in variants if fused else ():
                if what == "ag_moe":
                    ops[key], fns[key] = fused_layers.ag_moe_op(a, ids, w, ag_moe(a, ids, w), **_layout_kw(split))
                else:
                    ops[key], fns[key] = fused_layers.moe_rs_op(a, ids, wts, w, moe_rs(a, ids, wts, w),
                                                                partial_dtype=p, **_layout_kw(split))
            t = bench_interleaved(fns, iters=iters)
            if timeline:
                for key, op in ops.items():
                    mark_phases(op, fns[key], f"{what} {row.model} {row.tokens} {row.routing} {key}",
                                out=sys.stderr, host=True)
        finally:
            for op in ops.values():
                op.close()
        ideal = max(t["comm"], t["compute"])
        res = dict(what=what, model=row.model, tokens=row.tokens, routing=row.routing, world_size=W, **t,
                   ideal=ideal, seq_over_ideal=t["sequential"] / ideal,
                   compute_tflops=flops / t["compute"] / 1e9)
        results.append(res)
        for split, p, key in (variants if fused else [(None, None, None)]) if rank == 0 else ():
            label = row.routing + (f", SMs by {split}" if split is not None and len(sm_splits) > 1 else "") + \
                (f", partial {p}" if p is not None and len(partials) > 1 else "")
            cells = _fused_cells({**t, "tldsl": t[key]}, ideal, fused) if key is not None else ""
            print(f"| {what} | {row.model} | {row.tokens} | {label} | {t['sequential']:.3f} | {t['comm']:.3f} | "
                  f"{t['compute']:.3f} ({res['compute_tflops']:.0f} TFLOP/s) | {ideal:.3f} | "
                  f"{res['seq_over_ideal']:.2f} |" + cells, file=out, flush=True)
    return results


def _fused_cells(t: dict, ideal: float, fused: bool) -> str:
    """The fused op's columns: its time, over ideal, and the sequential layer's time over it."""
    if not fused:
        return ""
    return f" {t['tldsl']:.3f} | {t['tldsl'] / ideal:.2f} | {t['sequential'] / t['tldsl']:.2f} |"


def bench_attention(seqs, iters: int, *, causal: bool, gqa: bool, layout: str, out=sys.stdout,
                    heads: int = 32, head_dim: int = 128, dtype_name: str = "bfloat16", fused: bool = False,
                    comms=("default",), timeline: bool = False) -> list[dict]:
    """Time the sequence-parallel attention baseline per sequence length per rank (``fused``:
    and the fused op, checked against it first, once per ``--comm`` spec of ``comms``, timed as
    ``tldsl/<spec>`` past one, a table row each)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from . import fused_layers
    from .dist import bench_interleaved, mark_phases
    W, rank, dtype = dist.get_world_size(), dist.get_rank(), getattr(torch, dtype_name)
    hkv = heads // 4 if gqa else heads
    results = []
    for S in seqs:
        g = torch.Generator(device="cpu").manual_seed(rank)
        q, k, v = (torch.randn(S, h, head_dim, generator=g).to("cuda", dtype) for h in (heads, hkv, hkv))
        kv_all = torch.randn(W * S, hkv, head_dim, generator=g).to("cuda", dtype)
        qb = q.transpose(0, 1).unsqueeze(0)
        kb = vb = kv_all.transpose(0, 1).unsqueeze(0)
        mask = _lower_right(S, W * S) if causal else None
        fns = {"sequential": lambda: sp_attention(q, k, v, causal=causal, layout=layout),
               "comm": lambda: (_all_gather(k, None), _all_gather(v, None)),
               # compute alone: the last rank's queries over every key (with causal masks, the
               # contiguous layout's busiest rank)
               "compute": lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=gqa)}
        keys = {spec: "tldsl" if len(comms) == 1 else f"tldsl/{spec}" for spec in comms}
        ops = []
        try:                        # (the ops built so far are closed whatever fails)
            for spec in comms if fused else ():
                op, fns[keys[spec]] = fused_layers.sp_attention_op(
                    q, k, v, causal=causal, layout=layout, comm=comm_schedule(spec),
                    reference=sp_attention(q, k, v, causal=causal, layout=layout))
                ops.append((keys[spec], op))
            t = bench_interleaved(fns, iters=iters)
            for key, op in ops if timeline else ():
                mark_phases(op, fns[key], f"sp_attention S={S} {key}", out=sys.stderr, host=True)
        finally:
            for _, op in ops:
                op.close()
        ideal = max(t["comm"], t["compute"])
        res = dict(what="sp_attention", seq_per_rank=S, world_size=W, causal=causal, gqa=gqa, layout=layout,
                   **t, ideal=ideal, seq_over_ideal=t["sequential"] / ideal)
        results.append(res)
        for spec in (comms if fused else [None]) if rank == 0 else ():
            label = (f"S={S} W={W} {'causal' if causal else 'full'} {'GQA 32/8' if gqa else 'MHA'} {layout}"
                     + (f", comm {spec}" if spec is not None and len(comms) > 1 else ""))
            cells = _fused_cells({**t, "tldsl": t[keys[spec]]}, ideal, fused) if spec is not None else ""
            print(f"| sp_attention | {label} | {t['sequential']:.3f} | {t['comm']:.3f} | {t['compute']:.3f} | "
                  f"{ideal:.3f} | {res['seq_over_ideal']:.2f} |" + cells, file=out, flush=True)
    return results


def _lower_right(q_len: int, k_len: int):
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(q_len, k_len)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="torchrun --nproc_per_node=2 -m tldsl.bench baselines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("ag_moe", "moe_rs", "sp_attention"))
    ap.add_argument("--models", default=None,
                    help=f"comma-separated MODEL:TOKENS:ROUTING rows (models: {', '.join(MOE_MODELS)}; "
                         f"routings: {', '.join(ROUTINGS)}); default: the issue's rows")
    ap.add_argument("--seqs", default="4096,8192,16384,32768", help="sequence lengths per rank (sp_attention)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--gqa", action="store_true", help="32 query heads over 8 K/V heads")
    ap.add_argument("--layout", choices=LAYOUTS, default="contiguous")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--fused", action="store_true",
                    help="the fused op too: checked against the sequential layer, then timed beside it")
    ap.add_argument("--sm-split", default="work",
                    help="with --fused (MoE layers): how the op's compute kernels share the SMs — work, even, "
                         "each with its chained parts where the op puts them, or optionally /after (the combine "
                         "after the grouped GEMM, the staged GEMM after its row gather), /beside (beside it) or "
                         "/folded (the two in the grouped GEMM's kernel), several comma-separated (one op each, "
                         "timed in the same rounds)")
    ap.add_argument("--partial", default="out",
                    help="with --fused (moe_rs): the op's partials in the operands' dtype (out, its default) or in "
                         "fp32 (f32), or both comma-separated (one op each, timed in the same rounds)")
    ap.add_argument("--timeline", action="store_true",
                    help="with --fused: one more call of each fused op per row with its phases marked, printed on "
                         "stderr by every rank (device and host times)")
    ap.add_argument("--comm", default="default",
                    help=f"with --fused (sp_attention): how the op gathers K and V — {COMM_HELP} — or several "
                         "comma-separated (one op each, timed in the same rounds)")
    args = ap.parse_args(argv)
    args.comms = tuple(dict.fromkeys(s.strip() for s in args.comm.split(",")))
    if args.timeline and not args.fused:
        ap.error("--timeline marks the fused op's phases: add --fused")
    if args.comms != ("default",) and args.what != "sp_attention":
        ap.error(f"--comm: SequenceParallelAttention's (sp_attention) K/V gather; not taken by {args.what}")
    for spec in args.comms:
        try:
            comm_schedule(spec)
        except ValueError as e:
            ap.error(str(e))
    args.sm_splits = tuple(dict.fromkeys(s.strip() for s in args.sm_split.split(",")))
    if not args.sm_splits or any(s not in SM_SPLITS for s in args.sm_splits):
        ap.error(f"--sm-split: a comma-separated list of {', '.join(SM_SPLITS)}, got {args.sm_split!r}")
    args.partials = tuple(dict.fromkeys(s.strip() for s in args.partial.split(",")))
    if not args.partials or any(p not in PARTIAL_DTYPES for p in args.partials):
        ap.error(f"--partial: out, f32 or both comma-separated, got {args.partial!r}")
    if args.partials != ("out",) and args.what != "moe_rs":
        ap.error(f"--partial: MoE+ReduceScatter's (moe_rs) partials; {args.what} has none")
    try:
        args.rows = ([MoERow(*r) for r in MOE_ROWS] if not args.models
                     else [_parse_row(s) for s in args.models.split(",")])
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    args.seq_list = [int(s) for s in args.seqs.split(",")]
    return args


def _parse_row(text: str) -> MoERow:
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in MOE_MODELS or parts[2] not in ROUTINGS or not parts[1].isdigit():
        raise argparse.ArgumentTypeError(f"a row is MODEL:TOKENS:ROUTING (e.g. mixtral:8192:random; models: "
                                         f"{', '.join(MOE_MODELS)}; routings: {', '.join(ROUTINGS)}), got {text!r}")
    return MoERow(parts[0], int(parts[1]), parts[2])


def main(argv) -> int:
    import torch.distributed as dist
    from tldsl.runtime.dist.group import init_ranks
    args = parse_args(argv)
    init_ranks()
    try:
        if dist.get_rank() == 0:
            print(f"# baselines {args.what}, {dist.get_world_size()} ranks, {args.dtype}; ms (slowest rank's median)")
            extra = (" tldsl | tldsl / ideal | seq / tldsl |", "---|---|---|") if args.fused else ("", "")
            row = "row" if args.what == "sp_attention" else "model | tokens | routing"   # (the MoE rows' cells)
            print(f"| layer | {row} | sequential | comm | compute | ideal | seq / ideal |" + extra[0] +
                  "\n|---|" + "---|" * (row.count("|") + 1) + "---|---|---|---|---|" + extra[1])
        if args.what == "sp_attention":
            bench_attention(args.seq_list, args.iters, causal=args.causal, gqa=args.gqa, layout=args.layout,
                            dtype_name=args.dtype, fused=args.fused, comms=args.comms, timeline=args.timeline)
        else:
            bench_moe(args.what, args.rows, args.iters, dtype_name=args.dtype, fused=args.fused,
                      sm_splits=args.sm_splits, partials=args.partials, timeline=args.timeline)
    finally:
        dist.destroy_process_group()
    return 0
