"""GEMM + ReduceScatter: ``out = reduce_scatter(A @ B, dim=0)`` (the second GEMM of a
tensor-parallel MLP, row-parallel over K). Every rank multiplies its own K slice,
``A_r [M, Kr] @ B_r [Kr, N]``, into an fp32 partial; rank ``r`` ends with rows
``[r*M/W, (r+1)*M/W)`` of the sum of all ranks' partials. The communication part starts
reducing a segment as soon as the compute tiles that cover it are stored, so the
reduce-scatter overlaps the GEMM.

Precision (``partial_dtype``): every rank accumulates its product in fp32. With ``"f32"``
(default) the partial stays fp32 in the workspace and on the ring — twice the traffic of
fp16, but the sum over W ranks is rounded once, at the ``out`` store. With ``"out"`` the
partial is rounded to the output dtype when stored and travels in it (half the bytes):
the numerics of ``all_reduce``/``reduce_scatter`` of a bf16 ``matmul`` — what NCCL + cuBLAS
and PyTorch's ``fused_matmul_reduce_scatter`` compute; each hop adds in fp32 and rounds.
"""
from __future__ import annotations

import numpy as np

import tldsl as tl
from tldsl.collectives import PARTIAL_DTYPES, own_rows_waiting_in_a_cycle, partial_buffer, reduce_scatter
from tldsl.ops.registry import register
from tldsl.ops.weights import matrix_dims, stored_form, weight_tile
from tldsl.runtime.sim.memory import host_float32
from tldsl.testing import OpCase, OpSpec


@tl.kernel
def gemm_reduce_scatter(a, b, out, *, compute: tl.ComputeSchedule = None,
                        comm: tl.CommSchedule = None, partial_dtype: str = "f32", weights: str = "kn"):
    """a: [M, Kr] (this rank's K slice); b: [Kr, N] (``weights="nk"``: [N, Kr], a torch Linear's
    weight); out: [M/W, N] = this rank's rows of sum_r a_r @ b_r.
    ``partial_dtype``: ``"f32"`` or ``"out"`` (the partial products in out's dtype)."""
    W = tl.world_size()
    M, K = a.shape
    Kb, N = matrix_dims(b, weights, "gemm_reduce_scatter")
    tl.static_assert(M % W == 0, f"gemm_reduce_scatter: A has {M} rows, which {W} ranks cannot split evenly "
                                 f"(M must be divisible by the world size)")
    tl.static_assert(K == Kb, f"gemm_reduce_scatter: A is [{M}, {K}] but B is {list(b.shape)}"
                              f"{stored_form(weights, '[N, Kr]')} (inner dimensions differ)")
    tl.static_assert(tuple(out.shape) == (M // W, N),
                     f"gemm_reduce_scatter: out must be [{M // W}, {N}] (M/W rows), got {list(out.shape)}")
    BM, BN, BK = compute.tile
    partial = partial_buffer((M, N), out, partial_dtype, "gemm_reduce_scatter")
    # summing in the epilogue, the collective refuses a compute order in which the ranks' own tiles
    # wait for each other in a cycle (tldsl.collectives.own_rows_waiting_in_a_cycle), where the GEMM
    # hands its tiles over (rs.store_tile): a ScheduleError at that line
    rs = reduce_scatter(partial, out, comm, name="reduce_scatter",
                        producer_rows=BM, producers_per_row=tl.cdiv(N, BN))

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)), align_shift=rs.align_shift)
    def gemm(pm, pn):
        r0, c0 = pm * BM, pn * BN
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (r0, k), (BM, BK)), weight_tile(b, k, c0, BK, BN, weights))
        rs.store_tile(acc, r0, c0)       # store + notify (or, reducing in the epilogue, own rows summed here)


def _own_rows_waiting_in_a_cycle(compute: tl.ComputeSchedule, comm: tl.CommSchedule, M: int, N: int, W: int,
                                 align_shift: int = 1) -> str | None:
    """Why this op's GEMM (``compute``'s tiles over [M, N]) with ``reduce_in='epilogue'`` can hang,
    or None: :func:`tldsl.collectives.own_rows_waiting_in_a_cycle`, which the collective checks
    when the GEMM hands its tiles over (here for the tests' schedule strategies)."""
    return own_rows_waiting_in_a_cycle(compute, comm, M, W, (tl.cdiv(M, compute.BM), tl.cdiv(N, compute.BN)),
                                       compute.BM, align_shift)


def reference(a_slices, b_slices):
    """numpy: the full reduced product sum_r a_r @ b_r (fp32); rank r's out is rows r*M/W:(r+1)*M/W.
    One ``a`` [M, Kr] and one ``b`` [Kr, N] slice per rank (numpy arrays or torch tensors): other
    counts or shapes are an InputError naming them (``zip`` dropped a rank's slice silently)."""
    what = "gemm_reduce_scatter.reference"
    for name, xs in (("a_slices", a_slices), ("b_slices", b_slices)):
        if not isinstance(xs, (list, tuple)) or not xs:
            raise tl.InputError(f"{what}: {name} must be a non-empty list with one slice per rank, got "
                                f"{type(xs).__name__}")
    if len(a_slices) != len(b_slices):
        raise tl.InputError(f"{what}: one a and one b slice per rank, got {len(a_slices)} a_slices and "
                            f"{len(b_slices)} b_slices")
    a = [host_float32(f"{what}: a_slices[{r}]", x, 2) for r, x in enumerate(a_slices)]
    b = [host_float32(f"{what}: b_slices[{r}]", x, 2) for r, x in enumerate(b_slices)]
    for r, (ar, br) in enumerate(zip(a, b)):
        if ar.shape[1] != br.shape[0]:
            raise tl.InputError(f"{what}: a_slices[{r}] is {list(ar.shape)} but b_slices[{r}] is {list(br.shape)}: "
                                f"rank {r} multiplies [M, Kr] @ [Kr, N], so their inner dimensions must agree")
    if len({ar.shape[0] for ar in a}) > 1 or len({br.shape[1] for br in b}) > 1:
        raise tl.InputError(f"{what}: every rank's product is [M, N] of one M and N, got a_slices of shapes "
                            f"{[list(x.shape) for x in a]} and b_slices of {[list(x.shape) for x in b]}")
    return sum(ar @ br for ar, br in zip(a, b))


# -- registration for the tests ------------------------------------------------------------

def make_case(rng, world_size, *, rows_per_rank, n, k_per_rank, compute, comm, dtype="float16", partial_dtype="f32"):
    W, Ms = world_size, rows_per_rank
    M = W * Ms
    a = [rng.standard_normal((M, k_per_rank)).astype(dtype) for _ in range(W)]
    b = [rng.standard_normal((k_per_rank, n)).astype(dtype) for _ in range(W)]
    inputs = [{"a": a[r], "b": b[r], "out": np.full((Ms, n), np.nan, dtype)} for r in range(W)]
    ref = reference(a, b)
    expected = [{"out": ref[r * Ms:(r + 1) * Ms]} for r in range(W)]
    return OpCase(inputs, expected, {"compute": compute, "comm": comm, "partial_dtype": partial_dtype},
                  rtol=2e-2, atol=2e-2 * max(1.0, np.sqrt(W * k_per_rank) / 4),
                  description=f"gemm_reduce_scatter W={W} A=[{M}, {k_per_rank}] B=[{k_per_rank}, {n}] "
                              f"{compute} {comm} partial {partial_dtype}")


def _params(world_size):
    from hypothesis import strategies as st
    from tldsl.testing import strategies as tst

    # the work grows with W * M = W^2 * rows_per_rank: keep the largest draws at W=8 (8x8x8
    # tiles) well under half a second of simulation
    max_rows = min(24, 72 // world_size)
    max_nk = 40 if world_size <= 4 else 24

    @st.composite
    def params(draw):
        compute = draw(tst.compute_schedules())
        # SMs (any mode / order / tile) or the copy engine (push; rows per copy or whole segments)
        # or the copy engine summing this rank's rows in the GEMM's epilogue (whole tiles per rank)
        comm = draw(st.one_of(tst.comm_schedules(engines=("sm",), compute=compute),
                              st.tuples(st.sampled_from((None, 8, 16)), st.sampled_from(("comm", "epilogue"))).map(
                                  lambda t: tl.CommSchedule(engine="copy_engine", mode="push", tile_m=t[0],
                                                            reduce_in=t[1]))))
        n = draw(tst.dims(1, max_nk))
        if comm.reduce_in == "epilogue":
            rows = compute.BM * draw(st.integers(1, max(1, max_rows // compute.BM)))
            # an order without ranks waiting on each other in a cycle (the kernel refuses the others): the
            # drawn one, else comm_aligned (own rows last), with groups within a rank's rows
            if _own_rows_waiting_in_a_cycle(compute, comm, world_size * rows, n, world_size):
                compute = compute.with_(order="comm_aligned")
                if _own_rows_waiting_in_a_cycle(compute, comm, world_size * rows, n, world_size):
                    compute = compute.with_(group_m=1, cluster=(1, 1))
        else:
            rows = draw(tst.dims(1, max_rows))
        return dict(rows_per_rank=rows, n=n,
                    k_per_rank=draw(tst.dims(1, max_nk)), compute=compute, comm=comm,
                    partial_dtype=draw(st.sampled_from(PARTIAL_DTYPES)))
    return params()


def _mutant_params():
    # rows_per_rank is a multiple of BM: no compute tile spans two segments, so every wait on a
    # segment guards tiles that no earlier wait of the same task has already ordered (where a
    # compute tile does span two segments, the second wait on it is legitimately redundant).
    # tile_m=16 over 24-row segments gives a short last tile (the masked load_rows path).
    c = tl.ComputeSchedule(tile=(8, 16, 16), order="comm_aligned")
    base = dict(n=24, k_per_rank=20, compute=c)
    return [dict(base, world_size=3, rows_per_rank=24, comm=tl.CommSchedule(tile_m=16, order="ring", mode="push")),
            dict(base, world_size=4, rows_per_rank=16, comm=tl.CommSchedule(tile_m=None, order="ring", mode="pull")),
            dict(base, world_size=3, rows_per_rank=16, comm=tl.CommSchedule(tile_m=8, order="full_mesh", mode="push")),
            dict(base, world_size=4, rows_per_rank=24, comm=tl.CommSchedule(tile_m=16, order="full_mesh", mode="pull")),
            dict(base, world_size=3, rows_per_rank=24,
                 comm=tl.CommSchedule(tile_m=16, mode="push", engine="copy_engine")),
            dict(base, world_size=3, rows_per_rank=24, compute=c.with_(group_m=3),    # (own rows last)
                 comm=tl.CommSchedule(tile_m=16, mode="push", engine="copy_engine", reduce_in="epilogue"))]


SPEC = register(OpSpec("gemm_reduce_scatter", gemm_reduce_scatter, make_case, _params, _mutant_params(),
                       doc="out = reduce_scatter(A @ B) over the K-parallel ranks"))
