"""``CommSchedule(own_rows='compute')``: AllGather+GEMM's own rows moved by parts fused into the
compute part — a schedule choice the simulator executes and codegen lowers into the GEMM
(codegen/plan/fused_rows.py), instead of lowering options the simulator never saw."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tldsl as tl
from tldsl.codegen import LoweringError, lower, lower_all
from tldsl.collectives import all_gather
from tldsl.ir.semantics import wait_target
from tldsl.ops.allgather_gemm import allgather_gemm, fused_all_gather_matmul, reference

S = tl.TensorSpec
PULL = tl.CommSchedule(engine="copy_engine", mode="pull", own_rows="compute")
PUSH = tl.CommSchedule(engine="copy_engine", mode="push", own_rows="compute")
GEMM_PUSH = tl.CommSchedule(engine="compute", mode="push", own_rows="compute")


@settings(max_examples=25, deadline=None)
@given(W=st.integers(1, 4), tiles=st.integers(1, 3), k=st.integers(1, 56), n=st.integers(1, 40),
       bm=st.sampled_from([16, 32]), which=st.sampled_from(["pull", "push", "push sliced", "gemm push"]),
       seed=st.integers(0, 3))
def test_fused_rows_simulate_to_the_reference(W, tiles, k, n, bm, which, seed):
    """Every variant, two launches, any interleaving: C and the gathered rows (the landing
    buffer, or the output the GEMM stores them into) equal numpy's."""
    comm = {"pull": PULL, "push": PUSH, "push sliced": PUSH.with_(col_tile=16), "gemm push": GEMM_PUSH}[which]
    rng = np.random.default_rng(seed)
    Ms = tiles * bm
    shards = [rng.integers(-2, 3, (Ms, k)).astype(np.float16) for _ in range(W)]
    b = rng.integers(-2, 3, (k, n)).astype(np.float16)
    got = fused_all_gather_matmul(shards, b, compute=tl.ComputeSchedule(tile=(bm, 16, 16)), comm=comm, seed=seed,
                                  options={"launches": 2})
    want_a, want_c = np.concatenate(shards), reference(shards, b)
    for a_gathered, c in got:
        assert np.array_equal(a_gathered, want_a)
        assert np.array_equal(c.astype(np.float32), want_c)      # small integers: exact


def _trace(comm, W=2, Ms=256, K=512, N=384, **sched):
    compute = tl.ComputeSchedule(tile=(128, 128, 64), order="comm_aligned", group_m=Ms // 128, **sched)
    return allgather_gemm.trace(W, S((Ms, K), tl.bfloat16), S((K, N), tl.bfloat16), S((W * Ms, N), tl.bfloat16),
                                compute=compute, comm=comm)


@pytest.mark.parametrize("W", [1, 2, 4])
def test_each_schedule_lowers_to_its_gemm_variant(W):
    """The schedule picks the variant; the parts it fused are no kernels of their own."""
    kinds = {}
    for name, comm in (("pull", PULL), ("push", PUSH), ("gemm push", GEMM_PUSH)):
        ir = _trace(comm, W=W)
        lg = lower(ir, "gemm")
        kinds[name] = (lg.own_rows, lg.gather_rows, lg.push_rows)
        fused = [p.name for p in ir.parts if p.fused]
        assert fused and set(lower_all(ir)) == {p.name for p in ir.parts} - set(fused)
        for part in fused:
            with pytest.raises(LoweringError, match="fused into compute part 'gemm'"):
                lower(ir, part)
    assert kinds == {"pull": (True, False, False), "push": (False, True, False),
                     "gemm push": (False, True, W > 1)}
    plain = lower(_trace(tl.CommSchedule(engine="copy_engine", mode="push"), W=W), "gemm")
    assert (plain.own_rows, plain.gather_rows, plain.push_rows) == (False, False, False)


def test_a_fused_part_the_gemm_does_not_implement_is_refused_at_its_line():
    """A fused part whose events are not one of the GEMM's protocols (here: this rank's rows
    notified before they are copied) is refused, naming the part and the first event that
    differs."""

    @tl.kernel
    def odd(a: tl.Symmetric, b, c, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
        W = tl.world_size()
        Ms, K = a.shape
        BM, BN, BK = compute.tile
        a_full = tl.symmetric_buffer((W * Ms, K), a.dtype, "a_gathered")
        ready = tl.signal("ready", W, scope="symmetric")

        @tl.comm_part(grid=(W - 1,), name="push", engine="copy_engine", lanes=1)
        def push(i):
            me = tl.rank()
            peer = (me + W - 1 - i) % W
            tl.rank_copy_data(a_full.at(peer), (me * Ms, 0), a, (0, 0), (Ms, K))
            tl.rank_notify(ready, me, peer)

        @tl.comm_part(grid=(1,), name="own", fused=True)
        def own(_):
            me = tl.rank()
            tl.rank_notify(ready, me)                   # before the copy: not what the GEMM does
            tl.rank_copy_data(a_full, (me * Ms, 0), a, (0, 0), (Ms, K))
        out = tl.local_buffer((W * Ms, K), a.dtype, "a_gathered_out")

        @tl.comm_part(grid=(W,), name="out", fused=True)
        def copy_out(p):
            tl.rank_wait(ready, p)
            tl.rank_copy_data(out, (p * Ms, 0), a_full, (p * Ms, 0), (Ms, K))

        @tl.compute_part(grid=(tl.cdiv(W * Ms, BM), tl.cdiv(b.shape[1], BN)), align_shift=0)
        def gemm(pm, pn):
            tl.rank_wait(ready, pm * BM // Ms)
            acc = tl.fragment((BM, BN), tl.float32)
            for k in tl.range(0, K, BK):
                acc += tl.dot(tl.load(a_full, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
            tl.store(c, (pm * BM, pn * BN), acc)
    ir = odd.trace(2, S((128, 64), tl.float16), S((64, 128), tl.float16), S((256, 128), tl.float16),
                   compute=tl.ComputeSchedule(tile=(128, 128, 64)), comm=tl.CommSchedule(engine="copy_engine"))
    with pytest.raises(LoweringError, match="fused part 'own' is not the copy of this rank's rows") as e:
        lower(ir, "gemm")
    assert "test_fused_rows.py" in str(e.value)


def test_schedules_that_cannot_be_fused_are_refused_before_anything_runs():
    with pytest.raises(tl.ScheduleError, match="own_rows='compute' fuses"):
        tl.CommSchedule(engine="sm", own_rows="compute")
    with pytest.raises(tl.ScheduleError, match="stages whole shards"):
        tl.CommSchedule(engine="copy_engine", mode="pull", col_tile=64, own_rows="compute")
    with pytest.raises(tl.ScheduleError, match="needs mode='push' and own_rows='compute'"):
        tl.CommSchedule(engine="compute", mode="pull", own_rows="compute")
    with pytest.raises(tl.ScheduleError, match="choose one of"):
        tl.CommSchedule(own_rows="gemm")
    with pytest.raises(tl.ScheduleError, match="whole tiles"):
        _trace(PULL, Ms=200)
    with pytest.raises(tl.ScheduleError, match="without thread-block clusters"):
        _trace(PUSH, cluster=(2, 1))
    from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
    with pytest.raises(tl.ScheduleError, match="reduce_scatter sums every rank's rows"):
        gemm_reduce_scatter.trace(2, S((256, 64), tl.float16), S((64, 128), tl.float16), S((128, 128), tl.float16),
                                  compute=tl.ComputeSchedule(tile=(128, 128, 64)),
                                  comm=tl.CommSchedule(engine="copy_engine", mode="push", own_rows="compute"))


def test_a_lagged_wait_is_for_an_earlier_launch():
    """``lag``: the wait's target is the one of launch ``launch - lag`` (none before it), in the
    simulator, the copy-engine plan and the generated C++ alike (which must not wrap)."""
    from tldsl.codegen.rules.primitives import wait_target_formula
    assert [wait_target(1, L, lag=1) for L in (1, 2, 3)] == [0, 1, 2]
    assert [wait_target(2, L, per_launch=4, lag=2) for L in (1, 2, 3, 4)] == [0, 0, 2, 6]
    assert wait_target(1, 3) == 3 and wait_target(3, 1, epoch=False, lag=0) == 3
    cpp = wait_target_formula("1", True, None, lag=1)
    assert cpp == "(launch > 1ull ? (unsigned long long)(1) * (launch - 2ull) + (unsigned long long)(1) : 0ull)"
    for launch in (1, 2, 5):        # the C++ expression evaluated as unsigned 64-bit arithmetic
        expr = cpp.replace("(unsigned long long)", "").replace("ull", "").replace("launch", str(launch))
        cond, rest = expr[1:-1].split(" ? ")
        then, other = rest.split(" : ")
        assert (eval(then) if eval(cond) else eval(other)) == wait_target(1, launch, lag=1)
    with pytest.raises(tl.CompilationError, match="lag must be an int >= 0"):
        @tl.kernel
        def bad(x: tl.Symmetric):
            s = tl.signal("s", 2, scope="symmetric")

            @tl.comm_part(grid=(1,), engine="copy_engine")
            def part(_):
                tl.rank_wait(s, 0, lag=-1)
        bad.trace(2, S((8, 8), tl.float16))


@tl.kernel
def shifted_allgather_gemm(a: tl.Symmetric, b, c, *, shift: tl.constexpr = 0, compute: tl.ComputeSchedule = None,
                           comm: tl.CommSchedule = None):
    """allgather_gemm with its compute part's ``align_shift`` given."""
    W = tl.world_size()
    Ms, K = a.shape
    N = b.shape[1]
    M = W * Ms
    BM, BN, BK = compute.tile
    a_full = tl.symmetric_buffer((M, K), a.dtype, "a_gathered")
    gathered = all_gather(a, a_full, comm, name="gather_a")

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)), align_shift=shift)
    def gemm(pm, pn):
        r0, c0 = pm * BM, pn * BN
        gathered.wait_rows(r0, tl.minimum(r0 + BM, M), then_cols=True)
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            gathered.wait_cols(r0, tl.minimum(r0 + BM, M), k, BK)
            acc += tl.dot(tl.load(a_full, (r0, k), (BM, BK)), tl.load(b, (k, c0), (BK, BN)))
        tl.store(c, (r0, c0), acc)


@pytest.mark.parametrize("W", [2, 4])
def test_a_pushing_gemm_takes_an_align_shift_that_is_a_multiple_of_the_world_size(W):
    """Found by a helper's round: the pushing GEMM (push_rows) compared the raw ``align_shift`` with
    0, so ``align_shift=W`` — the same tile order as 0 (``order_align_shift``) — was refused. Now it
    lowers to the same source as 0; a shift that starts on a peer's rows is still refused."""
    Ms, K, N = 256, 512, 384

    def lowered(shift):
        compute = tl.ComputeSchedule(tile=(128, 128, 64), order="comm_aligned", group_m=Ms // 128)
        ir = shifted_allgather_gemm.trace(W, S((Ms, K), tl.bfloat16), S((K, N), tl.bfloat16),
                                          S((W * Ms, N), tl.bfloat16), shift=shift, compute=compute, comm=GEMM_PUSH)
        return lower(ir, "gemm")

    zero = lowered(0)
    assert zero.push_rows
    for shift in (W, 3 * W, -W):
        assert lowered(shift).source == zero.source, shift
    with pytest.raises(LoweringError, match=f"starting at this rank's rows .*align_shift={W + 1}, group_m=2"):
        lowered(W + 1)
