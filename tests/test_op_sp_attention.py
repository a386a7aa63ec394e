"""Sequence-parallel attention (all-gather of K/V overlapped with flash attention)."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.ir.analysis import collect
from tldsl.ops.sp_attention import SPEC, reference, sp_attention
from tldsl.testing import check_case

F16 = np.float16

# (seq_per_rank, heads, head_dim, compute tile, comm schedule): Sl odd, tiles that do not divide
# it, communication tiles smaller than, equal to and larger than BN, every engine and mode.
CONFIGS = {
    "pull-ring-commtile16-BN8": (13, 2, 12, (8, 8, 8), tl.CommSchedule(tile_m=16, mode="pull")),
    "push-mesh-commtile8-BN16": (11, 1, 16, (16, 16, 8), tl.CommSchedule(tile_m=8, mode="push", order="full_mesh")),
    "push-ring-commtile32-BM8BN8": (9, 2, 8, (8, 8, 16), tl.CommSchedule(tile_m=32, mode="push", sms=1)),
    "copy-engine-pull-BM16BN8": (7, 1, 10, (16, 8, 8), tl.CommSchedule(engine="copy_engine", mode="pull")),
    "copy-engine-push-default-tiles": (5, 2, 8, (128, 128, 64), tl.CommSchedule(engine="copy_engine", mode="push")),
}


def _case(W, name, causal, seed=0, dtype="float16"):
    sl, h, d, tile, comm = CONFIGS[name]
    if W == 8:
        sl = min(sl, 7)          # keep the biggest group cheap; still not a multiple of any tile
    return SPEC.make_case(np.random.default_rng(seed), W, seq_per_rank=sl, heads=h, head_dim=d,
                          causal=causal, compute=tl.ComputeSchedule(tile=tile), comm=comm, dtype=dtype)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("W", [1, 2, 3, 8])
def test_matches_numpy(W, causal, name):
    case = _case(W, name, causal, seed=W)
    res = check_case(SPEC, case, W, seed=W + 7)
    for r in range(W):
        assert not np.isnan(res[r]["o"]).any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_other_dtypes(dtype, causal):
    check_case(SPEC, _case(3, "pull-ring-commtile16-BN8", causal, seed=5, dtype=dtype), 3, seed=1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sharp_softmax_with_custom_scale(causal):
    """A large scale makes the running max jump between key blocks: the rescaling of l and
    acc must be right, and nothing may overflow."""
    W, sl, h, d = 3, 10, 1, 8
    rng = np.random.default_rng(11)
    qs, ks, vs = ([rng.standard_normal((sl, h * d)).astype(F16) for _ in range(W)] for _ in range(3))
    inputs = [{"q": qs[r], "k": ks[r], "v": vs[r], "o": np.full((sl, h * d), np.nan, F16)} for r in range(W)]
    res = tl.simulate(sp_attention, W, inputs, seed=2, heads=h, causal=causal, scale=6.0,
                      compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=tl.CommSchedule(tile_m=8))
    ref = reference(qs, ks, vs, h, causal, scale=6.0)
    for r in range(W):
        np.testing.assert_allclose(res[r]["o"].astype(np.float32), ref[r], rtol=2e-2, atol=3e-2)


def test_reference_causal_first_position_sees_only_itself():
    rng = np.random.default_rng(0)
    W, sl, h, d = 2, 3, 2, 4
    qs, ks, vs = ([rng.standard_normal((sl, h * d)).astype(np.float32) for _ in range(W)] for _ in range(3))
    out = reference(qs, ks, vs, h, causal=True)
    np.testing.assert_allclose(out[0][0], vs[0][0], rtol=1e-6)
    # the last position of the last rank sees every key: same as non-causal
    full = reference(qs, ks, vs, h, causal=False)
    np.testing.assert_allclose(out[-1][-1], full[-1][-1], rtol=1e-5)


def _specs(sl, width, dtype=F16):
    return [tl.TensorSpec((sl, width), tl.float16 if dtype == F16 else tl.float32)] * 4


def _wait_channels(kernel, rank, task, signal):
    return [ch for op, r, t, ch, _ in collect(kernel).waits
            if r == rank and t == task and op.operands[0].hint == signal]


def test_waits_per_key_block_own_shard_first():
    """Tile-centric overlap: each key block waits for just the communication tiles it reads,
    and a rank starts with its own shard (channels r*tpr ...), then rank+1, rank+2, ..."""
    W, sl = 3, 12
    comm = tl.CommSchedule(tile_m=8, mode="pull")          # 2 tiles per shard: channel = 2*rank + j
    compute = tl.ComputeSchedule(tile=(8, 8, 8))            # key blocks of 8 rows: rows 0-7, 8-11
    full = sp_attention.trace(W, *_specs(sl, 8), heads=1, compute=compute, comm=comm)
    assert _wait_channels(full, 1, (0, 0), "gather_k_ready") == [2, 3, 4, 5, 0, 1]
    assert _wait_channels(full, 2, (1, 0), "gather_v_ready") == [4, 5, 0, 1, 2, 3]
    causal = sp_attention.trace(W, *_specs(sl, 8), heads=1, causal=True, compute=compute, comm=comm)
    # rank 1, query rows 0-7 (global 12-19): own block 0 only, rank 2 skipped, rank 0 whole
    assert _wait_channels(causal, 1, (0, 0), "gather_k_ready") == [2, 0, 1]
    # rank 0, query rows 8-11 (global 8-11): its own shard only
    assert _wait_channels(causal, 0, (1, 0), "gather_k_ready") == [0, 1]
    # a key block of 8 rows over communication tiles of 4 rows waits on both tiles
    small = sp_attention.trace(W, *_specs(sl, 8), heads=1, compute=compute,
                               comm=tl.CommSchedule(tile_m=4, mode="push"))
    assert _wait_channels(small, 0, (0, 0), "gather_k_ready") == [0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_key_loop_stays_a_loop():
    """The IR of the compute part does not grow with the world size or the sequence."""
    compute, comm = tl.ComputeSchedule(tile=(8, 8, 8)), tl.CommSchedule(tile_m=8)

    def n_ops(W, sl):
        k = sp_attention.trace(W, *_specs(sl, 16), heads=2, causal=True, compute=compute, comm=comm)
        part = next(p for p in k.parts if p.role == "compute")
        return sum(1 for _ in part.walk())
    assert n_ops(2, 9) == n_ops(8, 24)


def test_comm_schedule_changes_nothing():
    outs = []
    for comm in (tl.CommSchedule(tile_m=8, mode="pull"), tl.CommSchedule(tile_m=16, mode="push", order="full_mesh"),
                 tl.CommSchedule(engine="copy_engine", mode="push")):
        case = SPEC.make_case(np.random.default_rng(3), 3, seq_per_rank=10, heads=2, head_dim=8, causal=True,
                              compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=comm)
        res = tl.simulate(sp_attention, 3, case.inputs, seed=4, **case.kwargs)
        outs.append([res[r]["o"] for r in range(3)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert np.array_equal(a, b)


def test_every_deleted_sync_primitive_is_caught():
    from tldsl.testing.mutants import run
    caught, total, mutants = run(["sp_attention"], seeds=2)
    assert total >= 24 and caught == total, [m for m in mutants if not m.caught]
    assert {m.variant.split()[0] for m in mutants} >= {"sm/pull/ring/tile_m=8", "sm/push/full_mesh/tile_m=8",
                                                       "copy_engine/push/ring", "copy_engine/pull/ring"}


# -- bad input: a clear error before anything is simulated -------------------------------------

@pytest.fixture
def no_simulation(monkeypatch):
    import importlib
    sim = importlib.import_module("tldsl.runtime.sim.simulate")   # the module, not the function

    class Forbidden:
        def __init__(self, *a, **k):
            raise AssertionError("the simulator started although the input is invalid")
    monkeypatch.setattr(sim, "Engine", Forbidden)


def _inputs(W, q_shape, kv_shape, o_shape=None, kv_dtype=F16):
    rng = np.random.default_rng(0)
    o_shape = o_shape or q_shape
    return [{"q": rng.standard_normal(q_shape).astype(F16),
             "k": rng.standard_normal(kv_shape).astype(kv_dtype),
             "v": rng.standard_normal(kv_shape).astype(kv_dtype),
             "o": np.full(o_shape, np.nan, F16)} for _ in range(W)]


def test_mismatched_shapes_rejected(no_simulation):
    with pytest.raises(tl.CompilationError, match=r"q, k, v and o must have the same shape.*q=\[8, 16\] k=\[9, 16\]"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (9, 16)), heads=2)
    with pytest.raises(tl.CompilationError, match=r"same shape.*k=\[8, 12\]"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 12)), heads=2)
    with pytest.raises(tl.CompilationError, match=r"same shape.*o=\[16, 16\]"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 16), o_shape=(16, 16)), heads=2)


def test_head_dim_must_divide_width(no_simulation):
    with pytest.raises(tl.CompilationError, match=r"width 12 .* 5 heads do not divide it"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 12), (8, 12)), heads=5)
    with pytest.raises(tl.CompilationError, match=r"heads must be a positive int, got 0"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 12), (8, 12)), heads=0)


def test_mismatched_dtypes_rejected(no_simulation):
    with pytest.raises(tl.CompilationError, match=r"q, k and v must share a dtype"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 16), kv_dtype=np.float32), heads=2)

