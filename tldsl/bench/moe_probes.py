"""Probes of the MoE grouped GEMMs on one GPU (``python -m tldsl.bench probe moe_notifies``).

* ``moe_notifies``: what MoE+ReduceScatter's grouped GEMM pays for releasing each tile to the
  combine. The kernel as generated (each tile's notifies handed, after the next tile's K loop, to
  the producer warpgroup's idle warp, whose 32 lanes each fence and add), the same source with the
  notifier's fence cut out, with its adds cut out, with both (the hand-over alone), and the part
  as tl.run lowers it after its signal is dropped (no notifies, :func:`.moe.lowered_rs`), beside
  ``_grouped_mm``; timed interleaved, the GEMMs' waits already satisfied. Cut variants are for timing only: their counters are wrong
  by design (nothing waits on them here).
"""
from __future__ import annotations

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
