"""The host's side of the generated kernels' run-time checks (``runtime/gpu/run_checks.py``):
how a recorded failure is decoded and which error, at which line, it becomes. The kernels' side
is emulated in tests/test_codegen_general.py and run on a GPU in tests/test_gpu_run.py."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen.ir_queries import wait_at_site, wait_site
from tldsl.runtime.gpu.run_checks import decode, failure
from tldsl.runtime.gpu.run_errors import RunCheckError

from test_codegen_general import F32, S, counted_wait


def _word(site: int, count: int) -> int:
    """The word as ``tldsl::checked_count`` writes it."""
    return ((site + 1) << 32) | (count & 0xFFFFFFFF)


@pytest.mark.parametrize("count", [0, -3, -2**31, 5, 2**31 - 1])
def test_a_recorded_failure_decodes_to_its_site_and_count(count):
    assert decode(0) is None
    assert decode(_word(0, count)) == (0, count)
    assert decode(_word(41, count)) == (41, count)


@pytest.mark.parametrize("per_launch, says", [(None, "must be positive — tl.simulate refuses it too"),
                                              (1, "must be positive and at most the slot's 1 notifies per launch")])
def test_a_failure_is_a_simulation_error_at_the_waits_line(per_launch, says):
    k = counted_wait.trace(1, S((8, 8), F32), S((1,), tl.int32), S((8, 8), F32),
                           compute=tl.ComputeSchedule(tile=(8, 8, 8)), per_launch=per_launch)
    wait = next(op for _, op in k.walk() if op.name == "consumer_tile_wait")
    site = wait_site(wait)
    assert wait_at_site(k, site) is wait and wait_at_site(k, site + 1) is None
    assert failure(k, 0, 1) is None
    err = failure(k, _word(site, 0), 2)
    assert isinstance(err, RunCheckError) and isinstance(err, tl.SimulationError)
    msg = str(err)
    assert msg.startswith(f"launch 2: consumer_tile_wait at {wait.loc.short()}: its count was 0 at run time")
    assert says in msg and "the outputs of this launch are not to be trusted" in msg
    assert "tl.consumer_tile_wait(s, 0, count=tl.load_scalar(cnt, (0,)), per_launch=per_launch)" in msg  # the line
    assert err.details == {"count": 0, "op": "consumer_tile_wait"}
    assert "no wait of kernel" in str(failure(k, _word(site + 1, -1), 1))


def test_waits_with_literal_counts_are_not_checked_at_run_time():
    """A literal count was checked when the program was traced: its wait's code is unchanged."""
    from tldsl.codegen.rules.primitives import checked_count
    k = counted_wait.trace(1, S((8, 8), F32), S((1,), tl.int32), S((8, 8), F32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    wait = next(op for _, op in k.walk() if op.name == "consumer_tile_wait")
    assert checked_count(wait, "3", 7) == "3"
    assert checked_count(wait, "t_4", 7) == "tldsl::checked_count(t_4, 7u, 0)"


@tl.kernel
def three_in_a_row(x, cnt, y, *, compute: tl.ComputeSchedule = None):
    """a -> b -> c: b waits only on a (tl.run runs it after a on its stream: that signal and its
    notifies and wait are dropped before lowering), c waits on b by a count read from a table."""
    M, N = x.shape
    s1 = tl.signal("s1", 1)
    s2 = tl.signal("s2", 1)
    ws1 = tl.local_buffer((M, N), x.dtype, "ws1")
    ws2 = tl.local_buffer((M, N), x.dtype, "ws2")

    @tl.compute_part(grid=(1,))
    def a(i):
        tl.store(ws1, (0, 0), tl.load(x, (0, 0), (M, N)) * 2.0)
        tl.producer_tile_notify(s1, 0)

    @tl.compute_part(grid=(1,))
    def b(i):
        tl.consumer_tile_wait(s1, 0, count=1)
        tl.store(ws2, (0, 0), tl.load(ws1, (0, 0), (M, N)) + 1.0)
        tl.producer_tile_notify(s2, 0)

    @tl.compute_part(grid=(1,))
    def c(i):
        tl.consumer_tile_wait(s2, 0, count=tl.load_scalar(cnt, (0,)))
        tl.store(y, (0, 0), tl.load(ws2, (0, 0), (M, N)) + 1.0)


def test_a_site_names_its_wait_after_the_rewrites_lowering_makes():
    """tl.run lowers the kernel with the signals stream order makes redundant dropped (ops removed,
    positions shifted): the site the generated check carries still names, in the kernel as
    traced, the wait whose count it checked (an op's position named a store two lines up; found
    by a reviewer)."""
    import re
    from tldsl.runtime.gpu.run_plan import lower_for_run
    k = three_in_a_row.trace(1, S((8, 8), F32), S((1,), tl.int32), S((8, 8), F32),
                             compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    wait = [o for _, o in k.walk() if o.name == "consumer_tile_wait"][-1]
    sites = [int(m.group(1)) for lk in lower_for_run(k).values()
             for m in re.finditer(r"tldsl::checked_count\(.*?, (\d+)u", getattr(lk, "source", ""))]
    assert sites == [wait_site(wait)]
    err = failure(k, _word(sites[0], 0), 1)
    assert f"consumer_tile_wait at {wait.loc.short()}" in str(err)
