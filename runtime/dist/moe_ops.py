"""AllGather+MoE and MoE+ReduceScatter as fused ops across a process group: the library's tile
programs (:func:`tldsl.ops.moe.allgather_moe`, :func:`tldsl.ops.moe.moe_reduce_scatter`) run by
the one fused-op runtime (:class:`~.program_op.FusedProgram`), plus what is specific to MoE —
the routing tables (the dynamic mapping) built **on the GPU** from the caller's ``topk_ids``
each call, with no host synchronisation (:class:`~..gpu.moe_routing.MoERoutingBuilder`).

Tensor-parallel MoE (TileLink's setting): tokens are sharded by rows, ``T = W * Ms``; every
rank holds every expert's ``1/W`` slice of the intermediate dimension. Layer 0 (gate and up
fused) is ``AllGatherMoE``: ``h = all_gather(x)[sorted rows] @ w1[expert]`` in expert-sorted
order, each expert's rows padded to a multiple of the compute tile's ``BM`` (padding rows are
zeros). Layer 1 is ``MoEReduceScatter``: ``h @ w2[expert]``, the top-k weighted sum per token and
the reduce-scatter, so rank ``r`` gets its own tokens' MoE output summed over the ranks' slices.
The two share one routing: ``AllGatherMoE`` returns its tables and ``MoEReduceScatter`` takes
them (or builds its own from ``topk_ids``).

**Ids outside ``[0, E)``.** Checking them on the host needs the ids on the host — a
synchronisation a serving loop (or a CUDA graph) cannot afford. With ``validate_ids=True``
(the default) the op checks them before it enqueues anything (one small device reduction read
back) and raises :class:`~tldsl.errors.InputError`; with ``False`` nothing waits: the routing
kernels set an error word on the device instead (a bad routed row joins no expert and no
memory is touched out of bounds) and :meth:`check_routing` reads it when the caller chooses.
A call captured in a CUDA graph with ``validate_ids=True`` is refused with an InputError that
says so (the check would read the device while the stream captures).

**Tables the library did not build** — a caller's ``router``, or ``tables`` handed to
``MoEReduceScatter`` — are checked on the device too with ``validate_ids=True`` (one more read),
against the ids (:mod:`.moe_tables`): the kernels trust their tables, and a wrong one would leave
a wait unsatisfied until its timeout, a row read before it is written, or a routed row lost.
"""
from __future__ import annotations

import numbers

import numpy as np

import tldsl as tl

from ...collectives import PARTIAL_DTYPES
from ...errors import InputError
from ...ops.moe import allgather_moe, check_table_rows, moe_num_tiles, moe_reduce_scatter, stage_rows_pays
from ...ops.weights import check_weight_layout
from . import program_op
from ..gpu.moe_routing import RoutingTables
from .moe_tables import check_routing_tables, table_shapes
from .operands import check_schedules, shape_and_dtype
from .program_op import FusedProgram

#: the routing tables each kernel reads, in its argument names
AG_TABLES = ("tile_expert", "tile_valid_rows", "tile_tokens", "tile_visit", "sorted_token_ids")
RS_TABLES = ("tile_expert", "tile_valid_rows", "token_pos", "tile_token_tiles", "tile_num_token_tiles", "token_tile_producers")


def _shape_dtype(name: str, x, dims: str) -> tuple:
    """(shape, tl dtype) of a tensor, array or ``tl.TensorSpec`` of the dims named ``dims``
    (``"[Ms, K]"``)."""
    shape, dt = shape_and_dtype(name, x)
    if len(shape) != dims.count(",") + 1:
        raise InputError(f"{name} must be {dims} ({dims.count(',') + 1}-d), got {list(shape)}")
    return shape, dt


#: AllGatherMoE's schedules where none is given, measured (BENCHMARKS.md, fourteenth session: one
#: H200, Mixtral 8192 tokens, one rank): 7.69 ms a layer, against 15.23 with the general defaults —
#: the generated all-gather on one CTA moved each shard as one communication tile, and the grouped
#: GEMM ran 128x128x64 tiles in 3 stages; the copy engines gather without an SM and 128x256x64 tiles
#: in 4 stages reach 501 TFLOP/s. The tiles in the swizzled order, in clusters of two (what
#: ``bench moe`` measures the grouped GEMM at): row by row, each tile row of an expert streams its
#: whole weight slice (more than L2 at Mixtral's sizes) from HBM again — MoEReduceScatter's GEMM
#: took 2.8 ms inside its op against 1.4 alone (BENCHMARKS.md, twenty-second session); this op:
#: Mixtral 8192 tokens 7.16 ms a layer against 7.98
DEFAULT_AG_COMPUTE = tl.ComputeSchedule(tile=(128, 256, 64), stages=4, order="swizzled", cluster=(2, 1))
DEFAULT_AG_COMM = tl.CommSchedule(engine="copy_engine", mode="pull")
#: MoEReduceScatter's schedules where none is given, measured (BENCHMARKS.md, fifteenth session: one
#: H200, Mixtral 8192 tokens, one rank, the SMs shared by work): 6.03 ms a layer against 13.57 with
#: the general defaults — the generated reduce-scatter moved the whole shard as one tile on one
#: CTA once every combine tile was done (7.79 ms with 128-row tiles on 8 lanes, each moving as
#: soon as its rows are combined), and 128x256x64 tiles in 4 stages speed up the grouped GEMM; the
#: swizzled order as for AllGatherMoE, but no clusters: beside the reduce-scatter's resident lanes
#: the pairs of CTAs did not all find two free SMs of one GPC at once, and the layer took 6.19 ms
#: instead of 3.9 (Mixtral, twenty-second session). 32 lanes, not 8: the combine finishes with the
#: GEMM, so the reduce-scatter's rows all arrive at the end; on 8 lanes it read the fp32 partial
#: for 0.34 ms (Qwen3-30B) to 0.76 ms (Mixtral) after the combine, on 32 for 0.06-0.17 ms
#: (twenty-second session)
DEFAULT_RS_COMPUTE = tl.ComputeSchedule(tile=(128, 256, 64), stages=4, order="swizzled")
DEFAULT_RS_COMM = tl.CommSchedule(tile_m=128, sms=32)


def _schedules(op: str, compute, comm, defaults: tuple) -> tuple:
    """``(compute, comm)``, each checked (:func:`~.operands.check_schedules`) or the op's default."""
    check_schedules(op, compute, comm)
    return defaults[0] if compute is None else compute, defaults[1] if comm is None else comm


def _positive(what: str, name: str, v, hint: str = "") -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise InputError(f"{what}{name} must be a positive int{hint}, got {v!r}")
    return int(v)


def _topk(v) -> int:
    return _positive("", "topk", v)


def check_moe_sizes(rows_per_rank, topk, num_experts, what: str = "") -> tuple[int, int, int]:
    """``(Ms, topk, E)`` as ints, each a positive int, else :class:`InputError` (``what``: a prefix of
    the message) — the ops' check of their sizes, which the torch layers' fake kernels run too."""
    return (_positive(what, "rows_per_rank", rows_per_rank, " (tokens per rank)"), _positive(what, "topk", topk),
            _positive(what, "num_experts", num_experts, " (the experts' weights' first dimension)"))


def _tables_dict(tables, what: str) -> dict:
    """The routing tables by name, as a router returns them (a dict), else InputError."""
    if not isinstance(tables, dict):
        hint = (" (a MoERouting's tables go as tensors by name: {n: torch.from_numpy(t) for n, t in "
                "routing.reduce_scatter_tables().items()})" if type(tables).__name__ == "MoERouting" else "")
        raise InputError(f"{what}, got {type(tables).__name__}{hint}")
    return tables


def _check_routing_options(router, validate_ids) -> None:
    """Before anything is built: ``validate_ids`` a real bool ('no' is truthy: it would check), and
    ``router`` None or callable (else the first call fails, after the collective build)."""
    if not isinstance(validate_ids, bool):
        raise InputError(f"validate_ids must be True or False, got {validate_ids!r}")
    if router is not None and not callable(router):
        raise InputError(f"router must be a callable router(topk_ids) -> {{name: int32 tensor}} (None: the "
                         f"routing built on the GPU), got {type(router).__name__}")


class _Routed:
    """What both MoE ops share: the routing sizes, the table builder, the ids' checks."""

    def _init_routing(self, W: int, Ms: int, topk: int, E: int, BM: int, router, validate_ids: bool):
        Ms, topk, E = check_moe_sizes(Ms, topk, E)
        self.world_size, self.rows_per_rank, self.topk, self.num_experts, self.block_m = W, Ms, topk, E, BM
        check_table_rows(type(self).__name__, W * Ms * topk, E, BM)      # (as moe_routing)
        self.num_tiles = moe_num_tiles(W * Ms * topk, E, BM)
        self.validate_ids = validate_ids
        self._router = router
        self._routing_buffers = None

    def _table_specs(self, names) -> dict:
        """The tables' specs by name; where the routing is built on the GPU (no router given), the
        builder's limits checked first (:class:`~..gpu.moe_routing.RoutingSizes`: a caller's router
        never runs its kernels, so is not held to them)."""
        if self._router is None:
            from ..gpu.moe_routing import RoutingSizes
            RoutingSizes(self.world_size, self.rows_per_rank, self.topk, self.num_experts, self.block_m)
        shapes = table_shapes(self.world_size * self.rows_per_rank, self.topk, self.num_experts, self.block_m,
                              self.num_tiles)
        return {n: tl.TensorSpec(shapes[n], tl.int32) for n in names}

    def _check_ids(self, topk_ids):
        import torch
        T = self.world_size * self.rows_per_rank
        if not isinstance(topk_ids, torch.Tensor):
            raise InputError(f"topk_ids: a torch tensor [{T}, {self.topk}], got {type(topk_ids).__name__}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise InputError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if tuple(topk_ids.shape) != (T, self.topk):
            raise InputError(f"topk_ids must be [{T}, {self.topk}] ({self.world_size} ranks x {self.rows_per_rank} "
                             f"tokens, top-{self.topk}), got {list(topk_ids.shape)}")
        if not topk_ids.is_contiguous():
            raise InputError("topk_ids is not contiguous (pass .contiguous())")
        if self.validate_ids:
            from .call_order import capturing
            if capturing():             # (reading the check's answer back would break the capture)
                raise InputError(f"{type(self).__name__}: a CUDA graph cannot check topk_ids on the host (it reads "
                                 "the device): build the op with validate_ids=False to capture it — the routing "
                                 "kernels still flag an id outside the experts, read by check_routing(tables)")
            bad = (topk_ids < 0) | (topk_ids >= self.num_experts)
            if bool(bad.any()):
                t, k = (int(i) for i in bad.nonzero()[0])
                raise InputError(f"topk_ids[{t}, {k}] = {int(topk_ids[t, k])} is not an expert id (there are "
                                 f"{self.num_experts} experts: 0..{self.num_experts - 1})")

    def routing(self, topk_ids) -> dict:
        """The routing tables of ``topk_ids`` (device int32 tensors by name), built on the caller's
        stream into buffers reused every call."""
        self._check_open()
        self._check_ids(topk_ids)
        if self._router is None:
            from ..gpu.moe_routing import MoERoutingBuilder
            self._router = MoERoutingBuilder(self.world_size, self.rows_per_rank, self.topk, self.num_experts,
                                             self.block_m)
        if self._routing_buffers is None and hasattr(self._router, "empty_tables"):
            self._routing_buffers = self._router.empty_tables()
        if self._routing_buffers is not None:
            return self._router(topk_ids, self._routing_buffers)
        return _tables_dict(self._router(topk_ids), "router(topk_ids) must return the routing tables by name (a dict of "
                                                             "int32 tensors)")

    def _check_foreign(self, tables: dict, names, topk_ids, ids_checked: bool = True) -> None:
        """With ``validate_ids``: tables the library's builder did not write (a caller's router, or
        tables passed in) checked on the device before anything is enqueued (:mod:`.moe_tables`),
        against ``topk_ids`` (checked first where no routing was built from them)."""
        if self.validate_ids and not isinstance(tables, RoutingTables):
            if not ids_checked:
                self._check_ids(topk_ids)
            check_routing_tables(tables, names, topk_ids, num_experts=self.num_experts, block_m=self.block_m,
                                 num_tiles=self.num_tiles)

    def check_routing(self, tables: dict) -> None:
        """Raise :class:`InputError` if the routing kernels flagged an id outside ``[0, E)`` (reads
        the device's error word: a synchronisation, at a point the caller chooses)."""
        if not isinstance(tables, dict):
            raise InputError(f"check_routing takes the routing tables by name (what the op's call or routing() "
                             f"returned), got {type(tables).__name__}")
        info = tables.get("info")
        if info is None:
            return
        import torch
        if not isinstance(info, (torch.Tensor, np.ndarray)) or tuple(info.shape) != (3,) or \
                str(info.dtype).replace("torch.", "") not in ("int32", "int64"):
            got = (f"{info.dtype} {list(info.shape)}".replace("torch.", "")
                   if isinstance(info, (torch.Tensor, np.ndarray)) else type(info).__name__)
            raise InputError(f"check_routing: tables['info'] must be the routing's error word (an int32 tensor [3], "
                             f"as the op's routing returns it), got {got}")
        flag, first = (int(v) for v in info[1:3].tolist())
        if flag:
            t, k = divmod(first, self.topk)
            raise InputError(f"topk_ids[{t}, {k}] was not an expert id (there are {self.num_experts} experts); "
                             "its routed row joined no expert")


class AllGatherMoE(_Routed, FusedProgram):
    """Layer 0 of a tensor-parallel MoE: all-gather the token shards and run the grouped GEMM of
    the routed rows with this rank's expert slices, overlapped tile by tile.

    ``x``: this rank's token shard ``[Ms, K]``; ``w1``: this rank's ``[E, K, Nr]`` (gate and up
    fused; ``weights="nk"``: ``[E, Nr, K]``, a stack of torch Linear weights, read K-major with no
    copy); both as tensors or ``tl.TensorSpec`` s (shapes and dtype, fixed per op); ``topk``:
    experts per token. Calling ``op(x, topk_ids, w1)`` (``topk_ids [W*Ms, topk]`` from the
    caller's router, the same on every rank) returns ``(h, tables)``: ``h [R_pad, Nr]`` in
    expert-sorted order, and the routing tables for :class:`MoEReduceScatter`. Schedules not given:
    :data:`DEFAULT_AG_COMPUTE` and :data:`DEFAULT_AG_COMM` (the copy engines gather). ``stage_rows``:
    gather the routed rows in a pass of their own before the grouped GEMM (True) or inside it
    (False); None: as :func:`~tldsl.ops.moe.stage_rows_pays` says for the shape and world size
    (staged at one rank where the slice is wide; across ranks not yet, so the GEMM keeps
    overlapping the all-gather). Staged, the op holds an ``[R_pad, K]`` workspace of the routed
    rows (``x_sorted``: 0.5 GB at Mixtral's 32768 tokens in bf16). A layer that
    writes its output (the next call's shard) into ``op.symmetric_buffer("x")`` and passes that
    as ``x`` saves the copy of the shard into the op's buffer every call (64 MB at 8192 tokens of
    4096 bf16 values: :meth:`~.program_op.FusedProgram.symmetric_buffer`). ``router``: a callable
    ``router(topk_ids) -> {name: int32 tensor}`` returning the tables of
    :class:`~tldsl.ops.moe.MoERouting` by name, on the ids' device (default: the routing built on
    the GPU); with ``validate_ids`` they are checked against the ids before anything is enqueued
    (:mod:`.moe_tables`)."""

    def __init__(self, x, w1, topk: int, group=None, *, compute=None, comm=None, router=None,
                 validate_ids: bool = True, stage_rows: bool | None = None, weights: str = "kn", **program_kw):
        check_weight_layout("AllGatherMoE", weights)
        (Ms, K), dt = _shape_dtype("x", x, "[Ms, K]")
        nk = weights == "nk"
        w_shape, wdt = _shape_dtype("w1", w1, "[E, Nr, K]" if nk else "[E, K, Nr]")
        if w_shape[2 if nk else 1] != K:
            raise InputError(f"w1 must be {f'[E, Nr, K={K}]' if nk else f'[E, K={K}, Nr]'} (weights={weights!r}), "
                             f"got {list(w_shape)}")
        if wdt != dt:
            raise InputError(f"x is {dt.name} but w1 is {wdt.name}")
        E, Nr = w_shape[0], w_shape[1 if nk else 2]
        if not (stage_rows is None or isinstance(stage_rows, (bool, np.bool_))):
            raise InputError(f"stage_rows must be True, False or None (chosen by the shape), got {stage_rows!r}")
        compute, comm = _schedules("AllGatherMoE", compute, comm, (DEFAULT_AG_COMPUTE, DEFAULT_AG_COMM))
        _check_routing_options(router, validate_ids)
        topk = _topk(topk)
        W = program_op.dist_context(group).world_size
        self.stage_rows = stage_rows_pays(Nr, W) if stage_rows is None else bool(stage_rows)
        stage_rows = self.stage_rows
        self._init_routing(W, Ms, topk, E, compute.tile[0], router, validate_ids)
        specs = {"x": tl.TensorSpec((Ms, K), dt), "w1": tl.TensorSpec(w_shape, dt),
                 **self._table_specs(AG_TABLES), "h": tl.TensorSpec((self.num_tiles * self.block_m, Nr), dt)}
        FusedProgram.__init__(self, allgather_moe, group, specs, compute=compute, comm=comm, stage_rows=stage_rows,
                              weights=weights, **program_kw)

    def __call__(self, x, topk_ids, w1, h=None):
        import torch
        self._check_open()
        self.check_arguments({"x": x, "w1": w1, **({} if h is None else {"h": h})})    # before the routing
        tables = self.routing(topk_ids)
        missing = [n for n in AG_TABLES if n not in tables]
        if missing:
            raise InputError(f"the router returned no {missing} (a router returns every table of "
                             "tldsl.ops.moe.MoERouting by name)")
        self._check_foreign(tables, AG_TABLES, topk_ids)
        if h is None:
            b = self.kernel.buffer("h")
            h = torch.empty(tuple(b.type.shape), dtype=x.dtype, device=x.device)
        args = {n: tables[n] for n in AG_TABLES}
        if self.stage_rows and self.chain != "after":
            args["tile_visit"] = self._layout_visit(args["tile_visit"])
        FusedProgram.__call__(self, x=x, w1=w1, h=h, **args)
        return h, tables

    def _layout_visit(self, visit):
        """The row tiles in layout order, for a staged gather the grouped GEMM overlaps (``chain``
        "beside" or "folded"): that GEMM takes its tiles as the gather completes them, expert after
        expert, and a visit by tokens (the routing's ``tile_visit``, what a gather run before the
        GEMM wants) would hold its first tiles back until every expert's tiles over the same tokens
        were in (measured on one H100, the gather folded into the GEMM: Mixtral 8192 tokens 0.55x
        ``_grouped_mm`` by tokens, 1.00x in layout order; BENCHMARKS.md, forty-second session)."""
        import torch
        cached = getattr(self, "_layout_visit_cache", None)
        if cached is None or cached.shape != visit.shape or cached.device != visit.device:
            cached = self._layout_visit_cache = torch.arange(visit.shape[0], dtype=torch.int32, device=visit.device)
        return cached

    def _problem(self) -> str:
        return (f"AllGather+MoE: {self.world_size} x {self.rows_per_rank} tokens, top-{self.topk} of "
                f"{self.num_experts} experts, BM {self.block_m}")


class MoEReduceScatter(_Routed, FusedProgram):
    """Layer 1 of a tensor-parallel MoE: the grouped GEMM of ``h`` with this rank's ``w2`` slices,
    the top-k weighted combine per token and the reduce-scatter, the combine and the scatter
    overlapped with the GEMM's tiles.

    ``w2``: this rank's ``[E, Nr, K]`` (a tensor or ``tl.TensorSpec``; ``weights="nk"``: ``[E, K, Nr]``,
    a stack of torch Linear weights); ``rows_per_rank``: tokens
    per rank ``Ms``; ``topk``. ``h`` is ``[R_pad, Nr]`` in expert-sorted order (what
    :class:`AllGatherMoE` returns for the same tokens and ``BM``). Calling ``op(h, topk_ids, topk_weights, w2, tables=None)`` returns
    ``out [Ms, K]``: this rank's tokens, summed over the ranks. ``tables``: the routing
    :class:`AllGatherMoE` returned for the same ``topk_ids`` (else built here; tables the library did
    not build are checked against the ids first, with ``validate_ids``). Schedules not
    given: :data:`DEFAULT_RS_COMPUTE` and :data:`DEFAULT_RS_COMM` (the reduce-scatter in 128-row
    tiles on 32 SMs). ``partial_dtype``: ``"out"`` (default: each rank's combined rows rounded to
    ``h``'s dtype before the reduce-scatter sums them, the numerics of NCCL's reduce-scatter of a
    bf16 layer and of :class:`~tldsl.runtime.dist.gemm_rs.MatmulReduceScatter`; fewer bytes for
    the combine and half the reduce-scatter's) or ``"f32"`` (fp32 partials)."""

    def __init__(self, w2, rows_per_rank: int, topk: int, group=None, *, compute=None, comm=None, router=None,
                 validate_ids: bool = True, weights_dtype=None, partial_dtype: str = "out", weights: str = "kn",
                 **program_kw):
        check_weight_layout("MoEReduceScatter", weights)
        w_shape, dt = _shape_dtype("w2", w2, "[E, K, Nr]" if weights == "nk" else "[E, Nr, K]")
        E, Nr, K = (w_shape[0], w_shape[2], w_shape[1]) if weights == "nk" else w_shape
        if not isinstance(rows_per_rank, numbers.Integral) or isinstance(rows_per_rank, bool) or rows_per_rank < 1:
            raise InputError(f"rows_per_rank must be a positive int (tokens per rank), got {rows_per_rank!r}")
        if partial_dtype not in PARTIAL_DTYPES:
            raise InputError(f"partial_dtype={partial_dtype!r}: choose 'out' (partials in h's dtype, as NCCL's "
                             f"reduce-scatter of a bf16 layer) or 'f32' (fp32 partials, more traffic)")
        self.partial_dtype = partial_dtype
        compute, comm = _schedules("MoEReduceScatter", compute, comm, (DEFAULT_RS_COMPUTE, DEFAULT_RS_COMM))
        _check_routing_options(router, validate_ids)
        topk = _topk(topk)
        W = program_op.dist_context(group).world_size
        Ms = int(rows_per_rank)
        self._init_routing(W, Ms, topk, E, compute.tile[0], router, validate_ids)
        R, topk = self.num_tiles * self.block_m, self.topk
        wts = tl.float32 if weights_dtype is None else weights_dtype
        specs = {"h": tl.TensorSpec((R, Nr), dt), "w2": tl.TensorSpec(w_shape, dt),
                 "topk_weights": tl.TensorSpec((W * Ms, topk), wts), **self._table_specs(RS_TABLES),
                 "out": tl.TensorSpec((Ms, K), dt)}
        FusedProgram.__init__(self, moe_reduce_scatter, group, specs, compute=compute, comm=comm,
                              partial_dtype=partial_dtype, weights=weights, **program_kw)

    def __call__(self, h, topk_ids, topk_weights, w2, tables: dict | None = None, out=None):
        import torch
        self._check_open()
        self.check_arguments({"h": h, "topk_weights": topk_weights, "w2": w2,              # before the routing
                              **({} if out is None else {"out": out})})
        passed = tables is not None
        tables = self.routing(topk_ids) if tables is None else _tables_dict(
            tables, "tables: pass what AllGatherMoE returned (its routing tables by name, a dict of int32 tensors) "
                    "or None (the routing built here)")
        missing = [n for n in RS_TABLES if n not in tables]
        if missing:
            raise InputError(f"tables: missing {missing} (pass what AllGatherMoE returned, or None)")
        self._check_foreign(tables, RS_TABLES, topk_ids, ids_checked=not passed)
        if out is None:
            b = self.kernel.buffer("out")
            out = torch.empty(tuple(b.type.shape), dtype=h.dtype, device=h.device)
        FusedProgram.__call__(self, h=h, w2=w2, topk_weights=topk_weights, out=out,
                              **{n: tables[n] for n in RS_TABLES})
        return out

    def _problem(self) -> str:
        return (f"MoE+ReduceScatter: {self.world_size} x {self.rows_per_rank} tokens, top-{self.topk} of "
                f"{self.num_experts} experts, BM {self.block_m}")
