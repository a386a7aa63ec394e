"""The generated Hopper GEMM on a GPU, against torch.matmul (skipped where there is no GPU).

Run on a GPU host with: ``python -m pytest -m gpu tests``.
"""
from __future__ import annotations

import pytest

from tldsl.runtime.gpu import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]

SHAPES = [(128, 128, 64), (256, 512, 1024), (1000, 1016, 1032), (4091, 2056, 520), (77, 4104, 8200),
          (8192, 8192, 8192)]
SCHEDULES = [((128, 256, 64), 4, "swizzled"), ((128, 128, 64), 5, "row_major"), ((256, 128, 64), 4, "comm_aligned"),
             ((64, 128, 64), 4, "swizzled"), ((128, 64, 32), 6, "row_major")]


def _run(M, N, K, tile, stages, order, in_dtype="bfloat16", out_dtype="bfloat16", cluster=(1, 1), sms=None):
    import torch
    import tldsl as tl
    from tldsl.codegen import lower_gemm
    from tldsl.ops.gemm import gemm
    from tldsl.runtime.gpu import GemmKernel
    tin, tout = getattr(torch, in_dtype), getattr(torch, out_dtype)
    k = gemm.trace(1, tl.TensorSpec((M, K), tl.ir.dtype_of(in_dtype)), tl.TensorSpec((K, N), tl.ir.dtype_of(in_dtype)),
                   tl.TensorSpec((M, N), tl.ir.dtype_of(out_dtype)),
                   compute=tl.ComputeSchedule(tile=tile, stages=stages, order=order, cluster=cluster))
    from tldsl.runtime.gpu.device import sm_count
    kern = GemmKernel(lower_gemm(k), reserve_sms=0 if sms is None else sm_count() - sms)
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N * 3 + K)
    a = torch.randn(M, K, device="cuda", dtype=tin, generator=g)
    b = torch.randn(K, N, device="cuda", dtype=tin, generator=g)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=tout)      # poisoned
    kern(a=a, b=b, c=c)
    torch.cuda.synchronize()
    ref = (a.float() @ b.float())
    assert not torch.isnan(c).any(), "some output tiles were never written"
    err = (c.float() - ref).abs().max().item()
    tol = (2e-2 if out_dtype != "float32" else 2e-3) * ref.abs().max().item() + 1e-2
    assert err <= tol, (f"{M}x{N}x{K} {tile} {stages} {order} cluster {cluster} {in_dtype}->{out_dtype}: "
                        f"max |err| {err:.3g} > {tol:.3g}")


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_gemm_matches_torch(M, N, K):
    _run(M, N, K, (128, 256, 64), 4, "swizzled")


@pytest.mark.parametrize("tile,stages,order", SCHEDULES)
def test_gemm_schedules(tile, stages, order):
    _run(1000, 1016, 1032, tile, stages, order)


CLUSTER_CASES = [  # (M, N, K, tile, stages, order, CTAs): odd tile-row counts leave a partner idle
    (1000, 1016, 1032, (128, 256, 64), 4, "swizzled", None), (4091, 2056, 520, (128, 256, 64), 4, "comm_aligned", None),
    (8192, 8192, 8192, (128, 256, 64), 4, "swizzled", None), (77, 4104, 8200, (128, 128, 64), 5, "row_major", None),
    (1000, 1016, 1032, (64, 128, 64), 4, "swizzled", 7),       # 7 SMs: 3 clusters walk many cluster tiles
]


@pytest.mark.parametrize("M,N,K,tile,stages,order,sms", CLUSTER_CASES)
def test_cluster_gemm_matches_torch(M, N, K, tile, stages, order, sms):
    _run(M, N, K, tile, stages, order, cluster=(2, 1), sms=sms)


@pytest.mark.parametrize("in_dtype,out_dtype", [("float16", "float16"), ("bfloat16", "float32"),
                                                ("float16", "float32")])
def test_gemm_dtypes(in_dtype, out_dtype):
    _run(520, 264, 392, (128, 128, 64), 4, "swizzled", in_dtype, out_dtype)


LINEAR_CASES = [  # (M, N, K, tile, stages, cluster M, dtypes, SMs): B stored [N, K] (a torch Linear's weight)
    (1000, 1016, 1032, (128, 256, 64), 4, 1, ("bfloat16", "bfloat16"), None),
    (4091, 2056, 520, (128, 256, 64), 4, 2, ("bfloat16", "bfloat16"), None),    # odd tile rows: a partner idles
    (77, 4104, 8200, (128, 128, 64), 5, 1, ("float16", "float32"), None),
    (520, 264, 392, (64, 128, 32), 6, 1, ("float16", "float16"), None),           # 64-byte swizzle (BK 32)
    (1000, 1016, 1032, (256, 128, 64), 3, 2, ("bfloat16", "float32"), 7),          # 3 clusters walk many tiles
    (8192, 2048, 704, (128, 256, 64), 4, 1, ("bfloat16", "bfloat16"), None),      # a short K (MoE+RS's per-rank)
    (1000, 1016, 1032, (128, 128, 128), 3, 2, ("bfloat16", "bfloat16"), None),   # two K chunks a stage, clusters
    (520, 264, 392, (128, 64, 16), 8, 1, ("float16", "float16"), None),           # 32-byte swizzle (BK 16)
    (1000, 1016, 1032, (64, 16, 32), 6, 2, ("bfloat16", "bfloat16"), None),       # 8 rows of B a CTA of a pair
]


@pytest.mark.parametrize("M,N,K,tile,stages,cluster,dtypes,sms", LINEAR_CASES)
def test_linear_with_weights_stored_n_by_k_matches_torch(M, N, K, tile, stages, cluster, dtypes, sms):
    """``tldsl.ops.gemm.linear``: ``tl.dot(x_tile, tl.trans(w_tile))`` with w [N, K] lowered by the
    GEMM recipe with B read K-major (its stages chunked along K; with clusters each CTA loads half
    of B's rows and multicasts them): against torch's ``x @ w.T`` on poisoned outputs."""
    import torch
    import tldsl as tl
    from tldsl.codegen import lower_gemm
    from tldsl.ops.gemm import linear
    from tldsl.runtime.gpu import GemmKernel
    from tldsl.runtime.gpu.device import sm_count
    tin, tout = (getattr(torch, d) for d in dtypes)
    din, dout = (tl.ir.dtype_of(d) for d in dtypes)
    k = linear.trace(1, tl.TensorSpec((M, K), din), tl.TensorSpec((N, K), din), tl.TensorSpec((M, N), dout),
                     compute=tl.ComputeSchedule(tile=tile, stages=stages, cluster=(cluster, 1)))
    lg = lower_gemm(k)
    assert lg.config.b_k_major
    kern = GemmKernel(lg, reserve_sms=0 if sms is None else sm_count() - sms)
    g = torch.Generator(device="cuda").manual_seed(M + 5 * N + 11 * K)
    x = torch.randn(M, K, device="cuda", dtype=tin, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=tin, generator=g)
    for _ in range(2):                                   # a second launch into a re-poisoned output
        y = torch.full((M, N), float("nan"), device="cuda", dtype=tout)
        kern(x=x, w=w, y=y)
        torch.cuda.synchronize()
        ref = x.float() @ w.float().T
        assert not torch.isnan(y).any(), "some output tiles were never written"
        err = (y.float() - ref).abs().max().item()
        tol = (2e-2 if tout != torch.float32 else 2e-3) * ref.abs().max().item() + 1e-2
        assert err <= tol, f"{M}x{N}x{K} {tile} cluster {cluster} {dtypes}: max |err| {err:.3g} > {tol:.3g}"


def test_waits_block_until_flags_are_set():
    """The AllGather+GEMM compute part waits per tile: with its flags at 0 nothing is written;
    once the flags are raised the same launch completes and is correct."""
    import torch
    import tldsl as tl
    from tldsl.bench.gemm import lower_with_waits
    from tldsl.runtime.gpu import GemmKernel
    M, N, K = 1024, 512, 256
    lw, _ = lower_with_waits(M, N, K, tl.ComputeSchedule(tile=(128, 128, 64), stages=4), world_size=2, comm_tile=128)
    kern = GemmKernel(lw)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    sig = {s: torch.zeros(64, device="cuda", dtype=torch.int64) for s in lw.signals}
    # Everything that runs while the kernel spins must already be loaded: with CUDA's lazy
    # module loading, loading a kernel waits for the spinning one, which waits for it.
    torch.cuda._sleep(1000)
    torch.isnan(c).all().item()           # loads the kernels of the check made while the GEMM spins
    for s in sig.values():
        s.fill_(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kern({"a_gathered": a, "b": b, "c": c}, signals=sig)
    torch.cuda._sleep(50_000_000)            # the kernel spins meanwhile
    assert torch.isnan(c).all().item(), "tiles were computed before their rows were signalled"
    for s in sig.values():
        s.fill_(1)                           # launch 1, count 1: every wait is satisfied
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    assert (c.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-2


def _ag_gemm_kernel(W, Ms, K, N, mode, *, group_m=8, engine="copy_engine", own_rows="comm"):
    """AllGather+GEMM's compute part (bf16, 128x256x64 tiles, comm_aligned order, the copy
    engine pulling or pushing; ``own_rows='compute'``: this rank's rows moved by the GEMM, with
    ``engine='compute'`` pushed by it too) lowered and loaded; a stuck wait traps."""
    import tldsl as tl
    from tldsl.codegen import lower
    from tldsl.ops.allgather_gemm import allgather_gemm
    from tldsl.runtime.gpu import GemmKernel
    bf = tl.bfloat16
    ir = allgather_gemm.trace(W, tl.TensorSpec((Ms, K), bf), tl.TensorSpec((K, N), bf), tl.TensorSpec((W * Ms, N), bf),
                              compute=tl.ComputeSchedule(tile=(128, 256, 64), stages=4, order="comm_aligned",
                                                         group_m=group_m),
                              comm=tl.CommSchedule(engine=engine, mode=mode, order="ring", own_rows=own_rows))
    lg = lower(ir, "gemm", wait_timeout_ns=2_000_000_000)
    return lg, GemmKernel(lg)


@pytest.mark.parametrize("rank,cols", [(0, 1), (1, 3), (1, 16)])
def test_gemm_staging_its_own_rows(rank, cols):
    """own_rows (AG+GEMM pulling with own_rows='compute', the runtime's staging='gemm') on one GPU, the peers stood in for by memory: this
    rank's rows are read from the shard (A_gathered's own rows start as NaN, so reading them
    would show), stored into the slot and into A_gathered, the staging tiles counted, and the
    launch published into this rank's slot of every peer's arrival array (here one scratch
    array). Launch 2 needs the peers' arrival at launch 1 before it overwrites the slot."""
    import torch
    W, Ms, K, N = 2, 512, 520, 3000
    lg, kern = _ag_gemm_kernel(W, Ms, K, N, "pull", group_m=Ms // 128, own_rows="compute")
    dev = "cuda"
    own = slice(rank * Ms, (rank + 1) * Ms)
    b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    flags = {s: torch.full((W,), 1 << 40, device=dev, dtype=torch.int64) for s in lg.signals}   # peers' rows: here
    staged = torch.zeros(1, device=dev, dtype=torch.int64)
    arrive = torch.zeros(W, device=dev, dtype=torch.int64)
    published = torch.zeros(W, device=dev, dtype=torch.int64)
    table = torch.full((W,), published.data_ptr(), device=dev, dtype=torch.int64)
    staged_name, arrive_name, table_name = lg.row_signals           # the IR's names
    signals = dict(flags, **{staged_name: staged, arrive_name: arrive, table_name: table})
    per_launch = (Ms // 128) * min(cols, -(-N // 256))
    for launch in (1, 2):
        shard = torch.randn(Ms, K, device=dev, dtype=torch.bfloat16)
        a_full = torch.randn(W * Ms, K, device=dev, dtype=torch.bfloat16)
        a_full[own] = float("nan")
        slot = torch.full((Ms, K), float("nan"), device=dev, dtype=torch.bfloat16)
        c = torch.full((W * Ms, N), float("nan"), device=dev, dtype=torch.bfloat16)
        arrive.fill_(launch - 1)                     # the peers have staged the previous launch
        kern({"a_gathered": a_full, "b": b, "c": c, "a": shard, "a_slot": slot, "own_cols": cols},
             signals=signals, launch_index=launch, rank=rank)
        torch.cuda.synchronize()
        assert torch.equal(slot, shard) and torch.equal(a_full[own], shard)
        ref = a_full.float() @ b.float()
        assert not torch.isnan(c).any()
        assert (c.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-2
        assert staged.item() == launch * per_launch
        assert published[rank].item() == launch and published[1 - rank].item() == 0


def _check_gathered(copy, c, landing, shard, own, b):
    """A gathering GEMM's results: the gathered copy is the landing rows with the shard in this
    rank's place, exactly, and C is that times B (no NaN left from the poisoned outputs)."""
    import torch
    want = landing.clone()
    want[own] = shard
    assert torch.equal(copy, want)
    ref = want.float() @ b.float()
    assert not torch.isnan(c).any()
    assert (c.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-2


@pytest.mark.parametrize("rank,cols", [(0, 1), (1, 5), (1, 12)])
def test_gemm_gathering_pushed_rows(rank, cols):
    """gather_rows (AG+GEMM with the copy engines pushing) on one GPU, the peers stood in for by
    memory: this rank's rows come from the shard (the landing buffer's own rows are NaN, so
    reading them would show), every other row from the landing buffer behind its flag, and every
    A stage is stored into the gathered copy (NaN-poisoned before): it equals [landing rows with
    the shard in this rank's place] exactly."""
    import torch
    W, Ms, K, N = 2, 512, 520, 3000
    lg, kern = _ag_gemm_kernel(W, Ms, K, N, "push", own_rows="compute")
    dev = "cuda"
    own = slice(rank * Ms, (rank + 1) * Ms)
    b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    for launch in (1, 2):
        flags = {s: torch.full((W,), launch, device=dev, dtype=torch.int64) for s in lg.signals}   # every shard landed
        shard = torch.randn(Ms, K, device=dev, dtype=torch.bfloat16)
        landing = torch.randn(W * Ms, K, device=dev, dtype=torch.bfloat16)
        landing[own] = float("nan")
        copy = torch.full((W * Ms, K), float("nan"), device=dev, dtype=torch.bfloat16)
        c = torch.full((W * Ms, N), float("nan"), device=dev, dtype=torch.bfloat16)
        kern({"a_gathered": landing, "b": b, "c": c, "a": shard, "a_gathered_out": copy, "own_cols": cols},
             signals=flags, launch_index=launch, rank=rank)
        torch.cuda.synchronize()
        _check_gathered(copy, c, landing, shard, own, b)


@pytest.mark.parametrize("rank,cols", [(0, 12), (1, 5), (1, 1)])
def test_gemm_pushing_its_rows(rank, cols):
    """push_rows (the GEMM pushes this rank's rows, pusher="gemm") on one GPU, the peer stood in
    for by memory: besides the gathering GEMM's results, this rank's shard lands in the peer's
    landing buffer (NaN-poisoned) at slot launch % 2, rows of this rank — exactly, nothing else
    touched — this rank's flag on the peer holds the launch, and the push counter counts every
    storing tile of this rank's rows once per launch."""
    import torch
    W, Ms, K, N = 2, 512, 520, 3000
    lg, kern = _ag_gemm_kernel(W, Ms, K, N, "push", group_m=Ms // 128, engine="compute", own_rows="compute")
    dev = "cuda"
    own = slice(rank * Ms, (rank + 1) * Ms)
    peer = 1 - rank
    b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
    peer_landing = torch.full((2 * W * Ms, K), float("nan"), device=dev, dtype=torch.bfloat16)
    peer_flags = torch.zeros(W, device=dev, dtype=torch.int64)
    my_flags = torch.zeros(W, device=dev, dtype=torch.int64)
    table = torch.zeros(W, device=dev, dtype=torch.int64)
    table[peer], table[rank] = peer_flags.data_ptr(), my_flags.data_ptr()
    count = torch.zeros(1, device=dev, dtype=torch.int64)
    tiles = (Ms // 128) * min(cols, -(-N // 256))
    for launch in (1, 2, 3):
        my_flags[peer] = launch                                   # the peer's shard has landed here
        shard = torch.randn(Ms, K, device=dev, dtype=torch.bfloat16)
        landing = torch.randn(W * Ms, K, device=dev, dtype=torch.bfloat16)
        landing[own] = float("nan")
        copy = torch.full((W * Ms, K), float("nan"), device=dev, dtype=torch.bfloat16)
        c = torch.full((W * Ms, N), float("nan"), device=dev, dtype=torch.bfloat16)
        before = peer_landing.clone()
        kern({"a_gathered": landing, "b": b, "c": c, "a": shard, "a_gathered_out": copy, "own_cols": cols,
              "push_landing_0": peer_landing},
             signals={lg.signals[0]: my_flags, **dict(zip(lg.row_signals, (count, table)))},
             launch_index=launch, rank=rank)
        torch.cuda.synchronize()
        _check_gathered(copy, c, landing, shard, own, b)
        row0 = (launch % 2) * W * Ms + rank * Ms
        pushed = slice(row0, row0 + Ms)
        assert torch.equal(peer_landing[pushed], shard)
        rest = torch.ones(2 * W * Ms, dtype=torch.bool, device=dev)
        rest[pushed] = False
        assert torch.equal(peer_landing[rest].isnan(), before[rest].isnan())     # nothing else written
        assert peer_flags.tolist() == [launch if q == rank else 0 for q in range(W)]
        assert count.item() == tiles * launch
