"""The static channel analysis a trace runs (``tldsl.ir.analysis``): a wait that no launch can
satisfy is an error at the user's line before anything runs, found by evaluating the index
arithmetic of every (rank, task) — once per run of tasks that differ only along grid axes no
synchronisation index reads, and within a budget that gives up early only where the work seen
over a spread of the grid says the whole would not fit."""
from __future__ import annotations

import pytest

import tldsl as tl
import tldsl.ir.analysis as an
from tldsl.errors import VerificationError

S = tl.TensorSpec
TILES = [S((32, 32), tl.float32)] * 3


def fan_in(count: int):
    """Sixteen producer tasks (4 x 4) each notify channel ``i`` — the column index ``j`` feeds no
    synchronisation — and four consumers each wait for ``count`` notifies on their channel."""
    @tl.kernel
    def fan_in(x, y, z):
        ready = tl.signal("ready", 4)

        @tl.compute_part(grid=(4, 4))
        def produce(i, j):
            tl.store(y, (i * 8, j * 8), tl.load(x, (i * 8, j * 8), (8, 8)))
            tl.producer_tile_notify(ready, i)

        @tl.compute_part(grid=(4,))
        def consume(t):
            tl.consumer_tile_wait(ready, t, count=count)
            tl.store(z, (t * 8, 0), tl.load(y, (t * 8, 0), (8, 32)))
    return fan_in


def test_tasks_along_an_unread_axis_are_evaluated_once_and_counted_for_each(monkeypatch):
    k = fan_in(4).trace(1, *TILES)
    sites = an.collect(k)
    assert sites.complete and sorted(sites.notifies.values()) == [4, 4, 4, 4]
    # the same verdicts as the enumeration of every task
    monkeypatch.setattr(an, "_task_extents", lambda part, ops_of: (tuple(part.grid), 1))
    every = an.collect(k)
    assert every.notifies == sites.notifies and every.evaluated > sites.evaluated
    assert [w[1:] for w in every.waits] == [w[1:] for w in sites.waits]
    monkeypatch.undo()
    with pytest.raises(VerificationError, match="waits for 5 notifies on channel 0 of signal 'ready', but only 4 "
                                                "can arrive") as e:
        fan_in(5).trace(1, *TILES)
    assert e.value.loc.filename == __file__


@tl.kernel
def one_heavy_task(x, z):
    """3000 consumer tasks; only the last loops (3000 times) around a wait on a channel that no
    task notifies: cheap to enumerate whole (about 6000 blocks), a hang to report."""
    ready = tl.signal("ready", 2)

    @tl.compute_part(grid=(1,))
    def produce(t):
        tl.store(z, (0,), tl.load(x, (0,), (8,)))
        tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=(3000,))
    def consume(t):
        for _ in tl.range(0, t // 2999 * 3000):
            tl.consumer_tile_wait(ready, 1)
        tl.store(z, (t * 8,), tl.load(x, (0,), (8,)))


def test_uneven_work_within_the_budget_is_enumerated_whole():
    """Three sample tasks would have put this kernel at 3M blocks and skipped it; the spread
    enumeration sees its real cost and reports the hang."""
    with pytest.raises(VerificationError, match="waits for 1 notify on channel 1 of signal 'ready'"):
        one_heavy_task.trace(1, S((8,), tl.float32), S((3000 * 8,), tl.float32))


def test_the_spread_order_visits_every_pair_once():
    for n in (1, 2, 7, 64, 1000, 3001):
        order = list(an._spread(n))
        assert sorted(order) == list(range(n))
        if n >= 64:      # a prefix reaches the far end of the grid
            assert max(order[: n // 16]) > n * 3 // 4
