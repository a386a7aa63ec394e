"""Sequence-parallel attention (all-gather of K/V overlapped with flash attention): MHA and
GQA, the contiguous and the zig-zag layout, sequences that are not multiples of the tiles."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tldsl as tl
from tldsl.errors import InputError
from tldsl.ir.analysis import MAX_ITERATIONS, collect
from tldsl.ops.sp_attention import SPEC, positions, reference, shard_sequence, sp_attention, unshard_sequence
from tldsl.testing import check_case, describe

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


# every configuration at two world sizes (the contiguous MHA kernel; 1, 2, 3 and 8 ranks overall)
WORLDS = {name: ws for name, ws in zip(sorted(CONFIGS), [(1, 8), (2, 3), (3, 8), (1, 2), (2, 8)])}


@pytest.mark.parametrize("name,W", [(n, w) for n in sorted(CONFIGS) for w in WORLDS[n]])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_numpy(W, causal, name):
    case = _case(W, name, causal, seed=W)
    res = check_case(SPEC, case, W, seed=W + 7)
    for r in range(W):
        assert not np.isnan(res[r]["o"]).any()


# (W, Sl, heads, kv_heads, head_dim, compute tile, comm schedule, layout, causal): zig-zag chunks
# of odd lengths that no tile divides (query blocks straddle a rank's two chunks), GQA groups of
# 2 and 4, MHA, every engine and mode
GQA_ZIGZAG = {
    "zigzag-gqa4-chunk7-pull": (4, 14, 4, 1, 8, (8, 8, 8), tl.CommSchedule(tile_m=8, mode="pull"), "zigzag", True),
    "zigzag-mha-chunk9-push-mesh": (3, 18, 2, None, 12, (16, 8, 8),
                                    tl.CommSchedule(tile_m=16, mode="push", order="full_mesh"), "zigzag", True),
    "zigzag-gqa2-chunk3-ce-push-W8": (8, 6, 2, 1, 8, (8, 16, 8), tl.CommSchedule(engine="copy_engine", mode="push"),
                                      "zigzag", True),
    "zigzag-gqa2-chunk5-W1": (1, 10, 4, 2, 8, (8, 8, 8), tl.CommSchedule(tile_m=8), "zigzag", True),
    "zigzag-gqa2-noncausal-ce-pull": (3, 10, 4, 2, 8, (16, 16, 8), tl.CommSchedule(engine="copy_engine", mode="pull"),
                                      "zigzag", False),
    "contiguous-gqa2-causal-push-ring": (2, 21, 4, 2, 16, (8, 16, 8), tl.CommSchedule(tile_m=8, mode="push"),
                                         "contiguous", True),
    "contiguous-gqa4-full-pull": (3, 9, 4, 1, 8, (8, 8, 8), tl.CommSchedule(tile_m=16, mode="pull"),
                                  "contiguous", False),
}


def _gz_case(name, seed=0, dtype="float16"):
    W, sl, h, hkv, d, tile, comm, layout, causal = GQA_ZIGZAG[name]
    return W, SPEC.make_case(np.random.default_rng(seed), W, seq_per_rank=sl, heads=h, kv_heads=hkv, head_dim=d,
                             causal=causal, layout=layout, compute=tl.ComputeSchedule(tile=tile), comm=comm,
                             dtype=dtype)


@pytest.mark.parametrize("name", sorted(GQA_ZIGZAG))
def test_gqa_and_zigzag_match_numpy(name):
    W, case = _gz_case(name, seed=len(name))
    res = check_case(SPEC, case, W, seed=3)
    for r in range(W):
        assert not np.isnan(res[r]["o"]).any()


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_drawn_shapes_match_numpy(data):
    """Hypothesis over the op's own parameter space (SPEC.params: ragged Sl and chunks, MHA and
    GQA, both layouts, causal or not, any schedule), world sizes 1-8; the property tests of the
    library draw more of the same (tests/test_properties.py)."""
    W = data.draw(st.integers(1, 8), label="world_size")
    params = data.draw(SPEC.params(W), label="params")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    case = SPEC.make_case(np.random.default_rng(seed), W, **params)
    check_case(SPEC, case, W, seed, label=describe(SPEC, W, params, seed))


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


@pytest.mark.parametrize("seq", [-4, 0, 2.0, True])
def test_positions_refuse_a_row_count_that_is_not_positive(seq):
    """positions(2, -4) returned an empty [2, 0] array without a word."""
    with pytest.raises(tl.InputError, match=r"sp_attention.positions: seq_per_rank must be a positive int"):
        positions(2, seq)
    assert positions(2, np.int64(2)).tolist() == [[0, 1], [2, 3]]


def test_zigzag_layout_and_host_helpers():
    assert positions(3, 4, "zigzag").tolist() == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    assert positions(2, 3).tolist() == [[0, 1, 2], [3, 4, 5]]
    x = np.arange(30 * 2).reshape(30, 2)
    for W, layout in ((3, "zigzag"), (5, "zigzag"), (1, "zigzag"), (3, "contiguous")):
        shards = shard_sequence(x, W, layout)
        assert len(shards) == W and all(s.shape == (30 // W, 2) for s in shards)
        for r, s in enumerate(shards):
            assert np.array_equal(s[:, 0] // 2, positions(W, 30 // W, layout)[r])
        assert np.array_equal(unshard_sequence(shards, layout), x)
    torch = pytest.importorskip("torch")
    t = torch.arange(24.0).reshape(12, 2)
    shards = shard_sequence(t, 3, "zigzag")
    assert all(isinstance(s, torch.Tensor) for s in shards)
    assert shards[1][:, 0].tolist() == [4.0, 6.0, 16.0, 18.0]
    assert torch.equal(unshard_sequence(shards, "zigzag"), t)
    with pytest.raises(InputError, match="two chunks of Sl/2 rows per rank"):
        shard_sequence(np.zeros((9, 2)), 3, "zigzag")
    with pytest.raises(InputError, match="does not split into world_size=4"):
        shard_sequence(np.zeros((9, 2)), 4)
    with pytest.raises(InputError, match="layout must be one of"):
        shard_sequence(np.zeros((8, 2)), 2, "striped")
    with pytest.raises(InputError, match="x must be a numpy array or torch tensor .*got list"):
        shard_sequence([[1, 2], [3, 4]], 2)
    with pytest.raises(InputError, match="got a 0-d Tensor"):
        shard_sequence(torch.tensor(1.0), 1)
    with pytest.raises(InputError, match="same shape"):
        unshard_sequence([np.zeros((4, 2)), np.zeros((6, 2))], "zigzag")
    with pytest.raises(InputError, match="takes a list with one shard per rank, got ndarray"):
        unshard_sequence(x, "contiguous")                  # its 30 rows are not 30 shards


def test_reference_zigzag_is_the_contiguous_result_permuted_and_gqa_is_repeated_heads():
    rng = np.random.default_rng(2)
    W, N, H, Hkv, D = 3, 18, 4, 2, 4
    q = rng.standard_normal((N, H * D)).astype(np.float32)
    k, v = (rng.standard_normal((N, Hkv * D)).astype(np.float32) for _ in range(2))
    full = {}
    for layout in ("contiguous", "zigzag"):
        out = reference(*(shard_sequence(x, W, layout) for x in (q, k, v)), H, True, kv_heads=Hkv, layout=layout)
        full[layout] = unshard_sequence(out, layout)
    np.testing.assert_allclose(full["zigzag"], full["contiguous"], rtol=1e-5, atol=1e-6)
    rep = [np.repeat(x.reshape(N, Hkv, D), H // Hkv, axis=1).reshape(N, H * D) for x in (k, v)]
    mha = reference(*(shard_sequence(x, W) for x in (q, *rep)), H, True)
    np.testing.assert_allclose(unshard_sequence(mha), full["contiguous"], rtol=1e-5, atol=1e-6)


def test_reference_causal_first_position_sees_only_itself():
    rng = np.random.default_rng(0)
    W, sl, h, d = 2, 3, 2, 4
    qs, ks, vs = ([rng.standard_normal((sl, h * d)).astype(np.float32) for _ in range(W)] for _ in range(3))
    out = reference(qs, ks, vs, h, causal=True)
    np.testing.assert_allclose(out[0][0], vs[0][0], rtol=1e-6)
    # the last position of the last rank sees every key: same as non-causal
    full = reference(qs, ks, vs, h, causal=False)
    np.testing.assert_allclose(out[-1][-1], full[-1][-1], rtol=1e-5)


def test_reference_refuses_heads_the_kernel_refuses():
    """Found by an explorer's round: heads=3 on a width of 32 returned np.empty's leftovers in the
    last two columns (a silent wrong answer), heads=0 and kv_heads=3 raised ZeroDivisionError, and
    unshard_sequence of 0-d shards an IndexError. Now an InputError that says what was expected,
    by the tile program's own check."""
    q = np.random.default_rng(0).standard_normal((16, 32)).astype(F16)
    with pytest.raises(InputError, match=r"sp_attention.reference: the width 32 .* 3 heads do not divide it"):
        reference([q], [q], [q], heads=3)
    with pytest.raises(InputError, match=r"heads must be a positive int, got 0"):
        reference([q], [q], [q], 0)
    with pytest.raises(InputError, match=r"kv_heads=3 must divide heads=2"):
        reference([q], [q], [q], 2, kv_heads=3)
    with pytest.raises(InputError, match=r"causal must be a bool, got 'yes'"):
        reference([q], [q], [q], 2, causal="yes")
    with pytest.raises(InputError, match=r"k and v shards must be \[Sl, kv_heads\*D\] = \[16, 1\*16\]"):
        reference([q], [q], [q], 2, kv_heads=1)
    with pytest.raises(InputError, match=r"one q, k and v shard per rank, got 2, 1 and 1"):
        reference([q, q], [q], [q], 2)
    with pytest.raises(InputError, match=r"q_shards must be 2-d"):
        reference([q[0]], [q], [q], 2)
    with pytest.raises(InputError, match=r"each shard must be .*got \['0-d float32', '0-d float32'\]"):
        unshard_sequence([np.float32(1), np.float32(2)])
    assert reference([q], [q], [q], 2)[0].shape == (16, 32)


def test_the_tile_program_refuses_a_causal_that_is_not_a_bool(no_simulation):
    """Found by an explorer's round: tl.simulate(sp_attention, causal="yes") ran (a truthy string
    taken as causal) where SequenceParallelAttention refuses it: both run one check now."""
    _raises_at_user_line(lambda: tl.simulate(sp_attention, 2, _inputs(2, (16, 32), (16, 32)), heads=2,
                                             causal="yes"), r"sp_attention: causal must be a bool, got 'yes'")


def _specs(sl, width, dtype=F16):
    return [tl.TensorSpec((sl, width), tl.float16 if dtype == F16 else tl.float32)] * 4


def _wait_channels(kernel, rank, task, signal):
    # task: (head, query block), the attention part's grid
    return [ch for op, r, t, ch, _ in collect(kernel).waits_at(rank, task) if op.operands[0].hint == signal]


def test_waits_per_key_block_own_shard_first():
    """Tile-centric overlap: each key block waits for just the communication tiles it reads,
    and a rank starts with its own shard (channels r*tpr ...), then rank+1, rank+2, ..."""
    W, sl = 3, 12
    comm = tl.CommSchedule(tile_m=8, mode="pull")          # 2 tiles per shard: channel = 2*rank + j
    compute = tl.ComputeSchedule(tile=(8, 8, 8))            # key blocks of 8 rows: rows 0-7, 8-11
    full = sp_attention.trace(W, *_specs(sl, 8), heads=1, compute=compute, comm=comm)
    assert _wait_channels(full, 1, (0, 0), "gather_k_ready") == [2, 3, 4, 5, 0, 1]
    assert _wait_channels(full, 2, (0, 1), "gather_v_ready") == [4, 5, 0, 1, 2, 3]
    causal = sp_attention.trace(W, *_specs(sl, 8), heads=1, causal=True, compute=compute, comm=comm)
    # rank 1, query rows 0-7 (global 12-19): own block 0 only, rank 2 skipped, rank 0 whole
    assert _wait_channels(causal, 1, (0, 0), "gather_k_ready") == [2, 0, 1]
    # rank 0, query rows 8-11 (global 8-11): its own shard only
    assert _wait_channels(causal, 0, (0, 1), "gather_k_ready") == [0, 1]
    # a key block of 8 rows over communication tiles of 4 rows waits on both tiles
    small = sp_attention.trace(W, *_specs(sl, 8), heads=1, compute=compute,
                               comm=tl.CommSchedule(tile_m=4, mode="push"))
    assert _wait_channels(small, 0, (0, 0), "gather_k_ready") == [0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_zigzag_waits_per_key_block_of_both_chunks():
    """W=2, chunks of 8 rows (rank 0: positions 0-7 and 24-31, rank 1: 8-15 and 16-23), one
    communication tile per chunk (channel = gathered rows / 8): a query block waits for the
    chunks at or before its last position only, own shard first, a shard's chunks in row order."""
    W, sl = 2, 16
    comm = tl.CommSchedule(tile_m=8, mode="pull")
    k = sp_attention.trace(W, *_specs(sl, 8), heads=1, causal=True, layout="zigzag",
                           compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=comm)
    assert _wait_channels(k, 0, (0, 0), "gather_k_ready") == [0]              # positions 0-7
    assert _wait_channels(k, 0, (0, 1), "gather_k_ready") == [0, 1, 2, 3]     # 24-31: everything
    assert _wait_channels(k, 1, (0, 0), "gather_k_ready") == [2, 0]           # 8-15: chunks 1, 0
    assert _wait_channels(k, 1, (0, 1), "gather_v_ready") == [2, 3, 0]        # 16-23: chunks 1, 2, 0


def _key_blocks_per_rank(W, sl, layout):
    k = sp_attention.trace(W, *_specs(sl, 8), heads=1, causal=True, layout=layout,
                           compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=tl.CommSchedule(tile_m=8, mode="pull"))
    waits = [r for op, r, t, ch, _ in collect(k).waits if op.operands[0].hint == "gather_k_ready"]
    return [waits.count(r) for r in range(W)]


def test_zigzag_balances_the_causal_work():
    """Every rank visits the same number of key blocks in the zig-zag layout (chunks of 16 rows,
    blocks of 8); in the contiguous one the last rank visits W times as many as the first."""
    assert len(set(_key_blocks_per_rank(4, 32, "zigzag"))) == 1
    contiguous = _key_blocks_per_rank(4, 32, "contiguous")
    assert contiguous == sorted(contiguous) and contiguous[-1] > 3 * contiguous[0]


def test_key_loop_stays_a_loop():
    """The IR of the compute part does not grow with the world size or the sequence."""
    compute, comm = tl.ComputeSchedule(tile=(8, 8, 8)), tl.CommSchedule(tile_m=8)

    def n_ops(W, sl, **kw):
        k = sp_attention.trace(W, *_specs(sl, 16), heads=2, causal=True, compute=compute, comm=comm, **kw)
        part = next(p for p in k.parts if p.role == "compute")
        return sum(1 for _ in part.walk())
    assert n_ops(2, 9) == n_ops(8, 24)
    assert n_ops(2, 10, layout="zigzag") == n_ops(8, 24, layout="zigzag")


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
    assert total >= 32 and caught == total, [m for m in mutants if not m.caught]
    assert {m.variant.split()[0] for m in mutants} >= {"sm/pull/ring/tile_m=8", "sm/push/full_mesh/tile_m=8",
                                                       "copy_engine/push/ring", "copy_engine/pull/ring"}
    zigzag = {m.variant.split()[0] for m in mutants if "layout=zigzag" in m.variant}
    assert zigzag == {"sm/pull/ring/tile_m=8", "copy_engine/push/ring"}, zigzag


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


def _raises_at_user_line(fn, pattern):
    with pytest.raises(tl.CompilationError, match=pattern) as ei:
        fn()
    assert "sp_attention.py" in str(ei.value) and "tl.static_assert" in str(ei.value), str(ei.value)


def test_mismatched_shapes_rejected(no_simulation):
    _raises_at_user_line(lambda: tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (9, 16)), heads=2),
                         r"q and o must be \[Sl, H\*D\], k and v \[Sl, H_kv\*D\].*q=\[8, 16\] k=\[9, 16\]")
    with pytest.raises(tl.CompilationError, match=r"k and v must be \[Sl, kv_heads\*D\] = \[8, 2\*8\].*k=\[8, 12\]"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 12)), heads=2)
    with pytest.raises(tl.CompilationError, match=r"q and o must be.*o=\[16, 16\]"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 16), o_shape=(16, 16)), heads=2)


def test_gqa_and_layout_arguments_checked(no_simulation):
    with pytest.raises(tl.CompilationError, match=r"kv_heads=3 must divide heads=4"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 12)), heads=4, kv_heads=3)
    with pytest.raises(tl.CompilationError, match=r"k and v must be \[Sl, kv_heads\*D\] = \[8, 1\*4\].*k=\[8, 8\]"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 8)), heads=4, kv_heads=1)
    with pytest.raises(tl.CompilationError, match=r"kv_heads must be a positive int, got 0"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 16)), heads=4, kv_heads=0)
    _raises_at_user_line(lambda: tl.simulate(sp_attention, 2, _inputs(2, (7, 16), (7, 16)), heads=2, causal=True,
                                             layout="zigzag"), r"two chunks of Sl/2 rows per rank: Sl=7 must be even")
    with pytest.raises(tl.CompilationError, match=r"layout must be one of \('contiguous', 'zigzag'\), got 'ring'"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 16)), heads=2, layout="ring")


def test_head_dim_must_divide_width(no_simulation):
    with pytest.raises(tl.CompilationError, match=r"width 12 .* 5 heads do not divide it"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 12), (8, 12)), heads=5)
    with pytest.raises(tl.CompilationError, match=r"heads must be a positive int, got 0"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 12), (8, 12)), heads=0)


def test_mismatched_dtypes_rejected(no_simulation):
    with pytest.raises(tl.CompilationError, match=r"q, k and v must share a dtype"):
        tl.simulate(sp_attention, 2, _inputs(2, (8, 16), (8, 16), kv_dtype=np.float32), heads=2)



@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")])
def test_channel_analysis_finds_the_same_sites_in_its_spread_order(causal, layout, monkeypatch):
    """The analysis visits (rank, task) pairs in an order spread over the grid; what it finds is
    what the plain row-by-row enumeration finds: the same waits in the same order, the same
    notify totals."""
    import tldsl.ir.analysis as an
    k = sp_attention.trace(4, *_specs(96, 16), heads=2, causal=causal, layout=layout,
                           compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=tl.CommSchedule(tile_m=8, mode="pull"))
    spread = collect(k)
    monkeypatch.setattr(an, "_spread", range)
    plain = collect(k)
    assert spread.complete and plain.complete and spread.evaluated == plain.evaluated > 1000
    assert [w[1:] for w in spread.waits] == [w[1:] for w in plain.waits]
    assert spread.notifies == plain.notifies


@pytest.mark.timed
def test_tracing_a_long_sequence_skips_the_channel_analysis_at_once():
    """A flash-attention part over 128k gathered keys (W = 4, 32k queries) would take ~1M block
    evaluations (its 32 heads share one: no index of its waits reads the head), twice the budget:
    the first 1/64 of its pairs, spread over the grid, say so and the analysis gives up there (the
    counts below say so). The time is a backstop, in this process's CPU seconds — the wall clock of
    a test sharing two cores with three other workers ran 5.8 s where the trace alone takes 3."""
    import time
    t0 = time.process_time()
    k = sp_attention.trace(4, *_specs(32768, 32 * 128), heads=32, causal=True,
                           compute=tl.ComputeSchedule(tile=(128, 128, 64)), comm=tl.CommSchedule(tile_m=128))
    sites = collect(k)
    assert not sites.complete and sites.estimate > MAX_ITERATIONS and sites.evaluated < MAX_ITERATIONS // 10
    assert time.process_time() - t0 < 10.0


def test_channel_analysis_evaluates_the_heads_once():
    """The heads axis of the attention grid is read by no index of its waits: the analysis
    evaluates head 0 of each row tile and counts its notifies once per head, and reaches the same
    verdicts — the same waits per head and the same notify totals as the full enumeration."""
    compute, comm = tl.ComputeSchedule(tile=(8, 8, 8)), tl.CommSchedule(tile_m=8, mode="pull")
    one = collect(sp_attention.trace(3, *_specs(24, 8), heads=1, causal=True, compute=compute, comm=comm))
    four = collect(sp_attention.trace(3, *_specs(24, 32), heads=4, causal=True, compute=compute, comm=comm))
    assert four.complete and four.evaluated == one.evaluated
    assert [(r, t, ch, n) for _, r, t, ch, n in four.waits] == [(r, t, ch, n) for _, r, t, ch, n in one.waits]
    assert sorted(four.notifies.values()) == sorted(one.notifies.values())


@pytest.mark.parametrize("kind", ["torch bf16", "torch requiring grad"])
def test_reference_takes_bf16_shards_as_the_other_references_do(kind):
    """Found by a helper's round: bf16 torch shards (which ``tl.simulate`` and the MoE references
    take) raised torch's TypeError from ``np.asarray``; a tensor requiring grad a RuntimeError.
    Now each is read as fp32 (:func:`host_array`) and the result is fp32 numpy, as for numpy
    shards of the same values."""
    rng = np.random.default_rng(4)
    W, sl, h, d = 2, 6, 2, 4
    qs, ks, vs = ([rng.standard_normal((sl, h * d)).astype(np.float32) for _ in range(W)] for _ in range(3))
    torch = pytest.importorskip("torch")
    if kind == "torch bf16":
        convert = lambda x: torch.from_numpy(x).to(torch.bfloat16)             # noqa: E731
    else:
        convert = lambda x: torch.from_numpy(x).requires_grad_()               # noqa: E731
    as_f32 = lambda t: t.detach().float().numpy()                              # noqa: E731
    shards = [[convert(x) for x in xs] for xs in (qs, ks, vs)]
    got = reference(*shards, h, True)
    want = reference(*([as_f32(x) for x in xs] for xs in shards), h, True)
    for r in range(W):
        assert isinstance(got[r], np.ndarray) and got[r].dtype == np.float32 and got[r].shape == (sl, h * d)
        np.testing.assert_array_equal(got[r], want[r])
    for bad, name in ((np.full((sl, h * d), "x"), "<U1"), (np.zeros((sl, h * d), "V2"), "|V2")):
        with pytest.raises(InputError, match=rf"sp_attention.reference: q_shards\[0\]: an array of numbers, got {name}"):
            reference([bad] * W, ks, vs, h)
