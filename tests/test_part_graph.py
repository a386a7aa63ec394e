"""Which parts wait on which (ir/part_graph.py): direct waits through the signals a part waits on
and another notifies, and waits through other parts — what folding two parts into one kernel
must rule out."""
from __future__ import annotations

import tldsl as tl
from tldsl.ir.part_graph import notifiers, reaches, self_signals, waited_signals, waits_on

S, F32 = tl.TensorSpec, tl.float32


@tl.kernel
def relay(x, y, z, w, *, compute: tl.ComputeSchedule = None):
    """``third`` waits on ``second``, which waits on ``first``: a chain of three compute parts."""
    a_done = tl.signal("a_done", 4)
    b_done = tl.signal("b_done", 4)

    @tl.compute_part(grid=(4,))
    def first(t):
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)) + 1.0)
        tl.producer_tile_notify(a_done, t)

    @tl.compute_part(grid=(4,))
    def second(t):
        tl.consumer_tile_wait(a_done, t)
        tl.consumer_tile_wait(a_done, t)
        tl.store(z, (t * 8,), tl.load(y, (t * 8,), (8,)) * 2.0)
        tl.producer_tile_notify(b_done, t)

    @tl.compute_part(grid=(4,))
    def third(t):
        tl.consumer_tile_wait(b_done, t)
        tl.store(w, (t * 8,), tl.load(z, (t * 8,), (8,)) - 1.0)


def _relay():
    return relay.trace(1, *[S((32,), F32)] * 4, compute=tl.ComputeSchedule(tile=(8, 8, 8)))


def test_direct_waits_follow_the_signals():
    k = _relay()
    assert notifiers(k) == {"a_done": {"first"}, "b_done": {"second"}}
    assert [s.name for s in waited_signals(k.part("second"))] == ["a_done"]          # each signal once
    assert waits_on(k) == {"first": set(), "second": {"first"}, "third": {"second"}}


def test_reaches_goes_through_other_parts_and_only_one_way():
    deps = waits_on(_relay())
    assert reaches(deps, "third", "first") and reaches(deps, "third", "second")
    assert not reaches(deps, "first", "third") and not reaches(deps, "second", "third")
    assert not reaches(deps, "first", "first")


def test_self_signals_are_those_a_part_notifies_and_waits_on():
    k = _relay()
    assert [self_signals(k.part(p)) for p in ("first", "second", "third")] == [[], [], []]
    from test_run_plan_split import chain_program          # 'chain' waits on its own tasks
    kc = chain_program()
    assert self_signals(kc.part("chain")) != []
