"""The race and uninitialised-read detectors on the simulator's region records: accesses kept
as boxes in a banded index, and a loop run in bulk checked and logged as whole regions
(runtime/sim/access_log.py, bulk_loop.py). What such records could get wrong is checked here
with small purpose-written kernels: partial overlaps, boxes that only touch, a write into the
gap between a loop's tiles, the longest axis not the first, a report naming the exact tile
of the exact iteration, part of a tile never written, tiles cached for a dot and then
overwritten. Every kernel runs with loops in bulk and op by op (``SimOptions(bulk_loops=False)``):
the two must agree to the bit, and on every report word for word.
"""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.runtime.sim import bulk_loop

F16, F32 = np.float16, np.float32
SEEDS = range(4)


def _run(kernel, W, inputs, seed, bulk, **kw):
    """(outputs and workspaces, steps) of a clean run, or (error type, message) of a reported one."""
    try:
        res = tl.simulate(kernel, W, inputs, seed=seed, options=tl.SimOptions(bulk_loops=bulk), **kw)
    except tl.SimulationError as e:
        return type(e), str(e)
    return [dict(res[r]) | res.workspaces[r] for r in range(W)], res.steps


def _same_either_way(kernel, W, inputs, seed, **kw):
    """The outcome with loops in bulk, after checking it is the op-by-op one, bit for bit."""
    bulk, one_by_one = _run(kernel, W, inputs, seed, True, **kw), _run(kernel, W, inputs, seed, False, **kw)
    if isinstance(bulk[0], type) or isinstance(one_by_one[0], type):
        assert bulk == one_by_one
        return bulk
    assert bulk[1] == one_by_one[1], "scheduler steps differ"
    for got, want in zip(bulk[0], one_by_one[0]):
        assert got.keys() == want.keys()
        for name in got:
            assert got[name].tobytes() == want[name].tobytes(), f"'{name}' differs between bulk and op by op"
    return bulk


def _expect_race(kernel, W, inputs, **kw):
    """The report of every seed (each also checked against op by op)."""
    msgs = []
    for seed in SEEDS:
        kind, msg = _same_either_way(kernel, W, inputs, seed, **kw)
        assert kind is tl.RaceError, msg
        msgs.append(msg)
    return msgs


def _clean(kernel, W, inputs, **kw):
    for seed in SEEDS:
        outs, _ = _same_either_way(kernel, W, inputs, seed, **kw)
        assert not isinstance(outs, type), outs
    return outs


def _rand(rng, shape, dtype=F16):
    return rng.standard_normal(shape).astype(dtype)


# -- two tasks writing tile regions -------------------------------------------------------------------

@tl.kernel
def two_writers(a, c, *, step: tl.constexpr, axis: tl.constexpr = 0):
    """Two tasks store the same tile, ``step`` apart along ``axis`` of ``c``, with nothing
    ordering them: a race exactly where the boxes overlap."""
    th, tw = a.shape

    @tl.compute_part(grid=(2,), name="write")
    def write(i):
        at = (i * step, 0) if axis == 0 else (0, i * step)
        tl.store(c, at, tl.load(a, (0, 0), (th, tw)))


@pytest.mark.parametrize("step, boxes", [
    (0, ("c[0:8, 0:8]", "c[0:8, 0:8]")),          # the same tile
    (5, ("c[0:8, 0:8]", "c[5:13, 0:8]")),         # three rows in common
    (7, ("c[0:8, 0:8]", "c[7:15, 0:8]")),         # one row in common
])
def test_overlapping_tile_writes_race(step, boxes):
    a = _rand(np.random.default_rng(0), (8, 8))
    inputs = [{"a": a, "c": np.zeros((16, 8), F16)}]
    for msg in _expect_race(two_writers, 1, inputs, step=step):
        assert msg.startswith("race on c of rank 0 (unordered accesses)"), msg
        for box in boxes:
            assert f"write {box} by rank 0 compute task write(" in msg, msg
        assert "compute task write(0)" in msg and "compute task write(1)" in msg, msg


def test_touching_tile_writes_do_not_race():
    a = _rand(np.random.default_rng(0), (8, 8))
    outs = _clean(two_writers, 1, [{"a": a, "c": np.zeros((16, 8), F16)}], step=8)
    np.testing.assert_array_equal(outs[0]["c"], np.concatenate([a, a]))


@pytest.mark.parametrize("step, race", [(12, True), (16, False), (15, True)])
def test_regions_along_the_longest_axis(step, race):
    # c is 4 x 64: the index bands run along columns, and tiles cross band edges
    a = _rand(np.random.default_rng(1), (4, 16))
    inputs = [{"a": a, "c": np.zeros((4, 64), F16)}]
    if race:
        for msg in _expect_race(two_writers, 1, inputs, step=step, axis=1):
            assert "write c[0:4, 0:16]" in msg and f"write c[0:4, {step}:{step + 16}]" in msg, msg
    else:
        outs = _clean(two_writers, 1, inputs, step=step, axis=1)
        np.testing.assert_array_equal(outs[0]["c"][:, :32], np.concatenate([a, a], axis=1))


@tl.kernel
def read_while_written(a, c, out):
    """Task 0 reads rows 0:8 of ``c``; task 1 writes rows 6:14, unordered."""
    @tl.compute_part(grid=(2,), name="rw")
    def rw(i):
        with tl.when(i == 0):
            tl.store(out, (0, 0), tl.load(c, (0, 0), (8, 8)))
        with tl.when(i == 1):
            tl.store(c, (6, 0), tl.load(a, (0, 0), (8, 8)))


def test_read_partly_overlapping_a_write_races_in_either_order():
    rng = np.random.default_rng(2)
    inputs = [{"a": _rand(rng, (8, 8)), "c": _rand(rng, (16, 8)), "out": np.zeros((8, 8), F16)}]
    orders = set()
    for seed in range(12):
        kind, msg = _same_either_way(read_while_written, 1, inputs, seed)
        assert kind is tl.RaceError, msg
        assert "read  c[0:8, 0:8] by rank 0 compute task rw(0)" in msg, msg
        assert "write c[6:14, 0:8] by rank 0 compute task rw(1)" in msg, msg
        orders.add("the read ran before the write it needs" in msg)
    assert orders == {True, False}


# -- a loop run in bulk ---------------------------------------------------------------------------------

def _gemm(c, x, w, k_tiles, step=8):
    """c = sum over the loop of x[:, k:k+8] @ w[k:k+8, :], one tl.range loop (run in bulk)."""
    acc = tl.fragment((8, 8), tl.float32)
    for k in tl.range(0, 8 * k_tiles, step):
        acc += tl.dot(tl.load(x, (0, k), (8, 8)), tl.load(w, (k, 0), (8, 8)))
    tl.store(c, (0, 0), acc)


@tl.kernel
def chunked_fill(a: tl.Symmetric, w, c, *, waits: tl.constexpr = 4, cols: tl.constexpr = 32):
    """The comm part pulls ``a`` into ``buf`` in four 8-column chunks (the last ``cols - 24``
    wide), each behind its notify; the compute part waits for the first ``waits`` chunks, then
    multiplies ``buf`` by ``w`` in a loop over the four column tiles."""
    buf = tl.local_buffer((8, 32), a.dtype, "buf")
    ready = tl.signal("ready", 4)

    @tl.comm_part(grid=(4,), name="fill")
    def fill(j):
        with tl.when(j < 3):
            tl.tile_pull_data(a.at(tl.rank()), (0, j * 8), (8, 8), buf, (0, j * 8))
        with tl.when(j == 3):
            tl.tile_pull_data(a.at(tl.rank()), (0, 24), (8, cols - 24), buf, (0, 24))
        tl.producer_tile_notify(ready, j)

    @tl.compute_part(grid=(1,), name="gemm")
    def gemm(i):
        for j in tl.static_range(waits):
            tl.consumer_tile_wait(ready, j)
        _gemm(c, buf, w, 4)


def _chunked_inputs(W=2):
    rng = np.random.default_rng(3)
    w = _rand(rng, (32, 8))
    return [{"a": _rand(rng, (8, 32)), "w": w, "c": np.full((8, 8), np.nan, F16)} for _ in range(W)]


def test_bulk_loop_computes_what_op_by_op_does():
    inputs = _chunked_inputs()
    outs = _clean(chunked_fill, 2, inputs)
    for r in range(2):
        want = inputs[r]["a"].astype(F32) @ inputs[r]["w"].astype(F32)
        np.testing.assert_allclose(outs[r]["c"].astype(F32), want, rtol=1e-2, atol=1e-2)


def test_race_names_the_one_tile_of_the_loop_left_unguarded():
    # no wait for the last chunk: of the loop's four reads of buf only the last one races
    for msg in _expect_race(chunked_fill, 2, _chunked_inputs(), waits=3):
        assert "buf[0:8, 24:32]" in msg and "compute task gemm(0) (load at" in msg, msg
        assert "comm task fill(3) (tile_pull_data at" in msg, msg
        assert "buf[0:8, 0:8]" not in msg and "buf[0:8, 16:24]" not in msg, msg


def test_uninitialised_part_of_one_tile_in_a_loop():
    # the last chunk fills 4 of its 8 columns: the loop's last tile reads 4 columns nobody wrote
    for seed in SEEDS:
        kind, msg = _same_either_way(chunked_fill, 2, _chunked_inputs(), seed, cols=28)
        assert kind is tl.UninitializedReadError, msg
        assert "compute task gemm(0) (load at" in msg and "reads buf[0:8, 24:32]" in msg, msg
        assert "element (0, 28) was not written" in msg, msg


def test_loops_in_chunks_of_iterations(monkeypatch):
    # a loop longer than the bulk path holds at once runs in chunks: same results, same reports
    monkeypatch.setattr(bulk_loop, "CHUNK_BYTES", 3 * 2 * 8 * 8 * 4)     # three iterations at a time
    test_bulk_loop_computes_what_op_by_op_does()
    test_race_names_the_one_tile_of_the_loop_left_unguarded()
    test_uninitialised_part_of_one_tile_in_a_loop()


@tl.kernel
def strided_reads(a, x, w, c, *, col: tl.constexpr):
    """A loop reads x's column tiles 0:8 and 16:24 (step 16); another task writes x[:, col:col+8]."""
    @tl.comm_part(grid=(1,), name="scribble")
    def scribble(i):
        tl.store(x, (0, col), tl.load(a, (0, 0), (8, 8)))

    @tl.compute_part(grid=(1,), name="gemm")
    def gemm(i):
        _gemm(c, x, w, 4, step=16)


@pytest.mark.parametrize("col, race", [(8, False), (24, False), (16, True), (12, True), (4, True)])
def test_write_into_the_gap_between_a_loops_tiles(col, race):
    rng = np.random.default_rng(4)
    inputs = [{"a": _rand(rng, (8, 8)), "x": _rand(rng, (8, 40)), "w": _rand(rng, (32, 8)),
               "c": np.full((8, 8), np.nan, F16)}]
    if not race:
        outs = _clean(strided_reads, 1, inputs, col=col)
        x, w = inputs[0]["x"].astype(F32), inputs[0]["w"].astype(F32)
        want = x[:, 0:8] @ w[0:8] + x[:, 16:24] @ w[16:24]
        np.testing.assert_allclose(outs[0]["c"].astype(F32), want, rtol=1e-2, atol=1e-2)
        return
    tile = "x[0:8, 0:8]" if col < 8 else "x[0:8, 16:24]"
    for msg in _expect_race(strided_reads, 1, inputs, col=col):
        assert f"read  {tile} by rank 0 compute task gemm(0)" in msg, msg
        assert f"write x[0:8, {col}:{col + 8}] by rank 0 comm task scribble(0)" in msg, msg


@tl.kernel
def overwrite_all(a, x, w, c):
    """A loop reads all four column tiles of x; another task rewrites all of x, unordered."""
    @tl.comm_part(grid=(1,), name="scribble")
    def scribble(i):
        tl.store(x, (0, 0), tl.load(a, (0, 0), (8, 32)))

    @tl.compute_part(grid=(1,), name="gemm")
    def gemm(i):
        _gemm(c, x, w, 4)


def test_a_write_over_a_whole_loop_names_its_first_tile():
    # when the loop ran first, its earliest read is the one reported, as a scan of the log in
    # order would report it
    rng = np.random.default_rng(5)
    inputs = [{"a": _rand(rng, (8, 32)), "x": _rand(rng, (8, 32)), "w": _rand(rng, (32, 8)),
               "c": np.full((8, 8), np.nan, F16)}]
    orders = set()
    for seed in range(12):
        kind, msg = _same_either_way(overwrite_all, 1, inputs, seed)
        assert kind is tl.RaceError, msg
        assert "write x[0:8, 0:32] by rank 0 comm task scribble(0)" in msg, msg
        assert "read  x[0:8, 0:8] by rank 0 compute task gemm(0)" in msg, msg
        orders.add("the read ran before the write it needs" in msg)
    assert orders == {True, False}


@tl.kernel
def computed_offsets(x, w, c, *, square: tl.constexpr):
    """The loads' offsets computed in the loop body: k*8 (tiles in a row) or k*k*8 (a gather
    that runs off the end of w, where it reads zeros)."""
    @tl.compute_part(grid=(1,), name="gemm")
    def gemm(i):
        acc = tl.fragment((8, 8), tl.float32)
        for k in tl.range(0, 4):
            off = k * k * 8 if square else k * 8
            acc += tl.dot(tl.load(x, (0, off), (8, 8)), tl.load(w, (off, 0), (8, 8)))
        tl.store(c, (0, 0), acc)


@pytest.mark.parametrize("square", [False, True])
def test_offsets_computed_in_the_loop(square):
    rng = np.random.default_rng(6)
    x, w = _rand(rng, (8, 40)), _rand(rng, (40, 8))
    outs = _clean(computed_offsets, 1, [{"x": x, "w": w, "c": np.full((8, 8), np.nan, F16)}], square=square)
    offs = [k * k * 8 for k in range(4)] if square else [k * 8 for k in range(4)]
    want = sum(x[:, o:o + 8].astype(F32) @ w[o:o + 8].astype(F32) for o in offs if o < 40)
    np.testing.assert_allclose(outs[0]["c"].astype(F32), want, rtol=1e-2, atol=1e-2)


# -- tiles kept for dots, then overwritten ---------------------------------------------------------------

@tl.kernel
def rewrite_between_reads(a, b: tl.Symmetric, w, c1, c2, *, via: tl.constexpr = "store"):
    """Four tasks in a chain: fill buf from a; multiply it (c1); overwrite its rows 4:8 from b
    (a store, or a pull); multiply it again (c2) — which must see the new rows."""
    buf = tl.local_buffer((8, 32), a.dtype, "buf")
    step = tl.signal("step", 3)

    @tl.compute_part(grid=(4,), name="phase")
    def phase(i):
        with tl.when(i == 0):
            tl.store(buf, (0, 0), tl.load(a, (0, 0), (8, 32)))
            tl.producer_tile_notify(step, 0)
        with tl.when(i == 1):
            tl.consumer_tile_wait(step, 0)
            _gemm(c1, buf, w, 4)
            tl.producer_tile_notify(step, 1)
        with tl.when(i == 2):
            tl.consumer_tile_wait(step, 1)
            if via == "store":
                tl.store(buf, (4, 0), tl.load(b, (4, 0), (4, 32)))
            else:
                tl.tile_pull_data(b.at(tl.rank()), (4, 0), (4, 32), buf, (4, 0))
            tl.producer_tile_notify(step, 2)
        with tl.when(i == 3):
            tl.consumer_tile_wait(step, 2)
            _gemm(c2, buf, w, 4)


@pytest.mark.parametrize("via", ["store", "pull"])
def test_a_dot_sees_rows_written_after_an_earlier_dot_read_them(via):
    rng = np.random.default_rng(7)
    a, b, w = _rand(rng, (8, 32)), _rand(rng, (8, 32)), _rand(rng, (32, 8))
    inputs = [{"a": a, "b": b, "w": w, "c1": np.full((8, 8), np.nan, F16), "c2": np.full((8, 8), np.nan, F16)}]
    outs = _clean(rewrite_between_reads, 1, inputs, via=via)
    mixed = np.concatenate([a[:4], b[4:]])
    for name, x in (("c1", a), ("c2", mixed)):
        np.testing.assert_allclose(outs[0][name].astype(F32), x.astype(F32) @ w.astype(F32), rtol=1e-2, atol=1e-2)


# -- ordering through a chain of tasks (sparse vector clocks) ------------------------------------------

@tl.kernel
def relay(a, c, *, hand_on: tl.constexpr = True):
    """Task 0 writes buf and notifies task 1, which notifies task 2 (if ``hand_on``: after waiting
    for task 0), which reads buf: ordered only through the middle task."""
    buf = tl.local_buffer((8, 8), a.dtype, "buf")
    s = tl.signal("s", 2)

    @tl.compute_part(grid=(3,), name="hop")
    def hop(i):
        with tl.when(i == 0):
            tl.store(buf, (0, 0), tl.load(a, (0, 0), (8, 8)))
            tl.producer_tile_notify(s, 0)
        with tl.when(i == 1):
            if hand_on:
                tl.consumer_tile_wait(s, 0)
            tl.producer_tile_notify(s, 1)
        with tl.when(i == 2):
            tl.consumer_tile_wait(s, 1)
            tl.store(c, (0, 0), tl.load(buf, (0, 0), (8, 8)))


def test_order_passes_through_a_middle_task():
    a = _rand(np.random.default_rng(8), (8, 8))
    inputs = [{"a": a, "c": np.zeros((8, 8), F16)}]
    np.testing.assert_array_equal(_clean(relay, 1, inputs)[0]["c"], a)
    for msg in _expect_race(relay, 1, inputs, hand_on=False):
        assert "write buf[0:8, 0:8] by rank 0 compute task hop(0)" in msg, msg
        assert "read  buf[0:8, 0:8] by rank 0 compute task hop(2)" in msg, msg
