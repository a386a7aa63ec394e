"""``tl.add_rows``: a tile's rows scatter-added into rows of a tensor (the dual of ``tl.load_rows``).

In the simulator against numpy (hypothesis over shapes, tiles, ids and dtypes); the race detector's
rule for adds (unordered adds to the same element commute; an add and a read or a write do not);
an add into workspace memory nothing wrote; the language's errors at the user's line. The general
lowering's kernel (NVRTC and the CPU emulation) is checked in ``test_codegen_general.py``
(``scatter_add_rows``), on the GPU in ``test_gpu_run.py``."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tldsl as tl
from tldsl.runtime.sim.memory import to_storage

from programs import weighted_scatter

S = tl.TensorSpec


def _reference(x, idx, w, y):
    out = y.astype(np.float64).copy()
    for r in range(x.shape[0]):
        if idx[r] >= 0:
            out[idx[r]] += w[r] * x[r].astype(np.float64)
    return out


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 70), N=st.integers(1, 70), rows_out=st.integers(1, 30),
       bm=st.sampled_from([8, 16, 32]), bn=st.sampled_from([8, 16, 64]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), seed=st.integers(0, 2**16))
def test_the_simulator_adds_every_row_as_numpy_does(M, N, rows_out, bm, bn, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = getattr(tl, dtype)
    x = rng.standard_normal((M, N)).astype(np.float32)
    idx = rng.integers(-2, rows_out, M).astype(np.int32)
    w = rng.uniform(0.1, 1.0, M).astype(np.float32)
    y = rng.standard_normal((rows_out, N)).astype(np.float32)
    k = weighted_scatter.trace(1, S((M, N), dt), S((M,), tl.int32), S((M,), tl.float32), S((rows_out, N), dt),
                               compute=tl.ComputeSchedule(tile=(bm, bn, 8)))
    xs, ys = (to_storage(a, dt) for a in (x, y))
    got = tl.simulate(k, 1, [dict(x=xs, idx=idx, w=w, y=ys)], seed=seed)[0]["y"]
    want = _reference(xs, idx, w, ys)
    # one rounding to the tensor's type an add: at most (adds into the row + 1) ulps of the sums' size
    adds = np.bincount(idx[idx >= 0], minlength=rows_out)[:, None] + 1
    ulp = {"float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-10}[dtype]
    scale = np.abs(ys).astype(np.float64) + np.zeros_like(want)
    for r in range(M):
        if idx[r] >= 0:
            scale[idx[r]] += np.abs(w[r] * xs[r])
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 2 * adds * ulp * scale + 1e-30)


@tl.kernel
def adds_then_read(x, idx, out, *, ordered: tl.constexpr = True, second: tl.constexpr = "read"):
    """Two tiles add x's rows into ``acc`` (the same rows); a reader copies ``acc`` to ``out``,
    after both adds when ``ordered``. ``second="store"``: a third task stores into ``acc`` unordered
    instead of the reader's wait; ``second="add"``: the two adders are ordered by nothing, and
    that is all (no reader)."""
    M, N = x.shape
    acc = tl.local_buffer(out.shape, out.dtype, "acc")
    zeroed, added = tl.signal("zeroed", 1), tl.signal("added", 1)

    @tl.compute_part(grid=(1,), name="zero")
    def zero(i):
        tl.store(acc, (0, 0), tl.zeros(out.shape, out.dtype))
        tl.producer_tile_notify(zeroed, 0)

    @tl.compute_part(grid=(2,), name="add")
    def add(i):
        tl.consumer_tile_wait(zeroed, 0, count=1)
        tl.add_rows(acc, tl.load(idx, (i * (M // 2),), (M // 2,)), 0, tl.load(x, (i * (M // 2), 0), (M // 2, N)))
        tl.producer_tile_notify(added, 0)

    @tl.compute_part(grid=(1,), name="read")
    def read(i):
        if second == "store":
            tl.consumer_tile_wait(zeroed, 0, count=1)
            tl.store(acc, (0, 0), tl.zeros(out.shape, out.dtype))
        elif second == "read":
            if ordered:
                tl.consumer_tile_wait(added, 0, count=2)
            else:
                tl.consumer_tile_wait(zeroed, 0, count=1)
            tl.store(out, (0, 0), tl.load(acc, (0, 0), out.shape))
        else:
            tl.consumer_tile_wait(added, 0, count=2)


def _adds_inputs():
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    return [dict(x=x, idx=np.array([0, 1, 0, 2, 0, 1, 2, 0], np.int32), out=np.full((3, 4), np.nan, np.float32))]


def _adds_kernel(**kw):
    return adds_then_read.trace(1, S((8, 4), tl.float32), S((8,), tl.int32), S((3, 4), tl.float32), **kw)


@pytest.mark.parametrize("seed", range(6))
def test_unordered_adds_to_the_same_rows_are_no_race(seed):
    got = tl.simulate(_adds_kernel(), 1, _adds_inputs(), seed=seed)[0]["out"]
    x, idx = _adds_inputs()[0]["x"], _adds_inputs()[0]["idx"]
    want = np.zeros((3, 4), np.float32)
    np.add.at(want, idx, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("second,kind", [("read", "read "), ("store", "write")])
def test_an_add_and_an_unordered_read_or_write_of_its_rows_race(second, kind):
    for seed in range(6):
        with pytest.raises(tl.RaceError) as info:
            tl.simulate(_adds_kernel(ordered=False, second=second), 1, _adds_inputs(), seed=seed)
        msg = str(info.value)
        assert msg.startswith("race on acc of rank 0"), msg
        assert "  add   acc[" in msg and f"  {kind} acc[" in msg, msg
        assert {info.value.details["primitive"], info.value.details["other_primitive"]} == {
            "add_rows", "load" if second == "read" else "store"}


@tl.kernel
def adds_into_unwritten(x, idx, out):
    """Adds into a workspace nothing zeroed, then reads it: NaN + x, an uninitialised read."""
    M, N = x.shape
    acc = tl.local_buffer(out.shape, out.dtype, "acc")
    added = tl.signal("added", 1)

    @tl.compute_part(grid=(1,), name="add")
    def add(i):
        tl.add_rows(acc, tl.load(idx, (0,), (M,)), 0, tl.load(x, (0, 0), (M, N)))
        tl.producer_tile_notify(added, 0)

    @tl.compute_part(grid=(1,), name="read")
    def read(i):
        tl.consumer_tile_wait(added, 0, count=1)
        tl.store(out, (0, 0), tl.load(acc, (0, 0), out.shape))


def test_an_add_into_workspace_nothing_wrote_is_an_uninitialised_read():
    k = adds_into_unwritten.trace(1, S((8, 4), tl.float32), S((8,), tl.int32), S((3, 4), tl.float32))
    with pytest.raises(tl.UninitializedReadError, match=r"compute task add\(0\) \(add_rows at test_add_rows.py:\d+\)"
                                                         r" adds into acc\[0:3, 0:4\] on rank 0, but element \(0, 0\) "
                                                         r"was not written"):
        tl.simulate(k, 1, _adds_inputs())


def test_a_row_id_past_the_tensor_is_an_out_of_bounds_error():
    inputs = _adds_inputs()
    inputs[0]["idx"] = np.array([0, 1, 0, 2, 0, 3, 2, 0], np.int32)
    with pytest.raises(tl.OutOfBoundsError, match="adds into row 3 of 'acc', which has 3 rows"):
        tl.simulate(_adds_kernel(), 1, inputs)


def _line_of(text: str) -> int:
    import inspect
    src, start = inspect.getsourcelines(_bad)
    return start + next(i for i, ln in enumerate(src) if text in ln)


@tl.kernel
def _bad(x, idx, y, ny, *, case: tl.constexpr = "int"):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(i):
        t = tl.load(x, (0, 0), (M, N))
        rows = tl.load(idx, (0,), (M,))
        if case == "int":
            tl.add_rows(ny, rows, 0, t)                                 # an i32 tensor
        elif case == "rows":
            tl.add_rows(y, t, 0, t)                                     # rows not an i32 tile
        elif case == "shape":
            tl.add_rows(y, rows, 0, tl.load(x, (0, 0), (M // 2, N)))    # a row per id
        elif case == "ints":
            tl.add_rows(y, rows, 0, tl.load(idx, (0,), (M,))[:, None])  # an int tile


@pytest.mark.parametrize("case,message,line", [
    ("int", "tl.add_rows adds floats; 'ny' is i32", "an i32 tensor"),
    ("rows", "tl.add_rows needs a 1-d i32 tile of row indices", "rows not an i32 tile"),
    ("shape", r"tl.add_rows adds a \[8, ncols\] tile \(one row per row id\), got \[4, 4\]", "a row per id"),
    ("ints", "tl.add_rows adds a float tile, got i32", "an int tile"),
])
def test_bad_adds_are_compilation_errors_at_the_users_line(case, message, line):
    with pytest.raises(tl.CompilationError, match=message) as info:
        _bad.trace(1, S((8, 4), tl.float32), S((8,), tl.int32), S((3, 4), tl.float32), S((3, 4), tl.int32),
                   case=case)
    assert info.value.loc.lineno == _line_of(line)
