"""The MoE grouped GEMMs beside ``torch._grouped_mm`` on one GPU (issue 20's rows).

    python -m tldsl.bench moe [--layer ag|rs] [--rows mixtral:8192:random,...] [--tile 128,256,64]
                              [--stages 4] [--cluster 2] [--iters 10]

``--layer ag`` (the default), AllGather+MoE's grouped GEMM:

One row per (model, tokens across TP = 2 ranks, routing): this GPU computes one rank's slice of
layer 0 (gate and up fused: ``N = 2 * ffn / 2``, ``K = hidden``) on every token, its waits
already satisfied — the kernel alone, as it runs once the all-gather has delivered every token.
It gathers its rows itself (``sorted_token_ids``), so it is compared with ``torch._grouped_mm``
on the same expert-sorted rows already gathered (the kernel alone) and with torch's whole
sequence (the row gather ``index_select`` + ``_grouped_mm``). Each row is checked against
``_grouped_mm`` first; TFLOP/s count the routed rows only (not our padding to whole tiles).
Our kernel is timed as the ops launch it: its arguments checked and packed once
(``Launcher.prepare``), each timed launch one driver call — the per-call Python checks of
``kernel(buffers, ...)`` are host time that would sit inside the CUDA-event interval.
Routings as the layer benchmark draws them (:func:`.baselines.random_topk`: top-k of random
logits, Zipf-skewed, every token on the same experts).

``--layer rs``, MoE+ReduceScatter's grouped GEMM and top-k combine: one rank's slice of layer 1
(``h [rows, ffn / 2] @ w2[expert] [ffn / 2, hidden]``) on every routed row, then the weighted
top-k sum per token into the fp32 partial the reduce-scatter would read — our two kernels (the
grouped GEMM into ``y_sorted``, the combine), each launch one driver call, beside
``torch._grouped_mm`` on the same expert-sorted rows (the GEMM alone) and torch's sequence
(``_grouped_mm`` + the weighted sum by ``index_add_``, as the layer benchmark computes it). The
partial is checked against torch's sequence first. Two more columns time our kernels one by one
(the GEMM alone, the combine alone: where the layer's time goes).
"""
from __future__ import annotations

import argparse
import sys

from .baselines import MOE_MODELS, MOE_ROWS, ROUTINGS, MoERow, _parse_row, random_topk, route

#: TP ranks the rows' weight slices are for (tokens are the total across them)
TP = 2


def lowered_row(row: MoERow, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16", cluster: int = 2):
    """``(topk_ids, host routing, lowered grouped GEMM)`` of one row (one rank's slice, W = 1:
    the kernel reads every token from ``x_gathered``)."""
    import tldsl as tl
    from tldsl.codegen import lower_grouped_gemm
    from tldsl.ops.moe import moe_routing
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, hidden, 2 * ffn // TP
    ids, _ = random_topk(T, E, topk, row.routing, device="cpu", seed=7)
    rt = moe_routing(ids.numpy(), E, 1, T, tile[0])
    k = rt.trace_allgather_moe(1, T, K, N, E, getattr(tl, dtype),
                               compute=tl.ComputeSchedule(tile=tile, stages=stages, order="swizzled",
                                                          cluster=(cluster, 1)),
                               comm=tl.CommSchedule(tile_m=128, mode="pull"))
    return ids, rt, lower_grouped_gemm(k, "grouped_gemm")


def lowered_rs_row(row: MoERow, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16", cluster: int = 2):
    """``(topk_ids, topk_weights, host routing, lowered grouped GEMM, lowered combine)`` of one
    row's layer 1 (one rank's slice, W = 1: the combine's partial holds every token)."""
    import tldsl as tl
    from tldsl.codegen import lower_combine, lower_grouped_gemm
    from tldsl.ops.moe import moe_routing
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, ffn // TP, hidden
    ids, wts = random_topk(T, E, topk, row.routing, device="cpu", seed=7)
    rt = moe_routing(ids.numpy(), E, 1, T, tile[0])
    k = rt.trace_moe_reduce_scatter(1, T, K, N, E, tl.TensorSpec((T, topk), tl.float32), getattr(tl, dtype),
                                    compute=tl.ComputeSchedule(tile=tile, stages=stages, order="swizzled"),
                                    comm=tl.CommSchedule(tile_m=128, order="ring", mode="push"))
    return ids, wts, rt, lower_grouped_gemm(k, "grouped_gemm", cluster=(cluster, 1)), lower_combine(k, "combine")


def bench_rs_row(row: MoERow, iters: int, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16",
                 cluster: int = 2) -> dict:
    """Check, then time, one row of layer 1: ``{ms, gmm_ms, seq_ms, tflops, gmm_tflops, err}``
    (``ms``: our grouped GEMM and combine, one after the other)."""
    import numpy as np
    import torch
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    from . import fused_layers
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, ffn // TP, hidden
    ids, wts, rt, lg, lc = lowered_rs_row(row, tile, stages, dtype, cluster)
    gk, ck = GroupedKernel(lg), GroupedKernel(lc)
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(T + E + 1)
    ids_dev, wts_dev = ids.cuda(), wts.cuda()
    order, offs = route(ids_dev, E)
    h_sorted = torch.randn(T * topk, K, device="cuda", generator=g).to(tdt)      # route's order, as torch has it
    w = (torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).to(tdt)
    h, _ = fused_layers.padded_rows(h_sorted, ids_dev, E, tile[0], rt.num_rows // tile[0])
    tabs = rt.reduce_scatter_tables()
    bufs = {"h": h, "w2": w, "topk_weights": wts_dev.float().contiguous(),
            **{n: torch.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in tabs.items()},
            "y_sorted": torch.full((rt.num_rows, N), float("nan"), device="cuda", dtype=tdt),
            "partial": torch.full((T, N), float("nan"), device="cuda", dtype=torch.float32)}
    # every wait already satisfied: the kernels alone, one after the other on one stream
    slots = {**lg.signal_slots, **lc.signal_slots}
    flags = {s: torch.full((n,), 1 << 40, device="cuda", dtype=torch.int64) for s, n in slots.items()}
    gemm = gk.prepare(bufs, {s: flags[s] for s in lg.signals})
    combine = ck.prepare(bufs, {s: flags[s] for s in lc.signals})
    flat_w = wts_dev.reshape(-1).float().index_select(0, order)[:, None]

    def ours():
        stream = torch.cuda.current_stream().cuda_stream
        gemm.launch(stream, 1)
        combine.launch(stream, 1)

    def gmm():
        return torch._grouped_mm(h_sorted, w, offs=offs)

    def sequence():
        out = torch.zeros((T, N), dtype=torch.float32, device="cuda")
        return out.index_add_(0, order // topk, torch._grouped_mm(h_sorted, w, offs=offs).float() * flat_w)

    def gemm_alone():
        gemm.launch(torch.cuda.current_stream().cuda_stream, 1)

    def combine_alone():
        combine.launch(torch.cuda.current_stream().cuda_stream, 1)
    ours()
    return _checked_timings(f"{row}: the grouped GEMM + combine differ from _grouped_mm + the weighted sum",
                            bufs["partial"], sequence(), [ours, gmm, sequence], iters, 2 * T * topk * K * N,
                            _computed_rows(rt), T * topk, parts=[gemm_alone, combine_alone])


def _checked_timings(what: str, got, want, fns, iters: int, flops: int, padded: int, routed: int,
                     parts=()) -> dict:
    """``got`` checked against ``want`` (else a RuntimeError: ``what`` and the errors; nothing
    timed), then ``fns`` — ours, ``_grouped_mm``, torch's sequence — and ``parts`` (ours kernel by
    kernel: ``parts_ms``) timed interleaved."""
    from . import fused_layers
    from .timing import interleaved_ms
    l2, worst = fused_layers.errors(got, want)
    if not (l2 <= fused_layers.REL_TOL and worst <= fused_layers.MAX_TOL):
        raise RuntimeError(f"{what}: relative L2 {l2:.3g}, largest {worst:.3g} x RMS; not timed")
    ms, gmm_ms, seq_ms, *parts_ms = interleaved_ms(list(fns) + list(parts), iters=iters)
    return dict(ms=ms, gmm_ms=gmm_ms, seq_ms=seq_ms, tflops=flops / ms / 1e9, gmm_tflops=flops / gmm_ms / 1e9,
                err=l2, padded=padded, routed=routed, parts_ms=parts_ms)


def bench_row(row: MoERow, iters: int, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16",
              cluster: int = 2) -> dict:
    """Check, then time, one row: ``{ms, gmm_ms, seq_ms, tflops, gmm_tflops, err}``."""
    import numpy as np
    import torch
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    from . import fused_layers
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, hidden, 2 * ffn // TP
    ids, rt, lowered = lowered_row(row, tile, stages, dtype, cluster)
    tabs = rt.allgather_tables()
    kern = GroupedKernel(lowered)
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(T + E)
    x = torch.randn(T, K, device="cuda", generator=g).to(tdt)
    w = (torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).to(tdt)
    h = torch.full((rt.num_rows, N), float("nan"), device="cuda", dtype=tdt)
    bufs = {"x_gathered": x, "w1": w, "h": h,
            **{n: torch.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in tabs.items()}}
    flags = {s: torch.ones(lowered.signal_slots[s], device="cuda", dtype=torch.int64) for s in lowered.signals}
    ids_dev = ids.cuda()
    order, offs = route(ids_dev, E)
    rows = x.index_select(0, order // topk)

    prepared = kern.prepare(bufs, flags)       # checked and packed once, as the ops do

    def ours():
        prepared.launch(torch.cuda.current_stream().cuda_stream, 1)

    def gmm():
        return torch._grouped_mm(rows, w, offs=offs)

    def sequence():
        return torch._grouped_mm(x.index_select(0, order // topk), w, offs=offs)
    ours()
    want = gmm()
    _, dest = fused_layers.padded_rows(want, ids_dev, E, tile[0], rt.num_rows // tile[0])
    return _checked_timings(f"{row}: the grouped GEMM differs from _grouped_mm", h[dest], want,
                            [ours, gmm, sequence], iters, 2 * T * topk * K * N, _computed_rows(rt), T * topk)


def _computed_rows(rt) -> int:
    """Rows our kernels compute: the routing's used tiles, whole (the tables hold the worst
    case's tiles, ``rt.num_rows``; an unused one costs its guard only)."""
    return int((rt.tile_expert >= 0).sum()) * rt.block_m


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", choices=("ag", "rs"), default="ag",
                    help="ag: AllGather+MoE's grouped GEMM (layer 0); rs: MoE+ReduceScatter's grouped GEMM and "
                         "top-k combine (layer 1)")
    ap.add_argument("--rows", default=None, help=f"MODEL:TOKENS:ROUTING,... (models: {', '.join(MOE_MODELS)}; "
                                                 f"routings: {', '.join(ROUTINGS)}); default: the issue's rows")
    ap.add_argument("--tile", default="128,256,64", help="BM,BN,BK of the compute schedule")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--cluster", type=int, choices=(1, 2), default=2,
                    help="CTAs per cluster along M (2: pairs of tiles share B by TMA multicast)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    try:
        args.row_list = ([MoERow(*r) for r in MOE_ROWS] if not args.rows
                         else [_parse_row(s) for s in args.rows.split(",")])
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    try:
        args.tile_t = tuple(int(v) for v in args.tile.split(","))
    except ValueError:
        args.tile_t = ()
    if len(args.tile_t) != 3:
        ap.error(f"--tile: three integers BM,BN,BK, got {args.tile!r}")
    return args


def main(argv, out=sys.stdout) -> int:
    args = parse_args(argv)
    rs = args.layer == "rs"
    what = (f"MoE+ReduceScatter grouped GEMM + top-k combine (TP={TP} slice of layer 1)" if rs
            else f"AllGather+MoE grouped GEMM (TP={TP} slice of layer 0)")
    print(f"# {what}, {args.dtype}, tile {args.tile_t} stages {args.stages} cluster ({args.cluster}, 1); ms (median of "
          f"{args.iters}, interleaved)", file=out)
    # rs: ours is the grouped GEMM and the combine; _grouped_mm is the GEMM alone (the bound of issue 20)
    ours, seq = ("tldsl GEMM + combine ms", "_grouped_mm + weighted sum ms") if rs else ("tldsl ms",
                                                                                        "gather + _grouped_mm ms")
    split = " GEMM alone ms | combine alone ms |" if rs else ""      # (rs: ours kernel by kernel)
    print(f"| row | {ours} | TFLOP/s | _grouped_mm ms | TFLOP/s | tldsl / _grouped_mm speed | {seq} "
          f"| tldsl / sequence speed | computed / routed rows |{split}\n|---|---|---|---|---|---|---|---|---|"
          f"{'---|---|' if rs else ''}", file=out, flush=True)
    failed = 0
    for row in args.row_list:
        try:
            r = (bench_rs_row if rs else bench_row)(row, args.iters, args.tile_t, args.stages, args.dtype,
                                                    args.cluster)
        except Exception as e:      # noqa: BLE001 - one row's failure is reported, the rest still run
            failed += 1
            print(f"| {row.model} {row.tokens} {row.routing} | failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160]} | | | | | | | |{' | |' if rs else ''}", file=out, flush=True)
            continue
        print(f"| {row.model} {row.tokens} {row.routing} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['gmm_ms']:.3f} | "
              f"{r['gmm_tflops']:.0f} | {r['gmm_ms'] / r['ms']:.2f} | {r['seq_ms']:.3f} | {r['seq_ms'] / r['ms']:.2f} | "
              f"{r['padded']} / {r['routed']} |" + "".join(f" {t:.3f} |" for t in r["parts_ms"]), file=out, flush=True)
    return 1 if failed else 0

