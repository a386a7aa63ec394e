"""Grouped GEMMs whose experts' weights are stored [E, N, K] — a stack of torch ``Linear`` weights
— and read as ``tl.trans(tl.load(w, (e, n, k), (BN, BK)))``: the grouped GEMM recipe stages B
K-major, as A (``Cfg::kBKMajor``), under every configuration it has (128-row tiles, half tiles,
64-row tiles in pairs, split columns, ping-pong, clusters, a gathered A). On the CPU: the plan,
the source, the TMA boxes and NVRTC's SASS; on a GPU: ``tl.run`` against ``tl.simulate``
(``tests/test_gpu_run.py``)."""
import contextlib
import warnings

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen.pipeline import lower
from tldsl.codegen.toolchain import toolchain_available, find_toolchain
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import CompileJob, compile_many

S = tl.TensorSpec


@tl.kernel
def experts_nk(x, w, tile_expert, tile_rows, ids, y, *, compute: tl.ComputeSchedule = None,
               gather: tl.constexpr = False, mask: tl.constexpr = True, guard: tl.constexpr = True):
    """``y`` row tile ``i`` = (rows of ``x``) @ ``w[tile_expert[i]].T``, its rows past
    ``tile_rows[i]`` zero (``mask``); ``w``: [E, N, K]. ``gather``: the tile's rows of x by ``ids``.
    ``guard``: tiles of expert -1 skipped (``tl.when``); without, every tile's expert is one of w's."""
    T, K = x.shape
    E, N, _ = w.shape
    BM, BN, BK = compute.tile
    NT = tile_expert.shape[0]

    @tl.compute_part(grid=(NT, tl.cdiv(N, BN)))
    def gg(i, pn):
        e = tl.load_scalar(tile_expert, (i,))
        n = tl.load_scalar(tile_rows, (i,))
        acc = tl.fragment((BM, BN), tl.float32)
        with tl.when(e >= 0) if guard else contextlib.nullcontext():
            rows = tl.load(ids, (i * BM,), (BM,)) if gather else None
            for k in tl.range(0, K, BK):
                a = tl.load_rows(x, rows, k, BK) if gather else tl.load(x, (i * BM, k), (BM, BK))
                acc += tl.dot(a, tl.trans(tl.load(w, (e, pn * BN, k), (BN, BK))))
        tl.store(y, (i * BM, pn * BN), tl.where(tl.iota(BM)[:, None] < n, acc, 0.0) if mask else acc)


def trace_experts(NT=6, E=3, N=384, K=320, tile=(128, 128, 64), stages=4, cluster=1, gather=False,
                  dt=tl.bfloat16, mask=True, guard=True):
    BM = tile[0]
    T = NT * BM
    return experts_nk.trace(1, S((T, K), dt), S((E, N, K), dt), S((NT,), tl.int32), S((NT,), tl.int32),
                            S((T,), tl.int32), S((T, N), dt), gather=gather, mask=mask, guard=guard,
                            compute=tl.ComputeSchedule(tile=tile, stages=stages, cluster=(cluster, 1)))


def inputs(k, seed=0, dtype=np.float32, skipped=True):
    """Inputs with experts of every fill: full tiles, partial ones (half tiles), an empty tile (-1:
    ``skipped``, for a guarded program); x, w and y (NaN: poisoned) in ``dtype``."""
    rng = np.random.default_rng(seed)
    x, w, te, tr, ids, y = k.args
    NT, BM = te.type.shape[0], x.type.shape[0] // te.type.shape[0]
    E = w.type.shape[0]
    experts = np.array([i % E for i in range(NT)], np.int32)
    if skipped:
        experts[NT // 2] = -1
    rows = np.array([BM, BM // 2 - 3, BM, 5, BM, BM - 1][:NT] + [BM] * max(0, NT - 6), np.int32)
    return {"x": rng.standard_normal(x.type.shape).astype(dtype),
            "w": rng.standard_normal(w.type.shape).astype(dtype),
            "tile_expert": experts, "tile_rows": rows,
            "ids": rng.permutation(x.type.shape[0]).astype(np.int32),
            "y": np.full(y.type.shape, np.nan, dtype)}


CONFIGS = {   # name: trace arguments — the grouped recipe's configurations
    "128x128 ping-pong": dict(tile=(128, 128, 64), stages=5),
    "128x256 half tiles": dict(tile=(128, 256, 64), stages=4, N=512),
    "128x256 clusters": dict(tile=(128, 256, 64), stages=4, N=512, cluster=2),
    "64x128 pairs": dict(tile=(64, 128, 64), stages=4, NT=8),
    "64x256 split columns": dict(tile=(64, 256, 64), stages=4, NT=8, N=512, mask=False),
    "128x128 gathered": dict(tile=(128, 128, 64), stages=4, gather=True),
    "128x256x32 (64-byte swizzle)": dict(tile=(128, 256, 32), stages=6, N=512),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_stack_of_linear_weights_lowers_to_the_grouped_recipe_k_major(name):
    lg = lower(trace_experts(**CONFIGS[name]), "gg")
    c = lg.config
    assert type(lg).__name__ == "LoweredGroupedGemm" and c.b_k_major
    assert "Major::MN" not in lg.source and "static constexpr bool kBKMajor = true;" in lg.source
    assert "[E, N, K] per expert, read K-major" in lg.describe()
    b = next(t for t in lg.tma if t.param == "tma_b")
    K, N, E = b.global_dims
    assert (K, N) == (320, CONFIGS[name].get("N", 384)) and b.global_strides == (K * 2, N * K * 2)
    assert b.box_dims == (min(64, c.BK), c.BN, 1)
    if name.startswith("64x128"):
        assert c.pair_rows
    if "split" in name:
        assert c.split_n
    if "ping-pong" in name:
        assert c.pingpong
    if "half" in name:
        assert c.half_tiles and not c.pingpong


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_grouped_gemm_without_a_guard_lowers_to_the_grouped_recipe(name):
    """No ``tl.when`` (every tile's expert is one of w's): the plain GEMM recipe, made for 2-d
    operands, steps aside at its matcher and the grouped recipe takes the part in the guarded
    program's configuration — no fallback, nothing to warn about."""
    from tldsl.codegen import pipeline
    k = trace_experts(**CONFIGS[name], guard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tl.FallbackWarning)
        lg = lower(k, "gg")
    assert type(lg).__name__ == "LoweredGroupedGemm" and lg.declined == ()
    assert [n for n, _ in pipeline.match(k, k.part("gg")).declined] == ["gemm"]
    assert lg.config == lower(trace_experts(**CONFIGS[name]), "gg").config


def expected(ins) -> np.ndarray:
    """``experts_nk``'s output (not gathered, masked) in fp32, by numpy: row tile i is x's rows times
    ``w[e].T``, its rows from ``tile_rows[i]`` on zero; a skipped tile (e = -1) zero."""
    NT = len(ins["tile_expert"])
    BM = ins["x"].shape[0] // NT
    want = np.zeros(ins["y"].shape, np.float32)
    for i, (e, n) in enumerate(zip(ins["tile_expert"], ins["tile_rows"])):
        if e >= 0:
            want[i * BM:i * BM + n] = ins["x"][i * BM:i * BM + n].astype(np.float32) @ ins["w"][e].astype(np.float32).T
    return want


def test_the_simulator_computes_each_tile_times_its_experts_weight_transposed():
    k = trace_experts(NT=4, E=2, N=96, K=64, tile=(32, 32, 16), stages=2)
    ins = inputs(k)
    r = tl.simulate(experts_nk, 1, [ins], gather=False, compute=tl.ComputeSchedule(tile=(32, 32, 16), stages=2))
    np.testing.assert_allclose(r[0]["y"], expected(ins), rtol=1e-5, atol=1e-4)


@tl.kernel
def _experts_at_wrong_offsets(x, w, tile_expert, y, *, compute: tl.ComputeSchedule = None):
    T, K = x.shape
    E, N, _ = w.shape
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tile_expert.shape[0], tl.cdiv(N, BN)))
    def gg(i, pn):
        e = tl.load_scalar(tile_expert, (i,))
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):          # B's tile at (k, n): as if B were [E, K, N]
            acc += tl.dot(tl.load(x, (i * BM, k), (BM, BK)), tl.trans(tl.load(w, (e, k, pn * BN), (BN, BK))))
        tl.store(y, (i * BM, pn * BN), acc)


def test_a_transposed_expert_tile_at_the_wrong_place_is_refused_with_the_reason():
    from tldsl.codegen import LoweringError
    from tldsl.codegen.recipes.grouped_gemm import lower_grouped_gemm
    bf = tl.bfloat16
    k = _experts_at_wrong_offsets.trace(1, S((256, 256), bf), S((2, 256, 256), bf), S((2,), tl.int32),
                                        S((256, 256), bf), compute=tl.ComputeSchedule(tile=(128, 128, 64)))
    why = r"B tile offsets must be \(e, pid1\*128, k\), got \(k, 128\*pid1\)"
    with pytest.raises(LoweringError, match=why):
        lower_grouped_gemm(k, "gg")
    # the pipeline runs it by the general lowering, with the grouped recipe's reason (not the plain
    # GEMM recipe's "2-d": that one is made for other programs)
    with pytest.warns(tl.FallbackWarning, match="general recipe: the grouped_gemm recipe refused: .*" + why):
        lk = lower(k, "gg")
    assert type(lk).__name__ == "LoweredGeneral" and [n for n, _ in lk.declined] == ["grouped_gemm"]


_OK, _WHY = toolchain_available()


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
def test_k_major_grouped_gemms_compile_for_sm90a(tmp_path):
    from test_codegen_nvrtc import MAX_REGISTERS
    names = sorted(CONFIGS) + ["128x256 half tiles, no guard"]
    lgs = [lower(trace_experts(**CONFIGS[n]), "gg") for n in sorted(CONFIGS)]
    lgs.append(lower(trace_experts(**CONFIGS["128x256 half tiles"], guard=False), "gg"))
    cks = compile_many([CompileJob(lg.source, lg.entry, lg.options) for lg in lgs], cache=KernelCache(tmp_path),
                       progress=False)
    for name, lg, ck in zip(names, lgs, cks):
        info = ck.ptxas_info()[ck.name]
        assert info["spill_store_bytes"] == 0 and info["registers"] <= MAX_REGISTERS, (name, info)
        if find_toolchain().cuobjdump is None:
            continue
        k = ck.sass()[ck.name]
        assert k.count("HGMMA") > 0 and k.count("BPT.TRAP") == 0 and k.count("LDL") == 0, name
