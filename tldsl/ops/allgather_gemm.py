"""AllGather + GEMM: ``C = all_gather(A_shard, dim=0) @ B`` on every rank (tensor-parallel
MLP input). The compute part waits per tile for exactly the rows it needs, so the GEMM
starts on the local shard while peers' shards are still arriving."""
from __future__ import annotations

import numpy as np

import tldsl as tl
from tldsl.collectives import all_gather
from tldsl.ops.registry import register
from tldsl.ops.weights import matrix_dims, stored_form, weight_tile
from tldsl.runtime.sim.memory import host_float32, host_operand, nan_like
from tldsl.testing import OpCase, OpSpec


@tl.kernel
def allgather_gemm(a: tl.Symmetric, b, c, *, compute: tl.ComputeSchedule = None,
                   comm: tl.CommSchedule = None, weights: str = "kn"):
    """a: [Ms, K] shard (symmetric); b: [K, N] (``weights="nk"``: [N, K], a torch Linear's weight);
    c: [W*Ms, N] = all_gather(a) @ b."""
    W = tl.world_size()
    Ms, K = a.shape
    Kb, N = matrix_dims(b, weights, "allgather_gemm")
    tl.static_assert(K == Kb, f"allgather_gemm: A shard is [{Ms}, {K}] but B is {list(b.shape)}"
                              f"{stored_form(weights, '[N, K]')}")
    tl.static_assert(tuple(c.shape) == (W * Ms, N), f"allgather_gemm: C must be [{W * Ms}, {N}], got {list(c.shape)}")
    M = W * Ms
    BM, BN, BK = compute.tile

    a_full = tl.symmetric_buffer((M, K), a.dtype, "a_gathered")
    gathered = all_gather(a, a_full, comm, name="gather_a")

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)), align_shift=0)
    def gemm(pm, pn):
        r0, c0 = pm * BM, pn * BN
        r1 = tl.minimum(r0 + BM, M)
        gathered.wait_rows(r0, r1, then_cols=True)
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            gathered.wait_cols(r0, r1, k, BK)          # column-sliced schedules: each slice as the loop reaches it
            acc += tl.dot(tl.load(a_full, (r0, k), (BM, BK)), weight_tile(b, k, c0, BK, BN, weights))
        tl.store(c, (r0, c0), acc)


def fused_all_gather_matmul(a_shards, b, *, compute=None, comm=None, seed: int = 0, options=None):
    """User-facing AG+GEMM on the simulator, with PyTorch's ``fused_all_gather_matmul``
    semantics: returns, per rank, ``(A_gathered, A_gathered @ B)``.

    ``a_shards``: one [Ms, K] array per rank; ``b``: [K, N] (the same on every rank, or a
    list with one per rank). The GPU backend will take torch tensors with the same meaning.
    """
    if not isinstance(a_shards, (list, tuple)) or not a_shards:
        raise tl.InputError("a_shards: one [Ms, K] array per rank (a non-empty list), got "
                            + (f"an empty {type(a_shards).__name__}" if isinstance(a_shards, (list, tuple))
                               else type(a_shards).__name__))
    W = len(a_shards)
    b_names = [f"b[{r}]" for r in range(W)] if isinstance(b, (list, tuple)) else ["b"] * W
    bs = list(b) if isinstance(b, (list, tuple)) else [b] * W
    if len(bs) != W:
        raise tl.InputError(f"got {W} A shards but {len(bs)} B matrices")
    a_shards, bs = [host_operand(x) for x in a_shards], [host_operand(x) for x in bs]   # torch tensors kept
    for what, arrays in (("a_shards", a_shards), ("b", bs)):
        for r, x in enumerate(arrays):
            if np.ndim(x) != 2:
                raise tl.InputError(f"{what}[{r}] must be a 2-d array, got shape {tuple(np.shape(x))}")
    Ms = np.shape(a_shards[0])[0]
    N = np.shape(bs[0])[1]
    try:
        floating = tl.TensorSpec.of(a_shards[0], "a_shards[0]").dtype.is_float
    except tl.InputError:               # a dtype no tile program holds (float64, complex, ...)
        floating = False
    if not floating:                    # (refused before the output is poisoned with NaN, which it cannot hold)
        raise tl.InputError(f"a_shards: floating-point arrays (float16, bfloat16 or float32), got "
                            f"{getattr(a_shards[0], 'dtype', None)}")
    _check_operands(a_shards, bs, b_names)
    inputs = [{"a": a_shards[r], "b": bs[r], "c": nan_like(a_shards[0], (W * Ms, N))} for r in range(W)]
    kwargs = {k: v for k, v in (("compute", compute), ("comm", comm)) if v is not None}
    res = tl.simulate(allgather_gemm, W, inputs, seed=seed, options=options, **kwargs)
    # the gathered rows: the landing buffer, or (own_rows='compute' pushing) the output the
    # compute part stores every row into
    return [(res.workspaces[r].get("a_gathered_out", res.workspaces[r]["a_gathered"]), res[r]["c"])
            for r in range(W)]


def _check_operands(a_shards, bs, b_names) -> None:
    """What the kernel would refuse inside its own lines (a tl.static_assert, tl.dot, the gathered
    buffer's shape), refused here naming the caller's argument: shards with rows and columns, and
    every B of the shards' K rows and their dtype."""
    spec = tl.TensorSpec.of(a_shards[0], "a_shards[0]")
    Ms, K = spec.shape
    if Ms == 0 or K == 0:
        raise tl.InputError(f"a_shards: each shard needs at least one row and one column, got shape [{Ms}, {K}]")
    for name, x in zip(b_names, bs):
        Kb, N = np.shape(x)
        if Kb != K or N == 0:
            raise tl.InputError(f"{name} is [{Kb}, {N}] but the A shards are [{Ms}, {K}]: B must be [{K}, N] with "
                                f"N >= 1 (all_gather(A) @ B)")
        b_dtype = tl.TensorSpec.of(x, name).dtype
        if b_dtype != spec.dtype:
            raise tl.InputError(f"{name} is {b_dtype} but the A shards are {spec.dtype}: A and B must share a dtype "
                                f"(cast one first)")


def reference(a_shards, b):
    """numpy: every rank's output of all_gather(A) @ B (fp32 accumulation). The operands: numpy
    arrays or torch tensors (bf16 too); shapes that do not fit are an InputError naming them."""
    what = "allgather_gemm.reference"
    if not isinstance(a_shards, (list, tuple)) or not a_shards:
        raise tl.InputError(f"{what}: a_shards must be a non-empty list of [Ms, K] shards, one per rank, got "
                            f"{type(a_shards).__name__}")
    shards = [host_float32(f"{what}: a_shards[{r}]", x, 2) for r, x in enumerate(a_shards)]
    b = host_float32(f"{what}: b", b, 2)
    K = shards[0].shape[1]
    if any(x.shape[1] != K for x in shards):
        raise tl.InputError(f"{what}: the A shards must share K (their columns), got shapes "
                            f"{[list(x.shape) for x in shards]}")
    if b.shape[0] != K:
        raise tl.InputError(f"{what}: b is {list(b.shape)} but the A shards have K={K} columns: b must be [{K}, N]")
    return np.concatenate(shards, axis=0) @ b


# -- registration for the tests ------------------------------------------------------------

def make_case(rng, world_size, *, rows_per_rank, n, k, compute, comm, dtype="float16"):
    W = world_size
    shards = [rng.standard_normal((rows_per_rank, k)).astype(dtype) for _ in range(W)]
    b = rng.standard_normal((k, n)).astype(dtype)
    inputs = [{"a": shards[r], "b": b, "c": np.full((W * rows_per_rank, n), np.nan, dtype)} for r in range(W)]
    ref = reference(shards, b)
    return OpCase(inputs, [{"c": ref} for _ in range(W)], {"compute": compute, "comm": comm},
                  rtol=2e-2, atol=2e-2 * max(1.0, np.sqrt(k) / 4),
                  description=f"allgather_gemm A=[{W}x{rows_per_rank}, {k}] B=[{k}, {n}] {compute} {comm}")


def _params(world_size):
    from hypothesis import strategies as st
    from tldsl.testing import strategies as tst

    @st.composite
    def params(draw):
        compute = draw(tst.compute_schedules())
        return dict(rows_per_rank=draw(tst.dims(1, 40)), n=draw(tst.dims(1, 40)), k=draw(tst.dims(1, 40)),
                    compute=compute, comm=draw(tst.comm_schedules(compute=compute, col_tiles=True)))
    return params()


def _mutant_params():
    c = tl.ComputeSchedule(tile=(16, 16, 16), order="comm_aligned")
    base = dict(world_size=3, rows_per_rank=12, n=16, k=24, compute=c)
    return [dict(base, comm=tl.CommSchedule(tile_m=8, mode="pull")),
            dict(base, comm=tl.CommSchedule(tile_m=8, mode="push", order="full_mesh")),
            dict(base, comm=tl.CommSchedule(engine="copy_engine", mode="pull")),
            dict(base, comm=tl.CommSchedule(engine="copy_engine", mode="push")),
            dict(base, comm=tl.CommSchedule(engine="copy_engine", mode="push", col_tile=16)),
            # this rank's rows (whole compute tiles) moved by parts fused into the GEMM: the copy-engine
            # push, the GEMM pushing
            dict(base, rows_per_rank=16, comm=tl.CommSchedule(engine="copy_engine", mode="push", col_tile=16,
                                                              own_rows="compute")),
            dict(base, rows_per_rank=16, comm=tl.CommSchedule(engine="compute", mode="push", own_rows="compute"))]


SPEC = register(OpSpec("allgather_gemm", allgather_gemm, make_case, _params, _mutant_params(),
                       doc="C = all_gather(A) @ B"))
