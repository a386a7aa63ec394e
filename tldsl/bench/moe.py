"""The MoE grouped GEMMs beside ``torch._grouped_mm`` on one GPU (issue 20's rows).

    python -m tldsl.bench moe [--layer ag|rs] [--rows mixtral:8192:random,...] [--tile 128,256,64]
                              [--stages 4] [--cluster 2] [--stage-rows auto|on|off] [--fold on|off]
                              [--gather-order tokens|layout]
                              [--group-m N] [--interleave N] [--partial out|f32] [--dtype bfloat16|float16]
                              [--iters 10] [--repeat 1] [--processes 1] [--json PATH]

``--layer ag`` (the default), AllGather+MoE's grouped GEMM:

One row per (model, tokens across TP = 2 ranks, routing): this GPU computes one rank's slice of
layer 0 (gate and up fused: ``N = 2 * ffn / 2``, ``K = hidden``) on every token, its waits
already satisfied — the kernel alone, as it runs once the all-gather has delivered every token.
It gathers its rows itself (``sorted_token_ids``) — inside the grouped GEMM, or, where the slice
is wide enough to pay for it (``--stage-rows``, :func:`tldsl.ops.moe.stage_rows_pays`), in a pass of
their own before the GEMM reads them by TMA (the two kernels then also timed one by one, and a
device-to-device copy of the bytes the gather moves, its bound; with
``--fold on``, that pass runs inside the GEMM's kernel, on its producer's spare warps, ahead of the
GEMM tiles waiting for its rows: one launch, its waits real; ``--gather-order``: that pass visits the
row tiles by the tokens they hold, as the routing's ``tile_visit`` orders them (``tokens``), or in
their layout order, expert after expert (``layout``); by default as AllGatherMoE does: by tokens
before the GEMM, in layout order folded into it) — so it
is compared with ``torch._grouped_mm`` on the same expert-sorted rows already gathered (the
kernel alone) and with torch's whole sequence (the row gather ``index_select`` +
``_grouped_mm``). Each row is checked against ``_grouped_mm`` first; TFLOP/s count the routed
rows only (not our padding to whole tiles). Our kernels are timed as the ops launch them: their
arguments bound and packed once by the runtime's binder, each timed launch one driver call — the
per-call Python checks of ``kernel(buffers, ...)`` are host time that would sit inside the
CUDA-event interval.
Routings as the layer benchmark draws them (:func:`.baselines.random_topk`: top-k of random
logits, Zipf-skewed, every token on the same experts).

``--layer rs``, MoE+ReduceScatter's grouped GEMM and top-k combine: one rank's slice of layer 1
(``h [rows, ffn / 2] @ w2[expert] [ffn / 2, hidden]``) on every routed row, then the weighted
top-k sum per token (in fp32) into the partial the reduce-scatter would read — in the operands' dtype
(``--partial out``, MoEReduceScatter's default, as NCCL's reduce-scatter of the layer reads it) or fp32
(``--partial f32``) — our two kernels (the
grouped GEMM into ``y_sorted``, the combine), each launch one driver call, beside
``torch._grouped_mm`` on the same expert-sorted rows (the GEMM alone) and torch's sequence
(``_grouped_mm`` + the weighted sum by ``index_add_`` into fp32 whichever partial ours stores, as the
layer benchmark computes it). The
partial is checked against torch's sequence first. Our two kernels are lowered as tl.run and the
op lower them: the combine runs after the GEMM on its stream, so the signal between them is
dropped (the GEMM notifies nothing, the combine waits for nothing). Three more columns time our
kernels one by one (the GEMM alone, the combine alone: where the layer's time goes) and the GEMM
as written, notifying each tile (its rows checked equal: what releasing each tile to a combine
beside it costs); then a device-to-device copy of the bytes the combine moves (the
routed rows of ``y_sorted`` read, the partial written): its bound; and last a copy of the least
bytes the pair must move through DRAM (:func:`pair_dram_bytes`: the weights of the experts with rows
and ``h``'s routed rows read, those rows of ``y_sorted`` written and read back, the partial written) — where that copy takes
nearly as long as ``_grouped_mm``, the pair can reach 1.0x only by keeping DRAM as busy as a copy
from start to end. ``--fold on``: the combine folded
into the grouped GEMM's kernel — its tiles run by the producer warpgroup's three spare warps, each
once its GEMM tiles are done, the GEMM's tiles column by column — one launch, its waits real
(checked too), beside the two kernels one after the other. ``--combine epilogue``: no combine
pass — the output zeroed, then the grouped GEMM adding each routed row, times its top-k weight, into
its token's row (``tl.add_rows``: :func:`~tldsl.ops.moe.moe_combined_experts`, :class:`AddedRows`),
``y_sorted`` neither written nor read back; the parts then time the GEMM storing ``y_sorted``, the
combine, the GEMM adding its rows and the zeroing of the output, each alone.

``--repeat R``: each row timed R times in this process, each time on tensors allocated anew (the
allocator's cache emptied and a ballast of another size held first, so most likely at other
addresses) and with the interleaved launches in another order (:func:`.timing.launch_order`:
another kernel runs before each); the table gives the medians over the repeats and the range of
the per-repeat speeds (``--json PATH`` also writes them, with every column, row by row).
Measured (BENCHMARKS.md, thirtieth session): the speeds move less between repeats than between
processes, where ``_grouped_mm`` on the small-expert rows runs in a fast or a slow state (0.29 or
0.33 ms on DeepSeek-MoE's layer 1): compare runs, not one. ``--processes P`` does that: the whole
benchmark run P times, each in a fresh process (:mod:`.processes`; each one's table on stderr), and
the table gives the medians over the processes and the range of their speeds.
"""
from __future__ import annotations

import argparse
import sys

from ..collectives import PARTIAL_DTYPES
from ..ops.weights import WEIGHT_LAYOUTS
from .baselines import MOE_MODELS, MOE_ROWS, ROUTINGS, MoERow, _parse_row, random_topk, route
from .folded import SATISFIED, comm_notified, folded_launches
from . import timing
from .timing import copy_of, fresh_placement

#: TP ranks the rows' weight slices are for (tokens are the total across them)
TP = 2


#: ``--stage-rows`` choices: ``auto`` asks :func:`tldsl.ops.moe.stage_rows_pays` (what
#: AllGatherMoE does), ``on`` / ``off`` force the routed rows' gather into a pass of its own / into
#: the grouped GEMM
STAGE_ROWS = ("auto", "on", "off")
#: ``--gather-order`` choices: the staged row gather's visit of the row tiles, by the routing's
#: ``tile_visit`` (by the tokens the tiles hold) or in layout order (each expert's tiles in turn)
GATHER_ORDERS = ("tokens", "layout")


def default_gather_order(fold: bool) -> str:
    """The staged gather's order AllGatherMoE takes: by tokens where the gather runs before the
    GEMM, in layout order where the GEMM overlaps it (folded into its kernel)."""
    return "layout" if fold else "tokens"


def stage_rows_for(row: MoERow, stage_rows: str = "auto") -> bool:
    """Whether the row's AllGather+MoE program gathers its routed rows in a pass of their own."""
    from tldsl.ops.moe import stage_rows_pays
    _, ffn, _, _ = MOE_MODELS[row.model]
    return stage_rows_pays(2 * ffn // TP, 1) if stage_rows == "auto" else stage_rows == "on"


def lowered_row(row: MoERow, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16", cluster: int = 2,
                stage_rows: str = "auto", interleave: int | None = None, group_m: int | None = None,
                gather_order: str = "tokens", weights: str = "kn"):
    """``(topk_ids, host routing, traced program, {part: lowered kernel})`` of one row (one rank's
    slice, W = 1: the program reads every token from ``x_gathered``): its grouped GEMM, and its
    row gather where the rows are staged (``gather_rows``); ``interleave``: the routing's tiles in
    rounds of that many per expert (:func:`tldsl.ops.moe.moe_routing`); ``group_m``, ``gather_order``:
    :func:`ag_program`'s."""
    from tldsl.codegen import lower, lower_grouped_gemm
    from tldsl.runtime.gpu.run_plan import stream_ordered
    ids, rt, k = ag_program(row, tile, stages, dtype, cluster, stage_rows, interleave, group_m, gather_order,
                            weights)
    parts = [p.name for p in k.parts if p.role == "compute"]
    as_run = stream_ordered(k)          # as tl.run and the op lower it: the GEMM after the gather, no signal between
    # the grouped GEMM by its own recipe, which names what it refuses (``lower`` would fall back to the general
    # lowering, and the row would time another kernel than the one it is labelled with)
    return ids, rt, k, {p: lower_grouped_gemm(as_run, p) if p == "grouped_gemm" else lower(as_run, p) for p in parts}


def ag_program(row: MoERow, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16", cluster: int = 2,
               stage_rows: str = "auto", interleave: int | None = None, group_m: int | None = None,
               gather_order: str = "tokens", weights: str = "kn"):
    """``(topk_ids, host routing, traced program)`` of one row's layer 0 (one rank's slice, W = 1);
    ``weights``: how the experts' weights are stored (:data:`tldsl.ops.weights.WEIGHT_LAYOUTS`);
    ``group_m``: a group's rows of the swizzled order, counted in cluster tiles (``cluster`` tile rows
    each; the schedule's default unless given); ``gather_order``: one of :data:`GATHER_ORDERS` (``layout``:
    the routing's ``tile_visit`` replaced by the tiles' layout order)."""
    import dataclasses

    import numpy as np

    import tldsl as tl
    from tldsl.ops.moe import moe_routing
    if gather_order not in GATHER_ORDERS:
        raise ValueError(f"gather_order must be one of {GATHER_ORDERS}, got {gather_order!r}")
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, hidden, 2 * ffn // TP
    ids, _ = random_topk(T, E, topk, row.routing, device="cpu", seed=7)
    rt = moe_routing(ids.numpy(), E, 1, T, tile[0], interleave=interleave)
    if gather_order == "layout":
        rt = dataclasses.replace(rt, tile_visit=np.arange(rt.num_tiles, dtype=np.int32))
    k = rt.trace_allgather_moe(1, T, K, N, E, getattr(tl, dtype), weights=weights,
                               compute=tl.ComputeSchedule(tile=tile, stages=stages, order="swizzled",
                                                          cluster=(cluster, 1),
                                                          **({"group_m": group_m} if group_m else {})),
                               comm=tl.CommSchedule(tile_m=128, mode="pull"),
                               stage_rows=stage_rows_for(row, stage_rows))
    return ids, rt, k


def prepared_parts(ir, lowered: dict, tensors: dict, signals: dict) -> dict:
    """``{part: PreparedLaunch}`` of lowered parts of ``ir`` at W = 1, every parameter bound by
    the runtime's one binder table (:func:`tldsl.runtime.gpu.bind.bind`) to ``tensors`` (by IR
    name, CUDA torch tensors) and ``signals`` (int64 counters by name): launched as the fused-op
    runtime launches them, each launch one driver call."""
    from tldsl.runtime.gpu.bind import DeviceMemory, array_dtype, bind, pack
    from tldsl.runtime.gpu.cuda_device import CudaDevice
    from tldsl.runtime.gpu.launch import PreparedLaunch
    from tldsl.runtime.gpu.plan_exec import DeviceArray
    from tldsl.runtime.gpu.run_program import scratch_allocator
    dev = CudaDevice()
    bufs = {b.name: DeviceArray(tensors[b.name].data_ptr(), tuple(b.type.shape), array_dtype(b.type.dtype),
                                owner=tensors[b.name]) for b in ir.buffers if b.name in tensors}
    sigs = {n: DeviceArray(t.data_ptr(), tuple(t.shape), "i64", owner=t) for n, t in signals.items()}
    mem = DeviceMemory(1, [bufs], [sigs], dev.upload, dev.encode_tma, allocate=scratch_allocator(dev.torch_device))
    loaded = dev.load({lk.entry: lk for lk in lowered.values()})
    out = {}
    for part, lk in lowered.items():
        grid = lk.grid(dev.sm_count)
        args, slot = pack(bind(lk, 0, mem, ctas=grid[0]))
        out[part] = PreparedLaunch(loaded[lk.entry], grid, lk.block, args, slot, lk.cluster_dims)
    return out


#: ``--fold`` choices: ``on`` folds the combine into the grouped GEMM's kernel (its tiles on the
#: producer warpgroup's spare warps, the GEMM's tiles column by column so that a column's combine
#: starts once its GEMM tiles are done), ``off`` launches the two kernels one after the other
FOLD = ("on", "off")
COMBINES = ("pass", "epilogue")


def rs_program(row: MoERow, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16", fold: bool = False,
               group_m: int | None = None, interleave: int | None = None, partial_dtype: str = "out",
               weights: str = "kn"):
    """``(topk_ids, topk_weights, host routing, traced program)`` of one row's layer 1 (one rank's
    slice, W = 1: the combine's partial holds every token). ``fold``: the tiles column by column
    (for a combine folded in) unless ``group_m`` (a group's rows of the swizzled order, in cluster tiles) says
    otherwise; unfolded, the schedule's ``group_m`` unless given; ``interleave``: the routing's
    tiles in rounds of that many per expert (:func:`tldsl.ops.moe.moe_routing`); ``partial_dtype``
    as :class:`~tldsl.runtime.dist.moe_ops.MoEReduceScatter` takes it (its default); ``weights``: how
    the experts' weights are stored (:data:`tldsl.ops.weights.WEIGHT_LAYOUTS`)."""
    import tldsl as tl
    from tldsl.ops.moe import moe_routing
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, ffn // TP, hidden
    ids, wts = random_topk(T, E, topk, row.routing, device="cpu", seed=7)
    rt = moe_routing(ids.numpy(), E, 1, T, tile[0], interleave=interleave)
    order = dict(order="swizzled")
    if fold or group_m:
        order["group_m"] = group_m or max(rt.num_tiles, -(-T // tile[0]))
    k = rt.trace_moe_reduce_scatter(1, T, K, N, E, tl.TensorSpec((T, topk), tl.float32), getattr(tl, dtype),
                                    compute=tl.ComputeSchedule(tile=tile, stages=stages, **order),
                                    comm=tl.CommSchedule(tile_m=128, order="ring", mode="push"),
                                    partial_dtype=partial_dtype, weights=weights)
    return ids, wts, rt, k


def lowered_rs(k, cluster: int = 2, notifies: bool = False) -> dict:
    """``{"grouped_gemm", "combine"}`` of layer 1's program ``k``, lowered as tl.run and the op
    lower them (the combine after the GEMM on its stream: the signal between them dropped), or
    with ``notifies`` as written (the GEMM notifying each tile, the combine waiting: what a
    combine beside the GEMM, or folded into it, needs)."""
    from tldsl.codegen import lower_combine, lower_grouped_gemm
    from tldsl.runtime.gpu.run_plan import stream_ordered
    as_run = k if notifies else stream_ordered(k)
    return {"grouped_gemm": lower_grouped_gemm(as_run, "grouped_gemm", cluster=(cluster, 1)),
            "combine": lower_combine(as_run, "combine")}


def lowered_rs_row(row: MoERow, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16", cluster: int = 2,
                   fold: bool = False, group_m: int | None = None, notifies: bool = False,
                   interleave: int | None = None, partial_dtype: str = "out", weights: str = "kn"):
    """``(topk_ids, topk_weights, host routing, lowered grouped GEMM, lowered combine)`` of one
    row's layer 1 (:func:`rs_program`, :func:`lowered_rs`); ``fold``: the combine folded into the
    grouped GEMM's kernel (then None in its place)."""
    ids, wts, rt, k = rs_program(row, tile, stages, dtype, fold, group_m, interleave, partial_dtype, weights)
    lowered = lowered_rs(k, cluster, notifies=notifies or fold)
    if fold:
        return ids, wts, rt, folded_as_run_folds(k, lowered), None
    return ids, wts, rt, lowered["grouped_gemm"], lowered["combine"]


#: the folded kernels' wait timeout, tl.run's default: a wait no launch satisfies traps (an error
#: naming the row) rather than hanging the GPU. Trapping costs nothing measurable (Mixtral 8192 and
#: 32768 folded: the same times with and without it; the report printed in debug builds costs 18 %:
#: BENCHMARKS.md, thirty-third session).
FOLDED_WAIT_TIMEOUT_NS = 60 * 10**9


def folded_as_run_folds(ir, lowered: dict):
    """The grouped GEMM of ``lowered`` with its chained partner folded in, exactly as ``tl.run``
    folds it (:func:`tldsl.runtime.gpu.fold.fold_chained`, its waits timing out as tl.run's do by
    default); raises where the recipe refuses."""
    from tldsl.runtime.gpu.fold import fold_chained
    lf = fold_chained(ir, lowered, {"wait_timeout_ns": FOLDED_WAIT_TIMEOUT_NS}, set(lowered))["grouped_gemm"]
    if lf.side is None:
        raise RuntimeError(f"{ir.name}: the grouped GEMM's recipe did not fold its chained part")
    return lf


class RsRow:
    """One row of layer 1 ready to launch, as ``bench moe --layer rs`` times it (:func:`rs_row`): our
    two kernels bound to poisoned buffers (the grouped GEMM into ``y_sorted``, the combine into the
    partial, the signal between them dropped), the GEMM as written (notifying each tile, into a
    ``y_sorted`` of its own), and torch's ``_grouped_mm`` and whole sequence on the same rows. Each
    method launches once on the current stream."""

    def __init__(self, k, rt, lg, lc, notifying, bufs, *, h_sorted, w, offs, order, flat_w, T, N, topk,
                 topk_weights=None):
        from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
        import torch
        self.k, self.rt, self.lg, self.lc, self.bufs = k, rt, lg, lc, bufs      # rt: the routing's tables
        self._h_sorted, self._w, self._offs, self._order, self._flat_w = h_sorted, w, offs, order, flat_w
        self._T, self._N, self._topk = T, N, topk
        self.topk_weights = topk_weights      # [T, topk] on the host: the routing's (AddedRows scales rows by them)
        slots = {**notifying.signal_slots, **lc.signal_slots}
        flags = {s: torch.full((n,), 1 << 40, device="cuda", dtype=torch.int64) for s, n in slots.items()}
        self._gemm = GroupedKernel(lg).prepare(bufs, {s: flags[s] for s in lg.signals})
        self._combine = GroupedKernel(lc).prepare(bufs, {s: flags[s] for s in lc.signals})
        self.y_notified = torch.full_like(bufs["y_sorted"], float("nan"))
        self._notifying = GroupedKernel(notifying).prepare({**bufs, "y_sorted": self.y_notified},
                                                           {s: flags[s] for s in notifying.signals})

    @staticmethod
    def _stream() -> int:
        import torch
        return torch.cuda.current_stream().cuda_stream

    def gemm(self):
        self._gemm.launch(self._stream(), 1)

    def combine(self):
        self._combine.launch(self._stream(), 1)

    def pair(self):
        self.gemm()
        self.combine()

    def notifying_gemm(self):
        self._notifying.launch(self._stream(), 1)

    def gmm(self):
        import torch
        return torch._grouped_mm(self._h_sorted, self._w, offs=self._offs)

    def experts_used(self) -> int:
        """How many experts have routed rows (their weights are all the GEMMs read); one host sync."""
        import torch
        return int((torch.diff(self._offs, prepend=self._offs.new_zeros(1)) > 0).sum())

    def sequence(self):
        import torch
        out = torch.zeros((self._T, self._N), dtype=torch.float32, device="cuda")
        return out.index_add_(0, self._order // self._topk, self.gmm().float() * self._flat_w)


def expert_weights(E: int, K: int, N: int, dtype, generator, weights: str = "kn"):
    """``(stored, as multiplied)``: the experts' weights as the kernels take them — ``[E, K, N]``, or
    (``weights="nk"``) ``[E, N, K]`` as a stack of torch Linear weights — and the ``[E, K, N]``
    operand ``_grouped_mm`` multiplies by: the same tensor, or its transposed view (no copy)."""
    import torch
    shape = (E, N, K) if weights == "nk" else (E, K, N)
    w = (torch.randn(shape, device="cuda", generator=generator) / K ** 0.5).to(dtype)
    return w, (w.transpose(1, 2) if weights == "nk" else w)


def rs_row(row: MoERow, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16", cluster: int = 2,
           group_m: int | None = None, interleave: int | None = None, partial_dtype: str = "out",
           weights: str = "kn") -> RsRow:
    """Layer 1 of ``row`` on this GPU (:class:`RsRow`): the program (:func:`rs_program`), its kernels
    lowered as tl.run and the op lower them (:func:`lowered_rs`), inputs drawn on the device; with
    ``weights="nk"`` the experts' weights stored [E, N, K] and ``_grouped_mm`` handed the same memory
    as the transposed view a torch Linear stack gives it."""
    import numpy as np
    import torch
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, ffn // TP, hidden
    ids, wts, rt, k = rs_program(row, tile, stages, dtype, group_m=group_m, interleave=interleave,
                                 partial_dtype=partial_dtype, weights=weights)
    as_run = lowered_rs(k, cluster)
    notifying = lowered_rs(k, cluster, notifies=True)["grouped_gemm"]
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(T + E + 1)
    ids_dev, wts_dev = ids.cuda(), wts.cuda()
    order, offs = route(ids_dev, E)
    h_sorted = torch.randn(T * topk, K, device="cuda", generator=g).to(tdt)      # route's order, as torch has it
    w, w_mat = expert_weights(E, K, N, tdt, g, weights)
    h = rows_laid_out(h_sorted, order, rt)
    tabs = rt.reduce_scatter_tables()
    bufs = {"h": h, "w2": w, "topk_weights": wts_dev.float().contiguous(),
            **{n: torch.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in tabs.items()},
            "y_sorted": torch.full((rt.num_rows, N), float("nan"), device="cuda", dtype=tdt),
            "partial": torch.full((T, N), float("nan"), device="cuda",
                                  dtype=torch.float32 if partial_dtype == "f32" else tdt)}
    flat_w = wts_dev.reshape(-1).float().index_select(0, order)[:, None]
    return RsRow(k, rt, as_run["grouped_gemm"], as_run["combine"], notifying, bufs, h_sorted=h_sorted, w=w_mat,
                 offs=offs, order=order, flat_w=flat_w, T=T, N=N, topk=topk, topk_weights=wts)


def lowered_added_rows(row: MoERow, rt, compute, dtype: str = "bfloat16", cluster: int = 2, weights: str = "kn"):
    """Layer 1 of ``row`` as one grouped GEMM adding its rows into the output
    (:func:`~tldsl.ops.moe.moe_combined_experts` traced for the routing ``rt`` under the compute
    schedule ``compute``: the pass pair's own, so every schedule option reaches both), lowered by the
    grouped-GEMM recipe."""
    import tldsl as tl
    from tldsl.codegen import lower_grouped_gemm
    hidden, ffn, E, _ = MOE_MODELS[row.model]
    k = rt.trace_combined_experts(ffn // TP, hidden, E, getattr(tl, dtype), weights=weights, compute=compute)
    return lower_grouped_gemm(k, "grouped_gemm", cluster=(cluster, 1))


class AddedRows:
    """Layer 1 of a row as one kernel: the grouped GEMM adding each routed row, times its top-k
    weight, into its token's row of the output (``tl.add_rows``, :func:`~tldsl.ops.moe.moe_combined_experts`:
    the combine in the GEMM's epilogue, no ``y_sorted``), on an :class:`RsRow`'s rows, weights and
    routing, under its program's compute schedule. :meth:`run` zeroes the output (:meth:`zero`) and launches the GEMM (:meth:`gemm`)."""

    def __init__(self, row: MoERow, r: RsRow, dtype: str = "bfloat16", cluster: int = 2, weights: str = "kn"):
        import numpy as np
        import torch
        from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
        self.lowered = lowered_added_rows(row, r.rt, r.k.compute_schedule, dtype, cluster, weights)
        N = MOE_MODELS[row.model][0]
        self.out = torch.full((r.rt.num_tokens, N), float("nan"), device="cuda", dtype=r.bufs["h"].dtype)
        bufs = {"h": r.bufs["h"], "w2": r.bufs["w2"], "tile_expert": r.bufs["tile_expert"],
                "tile_valid_rows": r.bufs["tile_valid_rows"],
                "sorted_token_ids": torch.from_numpy(np.ascontiguousarray(r.rt.sorted_token_ids)).cuda(),
                "row_weights": torch.from_numpy(r.rt.row_weights(r.topk_weights.numpy())).cuda(), "out": self.out}
        self._gemm = GroupedKernel(self.lowered).prepare(bufs, {})

    def gemm(self):
        import torch
        self._gemm.launch(torch.cuda.current_stream().cuda_stream, 1)

    def zero(self):
        self.out.zero_()

    def run(self):
        self.zero()
        self.gemm()


def bench_rs_row(row: MoERow, iters: int, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16",
                 cluster: int = 2, fold: bool = False, group_m: int | None = None,
                 interleave: int | None = None, run: int = 0, partial_dtype: str = "out",
                 weights: str = "kn", combine: str = "pass") -> dict:
    """Check, then time, one row of layer 1: ``{ms, gmm_ms, seq_ms, tflops, gmm_tflops, err,
    parts_ms}`` (``ms``: our grouped GEMM and combine — one kernel with ``fold``, else one after
    the other; with ``combine="epilogue"`` the output zeroed and the GEMM adding its rows into it
    (:class:`AddedRows`); ``parts_ms``: the two unfolded kernels one by one and the GEMM notifying
    each tile (epilogue: the GEMM adding rows, alone, instead), with ``fold`` the pair one after the
    other first, and last a copy of the combine's bytes)."""
    import torch
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    hidden, ffn, _, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, ffn // TP, hidden
    r = rs_row(row, tile, stages, dtype, cluster, group_m, interleave, partial_dtype, weights)
    bufs = r.bufs
    # the combine's bound: a copy of its bytes (the routed rows of y_sorted read, the partial written);
    # the pair's: a copy of the least bytes both kernels move through DRAM
    bounds = [copy_of(T * topk * N * bufs["y_sorted"].element_size() + T * N * bufs["partial"].element_size()),
              copy_of(pair_dram_bytes(bufs, T * topk, r.experts_used()))]
    what = f"{row}: the grouped GEMM + combine differ from _grouped_mm + the weighted sum"
    want = r.sequence()
    r.pair()
    r.notifying_gemm()
    # (unused tiles are stored by neither: poisoned in both)
    if not torch.allclose(r.y_notified, bufs["y_sorted"], rtol=0, atol=0, equal_nan=True):
        raise RuntimeError(f"{row}: the grouped GEMM with notifies stored other rows than without them")
    if combine == "epilogue":
        added = AddedRows(row, r, dtype, cluster, weights)
        added.run()
        return _checked_timings(f"{row}: the grouped GEMM adding its rows differs from _grouped_mm + the weighted sum",
                                added.out, want, [added.run, r.gmm, r.sequence], iters, 2 * T * topk * K * N,
                                _computed_rows(r.rt, added.lowered.config), T * topk,
                                parts=[r.gemm, r.combine, added.gemm, added.zero], run=run, bounds=bounds)
    if not fold:
        return _checked_timings(what, bufs["partial"], want, [r.pair, r.gmm, r.sequence], iters, 2 * T * topk * K * N,
                                _computed_rows(r.rt, r.lg.config), T * topk,
                                parts=[r.gemm, r.combine, r.notifying_gemm], run=run, bounds=bounds)
    _check_close(what + " (one after the other)", bufs["partial"], want)
    *_, lf, _ = lowered_rs_row(row, tile, stages, dtype, cluster, fold=True, group_m=group_m, interleave=interleave,
                               partial_dtype=partial_dtype, weights=weights)
    # folded: the combine's waits are real (its tiles wait for the GEMM's): counters of its own
    fused = folded_launches(r.k, lf, lambda sig: GroupedKernel(lf).prepare(bufs, sig))

    def folded():
        fused.launch(torch.cuda.current_stream().cuda_stream)
    bufs["partial"].fill_(float("nan"))
    bufs["y_sorted"].fill_(float("nan"))
    folded()
    return _checked_timings(what + " (folded)", bufs["partial"], want, [folded, r.gmm, r.sequence], iters,
                            2 * T * topk * K * N, _computed_rows(r.rt, lf.config), T * topk,
                            parts=[r.pair, r.gemm, r.combine, r.notifying_gemm], run=run, bounds=bounds)


def pair_dram_bytes(bufs, routed: int, experts_used: int | None = None) -> int:
    """The least bytes layer 1's grouped GEMM and combine move through DRAM together, counting only
    the ``routed`` rows (not the layout's padding) and the weights of the ``experts_used`` experts
    that have rows (all of them if None): those weights of ``w2`` and the routed rows of ``h`` read,
    those rows of ``y_sorted`` written and read back by the combine, the partial written.
    ``_grouped_mm`` alone moves all but the read-back and the partial. An estimate of the pair's
    bound, not a strict floor: ``y_sorted`` makes the round trip through DRAM only where it outgrows
    L2 (every row of issue 20 but Mixtral 2048), and the copy that times them moves half its bytes
    each way while the pair reads more than it writes (``probe moe_dram`` times them in their own
    mix: :func:`pair_dram_split`)."""
    return sum(pair_dram_split(bufs, routed, experts_used))


def pair_dram_split(bufs, routed: int, experts_used: int | None = None) -> tuple[int, int]:
    """:func:`pair_dram_bytes` as (bytes read, bytes written): read, the used experts' weights, the
    routed rows of ``h`` and those of ``y_sorted`` read back; written, those rows of ``y_sorted`` and
    the partial."""
    w2, y, h = bufs["w2"], bufs["y_sorted"], bufs["h"]
    E = w2.shape[0]
    used = E if experts_used is None else experts_used
    if not 0 < used <= E:
        raise ValueError(f"experts_used must be in 1..{E}, got {experts_used}")
    y_row, h_row = y.shape[1] * y.element_size(), h.shape[1] * h.element_size()
    reads = w2.numel() // E * used * w2.element_size() + routed * (h_row + y_row)
    return reads, routed * y_row + bufs["partial"].numel() * bufs["partial"].element_size()


def _check_close(what: str, got, want) -> float:
    """``got``'s relative L2 error against ``want``; a RuntimeError (``what`` and the errors, nothing
    timed) beyond the layer benchmark's tolerances."""
    from . import fused_layers
    l2, worst = fused_layers.errors(got, want)
    if not (l2 <= fused_layers.REL_TOL and worst <= fused_layers.MAX_TOL):
        raise RuntimeError(f"{what}: relative L2 {l2:.3g}, largest {worst:.3g} x RMS; not timed")
    return l2


def _checked_timings(what: str, got, want, fns, iters: int, flops: int, padded: int, routed: int,
                     parts=(), run: int = 0, bounds=()) -> dict:
    """``got`` checked against ``want`` (else a RuntimeError: ``what`` and the errors; nothing
    timed), then ``fns`` — ours, ``_grouped_mm``, torch's sequence — and ``parts`` (ours kernel by
    kernel: ``parts_ms``) timed interleaved, in :func:`.timing.launch_order` for ``run``; then
    ``bounds`` (copies of the bytes a pass must move, :func:`copy_of`) interleaved on their own, their
    times last in ``parts_ms`` (apart, so that the columns above keep the rotation they had without them)."""
    from .timing import interleaved_ms
    l2 = _check_close(what, got, want)
    ms, gmm_ms, seq_ms, *parts_ms = interleaved_ms(list(fns) + list(parts), iters=iters, run=run)
    if bounds:
        parts_ms += interleaved_ms(list(bounds), iters=iters, run=run)
    return dict(ms=ms, gmm_ms=gmm_ms, seq_ms=seq_ms, flops=flops, tflops=flops / ms / 1e9,
                gmm_tflops=flops / gmm_ms / 1e9, err=l2, padded=padded, routed=routed, parts_ms=parts_ms)


def bench_row(row: MoERow, iters: int, tile=(128, 256, 64), stages: int = 4, dtype: str = "bfloat16",
              cluster: int = 2, stage_rows: str = "auto", fold: bool = False, interleave: int | None = None,
              run: int = 0, group_m: int | None = None, gather_order: str | None = None,
              weights: str = "kn") -> dict:
    """Check, then time, one row: ``{ms, gmm_ms, seq_ms, tflops, gmm_tflops, err, parts_ms}``
    (``ms``: the program's kernels one after the other — the grouped GEMM, after the row gather
    where the rows are staged, which ``parts_ms`` then times one by one, and last a copy of the
    gather's bytes). ``fold`` (rows staged): ``ms`` is the grouped GEMM with the row gather folded
    into its kernel (one launch, its waits real), ``parts_ms`` the two kernels one after the other
    first; ``group_m``, ``gather_order``: :func:`ag_program`'s (None: ``layout`` folded, else ``tokens``,
    as AllGatherMoE chooses)."""
    import numpy as np
    import torch
    hidden, ffn, E, topk = MOE_MODELS[row.model]
    T, K, N = row.tokens, hidden, 2 * ffn // TP
    gather_order = gather_order or default_gather_order(fold)
    ids, rt, ir, lowered = lowered_row(row, tile, stages, dtype, cluster, stage_rows, interleave, group_m,
                                       gather_order, weights)
    tabs = rt.allgather_tables()
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(T + E)
    x = torch.randn(T, K, device="cuda", generator=g).to(tdt)
    w, w_mat = expert_weights(E, K, N, tdt, g, weights)
    h = torch.full((rt.num_rows, N), float("nan"), device="cuda", dtype=tdt)
    bufs = {"x_gathered": x, "w1": w, "h": h,
            **{n: torch.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in tabs.items()}}
    for b in ir.workspaces:
        if b.name not in bufs:          # the staged rows: poisoned, never read before written
            bufs[b.name] = torch.full(tuple(b.type.shape), float("nan"), device="cuda", dtype=tdt)
    # the all-gather's signal: every wait already satisfied; the parts' own signals count from 0
    comm_signals = comm_notified(ir)
    signals = {s.name: (torch.full((int(s.type.slots),), SATISFIED, device="cuda", dtype=torch.int64)
                        if s.name in comm_signals else torch.zeros(int(s.type.slots), device="cuda", dtype=torch.int64))
               for s in ir.signals}
    ids_dev = ids.cuda()
    order, offs = route(ids_dev, E)
    rows = x.index_select(0, order // topk)

    prepared = prepared_parts(ir, lowered, bufs, signals)      # checked and packed once, as the ops do
    kernels = [prepared[p] for p in lowered]                     # program order: the gather first
    gathers = [0]                       # launches of the first kernel: the epoch the GEMM's waits count in

    def ours():
        gathers[0] += 1
        stream = torch.cuda.current_stream().cuda_stream
        for kern in kernels:
            kern.launch(stream, gathers[0])

    def one(kern):
        def run():
            if kern is kernels[0]:
                gathers[0] += 1
            # (the GEMM alone: its waits already satisfied by the gathers before it)
            kern.launch(torch.cuda.current_stream().cuda_stream, gathers[0])
        return run

    def gmm():
        return torch._grouped_mm(rows, w_mat, offs=offs)

    def sequence():
        return torch._grouped_mm(x.index_select(0, order // topk), w_mat, offs=offs)
    ours()
    want = gmm()
    dest = laid_out(order, rt)
    what = f"{row}: the grouped GEMM differs from _grouped_mm"
    parts = [one(k) for k in kernels] if len(kernels) > 1 else []
    # staged: the row gather's bound, a copy of its bytes (the routed rows read; every row of the layout written,
    # padding included, as gather_rows stores them)
    gather_copy = copy_of((T * topk + rt.num_rows) * K * x.element_size()) if len(kernels) > 1 else None
    timed_config = lowered["grouped_gemm"].config       # the config of the GEMM the first column times
    if fold:
        _check_close(what + " (one after the other)", h[dest], want)
        from tldsl.codegen import lower
        lf = folded_as_run_folds(ir, {p: lower(ir, p) for p in lowered})    # folded: its signals kept, waits real
        timed_config = lf.config                    # (no half tiles folded: it computes more rows)
        # counters of its own: the kernels one after the other (stream-ordered) notify nothing
        folded = folded_launches(ir, lf,
                                 lambda sig: prepared_parts(ir, {"grouped_gemm": lf}, bufs, sig)["grouped_gemm"])

        def folded_launch():
            folded.launch(torch.cuda.current_stream().cuda_stream)
        h.fill_(float("nan"))
        bufs["x_sorted"].fill_(float("nan"))
        parts, ours = [ours] + parts, folded_launch
        ours()
    return _checked_timings(what + (" (folded)" if fold else ""), h[dest], want, [ours, gmm, sequence], iters,
                            2 * T * topk * K * N,
                            _computed_rows(rt, timed_config), T * topk, parts=parts,
                            run=run, bounds=[gather_copy] if gather_copy is not None else [])


def laid_out(order, rt):
    """The row of ``h`` / ``y_sorted`` that routing ``rt`` gives every expert-sorted row of torch's
    order (``order``: :func:`.baselines.route`'s, routed rows ``t * topk + k``)."""
    import torch
    T, topk = rt.num_tokens, rt.topk
    pos = torch.from_numpy(rt.token_pos.astype("int64")).to(order.device)
    return pos[(order % topk) * T + order // topk]


def rows_laid_out(sorted_rows, order, rt):
    """``sorted_rows`` (torch's expert-sorted order, :func:`.baselines.route`'s ``order``) in the
    routing's layout: ``[rt.num_rows, K]``, each row where :func:`laid_out` puts it, the padding rows zero."""
    import torch
    out = torch.zeros((rt.num_rows, sorted_rows.shape[1]), dtype=sorted_rows.dtype, device=sorted_rows.device)
    out[laid_out(order, rt)] = sorted_rows
    return out


def _computed_rows(rt, config) -> int:
    """Rows our kernels compute: the routing's used tiles, whole, but with the grouped GEMM's
    ``config.half_tiles`` those of at most ``BM / 2`` valid rows, which it runs as half tiles (the
    programs store a tile's rows past its valid ones as zeros; the tables hold the worst case's
    tiles, ``rt.num_rows``; an unused one costs its guard only). Paired 64-row tiles
    (``config.pair_rows``) are computed whole, alone or two to a CTA tile."""
    used = rt.tile_expert >= 0
    half_tiles = config.half_tiles and not config.pair_rows
    half = used & (rt.tile_valid_rows <= rt.block_m // 2) if half_tiles else used & False
    return int(used.sum()) * rt.block_m - int(half.sum()) * (rt.block_m // 2)


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
    ap.add_argument("--stage-rows", choices=STAGE_ROWS, default="auto",
                    help="ag: gather the routed rows in a pass of their own, then the grouped GEMM on them by TMA "
                         "(on), inside the grouped GEMM (off), or as AllGatherMoE chooses at one rank by the row's "
                         "shape (auto)")
    ap.add_argument("--fold", choices=FOLD, default="off",
                    help="rs: the combine folded into the grouped GEMM's kernel, its tiles run by the producer's "
                         "spare warps as the GEMM's columns complete (on), or launched after it (off); ag: the row "
                         "gather folded into the grouped GEMM's kernel, ahead of the tiles that read its rows (on; "
                         "the rows staged), or launched before it (off)")
    ap.add_argument("--combine", choices=COMBINES, default="pass",
                    help="rs: the top-k combine as a pass of its own after the grouped GEMM, over the expert-sorted "
                         "rows it stored (pass), or in the GEMM's epilogue, each row added into its token's row of "
                         "the zeroed output (epilogue: tl.add_rows, moe_combined_experts)")
    ap.add_argument("--gather-order", choices=GATHER_ORDERS, default=None,
                    help="ag, rows staged: the row gather visits the row tiles by the tokens they hold (tokens: the "
                         "routing's tile_visit) or expert after expert, in layout order (layout); default: as "
                         "AllGatherMoE does, tokens for a gather before the GEMM, layout for one folded into it")
    ap.add_argument("--group-m", type=int, default=None,
                    help="a group's rows of the swizzled order, in cluster tiles (default: the schedule's 8; "
                         "rs: for both kernels, and with --fold on all of them: column by column, so that a "
                         "column's combine tiles can start once its GEMM tiles are done)")
    ap.add_argument("--interleave", type=int, default=None,
                    help="the routing's tiles in rounds of this many per expert rather than expert after expert "
                         "(the token tiles then complete as the GEMM goes: for a combine folded in, --fold on)")
    ap.add_argument("--partial", choices=PARTIAL_DTYPES, default=None,
                    help="rs: the combine's partial (what the reduce-scatter reads) in the operands' dtype (out: "
                         "MoEReduceScatter's default, the numerics of NCCL's reduce-scatter of the layer) or in fp32")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--weights", choices=WEIGHT_LAYOUTS, default="kn",
                    help="how the experts' weights are stored: kn [E, K, N] (torch._grouped_mm's mat2) or nk [E, N, K] "
                         "(a stack of torch Linear weights; _grouped_mm gets their transposed view)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1,
                    help="time each row this many times, each on tensors allocated anew (other addresses) and "
                         "with the interleaved launches in another order (another kernel before each); the table gives "
                         "the medians and, past 1, the range of the per-repeat speeds")
    ap.add_argument("--processes", type=int, default=1,
                    help="run the whole benchmark this many times, each in a fresh process (where _grouped_mm "
                         "runs in a faster or a slower state); the table gives the medians over the processes and "
                         "the range of their speeds, each process's own table going to stderr")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the rows as JSON here: the options, and per row its figures (ms, TFLOP/s, the "
                         "parts' ms, each repeat's speed; with --processes each process's, and each process's "
                         "repeats' speeds) or its error")
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
    if args.combine != "pass" and (args.layer != "rs" or args.fold == "on"):
        ap.error("--combine epilogue: MoE+ReduceScatter's combine (--layer rs), not folded (--fold off)")
    if args.partial is not None and args.layer != "rs":
        ap.error("--partial: MoE+ReduceScatter's partial (--layer rs); AllGather+MoE has none")
    args.partial = args.partial or "out"
    if args.gather_order is not None and args.layer != "ag":
        ap.error("--gather-order: AllGather+MoE's row gather (--layer ag); MoE+ReduceScatter has none")
    if args.gather_order is not None and args.stage_rows == "off":
        ap.error("--gather-order: the order of the staged row gather; with --stage-rows off the GEMM gathers "
                 "its rows")
    if args.layer == "ag" and args.fold == "on":
        if args.stage_rows == "off":
            ap.error("--fold on (ag) folds the row gather that stages the rows: not with --stage-rows off")
        args.stage_rows = "on"
    if args.gather_order is None:
        args.gather_order = default_gather_order(args.layer == "ag" and args.fold == "on")
    for opt, what in (("interleave", "tiles"), ("group_m", "tile rows"), ("repeat", "timings"), ("iters", "launches"),
                      ("processes", "processes")):
        value = getattr(args, opt)
        if value is not None and value < 1:
            ap.error(f"--{opt.replace('_', '-')}: a positive number of {what}, got {value}")
    return args


def summarize_repeats(runs: list[dict]) -> dict:
    """One row's result from its repeats (:func:`bench_row` / :func:`bench_rs_row` dicts): every
    time the median over the repeats, TFLOP/s from those medians, the largest error, and
    ``speeds``, each repeat's ``_grouped_mm`` / ours speed ratio in run order."""
    import statistics
    if not runs:
        raise ValueError("no repeats to summarize")
    med = {k: statistics.median(r[k] for r in runs) for k in ("ms", "gmm_ms", "seq_ms")}
    parts = [statistics.median(ts) for ts in zip(*(r["parts_ms"] for r in runs))]
    flops = runs[0]["flops"]
    return dict(runs[0], **med, parts_ms=parts, tflops=flops / med["ms"] / 1e9, gmm_tflops=flops / med["gmm_ms"] / 1e9,
                err=max(r["err"] for r in runs), speeds=[r["gmm_ms"] / r["ms"] for r in runs])


def main(argv, out=sys.stdout) -> int:
    args = parse_args(argv)
    rs = args.layer == "rs"
    what = (f"MoE+ReduceScatter grouped GEMM + top-k combine (TP={TP} slice of layer 1)"
            + (", the combine in the GEMM's epilogue (--combine epilogue)" if args.combine == "epilogue" else "") if rs
            else f"AllGather+MoE grouped GEMM (TP={TP} slice of layer 0)")
    folded = ""
    if args.fold == "on":
        from tldsl.runtime.gpu.fold import FOLDED_CLUSTER      # what the folded kernel runs with, not the schedule's
        folded = f" (the folded kernel: {FOLDED_CLUSTER}, as tl.run folds)"
    repeats = (f"; the median of {args.repeat} such timings, each on tensors allocated anew, its launches reordered"
               if args.repeat > 1 else "")
    if args.processes > 1:
        repeats += f"; the median over {args.processes} processes, each a fresh one"
    partial = (f", the partial in {'fp32' if args.partial == 'f32' else args.dtype} (--partial {args.partial})"
               if rs else "")
    order = "" if rs or args.stage_rows == "off" else f", staged rows gathered in {args.gather_order} order"
    stored = ", weights stored [E, N, K] (--weights nk)" if args.weights == "nk" else ""
    print(f"# {what}{timing.on_device()}, {args.dtype}, tile {args.tile_t} stages {args.stages} cluster "
          f"({args.cluster}, 1){folded}{partial}{order}{stored}; ms (median of {args.iters}, interleaved{repeats})",
          file=out)
    # rs: ours is the grouped GEMM and the combine; _grouped_mm is the GEMM alone (the bound of issue 20)
    ours, seq = ("tldsl GEMM + combine ms", "_grouped_mm + weighted sum ms") if rs else ("tldsl ms",
                                                                                        "gather + _grouped_mm ms")
    # ours kernel by kernel: rs, the GEMM and the combine; ag, the row gather and the GEMM where staged
    fold = args.fold == "on"
    split = (" GEMM alone ms | combine alone ms | GEMM with notifies ms | copy of the combine's bytes ms "
             "| copy of the pair's least DRAM bytes ms |" if rs else
             " rows gathered | row gather alone ms | GEMM alone ms | copy of the gather's bytes ms |")
    if rs and args.combine == "epilogue":
        ours = "tldsl zeroing + GEMM adding its rows ms"
        split = (" GEMM storing y_sorted alone ms | combine alone ms | GEMM adding its rows alone ms "
                 "| zeroing the output alone ms | copy of the combine's bytes ms "
                 "| copy of the pair's least DRAM bytes ms |")
    if fold and rs:
        ours, split = "tldsl GEMM + combine folded ms", " GEMM, then combine ms |" + split
    elif fold:
        ours = "tldsl gather + GEMM folded ms"
        split = (" rows gathered | gather, then GEMM ms | row gather alone ms | GEMM alone ms "
                 "| copy of the gather's bytes ms |")
    staged_cells = split.count("|")          # ag: the cells of a row's staged gather, "rows gathered" first
    if args.processes > 1:
        split += " speed per process (min-max) |"
    elif args.repeat > 1:
        split += " speed per repeat (min-max) |"
    blank = split.count("|") * " |"
    print(f"| row | {ours} | TFLOP/s | _grouped_mm ms | TFLOP/s | tldsl / _grouped_mm speed | {seq} "
          f"| tldsl / sequence speed | computed / routed rows |{split}\n|---|---|---|---|---|---|---|---|---|"
          f"{split.count('|') * '---|'}", file=out, flush=True)
    failed = 0
    records = []
    per_process = None
    if args.processes > 1:
        from .processes import child_argv, rows_per_process
        # (the last --processes wins: an abbreviation of it that child_argv keeps is overridden)
        per_process = rows_per_process("moe", child_argv(argv) + ["--processes", "1"], args.processes)
    for n, row in enumerate(args.row_list):
        try:
            if per_process is not None:
                runs = _row_of_each_process(per_process, n, row)
                r = dict(summarize_repeats(runs), speeds_per_process=[run.pop("speeds", None) for run in runs])
            else:
                runs = []
                for i in range(args.repeat):
                    with fresh_placement(i):
                        runs.append(bench_rs_row(row, args.iters, args.tile_t, args.stages, args.dtype, args.cluster,
                                                 fold, args.group_m, args.interleave, run=i,
                                                 partial_dtype=args.partial, weights=args.weights,
                                                 combine=args.combine)
                                    if rs else
                                    bench_row(row, args.iters, args.tile_t, args.stages, args.dtype, args.cluster,
                                              args.stage_rows, fold, args.interleave, run=i, group_m=args.group_m,
                                              gather_order=args.gather_order, weights=args.weights))
                r = summarize_repeats(runs)
        except Exception as e:      # noqa: BLE001 - one row's failure is reported, the rest still run
            failed += 1
            # (a row that failed in a child process: its message names the child's error, not this one's)
            what = str(e) if isinstance(e, RowFailedInProcess) else f"{type(e).__name__}: {e}"
            records.append(dict(row=f"{row.model}:{row.tokens}:{row.routing}", error=what))
            print(f"| {row.model} {row.tokens} {row.routing} | failed: {what.splitlines()[0][:180]} "
                  f"| | | | | | | |{blank}", file=out, flush=True)
            continue
        parts = "".join(f" {t:.3f} |" for t in r["parts_ms"])
        if not rs:
            parts = (" staged |" + parts) if r["parts_ms"] else " in the GEMM |" + " |" * (staged_cells - 1)
        if args.repeat > 1 or args.processes > 1:
            parts += f" {min(r['speeds']):.2f}-{max(r['speeds']):.2f} |"
        print(f"| {row.model} {row.tokens} {row.routing} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['gmm_ms']:.3f} | "
              f"{r['gmm_tflops']:.0f} | {r['gmm_ms'] / r['ms']:.2f} | {r['seq_ms']:.3f} | {r['seq_ms'] / r['ms']:.2f} | "
              f"{r['padded']} / {r['routed']} |" + parts, file=out, flush=True)
        records.append(dict(row=f"{row.model}:{row.tokens}:{row.routing}", **r))
    if args.json:
        _write_json(args, records)
    return 1 if failed else 0


class RowFailedInProcess(RuntimeError):
    """A row one of the ``--processes`` children did not measure; the message says which and why."""


def _row_of_each_process(per_process: list, n: int, row: MoERow) -> list[dict]:
    """Row ``n`` (``row``) as each process measured it (:func:`.processes.rows_per_process`); a
    :class:`RowFailedInProcess` naming the first process that did not (it crashed, or the row
    failed in it: its error as that process named it)."""
    name = f"{row.model}:{row.tokens}:{row.routing}"
    runs = []
    for i, rows in enumerate(per_process):
        if isinstance(rows, str):
            raise RowFailedInProcess(rows)
        got = rows[n] if n < len(rows) else {}
        if got.get("row") != name:
            raise RowFailedInProcess(f"process {i + 1} has no row {name}")
        if "error" in got:
            raise RowFailedInProcess(f"in process {i + 1}: {got['error']}")
        runs.append({k: v for k, v in got.items() if k != "row"})
    return runs


def _write_json(args, records: list[dict]) -> None:
    """``--json``: the run's options and its rows, as the table printed them (the medians over the
    repeats) with every repeat's speed — with ``--processes``, the medians over the processes, each
    process's speed (``speeds``) and its repeats' (``speeds_per_process``)."""
    import json
    options = {k: getattr(args, k) for k in ("layer", "tile", "stages", "cluster", "stage_rows", "fold", "group_m",
                                              "gather_order", "interleave", "partial", "dtype", "iters", "repeat",
                                              "processes")}
    with open(args.json, "w") as f:
        json.dump({"benchmark": "moe", "options": options, "rows": records}, f, indent=1)

