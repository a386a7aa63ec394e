"""Probes of the MoE grouped GEMMs on one GPU (``python -m tldsl.bench probe moe_notifies``).

* ``moe_notifies``: what MoE+ReduceScatter's grouped GEMM pays for releasing each tile to the
  combine. The kernel as generated (each tile's notifies handed, after the next tile's K loop, to
  the producer warpgroup's idle warp, whose 32 lanes each fence and add), the same source with the
  notifier's fence cut out, with its adds cut out, with both (the hand-over alone), and the part
  as tl.run lowers it after its signal is dropped (no notifies, :func:`.moe.lowered_rs`), beside
  ``_grouped_mm``; timed interleaved, the GEMMs' waits already satisfied. Cut variants are for timing only: their counters are wrong
  by design (nothing waits on them here).
* ``moe_schedules``: one layer's grouped GEMM (``--layer ag``: AllGather+MoE's, its rows gathered
  inside it; ``rs``: MoE+ReduceScatter's, without its combine, which no GEMM schedule changes) under
  several compute schedules (``BMxBNxBK:STAGES[:CLUSTER[:GROUP_M]]``: the tile, its stages, CTAs a
  cluster, a group's rows of the swizzled order in cluster tiles), each checked against ``_grouped_mm``
  first, then all timed interleaved with it in one process. ``_grouped_mm`` runs in a faster or a
  slower state from one process to the next (BENCHMARKS.md, thirtieth session), so schedules are
  compared in one process, never across runs of ``bench moe``.
* ``moe_row_copies``: AllGather+MoE's routed rows gathered by batched copies (``cuMemcpyBatchAsync``,
  one copy a row) against the SMs' gather, alone and beside ``_grouped_mm``: whether the rows could
  be gathered without an SM while the GEMM computes (:func:`probe_moe_row_copies`).
"""
from __future__ import annotations

import dataclasses
import re
import sys

NOTIFY_VARIANTS = ("as generated", "no fence", "no adds", "hand-over only", "no notifies", "_grouped_mm")


def notify_ablations(source: str) -> dict[str, str]:
    """The grouped GEMM's source with parts of its notifier's hook (``notifies_lanes``) cut out."""
    head, sep, rest = source.partition("void notifies_lanes(")
    if not sep:
        raise ValueError("the source has no notifies_lanes hook (a part that never notifies, or one that waits)")
    body, close, tail = rest.partition("\n  }\n")

    def cut(pattern):
        return head + sep + re.sub(pattern, "", body) + close + tail
    fence, adds = r"\n\s*tldsl::fence_acq_rel<[^\n]*", r"\n\s*tldsl::red_relaxed_add<[^\n]*"
    both = head + sep + re.sub(adds, "", re.sub(fence, "", body)) + close + tail
    return {"as generated": source, "no fence": cut(fence), "no adds": cut(adds), "hand-over only": both}


def probe_moe_notifies(rows, iters=20, out=sys.stdout):
    import dataclasses
    import numpy as np
    import torch
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    from tldsl.runtime.gpu import require_gpu
    from . import fused_layers
    from .baselines import MOE_MODELS, route
    from .moe import TP, lowered_rs, rs_program
    from .timing import interleaved_ms
    require_gpu()
    print("| row | " + " | ".join(f"{n} ms" for n in NOTIFY_VARIANTS) + " |", file=out)
    print("|---" * (len(NOTIFY_VARIANTS) + 1) + "|", file=out)
    for row in rows:
        hidden, ffn, E, topk = MOE_MODELS[row.model]
        T, K, N = row.tokens, ffn // TP, hidden
        tile = (128, 256, 64)
        ids, _, rt, k = rs_program(row, tile)
        lg = lowered_rs(k, notifies=True)["grouped_gemm"]
        plain = GroupedKernel(lowered_rs(k)["grouped_gemm"])      # as tl.run lowers it: no notifies
        g = torch.Generator(device="cuda").manual_seed(T + E + 1)
        order, offs = route(ids.cuda(), E)
        h_sorted = torch.randn(T * topk, K, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
        h, _ = fused_layers.padded_rows(h_sorted, ids.cuda(), E, tile[0], rt.num_rows // tile[0])
        tabs = {n: torch.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in rt.reduce_scatter_tables().items()}
        y = torch.full((rt.num_rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        bufs = {"h": h, "w2": w, **tabs, "y_sorted": y}
        flags = {s: torch.full((n,), 1 << 40, device="cuda", dtype=torch.int64) for s, n in lg.signal_slots.items()}
        fns = []
        for src in notify_ablations(lg.source).values():
            prepared = GroupedKernel(dataclasses.replace(lg, source=src)).prepare(bufs, flags)
            fns.append(lambda p=prepared: p.launch(torch.cuda.current_stream().cuda_stream, 1))
        plain = plain.prepare({**bufs, "y_sorted": torch.empty_like(y)}, {})
        fns.append(lambda: plain.launch(torch.cuda.current_stream().cuda_stream, 1))
        fns.append(lambda: torch._grouped_mm(h_sorted, w, offs=offs))
        t = interleaved_ms(fns, iters=iters)
        print(f"| {row.model} {row.tokens} {row.routing} | " + " | ".join(f"{v:.3f}" for v in t) + " |", file=out,
              flush=True)


#: ``probe moe_schedules``' default schedules: the grouped GEMM's default, one stage fewer, half the
#: K step with twice the stages (about the same shared memory), 128 x 128 tiles
DEFAULT_SCHEDULES = "128x256x64:4,128x256x64:3,128x256x32:8,128x128x64:6"
#: the largest group ``--schedules`` takes (cluster tiles; a group past the grid's rows orders it
#: column by column already)
MAX_GROUP_M = 1 << 16


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A compute schedule of ``probe moe_schedules``: the tile, the pipeline stages, CTAs a cluster,
    and a group's rows of the swizzled order, counted in cluster tiles of ``cluster`` tile rows
    (``None``: the schedule's default)."""
    tile: tuple[int, int, int]
    stages: int
    cluster: int = 2
    group_m: int | None = None

    def __str__(self) -> str:
        tail = f":{self.cluster}:{self.group_m}" if self.group_m is not None else (
            f":{self.cluster}" if self.cluster != 2 else "")
        return "x".join(map(str, self.tile)) + f":{self.stages}" + tail


def parse_schedules(text: str) -> list[Schedule]:
    """``BMxBNxBK:STAGES[:CLUSTER[:GROUP_M]],...`` as :class:`Schedule` s (cluster 2, the
    schedule's group_m unless given); an
    ``argparse.ArgumentTypeError`` naming the bad item otherwise. The schedule's own checks (powers
    of two, stage counts, what fits shared memory) run when each is lowered (:func:`schedule_kernels`)."""
    import argparse
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        dims = parts[0].split("x")
        if not (2 <= len(parts) <= 4 and len(dims) == 3 and all(v.isdigit() for v in dims + parts[1:])):
            raise argparse.ArgumentTypeError(f"--schedules: BMxBNxBK:STAGES[:CLUSTER[:GROUP_M]],... "
                                             f"(e.g. 128x256x64:4,128x128x64:6:1,128x256x64:4:2:16), got {item!r}")
        cluster = int(parts[2]) if len(parts) >= 3 else 2
        if cluster not in (1, 2):
            raise argparse.ArgumentTypeError(f"--schedules: a cluster of 1 or 2 CTAs, got {item!r}")
        group_m = int(parts[3]) if len(parts) == 4 else None
        if group_m is not None and not 1 <= group_m <= MAX_GROUP_M:
            raise argparse.ArgumentTypeError(f"--schedules: a group of 1 to {MAX_GROUP_M} cluster tiles, got {item!r}")
        out.append(Schedule(tuple(int(v) for v in dims), int(parts[1]), cluster, group_m))
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--schedules: a schedule given twice in {text!r}")
    return out


def schedule_kernels(row, schedules, layer: str = "ag") -> list:
    """``[(schedule, topk_ids, host routing, lowered grouped GEMM)]`` of one row's layer under each
    schedule, each by the grouped GEMM's recipe (``ag``: rows gathered in the GEMM; ``rs``: the GEMM
    as tl.run runs it before its combine); a schedule the recipe or the schedule's own checks refuse
    (shape, stages, shared memory) is a ValueError naming it and saying why, and so are two schedules
    that give the same kernel (one spelling the defaults the other leaves out) — no GPU needed."""
    from tldsl.codegen import lower_grouped_gemm
    from tldsl.runtime.gpu.run_plan import stream_ordered
    from .moe import ag_program, rs_program
    if layer not in ("ag", "rs"):
        raise ValueError(f"layer: 'ag' or 'rs', got {layer!r}")
    out = []
    for sc in schedules:
        try:
            if layer == "ag":
                ids, rt, k = ag_program(row, sc.tile, sc.stages, cluster=sc.cluster, stage_rows="off",
                                        group_m=sc.group_m)
            else:
                ids, _, rt, k = rs_program(row, sc.tile, sc.stages, group_m=sc.group_m)
            lg = lower_grouped_gemm(stream_ordered(k), "grouped_gemm", cluster=(sc.cluster, 1))
        except Exception as e:      # noqa: BLE001 - every refusal, named by its schedule
            raise ValueError(f"schedule {sc} ({layer}, {row.model}:{row.tokens}:{row.routing}): "
                             f"{type(e).__name__}: {str(e).strip()}") from e
        same = next((other for other, *_, lo in out if lo.source == lg.source), None)
        if same is not None:
            raise ValueError(f"schedules {same} and {sc} ({layer}, {row.model}:{row.tokens}:{row.routing}) are the "
                             f"same kernel (group {lg.config.group_m}, cluster {sc.cluster}): give one of them")
        out.append((sc, ids, rt, lg))
    return out


def probe_moe_schedules(rows, schedules, layer: str = "ag", iters: int = 20, out=sys.stdout, kernels=None):
    """``kernels``: each row's :func:`schedule_kernels`, where the caller lowered them already."""
    import numpy as np
    import torch
    from tldsl.runtime.gpu import require_gpu
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    from .baselines import MOE_MODELS, route
    from .moe import TP, _check_close, laid_out, rows_laid_out
    from .timing import interleaved_ms
    require_gpu()
    names = [str(sc) for sc in schedules]
    print(f"# {layer}: the grouped GEMM alone under each schedule, ms (median of {iters}, interleaved)", file=out)
    print("| row | " + " | ".join(names) + " | _grouped_mm | fastest | its speed vs _grouped_mm |", file=out)
    print("|---" * (len(names) + 4) + "|", file=out, flush=True)
    for n_row, row in enumerate(rows):
        hidden, ffn, E, topk = MOE_MODELS[row.model]
        T = row.tokens
        K, N = (hidden, 2 * ffn // TP) if layer == "ag" else (ffn // TP, hidden)
        g = torch.Generator(device="cuda").manual_seed(T + E)
        row_kernels = kernels[n_row] if kernels is not None else schedule_kernels(row, schedules, layer)
        order, offs = route(row_kernels[0][1].cuda(), E)
        w = (torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
        if layer == "ag":
            x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
            a = x.index_select(0, order // topk)
        else:
            a = torch.randn(T * topk, K, device="cuda", generator=g).to(torch.bfloat16)
        want = torch._grouped_mm(a, w, offs=offs)
        stream = torch.cuda.current_stream().cuda_stream
        fns, held = [], []
        for sc, ids, rt, lg in row_kernels:
            out_t = torch.full((rt.num_rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            if layer == "ag":
                tabs = rt.allgather_tables()
                bufs = {"x_gathered": x, "w1": w, "h": out_t}
            else:
                tabs = rt.reduce_scatter_tables()
                bufs = {"h": rows_laid_out(a, order, rt), "w2": w, "y_sorted": out_t}
            bufs.update({n: torch.from_numpy(np.ascontiguousarray(v)).cuda() for n, v in tabs.items()})
            flags = {s: torch.full((n,), 1 << 40, device="cuda", dtype=torch.int64)
                     for s, n in lg.signal_slots.items()}            # every wait already satisfied
            prepared = GroupedKernel(lg).prepare(bufs, flags)
            prepared.launch(stream, 1)
            _check_close(f"{row.model} {row.tokens} {row.routing} {sc}", out_t[laid_out(order, rt)], want)
            held.append((bufs, flags))
            fns.append(lambda p=prepared: p.launch(stream, 1))
        fns.append(lambda: torch._grouped_mm(a, w, offs=offs))
        t = interleaved_ms(fns, iters=iters)
        best = min(range(len(names)), key=lambda i: t[i])
        print(f"| {row.model} {row.tokens} {row.routing} | " + " | ".join(f"{v:.3f}" for v in t) +
              f" | {names[best]} | {t[-1] / t[best]:.2f} |", file=out, flush=True)


# -- AllGather+MoE's routed rows by batched copies -------------------------------------------------

def row_copy_lists(dst_ptr: int, src_ptr: int, token_rows, row_bytes: int):
    """``(dsts, srcs, sizes)`` of a row gather as one copy a row: row ``r`` of the destination
    from row ``token_rows[r]`` of the source (both dense, ``row_bytes`` a row) — the lists
    ``cuMemcpyBatchAsync`` takes, as plain addresses."""
    rows = [int(t) for t in token_rows]
    if any(t < 0 for t in rows):
        raise ValueError("row_copy_lists: a row id < 0 (a padding row) has nothing to copy")
    return ([dst_ptr + r * row_bytes for r in range(len(rows))], [src_ptr + t * row_bytes for t in rows],
            [row_bytes] * len(rows))


#: ``probe moe_row_copies``' columns
ROW_COPY_VARIANTS = ("_grouped_mm alone", "SM gather (index_select)", "copy of the gather's bytes",
                     "batched copies, one batch", "batched copies, a batch per 128 rows",
                     "SM gather, then _grouped_mm", "_grouped_mm beside an SM gather",
                     "_grouped_mm beside batched copies, one batch",
                     "_grouped_mm beside batched copies, a batch per 128 rows")


def probe_moe_row_copies(rows, iters: int = 7, out=sys.stdout):
    """AllGather+MoE's routed rows (``bench moe``'s rows, TP = 2 slice) gathered by
    ``cuMemcpyBatchAsync`` with ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``, one copy a row, in
    one batch and a batch per 128 rows, against the SMs' gather (``index_select``), a copy of the
    same bytes and ``_grouped_mm``; and ``_grouped_mm`` with each gather on a second stream beside it
    (into another buffer): whether copies could gather the rows while the GEMM computes. Every
    gather checked against ``index_select`` first."""
    import time
    import torch
    from cuda.bindings import driver as cu
    from tldsl.runtime.gpu import require_gpu
    from .baselines import MOE_MODELS, random_topk, route
    from .moe import TP
    from .copies import batch_copies
    from .timing import median_ms
    require_gpu()
    overlap = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE

    def batch(lists, lo, hi, stream):
        batch_copies(cu, *(v[lo:hi] for v in lists), stream, overlap)

    print("| row | routed rows | gather MB | host enqueue ms: one batch, batches of 128 | "
          + " | ".join(f"{v} ms" for v in ROW_COPY_VARIANTS) + " |", file=out)
    print("|---" * (len(ROW_COPY_VARIANTS) + 4) + "|", file=out, flush=True)
    main, side = torch.cuda.Stream(), torch.cuda.Stream()       # batch copies refuse the legacy default stream
    with torch.cuda.stream(main):
        for row in rows:
            hidden, ffn, E, topk = MOE_MODELS[row.model]
            T, K, N = row.tokens, hidden, 2 * ffn // TP
            g = torch.Generator(device="cuda").manual_seed(T + E)
            ids, _ = random_topk(T, E, topk, row.routing, device="cuda")
            order, offs = route(ids, E)
            tok = (order // topk).contiguous()
            R, row_bytes = tok.numel(), 2 * K
            x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
            w = (torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
            xs, xs2 = (torch.full((R, K), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
            want = x.index_select(0, tok)
            token_rows = tok.cpu().tolist()
            lists = {id(b): row_copy_lists(b.data_ptr(), x.data_ptr(), token_rows, row_bytes) for b in (xs, xs2)}

            def one_batch(buf=xs, stream=main):
                batch(lists[id(buf)], 0, R, stream.cuda_stream)

            def batches_of_128(buf=xs, stream=main):
                for lo in range(0, R, 128):
                    batch(lists[id(buf)], lo, min(R, lo + 128), stream.cuda_stream)
            for gather in (one_batch, batches_of_128):
                xs.fill_(float("nan"))
                gather()
                torch.cuda.synchronize()
                if not torch.equal(xs, want):
                    raise RuntimeError(f"{row}: the batched copies ({gather.__name__}) gathered wrong rows")
            t0 = time.perf_counter()
            one_batch()
            t1 = time.perf_counter()
            batches_of_128()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            host = ((t1 - t0) * 1e3, (t2 - t1) * 1e3)
            cycles = int(2.0e6 * max(host) * 1.5) + 1000        # a sleep longer than the enqueue (~2e6 cycles a ms)
            gmm = lambda: torch._grouped_mm(xs, w, offs=offs)                     # noqa: E731
            sm_gather = lambda: torch.index_select(x, 0, tok, out=xs)             # noqa: E731
            src = torch.empty(R * row_bytes, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)

            def beside(gather):
                def run():
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        gather()
                    gmm()
                    main.wait_stream(side)
                return run
            fns = [(gmm, 0), (sm_gather, 0), (lambda: dst.copy_(src), 0), (one_batch, cycles),
                   (batches_of_128, cycles), (lambda: (sm_gather(), gmm()), 0),
                   (beside(lambda: torch.index_select(x, 0, tok, out=xs2)), 0),
                   (beside(lambda: one_batch(xs2, side)), cycles), (beside(lambda: batches_of_128(xs2, side)), cycles)]
            t = [median_ms(fn, iters, warmup=2, sleep_cycles=cyc) for fn, cyc in fns]
            print(f"| {row.model} {row.tokens} {row.routing} | {R} | {R * row_bytes / 1e6:.0f} | "
                  f"{host[0]:.1f}, {host[1]:.1f} | " + " | ".join(f"{v:.3f}" for v in t) + " |", file=out, flush=True)
