"""The simulator's detectors, each driven by a small purpose-written kernel, plus its
determinism, schedule independence, the IR printer and the timeline.

Every broken kernel comes with its fixed twin, run under the same seeds, so a detector that
fires on everything would fail here as surely as one that fires on nothing.
"""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

import tldsl as tl
from tldsl.ops.allgather_gemm import allgather_gemm

SEEDS = range(6)
F32 = np.float32


def _line(fn, text: str) -> int:
    """The line number (in this file) of the line of ``fn``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(fn.fn if isinstance(fn, tl.KernelFunction) else fn)
    hits = [first + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def _vec_inputs(W, n=8, **extra):
    """Per-rank inputs: ``a`` nonzero and different on every rank and element, the output ``c``
    poisoned (NaN), so an element a kernel never wrote cannot pass for a written zero."""
    return [dict({"a": np.arange(n, dtype=F32) + 1 + 100 * r, "c": np.full(n, np.nan, F32)}, **extra)
            for r in range(W)]


# -- races ---------------------------------------------------------------------------------------

@tl.kernel
def fetch_then_use(a: tl.Symmetric, c, *, wait: tl.constexpr = True):
    """The comm part pulls the next rank's ``a`` into ``got``; the compute part doubles it."""
    W = tl.world_size()
    n = a.shape[0]
    got = tl.local_buffer((n,), a.dtype, "got")
    ready = tl.signal("ready", 1)

    @tl.comm_part(grid=(1,), name="fetch")
    def fetch(i):
        tl.tile_pull_data(a.at((tl.rank() + 1) % W), (0,), (n,), got, (0,))
        tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=(1,), name="use")
    def use(i):
        if wait:
            tl.consumer_tile_wait(ready, 0)
        tl.store(c, (0,), tl.load(got, (0,), (n,)) * 2.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_missing_wait_is_a_race(seed):
    W = 3
    inputs = _vec_inputs(W)
    good = tl.simulate(fetch_then_use, W, inputs, seed=seed)
    for r in range(W):
        np.testing.assert_array_equal(good[r]["c"], 2 * inputs[(r + 1) % W]["a"])

    with pytest.raises(tl.RaceError) as info:
        tl.simulate(fetch_then_use, W, inputs, seed=seed, wait=False)
    err, msg = info.value, str(info.value)
    rank = err.details["rank"]
    pull = f"rank {rank} comm task fetch(0) (tile_pull_data at test_simulator.py:" \
           f"{_line(fetch_then_use, 'tl.tile_pull_data(')})"
    load = f"rank {rank} compute task use(0) (load at test_simulator.py:" \
           f"{_line(fetch_then_use, 'tl.load(got')})"
    assert msg.startswith(f"race on got of rank {rank} ")
    assert re.search(r"^  write got\[0:8\] by " + re.escape(pull) + "$", msg, re.M), msg
    assert re.search(r"^  read  got\[0:8\] by " + re.escape(load) + "$", msg, re.M), msg
    assert "no notify -> wait chain orders them" in msg
    assert {err.details["primitive"], err.details["other_primitive"]} == {"tile_pull_data", "load"}
    assert err.details["buffer"] == "got"
    assert tuple(map(tuple, err.details["region"])) == ((0,), (8,))


def test_race_is_found_whichever_access_ran_first():
    # vector clocks, not luck: across seeds the scheduler runs the read before the write and
    # after it, and the race is reported either way
    orders = set()
    for seed in range(12):
        with pytest.raises(tl.RaceError) as info:
            tl.simulate(fetch_then_use, 3, _vec_inputs(3), seed=seed, wait=False)
        orders.add("read ran before the write" in str(info.value))
    assert orders == {True, False}


@tl.kernel
def halves_then_sum(a, c, *, count: tl.constexpr = 2):
    """Two tasks each write half of ``staged`` and notify one slot; the reader waits ``count``
    notifies, then reads both halves (``count=1`` is one too few)."""
    ready, staged = tl.signal("ready", 1), tl.local_buffer(a.shape, a.dtype, "staged")
    half = (a.shape[0] // 2,)

    @tl.compute_part(grid=(2,), name="write")
    def write(i):
        tl.store(staged, (i * half[0],), tl.load(a, (i * half[0],), half) + 1.0)
        tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=(1,), name="read")
    def read(i):
        tl.consumer_tile_wait(ready, 0, count=count)
        tl.store(c, (0,), tl.load(staged, (0,), a.shape) * 2.0)


def test_a_wait_count_too_low_is_a_race_on_every_seed():
    # the reader's wait passes at the first notify, so it is ordered after that one writer only,
    # whichever writer came first and however many notifies the slot held when the reader ran
    # (before, the wait joined every release so far and the race showed on some seeds only)
    inputs = _vec_inputs(2)
    partial = 0
    for seed in range(24):
        good = tl.simulate(halves_then_sum, 2, inputs, seed=seed)
        np.testing.assert_array_equal(good[0]["c"], 2 * (inputs[0]["a"] + 1))
        with pytest.raises(tl.RaceError, match="race on staged") as info:
            tl.simulate(halves_then_sum, 2, inputs, seed=seed, count=1)
        assert "a wait count too low" in str(info.value)
        # where the reader ran after both notifies, the report says its wait took only the first
        partial += "its wait on ready[0] (its first 1 of the 2 notifies it had) is ordered only after" \
            in str(info.value)
    assert partial > 0


@tl.kernel
def rising_counts(a, c, *, one_writer: tl.constexpr = True):
    """Reader ``i`` waits for ``i + 1`` notifies of one slot: by one task writing ``staged`` element
    by element, notifying after each (``one_writer``), then reads element ``i`` of it; or by as many
    tasks notifying once each (whichever came first), and reads nothing they wrote."""
    ready, staged = tl.signal("ready", 1), tl.local_buffer(a.shape, a.dtype, "staged")
    if one_writer:
        @tl.compute_part(grid=(1,), name="write")
        def write(i):
            for k in tl.range(0, a.shape[0]):
                tl.store(staged, (k,), tl.load(a, (k,), (1,)) + 1.0)
                tl.producer_tile_notify(ready, 0)
    else:
        @tl.compute_part(grid=a.shape, name="arrive")
        def arrive(i):
            tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=a.shape, name="read")
    def read(i):
        tl.consumer_tile_wait(ready, 0, count=i + 1, per_launch=a.shape[0])
        tl.store(c, (i,), tl.load(staged if one_writer else a, (i,), (1,)) * 2.0)


@pytest.fixture
def joins(monkeypatch):
    """The sizes of the clocks the simulator's engine joins, one entry a join."""
    from tldsl.runtime.sim import engine
    sizes, join_into = [], engine.join_into

    def counting(dst, src):
        sizes.append(len(src))
        return join_into(dst, src)
    monkeypatch.setattr(engine, "join_into", counting)
    return sizes


def test_waits_for_rising_counts_of_many_notifiers_join_prefix_checkpoints(joins):
    # reader i is ordered after i + 1 different writers: it joins the prefix checkpoint below i + 1
    # and the few releases past it, not i + 1 clocks one by one
    from tldsl.runtime.sim.engine import CHECKPOINT
    n = 600
    inputs = [{"a": np.arange(n, dtype=F32), "c": np.full(n, np.nan, F32)}]
    out = tl.simulate(rising_counts, 1, inputs, seed=0, one_writer=False)
    np.testing.assert_array_equal(out[0]["c"], 2 * inputs[0]["a"])
    assert len(joins) <= 2 * CHECKPOINT * n, len(joins)      # one by one: 355,031 joins


def test_waits_for_rising_counts_join_each_notifier_once(joins):
    # reader i is ordered after the first i + 1 notifies, all by one task: the latest of them covers
    # the others, so each wait joins a few clocks, not i + 1 (n readers: O(n) joins, not n^2 / 2)
    n = 300
    inputs = [{"a": np.arange(n, dtype=F32), "c": np.full(n, np.nan, F32)}]
    for seed in range(3):
        joins.clear()
        out = tl.simulate(rising_counts, 1, inputs, seed=seed)
        np.testing.assert_array_equal(out[0]["c"], 2 * (inputs[0]["a"] + 1))
        # a few clocks a notify and a wait (the slot's, a prefix checkpoint's, the latest release's), not n^2 / 2
        assert len(joins) <= 10 * n and sum(joins) <= 20 * n, (len(joins), sum(joins))


@tl.kernel
def push_with_scope(a: tl.Symmetric, c, *, scope: tl.constexpr = "sys"):
    """Each rank pushes ``a`` into the next rank's ``inbox`` and notifies it at ``scope``."""
    W = tl.world_size()
    n = a.shape[0]
    inbox = tl.symmetric_buffer((n,), a.dtype, "inbox")
    arrived = tl.signal("arrived", 1, scope="symmetric")

    @tl.comm_part(grid=(1,), name="send")
    def send(i):
        peer = (tl.rank() + 1) % W
        tl.tile_push_data(inbox.at(peer), (0,), a, (0,), (n,))
        tl.peer_tile_notify(arrived, 0, peer, scope=scope)

    @tl.compute_part(grid=(1,), name="recv")
    def recv(i):
        tl.peer_tile_wait(arrived, 0)
        tl.store(c, (0,), tl.load(inbox, (0,), (n,)))


@pytest.mark.parametrize("seed", SEEDS)
def test_gpu_scope_release_does_not_order_a_peer(seed):
    W = 3
    inputs = _vec_inputs(W)
    good = tl.simulate(push_with_scope, W, inputs, seed=seed, scope="sys")
    for r in range(W):
        np.testing.assert_array_equal(good[r]["c"], inputs[(r - 1) % W]["a"])

    with pytest.raises(tl.RaceError) as info:
        tl.simulate(push_with_scope, W, inputs, seed=seed, scope="gpu")
    err, msg = info.value, str(info.value)
    reader = err.details["rank"]
    writer = (reader - 1) % W
    push = f"rank {writer} comm task send(0) (tile_push_data at test_simulator.py:" \
           f"{_line(push_with_scope, 'tl.tile_push_data(')})"
    load = f"rank {reader} compute task recv(0) (load at test_simulator.py:" \
           f"{_line(push_with_scope, 'tl.load(inbox')})"
    assert msg.startswith(f"race on inbox of rank {reader} "), msg
    assert re.search(r"^  write inbox\[0:8\] by " + re.escape(push) + "$", msg, re.M), msg
    assert re.search(r"^  read  inbox\[0:8\] by " + re.escape(load) + "$", msg, re.M), msg
    assert "too narrow a scope" in msg
    # the report names the wait the reader did, and the release that could not order it
    assert f"rank {reader} compute task recv(0) had waited on: arrived[0]" in msg, msg
    assert f"arrived[0] by rank {writer} was released at scope='gpu'" in msg, msg


# -- deadlocks ---------------------------------------------------------------------------------------

@tl.kernel
def crossed_handshake(a, c):
    """Each part waits for the other before notifying it: a cycle no static count can see."""
    to_mover = tl.signal("to_mover", 2)
    to_math = tl.signal("to_math", 2)

    @tl.comm_part(grid=(1,), name="mover")
    def mover(i):
        tl.consumer_tile_wait(to_mover, 1)
        tl.producer_tile_notify(to_math, 0)

    @tl.compute_part(grid=(1,), name="math")
    def math(i):
        tl.consumer_tile_wait(to_math, 0)
        tl.producer_tile_notify(to_mover, 1)
        tl.store(c, (0,), tl.load(a, (0,), (8,)))


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_deadlock_names_rank_tile_signal_and_channel(seed):
    with pytest.raises(tl.DeadlockError) as info:
        tl.simulate(crossed_handshake, 2, _vec_inputs(2), seed=seed)
    err, msg = info.value, str(info.value)
    assert msg.startswith("deadlock in launch 1")
    for rank in range(2):
        assert (f"rank {rank} comm task mover(0): consumer_tile_wait on 'to_mover'[1] at "
                f"test_simulator.py:{_line(crossed_handshake, 'tl.consumer_tile_wait(to_mover')}"
                " — has 0, needs 1") in msg
        assert (f"rank {rank} compute task math(0): consumer_tile_wait on 'to_math'[0] at "
                f"test_simulator.py:{_line(crossed_handshake, 'tl.consumer_tile_wait(to_math')}"
                " — has 0, needs 1") in msg
    d = err.details
    assert (d["rank"], d["tile"], d["primitive"]) == (0, (0,), "consumer_tile_wait")
    assert (d["signal"], d["channel"]) in {("to_mover", 1), ("to_math", 0)}
    assert len(d["blocked"]) == 4


@tl.kernel
def later_tile_produces(a, c):
    """Compute tile 0 consumes what compute tile 1 of the same part produces."""
    n = a.shape[0]
    done = tl.signal("done", 1)
    scratch = tl.local_buffer((n,), a.dtype, "scratch")

    @tl.compute_part(grid=(2,), name="tiles")
    def tiles(t):
        with tl.when(t == 0):
            tl.consumer_tile_wait(done, 0)
            tl.store(c, (0,), tl.load(scratch, (0,), (n,)) + 1.0)
        with tl.when(t == 1):
            tl.store(scratch, (0,), tl.load(a, (0,), (n,)))
            tl.producer_tile_notify(done, 0)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_deadlock_only_with_one_compute_slot(seed):
    W = 2
    inputs = _vec_inputs(W)
    for slots in (None, 2):      # every tile resident: tile 1 runs while tile 0 waits
        res = tl.simulate(later_tile_produces, W, inputs, seed=seed, options=tl.SimOptions(compute_slots=slots))
        for r in range(W):
            np.testing.assert_array_equal(res[r]["c"], inputs[r]["a"] + 1)
    # one resident tile at a time, in tile order: tile 0 holds the only slot, tile 1 never starts
    with pytest.raises(tl.DeadlockError) as info:
        tl.simulate(later_tile_produces, W, inputs, seed=seed, options=tl.SimOptions(compute_slots=1))
    msg = str(info.value)
    assert "compute task tiles(0): consumer_tile_wait on 'done'[0]" in msg
    assert "2 task(s) cannot start: each waits behind a blocked task of its lane" in msg
    assert "compute_slots" in msg


@tl.kernel
def later_tile_through_comm(a, c, *, order=(1, 0), notifiers=None):
    """Compute tile ``order[0]`` reads what a comm part copies from compute tile ``order[1]``'s
    rows: the waits go through another part, so no signal is both notified and waited on by
    ``tiles`` (the GPU run plan does not keep it resident); ``order=(0, 1)`` waits on a later tile.
    ``notifiers``: the tiles that notify the comm part (default: ``order[1]``), which waits for one
    notify of them all."""
    n = a.shape[0]
    notifying = (order[1],) if notifiers is None else notifiers
    ready = tl.signal("ready", 1)
    moved = tl.signal("moved", 1)
    first = tl.local_buffer((n,), a.dtype, "first")
    second = tl.local_buffer((n,), a.dtype, "second")

    @tl.comm_part(grid=(1,), name="move")
    def move(i):
        tl.consumer_tile_wait(ready, 0, count=1, per_launch=len(notifying))
        tl.store(second, (0,), tl.load(first, (0,), (n,)))
        tl.producer_tile_notify(moved, 0)

    @tl.compute_part(grid=(2,), name="tiles")
    def tiles(t):
        with tl.when(t == order[1]):
            tl.store(first, (0,), tl.load(a, (0,), (n,)))
        for k in notifying:
            with tl.when(t == k):
                tl.producer_tile_notify(ready, 0)
        with tl.when(t == order[0]):
            tl.consumer_tile_wait(moved, 0)
            tl.store(c, (0,), tl.load(second, (0,), (n,)) + 1.0)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_a_tile_waiting_through_another_part_for_a_later_tile_deadlocks_by_default(seed):
    """Tile 0 waits (through the comm part) for tile 1. A GPU may run ``tiles`` on one CTA
    (nothing makes its run plan keep both resident: no signal is both notified and waited on by
    ``tiles``), tile 0 first, and hang there. So by default the simulator runs a part that waits
    on its own tiles through other parts on one slot, and reports the deadlock with the reason;
    every tile resident (``compute_slots=2``) it runs. Tile 1 feeding tile 0 runs either way."""
    W = 2
    inputs = _vec_inputs(W)
    for order, options in (((1, 0), None), ((1, 0), tl.SimOptions(compute_slots=1)),
                           ((0, 1), tl.SimOptions(compute_slots=2))):
        res = tl.simulate(later_tile_through_comm, W, inputs, seed=seed, order=order, options=options)
        for r in range(W):
            np.testing.assert_array_equal(res[r]["c"], inputs[r]["a"] + 1)
    for options, why in ((None, "by default: it waits on its own tiles through other parts, and a GPU may give it "
                                "fewer CTAs than tiles; tl.SimOptions(compute_slots=N) checks every compute part on N "
                                "instead"),
                         (tl.SimOptions(compute_slots=1), "compute_slots")):
        with pytest.raises(tl.DeadlockError) as info:
            tl.simulate(later_tile_through_comm, W, inputs, seed=seed, order=(0, 1), options=options)
        msg = str(info.value)
        assert "compute task tiles(0): consumer_tile_wait on 'moved'[0]" in msg
        assert "comm task move(0): consumer_tile_wait on 'ready'[0]" in msg
        assert "2 task(s) cannot start" in msg and f"compute part 'tiles' ran on 1 slot(s) ({why})" in msg, msg
        assert "through other parts, for a later tile of its own slot" in msg


@tl.kernel
def two_parts_each_way(a, c, *, crossed: bool = False):
    """Two compute parts waiting on each other: tile t of 'first' stages its rows and then waits
    for tile t of 'second', which waits for the rows of tile t of 'first' — or, ``crossed``, of
    tile n - 1 - t. Neither part waits on a signal it notifies itself, so the GPU run plan keeps
    neither resident: crossed, a part on fewer CTAs than tiles hangs."""
    n = a.shape[0] // 8
    staged = tl.signal("staged", n)
    copied = tl.signal("copied", n)
    mid = tl.local_buffer(a.shape, a.dtype, "mid")

    @tl.compute_part(grid=(n,), name="first")
    def first(t):
        tl.store(mid, (t * 8,), tl.load(a, (t * 8,), (8,)) * 2.0)
        tl.producer_tile_notify(staged, t)
        tl.consumer_tile_wait(copied, t)
        tl.store(c, (t * 8,), tl.load(c, (t * 8,), (8,)) + 1.0)

    @tl.compute_part(grid=(n,), name="second")
    def second(t):
        src = n - 1 - t if crossed else t
        tl.consumer_tile_wait(staged, src)
        tl.store(c, (t * 8,), tl.load(mid, (src * 8,), (8,)))
        tl.producer_tile_notify(copied, t)


def two_parts_inputs(W, n):
    return [{"a": np.arange(8 * n, dtype=F32) + 1 + 100 * r, "c": np.full(8 * n, np.nan, F32)} for r in range(W)]


def two_parts_expected(a, n, crossed):
    src = a.reshape(n, 8)[::-1] if crossed else a.reshape(n, 8)
    return (src * 2 + 1).reshape(-1)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_parts_waiting_on_each_other_in_crossed_order_deadlock_by_default(seed):
    """Every tile resident, both orders run; a GPU gives each part only its share of the SMs, each
    CTA walking its tiles in order, so by default the parts run on one slot each: in order they
    run (on any number of CTAs, as on one), crossed they deadlock."""
    W, n = 2, 6
    inputs = two_parts_inputs(W, n)
    for crossed, options in ((False, None), (True, tl.SimOptions(compute_slots=n))):
        res = tl.simulate(two_parts_each_way, W, inputs, seed=seed, crossed=crossed, options=options)
        for r in range(W):
            np.testing.assert_array_equal(res[r]["c"], two_parts_expected(inputs[r]["a"], n, crossed))
    with pytest.raises(tl.DeadlockError) as info:
        tl.simulate(two_parts_each_way, W, inputs, seed=seed, crossed=True)
    msg = str(info.value)
    assert "compute task first(0): consumer_tile_wait on 'copied'[0]" in msg
    assert f"compute task second(0): consumer_tile_wait on 'staged'[{n - 1}]" in msg
    for part in ("first", "second"):
        assert f"compute part '{part}' ran on 1 slot(s) (by default: it waits on its own tiles through other" in msg


def test_the_parts_run_on_one_slot_are_those_waiting_on_themselves_through_others():
    """GEMM + ReduceScatter summing in the GEMM's epilogue: the GEMM waits for the copy engine's
    copies of its own tiles (checked on one slot); the combine behind MoE's grouped GEMM waits on
    it but nothing waits back; a part whose tiles wait for each other directly is kept resident by
    the GPU run plan. ``compute_slots`` applies to every part."""
    from tldsl.ops import OPS
    from tldsl.run import trace_for_run
    from tldsl.ir.part_graph import parts_waiting_through_others
    from tldsl.runtime.sim.engine import compute_slots

    def traced(name, **params):
        spec = OPS[name]
        W = params.pop("world_size")
        case = spec.make_case(np.random.default_rng(0), W, **params)
        return trace_for_run(spec.kernel, W, case.inputs, 0, None, case.kwargs)[0]

    epilogue = next(p for p in OPS["gemm_reduce_scatter"].mutant_params if p["comm"].reduce_in == "epilogue")
    assert parts_waiting_through_others(traced("gemm_reduce_scatter", **epilogue)) == ["gemm"]
    moe = traced("moe_reduce_scatter", **OPS["moe_reduce_scatter"].mutant_params[0])
    assert parts_waiting_through_others(moe) == []
    assert compute_slots(moe, None) == {"reduce_scatter": None, "grouped_gemm": None, "combine": None}
    assert compute_slots(moe, 3, ["combine"]) == {"reduce_scatter": 3, "grouped_gemm": 3, "combine": 3}
    assert compute_slots(moe, None, ["combine"]) == {"reduce_scatter": None, "grouped_gemm": None, "combine": 1}
    ir = two_parts_each_way.trace(1, tl.TensorSpec((48,), tl.float32), tl.TensorSpec((48,), tl.float32))
    assert parts_waiting_through_others(ir) == ["first", "second"]
    ir = later_tile_produces.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
    assert parts_waiting_through_others(ir) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_a_part_checked_on_one_slot_still_has_its_races_found(seed):
    """Tiles 0 and 1 both notify 'move', which waits for one notify but reads what tile 0 alone
    wrote. On one slot tile 0 always notifies first; with both resident, tile 1 may: a race. The
    one-slot run finds the deadlocks, and the race detector needs every tile resident, so the
    simulator runs such a kernel both ways: the race shows on these seeds (one whose
    interleaving lets tile 0 notify first shows none, as on one slot)."""
    with pytest.raises(tl.RaceError, match="race on first of rank 0"):
        tl.simulate(later_tile_through_comm, 1, _vec_inputs(1), seed=seed, notifiers=(0, 1))
    tl.simulate(later_tile_through_comm, 1, _vec_inputs(1), seed=seed, notifiers=(0, 1),
                options=tl.SimOptions(compute_slots=1))          # (one slot alone hides it)


# -- stale signals -------------------------------------------------------------------------------------

@tl.kernel
def staged_handoff(a, c, *, epoch: tl.constexpr = True, notifies: tl.constexpr = 1):
    """The comm part stages ``a`` and notifies ``notifies`` times; compute waits for one."""
    n = a.shape[0]
    ready = tl.signal("ready", 1)
    staged = tl.local_buffer((n,), a.dtype, "staged")

    @tl.comm_part(grid=(1,), name="stage")
    def stage(i):
        tl.store(staged, (0,), tl.load(a, (0,), (n,)))
        for _ in tl.static_range(notifies):
            tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=(1,), name="use")
    def use(i):
        tl.consumer_tile_wait(ready, 0, epoch=epoch)
        tl.store(c, (0,), tl.load(staged, (0,), (n,)))


def _launches(n):
    return tl.SimOptions(launches=n)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_epoch_counting_keeps_launches_apart(seed):
    inputs = _vec_inputs(2)
    res = tl.simulate(staged_handoff, 2, inputs, seed=seed, options=_launches(4))
    for r in range(2):
        np.testing.assert_array_equal(res[r]["c"], inputs[r]["a"])


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_absolute_wait_is_stale_in_the_second_launch(seed):
    inputs = _vec_inputs(2)
    res = tl.simulate(staged_handoff, 2, inputs, seed=seed, epoch=False, options=_launches(1))
    for r in range(2):
        np.testing.assert_array_equal(res[r]["c"], inputs[r]["a"])
    with pytest.raises(tl.StaleSignalError) as info:
        tl.simulate(staged_handoff, 2, inputs, seed=seed, epoch=False, options=_launches(2))
    msg = str(info.value)
    line = _line(staged_handoff, "tl.consumer_tile_wait(")
    assert re.match(rf"rank \d compute task use\(0\) \(consumer_tile_wait at test_simulator.py:{line}\) "
                    r"was satisfied by a stale signal", msg), msg
    assert "'ready'[0] already held 1 when launch 2 began, and the wait needs 1" in msg
    d = info.value.details
    assert (d["signal"], d["channel"], d["primitive"]) == ("ready", 0, "consumer_tile_wait")


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_over_notifying_is_stale_with_epoch_counting(seed):
    inputs = _vec_inputs(2)
    res = tl.simulate(staged_handoff, 2, inputs, seed=seed, notifies=2, options=_launches(1))
    for r in range(2):          # one launch: the extra notify is harmless
        np.testing.assert_array_equal(res[r]["c"], inputs[r]["a"])
    with pytest.raises(tl.StaleSignalError) as info:
        tl.simulate(staged_handoff, 2, inputs, seed=seed, notifies=2, options=_launches(2))
    assert "'ready'[0] already held 2 when launch 2 began, and the wait needs 2" in str(info.value)


# -- uninitialised reads and out-of-bounds ranks -----------------------------------------------------

@tl.kernel
def read_scratch(a, c, *, fill: tl.constexpr = False):
    n = a.shape[0]
    scratch = tl.local_buffer((n,), a.dtype, "scratch")

    @tl.compute_part(grid=(1,), name="use")
    def use(i):
        if fill:
            tl.store(scratch, (0,), tl.load(a, (0,), (n,)))
        tl.store(c, (0,), tl.load(scratch, (0,), (n,)))


def test_uninitialised_workspace_read():
    inputs = _vec_inputs(2)
    res = tl.simulate(read_scratch, 2, inputs, fill=True)
    for r in range(2):
        np.testing.assert_array_equal(res[r]["c"], inputs[r]["a"])
    with pytest.raises(tl.UninitializedReadError) as info:
        tl.simulate(read_scratch, 2, inputs)
    msg = str(info.value)
    line = _line(read_scratch, "tl.load(scratch")
    assert re.match(rf"rank (\d) compute task use\(0\) \(load at test_simulator.py:{line}\) reads "
                    r"scratch\[0:8\] on rank \1, but element \(0,\) was not written", msg), msg
    assert info.value.details["buffer"] == "scratch"


@tl.kernel
def pull_from_next(a: tl.Symmetric, c, *, wrap: tl.constexpr = True):
    W = tl.world_size()
    n = a.shape[0]

    @tl.compute_part(grid=(1,), name="use")
    def use(i):
        peer = (tl.rank() + 1) % W if wrap else tl.rank() + 1
        tl.store(c, (0,), tl.load(a.at(peer), (0,), (n,)))


def test_dynamic_rank_outside_the_group():
    inputs = _vec_inputs(3)
    res = tl.simulate(pull_from_next, 3, inputs)
    for r in range(3):          # rank 2 wraps around to rank 0
        np.testing.assert_array_equal(res[r]["c"], inputs[(r + 1) % 3]["a"])
    with pytest.raises(tl.OutOfBoundsError) as info:
        tl.simulate(pull_from_next, 3, inputs, wrap=False)
    msg = str(info.value)
    line = _line(pull_from_next, "tl.load(a.at(peer)")
    assert msg.splitlines()[0] == (f"rank 2 compute task use(0) (tile_pull_data at test_simulator.py:{line}): "
                                   "rank 3 is outside the group of 3 ranks")
    # then the line itself, with its path and a caret, as a compilation error shows it
    where, source, caret = msg.splitlines()[1:]
    assert where == f"  {__file__}:{line}:" and source.strip() == "tl.store(c, (0,), tl.load(a.at(peer), (0,), (n,)))"
    assert caret.strip() == "^" and source[len(caret) - 1:].startswith("tl.load")       # under the load
    assert [loc.lineno for loc in info.value.locs] == [line]


@tl.kernel
def notify_past_the_end(a, c):
    ready = tl.signal("ready", 2)

    @tl.comm_part(grid=(3,), name="stage")
    def stage(t):
        tl.producer_tile_notify(ready, t)     # t = 2 is past the signal's last slot

    @tl.compute_part(grid=(2,), name="use")
    def use(t):
        tl.consumer_tile_wait(ready, t)
        with tl.when(t == 0):                 # one writer of c: the run is about the channel, not a race
            tl.store(c, (0,), tl.load(a, (0,), (8,)))


def test_dynamic_channel_outside_the_signal():
    """Caught before the run by the static channel analysis, at the notify; and by the
    simulator itself where that analysis is off (or cannot compute the channel)."""
    with pytest.raises(tl.VerificationError, match=r"producer_tile_notify on rank 0, task \(2,\): channel 2 is "
                                                   r"outside signal 'ready' \(2 slots\)"):
        tl.simulate(notify_past_the_end, 1, _vec_inputs(1))
    with pytest.raises(tl.OutOfBoundsError) as info:
        tl.simulate(notify_past_the_end, 1, _vec_inputs(1), options=tl.SimOptions(static_checks=False))
    assert "comm task stage(2) (producer_tile_notify at test_simulator.py:" in str(info.value)
    assert "channel 2 is outside signal 'ready' (2 slots)" in str(info.value)


# -- determinism and exploration ------------------------------------------------------------------------

def _ag_case(W=3, Ms=20, K=24, N=20, seed=0):
    """Integer-valued f16 inputs: every product and sum is exact, so any two correct runs agree bit for bit."""
    rng = np.random.default_rng(seed)
    shards = [rng.integers(-3, 4, (Ms, K)).astype(np.float16) for _ in range(W)]
    b = rng.integers(-3, 4, (K, N)).astype(np.float16)
    inputs = [{"a": s, "b": b, "c": np.full((W * Ms, N), np.nan, np.float16)} for s in shards]
    ref = (np.concatenate(shards).astype(np.float64) @ b.astype(np.float64)).astype(np.float16)
    return inputs, ref


AG_SCHED = dict(compute=tl.ComputeSchedule(tile=(16, 16, 8)), comm=tl.CommSchedule(tile_m=8))


def test_same_seed_same_event_log():
    inputs, _ = _ag_case()
    a = tl.simulate(allgather_gemm, 3, inputs, seed=11, **AG_SCHED)
    b = tl.simulate(allgather_gemm, 3, inputs, seed=11, **AG_SCHED)
    assert len(a.events) > 50
    assert a.events == b.events and a.steps == b.steps
    assert a.timeline() == b.timeline()


def test_different_seeds_explore_different_orders():
    inputs, ref = _ag_case()
    logs = []
    for seed in range(6):
        res = tl.simulate(allgather_gemm, 3, inputs, seed=seed, **AG_SCHED)
        for r in range(3):
            np.testing.assert_array_equal(res[r]["c"], ref)
        # the order in which tasks ran (steps and task identities), not just the step counts
        logs.append(tuple((e[2], e[3], e[5], e[6]) for e in res.events))
    assert len(set(logs)) == len(logs)


# -- schedules change how, never what ----------------------------------------------------------------

COMPUTE_SCHEDULES = [
    tl.ComputeSchedule(tile=(16, 16, 8)),
    tl.ComputeSchedule(tile=(8, 32, 16), order="swizzled", group_m=2),
    tl.ComputeSchedule(tile=(32, 8, 32), order="comm_aligned"),
]
COMM_SCHEDULES = [
    tl.CommSchedule(tile_m=8),
    tl.CommSchedule(tile_m=16, order="full_mesh", mode="push", sms=3),
    tl.CommSchedule(tile_m=32, mode="pull", sms=1),
    tl.CommSchedule(engine="copy_engine", mode="pull"),
    tl.CommSchedule(engine="copy_engine", mode="push", order="full_mesh"),
]


def test_allgather_gemm_outputs_do_not_depend_on_the_schedule():
    inputs, ref = _ag_case()
    seen = set()
    for i, compute in enumerate(COMPUTE_SCHEDULES):
        for j, comm in enumerate(COMM_SCHEDULES):
            res = tl.simulate(allgather_gemm, 3, inputs, seed=i * 10 + j, compute=compute, comm=comm)
            for r in range(3):
                np.testing.assert_array_equal(res[r]["c"], ref, err_msg=f"{compute} {comm} rank {r}")
            seen.add(tuple((e[2], e[3], e[5]) for e in res.events if e[6] == "start"))
    # the schedules really ran differently
    assert len(seen) == len(COMPUTE_SCHEDULES) * len(COMM_SCHEDULES)


# -- the IR printer -----------------------------------------------------------------------------------------

def test_printed_ir_names_parts_schedules_buffers_and_lines():
    ir = fetch_then_use.trace(2, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32), wait=True)
    text = str(ir)
    assert text.splitlines()[0] == "kernel @fetch_then_use  world_size=2"
    assert "constexprs wait=True" in text
    assert "  arg       %a : tensor<8xf32, symmetric>" in text
    assert "  arg       %c : tensor<8xf32, global>" in text
    assert "  workspace %got : tensor<8xf32, global>" in text
    assert "  signal    %ready : signal<1, local>" in text
    assert "  comm part @fetch grid=(1,) engine=sm" in text and "// communication" in text
    assert "  compute part @use grid=(1,) engine=sm {  // computation" in text
    pull = _line(fetch_then_use, "tl.tile_pull_data(")
    wait = _line(fetch_then_use, "tl.consumer_tile_wait(")
    assert re.search(rf"^    tile_pull_data .*%a, .*%got, .*  // test_simulator\.py:{pull}$", text, re.M), text
    assert re.search(rf"^    consumer_tile_wait {{epoch=True}} %ready, 0, 1  // test_simulator\.py:{wait}$",
                     text, re.M), text
    # the comm part comes before the compute part, as declared
    assert text.index("@fetch") < text.index("@use")


def test_printed_ir_shows_schedules():
    inputs, _ = _ag_case()
    ir = allgather_gemm.trace(3, *(inputs[0][k] for k in ("a", "b", "c")),
                              compute=tl.ComputeSchedule(tile=(16, 16, 8), order="swizzled"),
                              comm=tl.CommSchedule(tile_m=8, mode="push", order="full_mesh"))
    text = str(ir)
    assert "  compute schedule: tile=(16, 16, 8) order=swizzled" in text
    assert "  comm schedule:    tile_m=8 order=full_mesh mode=push engine=sm" in text
    assert "  workspace %a_gathered : tensor<60x24xf16, symmetric>" in text
    assert re.search(r"^  comm part @\w+ grid=\(3, 3\) engine=sm lanes=2 \{  // communication$", text, re.M)
    assert re.search(r"^  compute part @gemm grid=\(4, 2\) engine=sm \{  // computation$", text, re.M)
    assert "// allgather_gemm.py:" in text


# -- the timeline --------------------------------------------------------------------------------------------

@tl.kernel
def slow_producer(a: tl.Symmetric, c):
    """The comm part copies ``a`` one element per step; the consumer waits for all of it."""
    n = a.shape[0]
    staged = tl.local_buffer((n,), a.dtype, "staged")
    ready = tl.signal("ready", 1)

    @tl.comm_part(grid=(1,), name="slow")
    def slow(i):
        for k in tl.range(0, n):
            tl.tile_pull_data(a.at(tl.rank()), (k,), (1,), staged, (k,))
        tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=(1,), name="consumer")
    def consumer(i):
        tl.consumer_tile_wait(ready, 0)
        tl.store(c, (0,), tl.load(staged, (0,), (n,)))


def test_timeline_shows_a_blocked_consumer():
    inputs = _vec_inputs(1, n=40)
    res = tl.simulate(slow_producer, 1, inputs, seed=0)
    np.testing.assert_array_equal(res[0]["c"], inputs[0]["a"])
    kinds = [e[6] for e in res.events if e[3] == "consumer"]
    assert kinds == ["start", "block", "resume", "end"]
    rows = {line.split("|")[0].split()[-1]: line.split("|")[1] for line in res.timeline().splitlines()[1:]}
    assert set(rows) == {"slow", "consumer"}
    # the consumer runs briefly, is blocked while the producer copies, then finishes
    assert re.fullmatch(r"#+~{40,}#+\.*", rows["consumer"]), rows["consumer"]
    assert re.fullmatch(r"#+\.*", rows["slow"]), rows["slow"]
    assert len(rows["consumer"]) == 64


def test_timeline_without_waits_shows_no_blocking():
    inputs = _vec_inputs(2)
    res = tl.simulate(read_scratch, 2, inputs, seed=0, fill=True)
    for r in range(2):
        np.testing.assert_array_equal(res[r]["c"], inputs[r]["a"])
    assert all(e[6] in ("start", "end") for e in res.events)
    timeline = res.timeline(width=32)
    rows = timeline.splitlines()[1:]
    assert len(rows) == 2 and all(re.fullmatch(r"#+\.*", line.split("|")[1]) for line in rows), timeline
    assert all(len(line.split("|")[1]) == 32 for line in rows)


# -- waits for the first pieces of a transfer (per_launch) ------------------------------------------

@tl.kernel
def pieces_then_use(a: tl.Symmetric, c, *, short: tl.constexpr = False):
    """The comm part pulls the next rank's ``a`` in two halves, notifying after each; the compute
    part waits for the first half (count 1 of 2 per launch) before reading it, then for both —
    or, ``short``, reads the second half after waiting for the first only."""
    W = tl.world_size()
    n = a.shape[0]
    h = n // 2
    got = tl.local_buffer((n,), a.dtype, "got")
    ready = tl.signal("ready", 1)

    @tl.comm_part(grid=(1,), name="fetch")
    def fetch(i):
        for lo in (0, h):
            tl.tile_pull_data(a.at((tl.rank() + 1) % W), (lo,), (h,), got, (lo,))
            tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=(1,), name="use")
    def use(i):
        tl.consumer_tile_wait(ready, 0, count=1, per_launch=2)
        tl.store(c, (0,), tl.load(got, (0,), (h,)) * 2.0)
        tl.consumer_tile_wait(ready, 0, count=1 if short else 2, per_launch=2)
        tl.store(c, (h,), tl.load(got, (h,), (h,)) * 2.0)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_waiting_for_the_first_pieces_of_a_transfer(seed):
    """per_launch: the wait for the first of a slot's two notifies per launch targets
    2 * (launch - 1) + 1 — right over four launches; waiting for one piece and reading both is a
    race (the second piece's copy is not ordered before the read)."""
    W = 2
    inputs = _vec_inputs(W)
    res = tl.simulate(pieces_then_use, W, inputs, seed=seed, options=_launches(4))
    for r in range(W):
        np.testing.assert_array_equal(res[r]["c"], 2 * inputs[(r + 1) % W]["a"])
    with pytest.raises(tl.RaceError) as info:
        for s in range(12):           # some schedule reads before the second half landed
            tl.simulate(pieces_then_use, W, inputs, seed=seed + 100 * s, short=True)
    assert info.value.details["buffer"] == "got"


def test_per_launch_waits_are_checked_when_traced():
    with pytest.raises(tl.CompilationError, match="count 3 exceeds per_launch=2"):
        _trace_one_wait(count=3, per_launch=2)
    with pytest.raises(tl.CompilationError, match="per_launch must be a positive int"):
        _trace_one_wait(count=1, per_launch=0)
    with pytest.raises(tl.CompilationError, match="it needs epoch=True"):
        _trace_one_wait(count=1, per_launch=2, epoch=False)


def _trace_one_wait(**wait):
    @tl.kernel
    def k(a, c):
        ready = tl.signal("ready", 1)

        @tl.compute_part(grid=(1,), name="use")
        def use(i):
            tl.consumer_tile_wait(ready, 0, **wait)
            tl.store(c, (0,), tl.load(a, (0,), (8,)))
    return k.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))


@tl.kernel
def relay_in_lanes(x, y, *, lanes: tl.constexpr = 2):
    done = tl.signal("done", 1)

    @tl.comm_part(grid=(4,), lanes=lanes, engine="sm")
    def part(t):
        with tl.when(t == 0):
            tl.consumer_tile_wait(done, 0, count=1, per_launch=2)
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)) + 1.0)
        with tl.when((t == 0) | (t == 2)):
            tl.producer_tile_notify(done, 0)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_a_lane_runs_its_tasks_in_order_as_the_gpus_ctas_do(seed):
    """Two lanes over four tasks: on the GPU CTA 0 runs tasks 0 and 2, one after the other, so
    task 0's wait, which only task 2 (or task 0 itself, later) satisfies, hangs. A lane that took
    whichever task came next would run task 2 once task 1 finished, and the run would pass (the
    reviewer's program); with a lane per task it does pass."""
    x = np.arange(32, dtype=np.float32)
    inputs = [{"x": x, "y": np.zeros(32, np.float32)}]
    with pytest.raises(tl.DeadlockError) as info:
        tl.simulate(relay_in_lanes, 1, inputs, seed=seed)
    assert "comm task part(0): consumer_tile_wait on 'done'[0]" in str(info.value)
    assert "1 task(s) cannot start: each waits behind a blocked task of its lane" in str(info.value)
    res = tl.simulate(relay_in_lanes, 1, inputs, seed=seed, lanes=4)
    np.testing.assert_array_equal(res[0]["y"], x + 1)


@tl.kernel
def _doubled(x, y):
    @tl.compute_part(grid=(2,))
    def rows(pm):
        tl.store(y, (pm * 8, 0), tl.load(x, (pm * 8, 0), (8, 16)) * 2)


def test_torch_tensors_are_inputs_as_they_are_for_tl_run_bf16_included():
    """A bf16 kernel is simulated from torch bf16 tensors (numpy has no bf16): traced for their
    dtypes, values read as torch holds them, outputs back as numpy float32 holding bf16 values —
    the same as the kernel traced for bf16 and given float32 arrays."""
    torch = pytest.importorskip("torch")
    x = (torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16) / 7 - 17).to(torch.bfloat16)
    y = torch.full((16, 16), float("nan"), dtype=torch.bfloat16)
    result = tl.simulate(_doubled, 1, [{"x": x, "y": y}])
    assert [b.type.dtype for b in result.kernel.args] == [tl.bfloat16, tl.bfloat16]
    got = result.outputs[0]["y"]
    assert got.dtype == np.float32 and np.array_equal(got, (x.float() * 2).to(torch.bfloat16).float().numpy())
    assert torch.isnan(y).all()                       # the caller's tensors are copied, not written
    traced = _doubled.trace(1, tl.TensorSpec((16, 16), tl.bfloat16), tl.TensorSpec((16, 16), tl.bfloat16))
    as_float32 = tl.simulate(traced, 1, [{"x": x.float().numpy(), "y": np.full((16, 16), np.nan, np.float32)}])
    assert np.array_equal(as_float32.outputs[0]["y"], got)
    half = tl.simulate(_doubled, 1, [{"x": x.to(torch.float16), "y": y.to(torch.float16)}])
    assert half.outputs[0]["y"].dtype == np.float16 and half.kernel.args[0].type.dtype == tl.float16


def test_a_torch_tensor_with_its_negative_or_conjugate_bit_set_is_read_as_its_values():
    """A lazily negated view (``_neg_view()``, which some torch ops return) was torch's RuntimeError
    from ``.numpy()`` ("negative bit set"); the simulator now reads the values it stands for."""
    torch = pytest.importorskip("torch")
    from tldsl.runtime.sim.memory import host_array, host_float32
    base = torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16)
    x = base._neg_view()
    assert x.is_neg()
    result = tl.simulate(_doubled, 1, [{"x": x, "y": np.zeros((16, 16), np.float32)}])
    np.testing.assert_array_equal(result[0]["y"], -2 * base.numpy())
    np.testing.assert_array_equal(host_float32("x", x), -base.numpy())
    conj = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert conj.is_conj() and np.array_equal(host_array(conj), np.array([1 - 2j, 3 + 1j]))


def test_the_op_librarys_simulate_wrappers_take_the_tensors_tl_simulate_takes():
    """Found by an explorer's round: fused_all_gather_matmul (like the MoE wrappers, tested in
    test_op_moe.py) called np.asarray on its operands, and crashed on bf16 tensors (TypeError) and
    on tensors that require grad (RuntimeError), which tl.simulate takes. Now it hands them on as
    they are: bf16 traced as bf16, the result that of the same values as float32 (small integers:
    exact)."""
    torch = pytest.importorskip("torch")
    from tldsl.ops.allgather_gemm import fused_all_gather_matmul, reference
    rng = np.random.default_rng(0)
    a = [rng.integers(-3, 4, (16, 16)).astype(np.float32) for _ in range(2)]
    b = rng.integers(-3, 4, (16, 8)).astype(np.float32)
    want = reference(a, b)
    kw = dict(compute=tl.ComputeSchedule(tile=(16, 16, 16)), options={"launches": 1})
    for dtype in (torch.bfloat16, torch.float16):
        got = fused_all_gather_matmul([torch.tensor(x, dtype=dtype) for x in a], torch.tensor(b, dtype=dtype), **kw)
        for gathered, c in got:
            assert np.array_equal(np.asarray(gathered, np.float32), np.concatenate(a))
            assert np.array_equal(np.asarray(c, np.float32), want), dtype
    grad = fused_all_gather_matmul([torch.tensor(x).requires_grad_() for x in a], torch.tensor(b), **kw)
    assert all(np.array_equal(c, want) for _, c in grad)
    with pytest.raises(tl.InputError, match=r"floating-point arrays \(float16, bfloat16 or float32\), got "
                                            r"torch.int32"):
        fused_all_gather_matmul([torch.zeros(16, 16, dtype=torch.int32)] * 2, torch.zeros(16, 8, dtype=torch.int32))


@tl.kernel
def accumulate(x, y, seen: tl.Symmetric):
    """``y += x`` in place, and a symmetric argument pushed into by the next rank."""
    W = tl.world_size()

    @tl.compute_part(grid=(2,))
    def part(p):
        tl.store(y, (p * 4,), tl.load(y, (p * 4,), (4,)) + tl.load(x, (p * 4,), (4,)))
        tl.tile_push_data(seen.at((tl.rank() + 1) % W), (p * 4,), tl.load(x, (p * 4,), (4,)) * 2.0)


@pytest.mark.parametrize("launches", [1, 2, 3])
def test_every_launch_runs_on_the_callers_arguments(launches):
    """An in-place kernel returns one application of itself whatever ``launches`` is: what the
    program writes into its arguments is put back between launches (signals and workspaces
    carry over). It returned ``y + launches * x`` before."""
    rng = np.random.default_rng(4)
    inputs = [{"x": rng.standard_normal(8).astype(np.float32), "y": rng.standard_normal(8).astype(np.float32),
               "seen": rng.standard_normal(8).astype(np.float32)} for _ in range(2)]
    res = tl.simulate(accumulate, 2, inputs, options=tl.SimOptions(launches=launches))
    assert res.launches == launches
    for r in range(2):
        np.testing.assert_array_equal(res[r]["y"], inputs[r]["y"] + inputs[r]["x"])
        np.testing.assert_array_equal(res[r]["x"], inputs[r]["x"])
    for r in range(2):
        np.testing.assert_array_equal(res[(r + 1) % 2]["seen"], inputs[r]["x"] * 2)


@tl.kernel
def lagged_by_mistake(x, stage: tl.Symmetric, y):
    """``lag=1`` where ``lag=0`` was meant: the wait counts the previous launch's notify."""
    W = tl.world_size()
    M, N = x.shape
    got = tl.signal("got", W, scope="symmetric")

    @tl.comm_part(grid=(W,))
    def send(s):
        me = tl.rank()
        p = (me + s) % W
        tl.tile_push_data(stage.at(p), (me * M, 0), x, (0, 0), (M, N))
        tl.peer_tile_notify(got, me, p)

    @tl.compute_part(grid=(W,))
    def use(q):
        tl.peer_tile_wait(got, q, lag=1)
        tl.store(y, (q * M, 0), tl.load(stage, (q * M, 0), (M, N)))


def test_a_race_report_names_a_wait_that_counted_an_earlier_launch():
    inputs = [{"x": np.full((8, 8), r + 1.0, np.float32), "stage": np.full((16, 8), np.nan, np.float32),
               "y": np.full((16, 8), np.nan, np.float32)} for r in range(2)]
    with pytest.raises(tl.RaceError, match=r"had waited on:? got\[\d\] \(lag=1: the notifies of 1 launch back, "
                                           r"none of this launch's\)"):
        tl.simulate(lagged_by_mistake, 2, inputs)


def test_a_part_waiting_on_later_tasks_of_its_own_is_warned_of_where_a_gpu_could_not_hold_it():
    """The reverse chain (tile t waits for tile t + 1) simulates with every tile at once, but tl.run
    refuses it past 132 tiles on an H100 / H200: the simulation says so (ResidencyWarning); the
    running sum (each tile waits for the one before it) and a chain a GPU holds whole are not warned of."""
    import warnings
    from test_run_plan import reverse_chain, running_sum

    def warned(fn, n):
        x = np.arange(8 * n, dtype=np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tl.simulate(fn, 1, [{"x": x, "y": np.full(8 * n, np.nan, np.float32)}])
        return [w for w in caught if issubclass(w.category, tl.ResidencyWarning)]

    (w,) = warned(reverse_chain, 200)
    assert "part 'part' waits for its own tasks (signal(s) done)" in str(w.message) and w.filename == __file__
    assert "SimOptions(compute_slots=132)" in str(w.message)
    assert not warned(running_sum, 200) and not warned(reverse_chain, 16)
