"""Tiles held in registers (codegen/plan/held.py, codegen/rules/held.py): which values the plan
holds and which it leaves in shared memory, the chunk-order code, and — run on CPU threads —
the same results as the simulator for the shapes, dtypes and statements the rule takes."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

import tldsl as tl
from tldsl.bench import general_programs as gp
from tldsl.codegen import lower
from tldsl.codegen.plan.held import HELD_BYTES
from tldsl.codegen.rules.tile_ops import BARRIER
from tldsl.testing.program_tolerance import assert_agrees, reference_with_tolerances

S = tl.TensorSpec
ROWS = tl.ComputeSchedule(tile=(16, 256, 16))
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ missing (CPU emulation of generated kernels)")


def _held(lk) -> list[str]:
    return list(lk.held)


@tl.kernel
def twice_used(x, y1, y2, *, compute: tl.ComputeSchedule = None):
    """An element value stored once and read by two stores (held, not recomputed)."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        u = tl.load(x, (pm * BM, pn * BN), (BM, BN)) * 3.0
        tl.store(y1, (pm * BM, pn * BN), u)
        tl.store(y2, (pm * BM, pn * BN), u + 1.0)


@tl.kernel
def widen(x, y, *, compute: tl.ComputeSchedule = None):
    """A 16-bit tile stored as f32 (one chunk width for both: 8)."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        t = tl.load(x, (pm * BM, pn * BN), (BM, BN))
        tl.store(y, (pm * BM, pn * BN), tl.cast(t, tl.float32) * 0.5)


@tl.kernel
def int_rows(q, s, y, *, compute: tl.ComputeSchedule = None):
    """i32 tiles in registers: a row sum and the rows minus their maximum."""
    M, N = q.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        t = tl.load(q, (pm * BM, 0), (BM, N))
        tl.store(s, (pm * BM, 0), tl.expand_dims(tl.sum(t, 1), 1))
        tl.store(y, (pm * BM, 0), t - tl.expand_dims(tl.max(t, 1), 1))


@tl.kernel
def cube_rows(x, y, *, compute: tl.ComputeSchedule = None):
    """A 3-D tile: each innermost row scaled by its maximum magnitude."""
    A, B, N = x.shape
    BM, _, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(A, 2),))
    def part(pa):
        t = tl.cast(tl.load(x, (pa * 2, 0, 0), (2, B, N)), tl.float32)
        m = tl.expand_dims(tl.max(tl.abs(t), 2), 2)
        tl.store(y, (pa * 2, 0, 0), tl.cast(t / (m + 1.0), y.dtype))


@tl.kernel
def into_fragment(x, y, *, compute: tl.ComputeSchedule = None):
    """A held tile written into a fragment (its slot), which a loop then adds to."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        acc = tl.fragment((BM, BN), tl.float32)
        t = tl.cast(tl.load(x, (pm * BM, 0), (BM, BN)), tl.float32)
        acc.write(t * t)
        for c in tl.range(BN, N, BN):
            u = tl.cast(tl.load(x, (pm * BM, c), (BM, BN)), tl.float32)
            acc.write(acc.read() + u * u)
        tl.store(y, (pm * BM, 0), acc.read())


@tl.kernel
def gathered_dot(a, b, y, *, compute: tl.ComputeSchedule = None):
    """A loaded tile read by a dot and by a broadcast: it stays in shared memory."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        ta = tl.load(a, (pm * BM, 0), (BM, K))
        tb = tl.load(b, (0, pn * BN), (K, BN))
        tl.store(y, (pm * BM, pn * BN), tl.dot(ta, tb) + tl.expand_dims(tl.sum(tl.cast(ta, tl.float32), 1), 1))


def _trace(fn, specs, tile, **kw):
    return fn.trace(1, *specs, compute=tl.ComputeSchedule(tile=tile), **kw)


def test_a_whole_row_softmax_holds_its_row_and_its_exp():
    """x's row and e = exp(x - max) in registers (the cast read twice is computed again; the exp
    is not: :func:`codegen.plan.general._group_threads` takes the 256-thread groups that hold
    it over four groups of 128 computing it twice), so the arena is the reductions' few
    floats and the CTA takes two tasks of 256 threads."""
    k = gp.row_softmax.trace(1, S((16384, 8192), tl.float16), S((16384, 8192), tl.float16), compute=ROWS, rows=1)
    lk = lower(k, "part")
    assert lk.threads == 256 and lk.groups == 2, lk.describe()
    assert len(lk.held) == 2 and "1x8192 f16 (load" in lk.held[0] and "64 B a thread" in lk.held[0]
    assert "1x8192 f32 (ewise" in lk.held[1] and "128 B a thread" in lk.held[1]
    # max, sum and 1 / sum in every thread's registers: the slots are the reductions' warp results
    assert len(lk.replicated) == 3 and "f32 (reduce" in lk.replicated[0] and "f32 (ewise" in lk.replicated[2]
    assert all("reduce" in s for s in lk.slots) and len(lk.slots) == 2
    # a barrier a reduction, none after the exp, the reciprocal, the store or at the task's end
    loop = lk.source.index("for (int task")
    assert lk.source.count(BARRIER) == 2 and lk.source.index(BARRIER) > loop, lk.source
    assert "Chunk<tldsl::comm::f16, 8> hold" in lk.source and "Chunk<float, 8> hold" in lk.source
    # one row a task: its reductions go thread, warp (shuffles), group — no partial a chunk
    assert lk.source.count("over the row in registers ->") == 2 and "chunks of 8 from registers" in lk.source
    assert "over the rows' chunks" not in lk.source
    # every held chunk is read at an index the unrolled loops make constant
    assert "#pragma unroll\n" in lk.source and "get(v" in lk.source


@pytest.mark.parametrize("n,threads,groups", [(2048, 64, 8), (4096, 128, 4), (8192, 256, 2)])
def test_the_group_is_as_large_as_holding_the_exp_needs(n, threads, groups):
    """Rows of 2048 to 8192: the fewest threads a task that hold the row and its exp (48
    registers a thread at most), so the exp is computed once, and as many tasks a CTA as fit."""
    k = gp.row_softmax.trace(1, S((4096, n), tl.float16), S((4096, n), tl.float16), compute=ROWS, rows=1)
    lk = lower(k, "part")
    assert (lk.threads, lk.groups) == (threads, groups), lk.describe()
    assert lk.source.count("tldsl::gen::exp_(") == 1 and any("f32 (ewise" in h for h in lk.held)


def test_rms_norms_hold_the_row_and_the_weights():
    x, w = S((16384, 8192), tl.float16), S((1, 8192), tl.float16)
    lk = lower(gp.rms_norm.trace(1, x, w, x, compute=ROWS, rows=1), "part")
    assert len(lk.held) == 2 and lk.threads == 256, lk.describe()
    lk = lower(gp.add_rms_norm.trace(1, x, x, w, x, x, compute=ROWS, rows=1), "part")
    assert len(lk.held) >= 2 and lk.threads == 256, lk.describe()


def test_values_read_other_than_element_for_element_stay_in_shared_memory():
    """A dot operand, or a tile read through a broadcast (another shape), is not held."""
    lk = lower(_trace(gathered_dot, [S((64, 32), tl.float16), S((32, 64), tl.float16), S((64, 64), tl.float32)],
                      (64, 64, 32)), "part")
    assert not lk.held and "hold" not in lk.source


def test_rows_not_a_multiple_of_the_chunk_and_tiles_over_the_budget_are_not_held():
    """Whole rows of 300 f16 (not a multiple of the 8-element chunk) stay in shared memory; so do
    16 KB tiles over 32 threads (512 B a thread, over HELD_BYTES)."""
    lk = lower(gp.row_softmax.trace(1, S((37, 300), tl.float16), S((37, 300), tl.float16), compute=ROWS, rows=1),
               "part")
    assert not lk.held and "hold" not in lk.source, lk.describe()
    lk = lower(_trace(twice_used, [S((64, 512), tl.float32)] * 3, (8, 256, 16)), "part", threads=32)
    assert not lk.held and 8 * 256 * 4 // 32 > HELD_BYTES, lk.describe()
    assert lower(_trace(twice_used, [S((64, 512), tl.float32)] * 3, (8, 256, 16)), "part", threads=128).held


def test_int_tiles_stay_in_shared_memory():
    """i32 tiles are not held (codegen/plan/held.py: a ptxas fold of a held chunk's negated row
    maximum dropped a negation on the H200); the GPU test below runs the program that showed it."""
    k = _trace(int_rows, [S((19, 96), tl.int32), S((19, 1), tl.int32), S((19, 96), tl.int32)], (8, 128, 16))
    assert not lower(k, "part").held


@tl.kernel
def negated_row_max(x0, y0):
    @tl.compute_part(grid=(1,))
    def part(pm):
        t = tl.load(x0, (0, 0), (32, 32))
        tl.store(y0, (0,), tl.max(-t, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,npdt", [(tl.int32, np.int32), (tl.float32, np.float32)])
@pytest.mark.parametrize("shape", [(23, 26), (32, 32)])
def test_a_negated_row_max_on_the_gpu(dtype, npdt, shape):
    """The row maximum of -x, i32 (shared memory) and f32 (held): as the simulator says — the
    H200 once answered the row maximum of x for i32 tiles held in registers."""
    from tldsl.runtime.gpu import gpu_available
    if not gpu_available():
        pytest.skip("needs an sm_90 GPU with torch and cuda-python")
    x = np.random.default_rng(0).integers(1, 9, shape).astype(npdt)
    ins = [{"x0": x, "y0": np.full(shape[0], -7, npdt)}]
    want = tl.simulate(negated_row_max, 1, ins)[0]["y0"]
    assert np.array_equal(np.asarray(tl.run(negated_row_max, 1, ins)[0]["y0"]), want)


@tl.kernel
def nan_row_extrema(x0, y0, y1):
    @tl.compute_part(grid=(1,))
    def part(pm):
        t = tl.load(x0, (0, 0), (16, 64))
        tl.store(y0, (0,), tl.max(t, 1))
        tl.store(y1, (0,), tl.min(t * 2.0, 1))


@pytest.mark.gpu
def test_a_row_max_and_min_with_nans_on_the_gpu():
    """numpy's NaN-propagating maximum and minimum (f32: one max.NaN / min.NaN instruction each)
    over held rows with a NaN in some of them, one at a chunk's first element, one at its last."""
    from tldsl.runtime.gpu import gpu_available
    if not gpu_available():
        pytest.skip("needs an sm_90 GPU with torch and cuda-python")
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    x[3, 0] = x[7, 63] = x[11, 20] = np.nan
    ins = [{"x0": x, "y0": np.full(16, 5, np.float32), "y1": np.full(16, 5, np.float32)}]
    assert lower(nan_row_extrema.trace(1, S((16, 64), tl.float32), S((16,), tl.float32), S((16,), tl.float32)),
                 "part").held
    want, got = tl.simulate(nan_row_extrema, 1, ins)[0], tl.run(nan_row_extrema, 1, ins)[0]
    for k in ("y0", "y1"):
        assert np.array_equal(np.asarray(got[k]), want[k], equal_nan=True), k
    assert np.isnan(want["y0"][[3, 7, 11]]).all()


def test_a_value_rounded_to_16_bits_and_stored_is_converted_once():
    """``tl.cast(e, f16)`` stored into an f16 tensor converts ``e`` once (its rounding to f16 and
    back, then to f16 again, cost two more instructions an element)."""
    k = gp.row_softmax.trace(1, S((64, 8192), tl.float16), S((64, 8192), tl.float16), compute=ROWS, rows=1)
    src = lower(k, "part").source
    puts = re.findall(r"put<tldsl::comm::f16>\((\w+)\)", src) + re.findall(r"put<tldsl::comm::f16>\(\(float\)\((\w+)\)\)", src)
    assert puts, src
    for v in puts:
        definition = re.search(rf"const float {v} = (.*);", src).group(1)
        assert "round_f16" not in definition, definition


def test_loads_inside_a_loop_are_not_held():
    """The load before the loop is held (its fragment write runs in chunk order); the one in the
    loop stays a shared-memory slot, as does the fragment the loop reads."""
    lk = lower(_trace(into_fragment, [S((32, 512), tl.float16), S((32, 128), tl.float32)], (16, 128, 16)), "part")
    assert len(lk.held) == 1 and "(load" in lk.held[0], lk.describe()
    assert sum("(load" in s for s in lk.slots) == 1 and any("frag_alloc" in s for s in lk.slots), lk.describe()
    assert "write fragment" in lk.source and ", in chunk order" in lk.source


CASES = [
    pytest.param(gp.row_softmax, lambda M, N: [S((M, N), tl.float16)] * 2, (37, 304), {"rows": 1}, id="softmax-rows1"),
    pytest.param(gp.row_softmax, lambda M, N: [S((M, N), tl.bfloat16)] * 2, (37, 304), {"rows": 3}, id="softmax-rows3"),
    pytest.param(gp.rms_norm, lambda M, N: [S((M, N), tl.float16), S((1, N), tl.float16), S((M, N), tl.float16)],
                 (29, 520), {"rows": 2}, id="rmsnorm-rows2"),
    pytest.param(gp.add_rms_norm, lambda M, N: [S((M, N), tl.float16)] * 2 + [S((1, N), tl.float16)]
                 + [S((M, N), tl.float16)] * 2, (21, 264), {"rows": 1}, id="add-rmsnorm"),
    pytest.param(twice_used, lambda M, N: [S((M, N), tl.float32)] * 3, (45, 70), {}, id="twice-used-f32-edges"),
    pytest.param(widen, lambda M, N: [S((M, N), tl.bfloat16), S((M, N), tl.float32)], (40, 100), {}, id="widen"),
    pytest.param(into_fragment, lambda M, N: [S((M, N), tl.float16), S((M, 128), tl.float32)], (33, 384), {},
                 id="fragment"),
]
TILES = {"twice-used-f32-edges": (16, 32, 16), "widen": (8, 64, 16),
         "fragment": (16, 128, 16)}


@needs_gxx
@pytest.mark.parametrize("fn,specs,shape,kw", CASES)
def test_held_tiles_match_the_simulator_on_cpu_threads(tmp_path, request, fn, specs, shape, kw):
    from test_codegen_general import _stored_inputs, emulate, inputs_for
    tile = TILES.get(request.node.callspec.id, (16, 256, 16))
    k = fn.trace(1, *specs(*shape), compute=tl.ComputeSchedule(tile=tile), **kw)
    lk = lower(k, "part")
    assert lk.held, lk.describe()
    arrays = inputs_for(k, np.random.default_rng(5))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    assert_agrees([emulate(k, lk, _stored_inputs(k, arrays), tmp_path)], want, tolerances)


@needs_gxx
def test_a_three_dimensional_held_tile_matches_the_simulator(tmp_path):
    from test_codegen_general import _stored_inputs, emulate, inputs_for
    k = _trace(cube_rows, [S((5, 3, 64), tl.float16), S((5, 3, 64), tl.float16)], (8, 64, 16))
    lk = lower(k, "part")
    assert lk.held, lk.describe()
    arrays = inputs_for(k, np.random.default_rng(3))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    assert_agrees([emulate(k, lk, _stored_inputs(k, arrays), tmp_path)], want, tolerances)


@tl.kernel
def in_place(x, *, compute: tl.ComputeSchedule = None):
    """x = 2 x, tile by tile: the part stores the tensor it loads."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        tl.store(x, (pm * BM, pn * BN), tl.load(x, (pm * BM, pn * BN), (BM, BN)) * 2.0)


def test_the_next_tasks_held_loads_are_fetched_while_a_task_computes():
    """The softmax's row: fetched for the group's next task right after the current one's is
    taken (a second set of registers); not where the part stores the tensor it loads, nor in a
    part that waits (the fuzzer's program 149)."""
    k = gp.row_softmax.trace(1, S((16384, 8192), tl.float16), S((16384, 8192), tl.float16), compute=ROWS, rows=1)
    src = lower(k, "part").source
    assert src.count("auto fetch") == 1 and "_next[" in src
    assert src.index("auto fetch") < src.index("for (int task")
    assert "fetch" in src[src.index("for (int task"):]
    lk = lower(_trace(in_place, [S((64, 256), tl.float32)], (16, 256, 16)), "part")
    assert lk.held and "fetch" not in lk.source
    from test_fuzz_regressions import fuzz_2026_149
    k = fuzz_2026_149.trace(2, S((23, 26), tl.int32), S((23,), tl.int32))
    assert "fetch" not in lower(k, "stage0").source


def test_the_same_tile_every_task_is_loaded_once_before_the_first():
    """An RMSNorm's weight row (offsets without a program id): held and loaded before the task
    loop, not again per task; the row it scales is fetched a task ahead."""
    x, w = S((16384, 8192), tl.float16), S((1, 8192), tl.float16)
    src = lower(gp.rms_norm.trace(1, x, w, x, compute=ROWS, rows=1), "part").source
    loop = src.index("for (int task")
    assert src[:loop].count("load w ->") == 1 and "load w ->" not in src[loop:]
    assert "loaded before the first" in src[loop:] and "fetch" in src[loop:]


@tl.kernel
def read_and_reset(acc, y, *, compute: tl.ComputeSchedule = None):
    """Take a tile of an accumulator, zero it, store what was taken (f16: 8-element chunks over a
    4-element-chunk store of zeros)."""
    M, N = acc.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        t = tl.load(acc, (pm * BM, 0), (BM, N))
        tl.store(acc, (pm * BM, 0), tl.zeros((BM, N), tl.float32))
        tl.store(y, (pm * BM, 0), t)


@tl.kernel
def shift_right(x, *, compute: tl.ComputeSchedule = None):
    """x[:, 1:] = x[:, :-1], 16 rows a task (the tasks' rows are disjoint)."""
    M, N = x.shape

    @tl.compute_part(grid=(M // 16,))
    def part(pm):
        tl.store(x, (pm * 16, 1), tl.load(x, (pm * 16, 0), (16, N)))


@needs_gxx
@pytest.mark.parametrize("fn,specs,kw", [
    (read_and_reset, [S((64, 512), tl.float32), S((64, 512), tl.float16)],
     {"compute": tl.ComputeSchedule(tile=(16, 256, 16))}),
    (shift_right, [S((64, 512), tl.float16)], {}),
], ids=["read_and_reset", "shift_right"])
def test_a_held_load_of_a_tensor_the_part_writes_has_a_barrier_before_the_write(tmp_path, fn, specs, kw):
    """Every thread has its chunks before any thread's next statement writes the tensor (found
    by review: without the barrier, CPU threads read zeros / shifted values). One launch: the
    simulator's default second launch would read what the first wrote."""
    from test_codegen_general import emulate, inputs_for
    k = fn.trace(1, *specs, **kw)
    lk = lower(k, "part")
    src = lk.source
    load, write = src.index("load acc" if fn is read_and_reset else "load x"), src.index("store -> ")
    assert lk.held and BARRIER in src[load:write], lk.describe()     # every chunk loaded before any is written
    arrays = inputs_for(k, np.random.default_rng(0))
    want = tl.simulate(fn, 1, [{n: a.copy() for n, a in arrays.items()}], options={"launches": 1}, **kw)[0]
    got = emulate(k, lk, {n: a.copy() for n, a in arrays.items()}, tmp_path, grid=3)
    for name in arrays:
        np.testing.assert_array_equal(got[name], want[name])


def test_an_int_reduction_of_held_floats_does_not_run_in_chunk_order():
    """``max(-int(t))`` over a held f32 tile would unroll the same i32 max chain ptxas folds
    wrongly (see test_int_tiles_stay_in_shared_memory): the tile stays in shared memory."""
    @tl.kernel
    def int_max(x, y):
        @tl.compute_part(grid=(1,))
        def part(pm):
            tl.store(y, (0,), tl.max(-tl.cast(tl.load(x, (0, 0), (32, 32)), tl.int32), 1))
    k = int_max.trace(1, S((32, 32), tl.float32), S((32,), tl.int32))
    assert not lower(k, "part").held


def test_a_long_chain_of_element_ops_lowers_quickly():
    """t = t * t twenty times on a held tile, then a row sum: the costly-math check looks at
    each value once (it took 16 s at depth 20 when it walked every path)."""
    import time

    @tl.kernel
    def squares(x, y, *, compute: tl.ComputeSchedule = None):
        M, N = x.shape
        BM, _, _ = compute.tile

        @tl.compute_part(grid=(tl.cdiv(M, BM),))
        def part(pm):
            t = tl.load(x, (pm * BM, 0), (BM, N))
            for _ in range(20):
                t = t * t
            tl.store(y, (pm * BM, 0), t + tl.expand_dims(tl.sum(t, 1), 1))
    k = squares.trace(1, S((64, 256), tl.float32), S((64, 256), tl.float32), compute=ROWS)
    t0 = time.process_time()          # CPU: lowering is this process's work, whatever else runs beside it
    lower(k, "part")
    assert time.process_time() - t0 < 5.0
