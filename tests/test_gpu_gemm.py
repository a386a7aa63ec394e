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


def test_waits_block_until_flags_are_set():
    """The AllGather+GEMM compute part waits per tile: with its flags at 0 nothing is written;
    once the flags are raised the same launch completes and is correct."""
    import torch
    import tldsl as tl
    from tldsl.bench import _lower_with_waits
    from tldsl.runtime.gpu import GemmKernel
    M, N, K = 1024, 512, 256
    lw, _ = _lower_with_waits(M, N, K, tl.ComputeSchedule(tile=(128, 128, 64), stages=4), world_size=2, comm_tile=128)
    kern = GemmKernel(lw)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    sig = {s: torch.zeros(64, device="cuda", dtype=torch.int64) for s in lw.signals}
    # Everything that runs while the kernel spins must already be loaded: with CUDA's lazy
    # module loading, loading a kernel waits for the spinning one, which waits for it.
    torch.cuda._sleep(1000)
    assert torch.isnan(c).all().item()
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
