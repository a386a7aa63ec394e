"""GEMM + ReduceScatter and the reduce_scatter collective: results against numpy for many
world sizes, shapes and schedules, the compute order the ring relies on, bad inputs
rejected before anything runs, and the mutation check of every synchronisation primitive.
(Random shapes and schedules from the op's hypothesis strategy run in test_properties.py.)"""
import numpy as np
import pytest

import tldsl as tl
from tldsl.collectives import reduce_scatter
from tldsl.ops.gemm_reduce_scatter import SPEC, gemm_reduce_scatter, reference
from tldsl.testing import check_case


def _case(W, rows, n, k, compute, comm, seed=0, dtype="float16"):
    return SPEC.make_case(np.random.default_rng(seed), W, rows_per_rank=rows, n=n, k_per_rank=k,
                          compute=compute, comm=comm, dtype=dtype)


C16 = tl.ComputeSchedule(tile=(16, 16, 16), order="comm_aligned")
C8 = tl.ComputeSchedule(tile=(8, 32, 8), order="swizzled", group_m=2)
C32 = tl.ComputeSchedule(tile=(32, 8, 16), order="row_major")

# (compute, comm): comm tile smaller than BM, equal, larger (and larger than a segment), whole
# segments; ring and full mesh; push and pull
SCHEDULES = [
    (C16, tl.CommSchedule(tile_m=8, order="ring", mode="push")),
    (C16, tl.CommSchedule(tile_m=32, order="ring", mode="pull", sms=1)),
    (C8, tl.CommSchedule(tile_m=8, order="full_mesh", mode="push")),
    (C8, tl.CommSchedule(tile_m=None, order="ring", mode="push", sms=3)),
    (C32, tl.CommSchedule(tile_m=16, order="full_mesh", mode="pull")),
    (C32, tl.CommSchedule(tile_m=8, order="ring", mode="pull")),
]


@pytest.mark.parametrize("W", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("sched", range(len(SCHEDULES)))
def test_matches_numpy(W, sched):
    compute, comm = SCHEDULES[sched]
    rows, n, k = {1: (21, 37, 19), 2: (13, 20, 33), 3: (11, 17, 9), 5: (7, 23, 12), 8: (5, 11, 7)}[W]
    case = _case(W, rows, n, k, compute, comm, seed=W + 10 * sched)
    check_case(SPEC, case, W, seed=sched)


def test_fp32_operands():
    case = _case(3, 10, 12, 24, C16, tl.CommSchedule(tile_m=8, mode="push"), dtype="float32")
    case.rtol, case.atol = 1e-5, 1e-4
    check_case(SPEC, case, 3, seed=0)


def test_single_resident_task_one_lane_many_launches():
    """A persistent kernel with one compute CTA and one communication SM, launched three
    times: no deadlock, no stale signal, same result."""
    for order in ("ring", "full_mesh"):
        for mode in ("push", "pull"):
            case = _case(4, 12, 16, 16, C8, tl.CommSchedule(tile_m=8, order=order, mode=mode, sms=1))
            check_case(SPEC, case, 4, seed=5, options=tl.SimOptions(compute_slots=1, launches=3))


def test_partials_and_ring_traffic_are_fp32():
    W, rows, n = 3, 10, 12
    case = _case(W, rows, n, 8, C16, tl.CommSchedule(tile_m=8, mode="push"))
    res = check_case(SPEC, case, W, seed=0)
    ws = res.workspaces[0]
    assert ws["partial"].dtype == np.float32 and ws["partial"].shape == (W * rows, n)
    # one staging slot per ring step, each a segment padded to whole communication tiles
    assert ws["reduce_scatter_recv"].dtype == np.float32
    assert ws["reduce_scatter_recv"].shape == ((W - 1) * 16, n)


def test_single_rank_needs_no_staging_or_peer_signals():
    case = _case(1, 9, 10, 11, C16, tl.CommSchedule(tile_m=8))
    res = check_case(SPEC, case, 1, seed=0)
    assert set(res.workspaces[0]) == {"partial"}
    assert [s.type.scope.value for s in res.kernel.signals] == ["local"]


@pytest.mark.parametrize("order", ["ring", "full_mesh"])
def test_compute_order_matches_the_order_segments_are_reduced(order):
    """With the comm_aligned order, rank r computes segments r+1, r+2, ..., r: the order in
    which the ring (and the full mesh's sends) consume them."""
    W, rows = 4, 16
    case = _case(W, rows, 16, 8, C16, tl.CommSchedule(tile_m=16, order=order))
    kernel = gemm_reduce_scatter.trace(W, *[case.inputs[0][a] for a in gemm_reduce_scatter.arg_names],
                                       **case.kwargs)
    gemm = next(p for p in kernel.parts if p.role == "compute")
    for r in range(W):
        seq = C16.tile_order(gemm.grid, r, W, gemm.align_shift)
        segs = []
        for pm, _ in seq:
            seg = pm * 16 // rows
            if not segs or segs[-1] != seg:
                segs.append(seg)
        assert segs == [(r + s + 1) % W for s in range(W)], (r, segs)


def test_matches_reference_for_a_hand_computed_case():
    """W=2, integers: out on rank r is rows r of a_0 @ b_0 + a_1 @ b_1, exactly."""
    a = [np.arange(8, dtype=np.float32).reshape(4, 2), np.ones((4, 2), np.float32)]
    b = [np.eye(2, 3, dtype=np.float32), np.full((2, 3), 2, np.float32)]
    want = reference(a, b)
    assert want[0].tolist() == [4.0, 5.0, 4.0]
    inputs = [{"a": a[r], "b": b[r], "out": np.full((2, 3), np.nan, np.float32)} for r in range(2)]
    res = tl.simulate(gemm_reduce_scatter, 2, inputs, seed=1, compute=C8,
                      comm=tl.CommSchedule(tile_m=8, mode="push"))
    np.testing.assert_array_equal(res[0]["out"], want[:2])
    np.testing.assert_array_equal(res[1]["out"], want[2:])


@pytest.mark.parametrize("W", [2, 3, 5])
def test_every_communication_schedule_gives_the_same_bits(W):
    """Ring and full mesh add the partials in the same order: push/pull, ring/full mesh and
    the communication tile size change how the sum travels, never a bit of it."""
    outs = []
    for comm in [tl.CommSchedule(tile_m=8, order="ring", mode="push"),
                 tl.CommSchedule(tile_m=None, order="ring", mode="pull", sms=1),
                 tl.CommSchedule(tile_m=32, order="full_mesh", mode="push"),
                 tl.CommSchedule(tile_m=16, order="full_mesh", mode="pull", sms=3)]:
        case = _case(W, 19, 13, 29, C8, comm, seed=7)
        res = check_case(SPEC, case, W, seed=W)
        outs.append([res[r]["out"] for r in range(W)])
    for other in outs[1:]:
        for r in range(W):
            assert np.array_equal(outs[0][r], other[r]), r


# -- bad input: rejected while tracing, before anything runs -------------------------------

def _trace(W, M, K, Kb, N, out_rows, comm=None, compute=C16):
    specs = [tl.TensorSpec((M, K), tl.float16), tl.TensorSpec((Kb, N), tl.float16),
             tl.TensorSpec((out_rows, N), tl.float16)]
    return gemm_reduce_scatter.trace(W, *specs, compute=compute, comm=comm or tl.CommSchedule(tile_m=8))


def test_rows_not_divisible_by_world_size():
    with pytest.raises(tl.CompilationError, match=r"A has 10 rows, which 3 ranks cannot split evenly"):
        _trace(3, 10, 8, 8, 16, 3)
    inputs = [{"a": np.zeros((10, 8), np.float16), "b": np.zeros((8, 16), np.float16),
               "out": np.zeros((3, 16), np.float16)} for _ in range(3)]
    with pytest.raises(tl.CompilationError, match="M must be divisible by the world size"):
        tl.simulate(gemm_reduce_scatter, 3, inputs, compute=C16, comm=tl.CommSchedule(tile_m=8))


def test_mismatched_inner_dimension():
    with pytest.raises(tl.CompilationError, match=r"A is \[12, 8\] but B is \[9, 16\] \(inner dimensions differ\)"):
        _trace(3, 12, 8, 9, 16, 4)


@pytest.mark.parametrize("a, b, says", [
    ([np.ones((4, 8))], [np.ones((4, 4))], r"a_slices\[0\] is \[4, 8\] but b_slices\[0\] is \[4, 4\]: rank 0 "
                                            r"multiplies \[M, Kr\] @ \[Kr, N\]"),
    ([np.ones((4, 8))] * 2, [np.ones((8, 4))] * 3, "one a and one b slice per rank, got 2 a_slices and 3 b_slices"),
    ([np.ones((4, 8)), np.ones((6, 8))], [np.ones((8, 4))] * 2, r"every rank's product is \[M, N\] of one M and N"),
    ([], [], "a_slices must be a non-empty list"),
    ([np.ones(8)], [np.ones((8, 4))], r"a_slices\[0\]: a 2-d array of numbers, got float64 \[8\]"),
])
def test_the_reference_refuses_slices_that_do_not_multiply(a, b, says):
    """numpy's gufunc ValueError on a K mismatch, and zip silently dropping the third b slice."""
    with pytest.raises(tl.InputError, match="gemm_reduce_scatter.reference: " + says):
        reference(a, b)


def test_the_reference_sums_every_ranks_product():
    a, b = [np.full((2, 3), r + 1.0) for r in range(2)], [np.ones((3, 2))] * 2
    np.testing.assert_array_equal(reference(a, b), np.full((2, 2), 9.0))


def test_wrong_output_shape():
    with pytest.raises(tl.CompilationError, match=r"out must be \[4, 16\] \(M/W rows\), got \[12, 16\]"):
        _trace(3, 12, 8, 8, 16, 12)


def test_copy_engine_pull_is_rejected():
    comm = tl.CommSchedule(engine="copy_engine", mode="pull")
    with pytest.raises(tl.ScheduleError, match=r"the owner adds them on SMs: use CommSchedule\(engine='copy_engine', "
                                               r"mode='push'\)") as info:
        _trace(2, 8, 8, 8, 16, 4, comm=comm)
    assert "gemm_reduce_scatter.py:" in str(info.value)    # points at the reduce_scatter call


def test_copy_engine_push_parts_and_plan():
    """engine='copy_engine': a copy-engine part that waits for the GEMM's chunk counters, copies
    each chunk into block `rank` of the owner's receive buffer and notifies it after every
    chunk; an SM part that sums this rank's rows once every peer's chunks are in. The plan of
    the copy part is what the runtime enqueues."""
    from tldsl.codegen import lower
    from tldsl.codegen import CeCopy, CeSignalWrite, CeWait
    W, Ms, K, N = 2, 40, 16, 24
    comm = tl.CommSchedule(engine="copy_engine", mode="push", tile_m=16)
    k = _trace(W, W * Ms, K, K, N, Ms, comm=comm, compute=tl.ComputeSchedule(tile=(8, 8, 16)))
    parts = {p.name: (p.engine, tuple(p.grid)) for p in k.parts}
    assert parts == {"gemm": ("sm", (10, 3)), "reduce_scatter": ("copy_engine", (1, 3)),
                     "reduce_scatter_sum": ("sm", (3,))}
    plan = lower(k, "reduce_scatter")
    acts = plan.actions[1]                      # rank 1 pushes rows [0, 40) of its partial to rank 0
    assert [type(a) for a in acts] == [CeWait, CeCopy, CeSignalWrite] * 3
    waits, copies, writes = acts[0::3], acts[1::3], acts[2::3]
    # chunk j covers partial rows [16 j, min(16 j + 16, 40)): producer tiles of 8 rows x 3 columns
    assert [(w.signal, w.slot, w.count) for w in waits] == [("reduce_scatter_ready", j, c) for j, c in
                                                              ((0, 6), (1, 6), (2, 3))]
    assert [(c.src, c.src_rank, c.dst, c.dst_rank, c.height) for c in copies] == \
        [("partial", 1, "reduce_scatter_recv", 0, h) for h in (16, 16, 8)]
    assert [c.dst_byte_offset for c in copies] == [(Ms + 16 * j) * N * 4 for j in range(3)]   # block 1 on rank 0 (f32)
    assert [(w.signal, w.rank, w.slot, w.value(2)) for w in writes] == \
        [("reduce_scatter_done", 0, 1, 3 + j) for j in (1, 2, 3)]            # launch 2: counts 4, 5, 6
    # the sum part is an SM kernel (waits: its own chunk's producers, then every peer's count)
    s = lower(k, "reduce_scatter_sum")
    assert s.waits == 2 and s.transfers == 1 and s.notifies == 0


# -- the collective on its own (the API other ops reuse) -----------------------------------

@tl.kernel
def plain_reduce_scatter(x, out, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    """out = reduce_scatter(x): the producer only copies x into the partial workspace."""
    M, N = x.shape
    BM, BN, _ = compute.tile
    partial = tl.local_buffer((M, N), tl.float32, "partial")
    rs = reduce_scatter(partial, out, comm, name="rs", producer_rows=BM, producers_per_row=tl.cdiv(N, BN))

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)), align_shift=rs.align_shift)
    def copy(pm, pn):
        tl.store(partial, (pm * BM, pn * BN), tl.load(x, (pm * BM, pn * BN), (BM, BN)))
        rs.notify_rows(pm * BM, tl.minimum(pm * BM + BM, M))


@pytest.mark.parametrize("W,rows,n,bm,tile_m,order,mode", [
    (3, 7, 19, 8, 16, "ring", "push"),        # producer tiles span segments, comm tile > segment
    (4, 20, 9, 16, 8, "ring", "pull"),        # comm tiles smaller than producer tiles, short last tile
    (5, 6, 40, 32, None, "full_mesh", "push"),
    (2, 33, 5, 8, 32, "full_mesh", "pull"),
])
def test_collective_alone(W, rows, n, bm, tile_m, order, mode):
    rng = np.random.default_rng(W)
    xs = [rng.standard_normal((W * rows, n)).astype(np.float32) for _ in range(W)]
    total = np.sum(xs, axis=0)
    inputs = [{"x": xs[r], "out": np.full((rows, n), np.nan, np.float32)} for r in range(W)]
    res = tl.simulate(plain_reduce_scatter, W, inputs, seed=2,
                      compute=tl.ComputeSchedule(tile=(bm, 16, 8), order="comm_aligned"),
                      comm=tl.CommSchedule(tile_m=tile_m, order=order, mode=mode))
    for r in range(W):
        np.testing.assert_allclose(res[r]["out"], total[r * rows:(r + 1) * rows], rtol=1e-5, atol=1e-5)


def test_collective_rejects_bad_arguments():
    @tl.kernel
    def bad(x, out, *, producer_rows: tl.constexpr = 8, comm: tl.CommSchedule = None):
        partial = tl.local_buffer(x.shape, tl.float32, "partial")
        rs = reduce_scatter(partial, out, comm, producer_rows=producer_rows)

        @tl.compute_part(grid=(1,))
        def noop(i):
            rs.notify_rows(0, 1)

    f32 = tl.float32
    with pytest.raises(tl.CompilationError, match="producer_rows must be a positive Python int, got 0"):
        bad.trace(2, tl.TensorSpec((8, 4), f32), tl.TensorSpec((4, 4), f32), producer_rows=0)
    with pytest.raises(tl.CompilationError, match=r"the 9 rows of 'partial' cannot be split evenly over 2 ranks"):
        bad.trace(2, tl.TensorSpec((9, 4), f32), tl.TensorSpec((4, 4), f32))
    with pytest.raises(tl.CompilationError, match=r"'out' must be \[4, 4\] .* got \[4, 5\]"):
        bad.trace(2, tl.TensorSpec((8, 4), f32), tl.TensorSpec((4, 5), f32))


# -- every synchronisation primitive is necessary ----------------------------------------------

def test_mutation_check_catches_every_deleted_primitive():
    from tldsl.testing.mutants import run
    caught, total, mutants = run(op_filter=["gemm_reduce_scatter"], seeds=1)
    missed = [f"{m.variant}: {m.primitive} #{m.index} -> {m.outcome}" for m in mutants if not m.caught]
    assert not missed, missed
    variants = {m.variant for m in mutants}
    assert {v.split()[0].rsplit("/tile_m", 1)[0] for v in variants} == {
        "sm/push/ring", "sm/pull/ring", "sm/push/full_mesh", "sm/pull/full_mesh", "copy_engine/push/ring"}
    assert any(v.split()[0].endswith("/reduce_in=epilogue") for v in variants)     # the GEMM's epilogue sum too
    assert caught == total > 0


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("partial_dtype", ["out", "f32"])
def test_copy_engine_sums_in_the_sm_schedules_order(W, partial_dtype):
    """A schedule changes how, never what: the copy-engine reduce-scatter's sum associates like
    the SM ring and full mesh, P[r] + (P[r+1] + (... + P[r-1])), so all agree to the last bit."""
    compute = tl.ComputeSchedule(tile=(8, 8, 8), order="row_major", stages=1, group_m=1)
    outs = []
    for comm in (tl.CommSchedule(engine="copy_engine", mode="push", tile_m=16),
                 tl.CommSchedule(tile_m=8, order="ring", mode="push", sms=1),
                 tl.CommSchedule(order="full_mesh", mode="pull", sms=2)):
        case = SPEC.make_case(np.random.default_rng(3), W, rows_per_rank=20, n=12, k_per_rank=9, compute=compute,
                              comm=comm, partial_dtype=partial_dtype)
        res = tl.simulate(gemm_reduce_scatter, W, case.inputs, seed=1, **case.kwargs)
        outs.append([res[r]["out"] for r in range(W)])
    for other in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outs[0], other))


@pytest.mark.parametrize("W", [2, 3, 4])
def test_epilogue_sum_agrees_with_every_schedule_to_the_last_bit(W):
    """reduce_in='epilogue': the GEMM adds what peers sent to its own tiles, in the SM schedules'
    order, its own term rounded to the partials' dtype as if stored: the same bits as the other
    schedules, for fp32 partials and for partials in the output's dtype."""
    compute = tl.ComputeSchedule(tile=(8, 8, 8), order="comm_aligned", stages=1, group_m=1)
    outs = {}
    for pdt in ("f32", "out"):
        for name, comm in (("epilogue", tl.CommSchedule(engine="copy_engine", mode="push", tile_m=8,
                                                        reduce_in="epilogue")),
                           ("ring", tl.CommSchedule(tile_m=8, order="ring", mode="push", sms=1))):
            case = SPEC.make_case(np.random.default_rng(5), W, rows_per_rank=16, n=12, k_per_rank=9,
                                  compute=compute, comm=comm, partial_dtype=pdt)
            res = tl.simulate(gemm_reduce_scatter, W, case.inputs, seed=2, **case.kwargs)
            outs[pdt, name] = [np.asarray(res[r]["out"], np.float32) for r in range(W)]
            for r in range(W):
                np.testing.assert_allclose(outs[pdt, name][r], case.expected[r]["out"], rtol=case.rtol, atol=case.atol)
    for pdt in ("f32", "out"):
        assert all(np.array_equal(a, b) for a, b in zip(outs[pdt, "epilogue"], outs[pdt, "ring"]))


def test_epilogue_sum_parts_and_rules(monkeypatch):
    """No sum part: the copy-engine part pushes, the GEMM's own-row tiles wait for every peer's
    rows and add them. It needs whole GEMM tiles per rank and the copy-engine push schedule."""
    W, Ms, K, N = 2, 16, 16, 24
    comm = tl.CommSchedule(engine="copy_engine", mode="push", tile_m=8, reduce_in="epilogue")
    compute = tl.ComputeSchedule(tile=(8, 8, 16), order="comm_aligned", group_m=2)   # a rank's 2 tile rows: a group
    k = _trace(W, W * Ms, K, K, N, Ms, comm=comm, compute=compute)
    assert {p.name: p.engine for p in k.parts} == {"gemm": "sm", "reduce_scatter": "copy_engine"}
    with pytest.raises(tl.ScheduleError, match=r"M/W = 12 is not a multiple of the producer tile's 8 rows") as info:
        _trace(W, W * 12, K, K, N, 12, comm=comm, compute=compute)
    assert "gemm_reduce_scatter.py:" in str(info.value)
    with pytest.raises(tl.ScheduleError, match=r"reduce_in='epilogue' .* engine='copy_engine', mode='push'"):
        tl.CommSchedule(engine="sm", mode="push", reduce_in="epilogue")
    # an own tile taken early holds its CTA while it waits (on a GPU running the GEMM on fewer CTAs
    # than tiles, the tiles its peers' copies need may never start): refused where ranks would wait
    # for each other in a cycle — groups straddling two ranks' rows, each rank reaching an own tile
    # before the other's last; or, at three ranks, row by row (rank 1's copy engine pushes rank 2's
    # rows, computed after its own, before rank 0's)
    for bad, W_, cycle in (
            (compute.with_(group_m=8), W, ("rank 1 reaches its own tile row 2 before tile row 1, which its copy of "
                                           "rank 0's rows waits for", "rank 0 reaches its own tile row 0 before")),
            (compute.with_(group_m=3), W, ("rank 1 reaches its own tile row 2 before tile row 1",)),
            (compute.with_(order="swizzled", group_m=8), W, ("rank 1 reaches its own tile row 2",)),
            (compute.with_(order="row_major"), 3, ("rank 1 reaches its own tile row 2 before tile row 5, which its "
                                                   "copy of rank 0's rows waits for",))):
        with pytest.raises(tl.CompilationError, match=r"reduce_in='epilogue' with ComputeSchedule\(.*\) and "
                                                      r"CommSchedule\(.*\) can hang: a tile of a rank's own rows") \
                as info:
            _trace(W_, W_ * Ms, K, K, N, Ms, comm=comm, compute=bad)
        assert all(c in str(info.value) for c in cycle), str(info.value)
        assert "gemm_reduce_scatter.py:" in str(info.value) and "reduce_in='comm'" in str(info.value)
    # at two ranks, an order walking a rank's rows at a time never hangs (each rank pushes one peer,
    # and the rank whose rows come first waits for nobody): accepted, and the simulator, running
    # the GEMM on one slot, finds no deadlock
    for order, group in (("row_major", 8), ("swizzled", 2)):
        alike = compute.with_(order=order, group_m=group)
        case = SPEC.make_case(np.random.default_rng(1), W, rows_per_rank=Ms, n=N, k_per_rank=K, compute=alike,
                              comm=comm)
        for slots in (None, 1):
            res = tl.simulate(gemm_reduce_scatter, W, case.inputs, options=tl.SimOptions(compute_slots=slots),
                              **case.kwargs)
            for r in range(W):
                np.testing.assert_allclose(np.asarray(res[r]["out"], np.float32), case.expected[r]["out"],
                                           rtol=case.rtol, atol=case.atol)
    # ... and the refused orders do deadlock there (traced with the rule switched off)
    import tldsl.collectives as coll
    monkeypatch.setattr(coll, "own_rows_waiting_in_a_cycle", lambda *a, **k: None)
    for bad, W_ in ((compute.with_(group_m=8), W), (compute.with_(order="row_major"), 3)):
        case = SPEC.make_case(np.random.default_rng(0), W_, rows_per_rank=Ms, n=N, k_per_rank=K, compute=bad,
                              comm=comm)
        with pytest.raises(tl.DeadlockError):
            tl.simulate(gemm_reduce_scatter, W_, case.inputs, options=tl.SimOptions(compute_slots=1), **case.kwargs)
    monkeypatch.undo()
    W3 = 3                                 # comm_aligned: rank r starts on rank r+1's rows, ends on its own
    _trace(W3, W3 * Ms, K, K, N, Ms, comm=comm, compute=compute.with_(group_m=1))
    sim = tl.simulate(gemm_reduce_scatter, W3, SPEC.make_case(np.random.default_rng(0), W3, rows_per_rank=Ms, n=N,
                      k_per_rank=K, compute=compute.with_(group_m=1), comm=comm).inputs,
                      compute=compute.with_(group_m=1), comm=comm)       # one CTA a GEMM (the default): no deadlock
    assert sim.steps
    with pytest.raises(tl.ScheduleError, match=r"reduce_in='sm'"):
        tl.CommSchedule(reduce_in="sm")


@tl.kernel
def users_gemm_rs(a, b, out, *, shift=None, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    """A user's GEMM + ReduceScatter written with the public collective (not the op library's)."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile
    partial = tl.local_buffer((M, N), tl.float32, "partial")
    rs = reduce_scatter(partial, out, comm, producer_rows=BM, producers_per_row=tl.cdiv(N, BN))

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)), align_shift=rs.align_shift if shift is None else shift)
    def gemm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        rs.store_tile(acc, pm * BM, pn * BN)


def test_the_collective_refuses_an_epilogue_sum_whose_ranks_wait_in_a_cycle():
    """The op library's gemm_reduce_scatter refused an order in which the ranks' own tiles wait for
    each other in a cycle (reduce_in='epilogue'), but a user's program calling the collective got
    the simulator's DeadlockError over the collective's internal parts. The check is now the
    collective's (the op's too): a ScheduleError naming the schedules and the cycle, at the user's
    store_tile line, when the kernel is traced — and the orders it takes still run."""
    W, M, K, N = 4, 128, 24, 24
    rng = np.random.default_rng(0)
    ins = [{"a": rng.standard_normal((M, K)).astype(np.float32), "b": rng.standard_normal((K, N)).astype(np.float32),
            "out": np.full((M // W, N), np.nan, np.float32)} for _ in range(W)]
    comm = tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue")
    row_major = tl.ComputeSchedule(tile=(16, 16, 8))
    specs = [tl.TensorSpec(v.shape, tl.float32) for v in ins[0].values()]
    for run in (lambda: tl.simulate(users_gemm_rs, W, ins, compute=row_major, comm=comm),
                lambda: users_gemm_rs.trace(W, *specs, compute=row_major, comm=comm)):
        with pytest.raises(tl.ScheduleError, match=r"reduce_in='epilogue' with ComputeSchedule\(.*order='row_major'.*\) "
                                                   r"and CommSchedule\(.*\) can hang") as info:
            run()
        assert info.value.loc.filename == __file__ and "rs.store_tile(acc" in info.value.loc.source
        assert "rank 1 reaches its own tile row 2 before tile row 7" in str(info.value)
    # the op refuses it with the same check, at its own store_tile line
    with pytest.raises(tl.ScheduleError, match=r"row_major.* can hang") as info:
        gemm_reduce_scatter.trace(W, *specs, compute=row_major, comm=comm)
    assert info.value.loc.filename.endswith("gemm_reduce_scatter.py")
    # the order checked is the part's: comm_aligned with the handle's shift runs; another shift
    # (every rank reaching its own rows first) is refused
    aligned = row_major.with_(order="comm_aligned", group_m=1)
    res = tl.simulate(users_gemm_rs, W, ins, compute=aligned, comm=comm)
    want = sum(i["a"] @ i["b"] for i in ins)
    for r in range(W):
        np.testing.assert_allclose(res[r]["out"], want[r * M // W:(r + 1) * M // W], rtol=1e-4, atol=1e-4)
    with pytest.raises(tl.ScheduleError, match="can hang"):
        users_gemm_rs.trace(W, *specs, compute=aligned, comm=comm, shift=0)


def test_all_gather_has_nothing_to_reduce():
    from tldsl.ops.allgather_gemm import allgather_gemm
    comm = tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue")
    with pytest.raises(tl.ScheduleError, match="all_gather has nothing to reduce"):
        allgather_gemm.trace(2, tl.TensorSpec((16, 16), tl.float16), tl.TensorSpec((16, 16), tl.float16),
                             tl.TensorSpec((32, 16), tl.float16), compute=tl.ComputeSchedule(tile=(8, 8, 8)), comm=comm)


def test_the_cycle_named_is_one_of_waiting_ranks_and_the_shortest_through_its_first_rank():
    from tldsl.collectives import _a_cycle
    assert _a_cycle({0: {1: ()}, 1: {0: ()}}) == [0, 1]
    assert _a_cycle({0: {1: ()}, 1: {2: (), 3: ()}, 2: {1: ()}, 3: {0: ()}}) == [0, 1, 3]
    assert _a_cycle({0: {}, 1: {2: ()}, 2: {1: ()}}) == [1, 2]           # rank 0 waits for nobody
    assert _a_cycle({0: {1: ()}, 1: {2: ()}, 2: {}}) is None


@pytest.mark.parametrize("W", [1, 2, 3])
def test_weights_stored_as_a_linear_layer_give_the_same_results(W):
    """``weights="nk"`` (B stored [N, K], a torch Linear's weight, read as ``tl.trans`` of its tile):
    AllGather+GEMM and GEMM+ReduceScatter give exactly what they give on the transposed [K, N] copy,
    and their tile programs go to the GEMM recipe with B K-major."""
    from tldsl.codegen.pipeline import lower
    from tldsl.ops.allgather_gemm import allgather_gemm
    rng = np.random.default_rng(W)
    compute = tl.ComputeSchedule(tile=(16, 16, 16), stages=2)
    Ms, K, N = 24, 40, 32
    a = [rng.standard_normal((Ms, K)).astype(np.float32) for _ in range(W)]
    b = rng.standard_normal((K, N)).astype(np.float32)
    c = np.full((W * Ms, N), np.nan, np.float32)
    kn = tl.simulate(allgather_gemm, W, [dict(a=a[r], b=b, c=c) for r in range(W)], compute=compute)
    nk = tl.simulate(allgather_gemm, W, [dict(a=a[r], b=np.ascontiguousarray(b.T), c=c) for r in range(W)],
                     compute=compute, weights="nk")
    for r in range(W):
        np.testing.assert_array_equal(kn[r]["c"], nk[r]["c"])
    x = [rng.standard_normal((W * 16, K)).astype(np.float32) for _ in range(W)]
    bs = [rng.standard_normal((K, N)).astype(np.float32) for _ in range(W)]
    out = np.full((16, N), np.nan, np.float32)
    kn = tl.simulate(gemm_reduce_scatter, W, [dict(a=x[r], b=bs[r], out=out) for r in range(W)], compute=compute)
    nk = tl.simulate(gemm_reduce_scatter, W, [dict(a=x[r], b=np.ascontiguousarray(bs[r].T), out=out)
                                              for r in range(W)], compute=compute, weights="nk")
    for r in range(W):
        np.testing.assert_array_equal(kn[r]["out"], nk[r]["out"])
    bf = tl.bfloat16
    k = allgather_gemm.trace(W, tl.TensorSpec((256, 256), bf), tl.TensorSpec((384, 256), bf),
                             tl.TensorSpec((W * 256, 384), bf), weights="nk")
    lg = lower(k, "gemm")
    assert type(lg).__name__ == "LoweredGemm" and lg.config.b_k_major
    with pytest.raises(tl.CompilationError, match=r"B is \[384, 128\] \(weights='nk': \[N, K\]\)"):
        allgather_gemm.trace(W, tl.TensorSpec((256, 256), bf), tl.TensorSpec((384, 128), bf),
                             tl.TensorSpec((W * 256, 384), bf), weights="nk")
