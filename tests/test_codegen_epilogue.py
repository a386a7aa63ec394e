"""GEMM epilogues generated from the tile program: per-tile choice of stores, waits before an
elementwise sum of the accumulator with loaded tiles, notifies after the accumulator's store
(GEMM + ReduceScatter summing this rank's rows in the epilogue, ``reduce_in='epilogue'``)."""
import pytest

import tldsl as tl
from tldsl.codegen import toolchain as tcm
from tldsl.codegen import lower_gemm
from tldsl.codegen import LoweringError
from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter

S = tl.TensorSpec
COMPUTE = tl.ComputeSchedule(tile=(128, 256, 64), stages=4, order="comm_aligned")


def trace_rs(W=2, Ms=1024, K=4096, N=8192, partial_dtype="out", reduce_in="epilogue", tile_m=256):
    comm = tl.CommSchedule(engine="copy_engine", mode="push", tile_m=tile_m, reduce_in=reduce_in)
    return gemm_reduce_scatter.trace(W, S((W * Ms, K), tl.bfloat16), S((K, N), tl.bfloat16),
                                     S((Ms, N), tl.bfloat16), compute=COMPUTE, comm=comm,
                                     partial_dtype=partial_dtype)


@pytest.mark.parametrize("W", [2, 3])
def test_epilogue_sum_lowers_to_a_generated_epilogue(W):
    lg = lower_gemm(trace_rs(W=W), "gemm")
    params = {p.name: p for p in lg.params}
    # the sum's target and source: a TMA store into out, plain (never read-only-path) loads of recv
    assert params["tma_out"].source == "tma:tma_out"
    assert params["buf_reduce_scatter_recv"].ctype == "const __nv_bfloat16*"          # no __restrict__
    assert params["buf_reduce_scatter_recv"].source == "data:reduce_scatter_recv"
    assert params["sig_reduce_scatter_done"].ctype == "const unsigned long long*"     # waited on only
    assert params["sig_reduce_scatter_ready"].ctype == "unsigned long long* __restrict__"
    assert lg.data_buffers == (("reduce_scatter_recv", (W * 1024, 8192), "bf16"),)
    out = next(t for t in lg.tma if t.param == "tma_out")
    assert (out.buffer, out.global_dims, out.box_dims) == ("out", (8192, 1024), (64, 64))
    assert lg.epilogue_waits == W - 1 and lg.waits == 0 and lg.notifies == 1
    assert set(lg.signals) == {"reduce_scatter_done"} and lg.notify_signals == ("reduce_scatter_ready",)
    src = lg.source
    assert "struct TileEpilogue" in src and "tldsl::sm90::NoNotifies{}, TileEpilogue{" in src
    assert src.count("tldsl::wait_at_least<tldsl::kScopeSys>(sig_reduce_scatter_done") == W - 1
    assert src.count("epi_load2(buf_reduce_scatter_recv") == W - 1
    assert "ctx.template release<tldsl::kScopeGpu>();" in src       # the partial tiles' notifies
    assert "more in the epilogue" in lg.describe()


def test_without_the_epilogue_sum_the_gemm_is_unchanged():
    """reduce_in='comm' keeps the built-in store + notifies (no generated epilogue)."""
    lg = lower_gemm(trace_rs(reduce_in="comm"), "gemm")
    assert "TileEpilogue" not in lg.source and "TileNotifies{" in lg.source
    assert lg.data_buffers == () and lg.epilogue_waits == 0


def _accumulate(a, b, pm, pn, compute):
    """The GEMM's K loop (traced into the caller's compute part): the accumulator of tile (pm, pn)."""
    K = a.shape[1]
    BM, BN, BK = compute.tile
    acc = tl.fragment((BM, BN), tl.float32)
    for k in tl.range(0, K, BK):
        acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
    return acc


@tl.kernel
def sum_first(a, b, c, d, e, *, compute: tl.ComputeSchedule = None):
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(a.shape[0], BM), tl.cdiv(b.shape[1], BN)))
    def mm(pm, pn):
        acc = _accumulate(a, b, pm, pn, compute)
        with tl.when(pm >= 1):
            tl.store(e, (pm * BM - BM, pn * BN), acc + tl.load(d, (pm * BM, pn * BN), (BM, BN)))
        with tl.when(pm < 1):
            tl.store(c, (pm * BM, pn * BN), acc)


@tl.kernel
def max_sum(a, b, c, d, e, *, compute: tl.ComputeSchedule = None):
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(a.shape[0], BM), tl.cdiv(b.shape[1], BN)))
    def mm(pm, pn):
        acc = _accumulate(a, b, pm, pn, compute)
        with tl.when(pm < 1):
            tl.store(c, (pm * BM, pn * BN), acc)
        with tl.when(pm >= 1):
            tl.store(e, (pm * BM - BM, pn * BN), tl.maximum(acc, tl.load(d, (pm * BM, pn * BN), (BM, BN))))


@tl.kernel
def notify_first(a, b, c, d, e, *, compute: tl.ComputeSchedule = None):
    BM, BN, _ = compute.tile
    done = tl.signal("done", 4)

    @tl.compute_part(grid=(tl.cdiv(a.shape[0], BM), tl.cdiv(b.shape[1], BN)))
    def mm(pm, pn):
        acc = _accumulate(a, b, pm, pn, compute)
        with tl.when(pm < 1):
            tl.producer_tile_notify(done, pn)           # nothing stored yet: it would release nothing
            tl.store(c, (pm * BM, pn * BN), acc)
        with tl.when(pm >= 1):
            tl.store(e, (pm * BM - BM, pn * BN), acc + tl.load(d, (pm * BM, pn * BN), (BM, BN)))


@pytest.mark.parametrize("kernel,text", [(sum_first, "after its store of the accumulator itself"),
                                         (max_sum, "elementwise 'max' in a GEMM epilogue"),
                                         (notify_first, "a notify before the tile's store")])
def test_unsupported_epilogues_are_rejected_at_the_user_line(kernel, text):
    specs = [S((256, 128), tl.float16), S((128, 256), tl.float16), S((256, 256), tl.float16),
             S((256, 256), tl.float16), S((128, 256), tl.float16)]
    ir = kernel.trace(1, *specs, compute=tl.ComputeSchedule(tile=(128, 128, 64)))
    with pytest.raises(LoweringError) as ei:
        lower_gemm(ir)
    assert text in str(ei.value) and ei.value.loc.filename == __file__


_OK, _WHY = tcm.toolchain_available()


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@pytest.mark.parametrize("partial_dtype", ["out", "f32"])
def test_epilogue_sum_compiles_without_spills(partial_dtype):
    from test_codegen_nvrtc import check_sass
    lg = lower_gemm(trace_rs(partial_dtype=partial_dtype), "gemm")
    ck = lg.compile(progress=False)
    if partial_dtype == "out":
        k = check_sass(ck, waits_scope="SYS")
        if k is not None:      # the loads of a batch are issued together: 64 pair loads per thread per tile
            assert sum(n for op, n in k.opcodes.items() if op.startswith("LDG.E.STRONG.GPU")) == 64
    else:                      # fp32 partials: twice the fetched bytes, a few spilled registers at most
        info = ck.ptxas_info()[ck.name]
        assert info["registers"] <= 168 and info["spill_store_bytes"] <= 64, info


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@pytest.mark.parametrize("partial_dtype", ["out", "f32"])
@pytest.mark.parametrize("W", [3, 4, 5, 6, 7, 8])
def test_epilogue_sum_of_any_number_of_peers_compiles(W, partial_dtype, tmp_path):
    """The epilogue's loads go in batches of column blocks that must tile the accumulator's BN / 8:
    a batch of as many blocks as fit 256 fetched bytes did not at W=4 (three peers' fp16 pairs, 12
    bytes a pair: 10 blocks of a 128-column tile's 16) — NVRTC refused the kernel ("batches must
    tile the accumulator columns") that tl.simulate ran. The batch is now the largest divisor."""
    from tldsl.codegen.toolchain.cache import KernelCache
    compute = tl.ComputeSchedule(tile=(64, 128, 64), order="comm_aligned", group_m=1)
    comm = tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue")
    k = gemm_reduce_scatter.trace(W, S((64 * W, 64), tl.float16), S((64, 128), tl.float16), S((64, 128), tl.float16),
                                  compute=compute, comm=comm, partial_dtype=partial_dtype)
    lg = lower_gemm(k, "gemm")
    assert lg.source.count("epi_load2(buf_reduce_scatter_recv") == W - 1
    lg.compile(progress=False, cache=KernelCache(tmp_path / "cache"))


def test_epilogue_probe_cuts_what_it_names():
    """`python -m tldsl.bench probe epilogue` times the epilogue-sum GEMM with parts cut out of
    its source: each cut removes what it says and nothing else."""
    from tldsl.bench.probes import _rs_gemm, epilogue_ablations
    cuts = epilogue_ablations(_rs_gemm(2048, 8192, 4096, "epilogue").source)
    count = {n: (s.count("wait_at_least<"), s.count("epi_load2("), s.count("ctx.apply("), s.count("if (false)"))
             for n, s in cuts.items()}
    assert count == {"fused": (1, 1, 1, 0), "no waits": (0, 1, 1, 0), "no loads": (0, 0, 1, 0),
                     "no sums": (0, 0, 0, 0), "no own-row stores": (0, 0, 0, 1)}
    with pytest.raises(SystemExit):
        from tldsl.bench import main
        main(["probe", "nothing"])
