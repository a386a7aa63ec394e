"""A GEMM whose B is stored [N, K] — a torch ``Linear``'s weight — written as
``tl.dot(a_tile, tl.trans(w_tile))``: the GEMM recipe lowers it (before, it fell to the general
lowering's statement-by-statement path without a word), reading B's stages K-major as it reads
A's (``Cfg::kBKMajor``, ``sm90_gemm.hpp``). On the CPU: the plan, the source, the TMA boxes, and
NVRTC's SASS; on a GPU: ``tests/test_gpu_gemm.py``."""
import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import lower_gemm
from tldsl.codegen.pipeline import lower
from tldsl.codegen.toolchain import toolchain_available, find_toolchain
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import CompileJob, compile_many
from tldsl.ops.gemm import gemm, linear

S = tl.TensorSpec


def trace_linear(M=1000, N=776, K=520, tile=(128, 256, 64), stages=4, cluster=1, dt=tl.bfloat16, odt=None):
    return linear.trace(1, S((M, K), dt), S((N, K), dt), S((M, N), odt or dt),
                        compute=tl.ComputeSchedule(tile=tile, stages=stages, cluster=(cluster, 1)))


def _b_spec(lg):
    return next(t for t in lg.tma if t.param == "tma_b")


@pytest.mark.parametrize("cluster", [1, 2])
def test_a_transposed_b_tile_lowers_to_the_gemm_recipe_k_major(cluster):
    lg = lower(trace_linear(cluster=cluster), "tile")
    assert type(lg).__name__ == "LoweredGemm" and lg.config.b_k_major
    assert lg.source.count("cute::SM90::GMMA::Major::K") == 2 and "Major::MN" not in lg.source
    assert "static constexpr bool kBKMajor = true;" in lg.source
    assert "B[776x520]^T" in lg.source and "(B stored K-major)" in lg.describe()
    b = _b_spec(lg)
    # [N, K] row-major: the inner dimension is K; boxes of 64 K-columns by the tile's N rows (a
    # cluster's two CTAs each load half the rows and multicast them)
    assert b.global_dims == (520, 776) and b.global_strides == (520 * 2,)
    assert b.box_dims == (64, 256 // cluster)
    assert lg.config.smem_bytes == lower_gemm(gemm.trace(1, S((1000, 520), tl.bfloat16), S((520, 776), tl.bfloat16),
                                                         S((1000, 776), tl.bfloat16),
                                                         compute=tl.ComputeSchedule(tile=(128, 256, 64), stages=4,
                                                                                    cluster=(cluster, 1)))
                                              ).config.smem_bytes


def test_an_mn_major_gemm_renders_no_k_major_flag():
    """B stored [K, N] keeps the configuration it had (the template's default is MN-major): its
    source and so its SASS are what they were before K-major B existed."""
    lg = lower_gemm(gemm.trace(1, S((1000, 520), tl.bfloat16), S((520, 776), tl.bfloat16), S((1000, 776), tl.bfloat16),
                               compute=tl.ComputeSchedule(tile=(128, 256, 64), stages=4)))
    assert not lg.config.b_k_major and "kBKMajor" not in lg.source
    assert lg.source.count("Major::MN") == 1 and _b_spec(lg).box_dims == (64, 64)


def test_k_major_b_chunks_along_k():
    """B's chunks follow its contiguous dimension: K (BK/64 chunks of BN rows), as A's, where an
    MN-major B has BN/64 chunks of BK rows; the swizzle is 64 bytes at BK = 32, as A's."""
    for tile, box in (((128, 128, 128), (64, 128)), ((128, 256, 32), (32, 256)), ((64, 128, 64), (64, 128))):
        lg = lower(trace_linear(tile=tile, stages=3), "tile")
        assert _b_spec(lg).box_dims == box and lg.config.SB == min(128, 2 * tile[2])
        assert _b_spec(lg).swizzle == ("CU_TENSOR_MAP_SWIZZLE_128B" if tile[2] >= 64 else "CU_TENSOR_MAP_SWIZZLE_64B")


def test_the_simulator_computes_x_times_w_transposed():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((100, 72)).astype(np.float32)
    w = rng.standard_normal((40, 72)).astype(np.float32)
    r = tl.simulate(linear, world_size=1, inputs=[dict(x=x, w=w, y=np.full((100, 40), np.nan, np.float32))],
                    compute=tl.ComputeSchedule(tile=(64, 32, 16), stages=2))
    np.testing.assert_allclose(r[0]["y"], x @ w.T, rtol=1e-5, atol=1e-4)


def test_a_weight_of_the_wrong_shape_is_refused_at_trace_time():
    with pytest.raises(tl.TldslError, match=r"w is \[N, K\]"):
        linear.trace(1, S((128, 64), tl.bfloat16), S((64, 128), tl.bfloat16), S((128, 64), tl.bfloat16),
                     compute=tl.ComputeSchedule(tile=(128, 64, 64)))


@tl.kernel
def _linear_wrong_offsets(x, w, y, *, compute: tl.ComputeSchedule = None):
    M, K = x.shape
    N, _ = w.shape
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def tile(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):      # B's tile taken at (k, n): as if B were [K, N]
            acc += tl.dot(tl.load(x, (pm * BM, k), (BM, BK)), tl.trans(tl.load(w, (k, pn * BN), (BN, BK))))
        tl.store(y, (pm * BM, pn * BN), acc)


def test_a_transposed_b_tile_at_the_wrong_place_is_refused_by_the_recipe_with_the_reason():
    from tldsl.codegen import LoweringError
    k = _linear_wrong_offsets.trace(1, S((256, 256), tl.bfloat16), S((256, 256), tl.bfloat16),
                                    S((256, 256), tl.bfloat16), compute=tl.ComputeSchedule(tile=(128, 128, 64)))
    with pytest.raises(LoweringError, match=r"B tile offsets must be \(128\*pid1, k\) .*got \(k, 128\*pid1\)"):
        lower_gemm(k)


_OK, _WHY = toolchain_available()


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
def test_k_major_gemms_compile_for_sm90a_with_k_major_wgmma(tmp_path):
    from test_codegen_nvrtc import check_sass
    cases = [dict(tile=(128, 256, 64), stages=4, cluster=1), dict(tile=(128, 256, 64), stages=4, cluster=2),
             dict(tile=(128, 128, 64), stages=5, cluster=1, dt=tl.float16, odt=tl.float32),
             dict(tile=(256, 128, 64), stages=3, cluster=2), dict(tile=(64, 128, 32), stages=6, cluster=1)]
    lgs = [lower_gemm(trace_linear(**c)) for c in cases]
    cks = compile_many([CompileJob(lg.source, lg.entry, lg.options) for lg in lgs], cache=KernelCache(tmp_path),
                       progress=False)
    for lg, ck in zip(lgs, cks):
        if find_toolchain().cuobjdump is None:
            continue
        k = check_sass(ck)
        assert k.count(f"HGMMA.64x{lg.config.BN}x16.F32") > 0
        if lg.config.cluster[0] == 2:
            assert k.count("UTMALDG.2D.MULTICAST") > 0      # each CTA's half of B's rows, to both
