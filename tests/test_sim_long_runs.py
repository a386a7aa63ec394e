"""A long simulation says so before it starts, with the number of scheduler steps to expect,
and shows progress while it runs: on stderr by default (what a terminal and a notebook both
show), or through a callback (a notebook's progress bar). Steps grow as W^2: at W = 128 the
library's AllGather+GEMM below takes 22 W^2 of them, and the warning comes before the
static analysis and before any step runs."""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

import tldsl as tl
from tldsl.ops import OPS
from tldsl.runtime.sim import LongSimulationWarning, SimProgress


def _allgather_gemm(W, n=64):
    """AllGather+GEMM with one 16-row communication tile per rank and 16x16x16 compute tiles:
    per launch, W^2 comm tasks of 3 steps (start, pull, notify) and W^2 * n/16 compute tasks
    of 2 (start, one wait)."""
    spec = OPS["allgather_gemm"]
    case = spec.make_case(np.random.default_rng(0), W, rows_per_rank=16, n=n, k=64,
                          compute=tl.ComputeSchedule(tile=(16, 16, 16)), comm=tl.CommSchedule(tile_m=16))
    return spec.kernel, case


def _expected_steps(W, n=64, launches=2):
    return launches * (3 * W * W + 2 * W * W * (n // 16))


class _Stop(Exception):
    """Raised by a test's progress callback to end a long run early."""


@pytest.mark.timed
def test_large_world_warns_before_anything_runs():
    W = 128
    kernel, case = _allgather_gemm(W)
    t0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LongSimulationWarning)     # the warning ends the call
        with pytest.raises(LongSimulationWarning) as info:
            tl.simulate(kernel, W, case.inputs, **case.kwargs)
    msg = str(info.value)
    assert f"simulating W={W} ranks: about {_expected_steps(W):,} scheduler steps expected" in msg, msg
    assert f"{W * W * 5:,} tasks per launch" in msg and "grows with W^2" in msg, msg
    assert "SimOptions(warn_steps=None)" in msg
    # up front: before the static channel analysis (seconds at this W) and any scheduler step
    assert time.process_time() - t0 < 3.0


def test_warning_says_when_the_run_would_hit_max_steps():
    W = 128
    kernel, case = _allgather_gemm(W)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LongSimulationWarning)
        with pytest.raises(LongSimulationWarning, match=r"more than max_steps=100,000: the run will stop there"):
            tl.simulate(kernel, W, case.inputs, options=tl.SimOptions(max_steps=100_000), **case.kwargs)


def test_large_world_reports_progress_while_it_runs():
    W = 128
    kernel, case = _allgather_gemm(W)
    seen: list[SimProgress] = []

    def progress(p):
        seen.append(p)
        if len(seen) == 3:
            raise _Stop

    opts = tl.SimOptions(progress=progress, progress_interval_s=0.0, static_checks=False)
    with pytest.warns(LongSimulationWarning):
        with pytest.raises(_Stop):
            tl.simulate(kernel, W, case.inputs, options=opts, **case.kwargs)
    assert [p.launch for p in seen] == [1, 1, 1]
    assert all(p.expected_steps == _expected_steps(W) and p.launches == 2 and not p.done for p in seen)
    assert 0 < seen[0].steps < seen[1].steps < seen[2].steps < _expected_steps(W) // 2
    assert str(seen[0]).startswith(f"tl.simulate: launch 1/2, step {seen[0].steps:,} of about "
                                   f"{_expected_steps(W):,} (0%)")


def test_the_estimate_holds_and_smaller_runs_do_not_warn():
    # (W = 64 runs without a warning too: test_sim_speed runs every library op there)
    W = 32
    kernel, case = _allgather_gemm(W, n=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = tl.simulate(kernel, W, case.inputs, options=tl.SimOptions(static_checks=False), **case.kwargs)
    assert res.expected_steps == _expected_steps(W, n=16)
    # a wait that finds its signal already set takes no step of its own: the estimate is a little high
    assert 0.95 * res.expected_steps <= res.steps <= res.expected_steps


def test_progress_callback_sees_every_launch_and_the_end():
    W = 16
    kernel, case = _allgather_gemm(W)
    seen: list[SimProgress] = []
    res = tl.simulate(kernel, W, case.inputs, options=tl.SimOptions(progress=seen.append, progress_interval_s=0.0),
                      **case.kwargs)
    assert {p.launch for p in seen if not p.done} == {1, 2}
    steps = [p.steps for p in seen]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    last = seen[-1]
    assert last.done and last.steps == res.steps and last.expected_steps == res.expected_steps
    assert str(last).startswith(f"tl.simulate: done, {res.steps:,} scheduler steps in ")


def test_a_warned_run_prints_progress_to_stderr(capsys, monkeypatch):
    # a small run made "long" by a low threshold: the warning, then progress lines on stderr
    monkeypatch.delenv("TLDSL_QUIET", raising=False)
    W = 8
    kernel, case = _allgather_gemm(W)
    with pytest.warns(LongSimulationWarning, match=f"about {_expected_steps(W):,} scheduler steps"):
        res = tl.simulate(kernel, W, case.inputs, options=tl.SimOptions(warn_steps=100, progress_interval_s=0.0),
                          **case.kwargs)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("tl.simulate: ") for line in lines), lines
    assert lines[0].startswith("tl.simulate: launch 1/2, step ")
    assert lines[-1].startswith(f"tl.simulate: done, {res.steps:,} scheduler steps in ")


@pytest.mark.parametrize("asked", [False, True])
def test_tldsl_quiet_silences_the_lines_a_warned_run_prints_unasked(capsys, monkeypatch, asked):
    """``TLDSL_QUIET=1`` kept the compile quiet but a long simulation still printed its progress;
    ``SimOptions(progress=True)`` still prints."""
    monkeypatch.setenv("TLDSL_QUIET", "1")
    kernel, case = _allgather_gemm(8)
    opts = tl.SimOptions(warn_steps=100, progress_interval_s=0.0, progress=True if asked else None)
    with pytest.warns(LongSimulationWarning):
        tl.simulate(kernel, 8, case.inputs, options=opts, **case.kwargs)
    lines = capsys.readouterr().err.splitlines()
    assert (len(lines) > 1 and lines[-1].startswith("tl.simulate: done")) if asked else lines == [], lines


@pytest.mark.parametrize("opts", [dict(warn_steps=100, progress=False), dict()])
def test_quiet_unless_warned_or_asked(capsys, opts):
    W = 8
    kernel, case = _allgather_gemm(W)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LongSimulationWarning)
        tl.simulate(kernel, W, case.inputs, options=tl.SimOptions(progress_interval_s=0.0, **opts), **case.kwargs)
    assert capsys.readouterr().err == ""


def test_progress_option_is_checked():
    with pytest.raises(ValueError, match="progress must be None, True, False or a function"):
        tl.SimOptions(progress="stderr")


def test_progress_asked_for_reports_at_least_the_end(capsys):
    # a run shorter than one progress interval still says when it is done
    W = 4
    kernel, case = _allgather_gemm(W)
    res = tl.simulate(kernel, W, case.inputs, options=tl.SimOptions(progress=True), **case.kwargs)
    lines = capsys.readouterr().err.splitlines()
    assert lines and lines[-1].startswith(f"tl.simulate: done, {res.steps:,} scheduler steps in "), lines
    assert all(line.startswith("tl.simulate: launch ") for line in lines[:-1]), lines


def test_a_kernel_checked_on_one_slot_first_reports_both_runs_as_one():
    """Parts waiting on themselves through others are run twice (on one slot, then every tile
    resident): progress covers both, launches and steps counted on, and ends once."""
    from test_simulator import two_parts_each_way, two_parts_inputs
    W, n = 2, 64
    seen: list[SimProgress] = []
    res = tl.simulate(two_parts_each_way, W, two_parts_inputs(W, n),
                      options=tl.SimOptions(progress=seen.append, progress_interval_s=0.0, launches=2))
    assert {p.launch for p in seen if not p.done} == {1, 2, 3, 4} and all(p.launches == 4 for p in seen)
    steps = [p.steps for p in seen]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert [p.done for p in seen].count(True) == 1 and seen[-1].done
    assert seen[-1].expected_steps == 2 * res.expected_steps
    assert res.steps < seen[-1].steps <= 2.2 * res.steps         # the one-slot run's steps, then the returned run's


def _counting(turns: int, inner: int = 1):
    @tl.kernel
    def counted(out):
        @tl.compute_part(grid=(2,))
        def v(p):
            acc = tl.fragment((8,), tl.float32)
            for i in tl.range(0, turns):
                for j in tl.range(0, inner):
                    acc += 1.0
            tl.store(out, (p * 8,), acc)
    return counted


def test_a_long_loop_without_primitives_warns_though_it_takes_few_steps():
    """A tl.range loop that reaches no primitive runs within one scheduler step: a billion turns
    of it are four steps, so its turns are counted apart — nested loops multiplied — and warned
    about before anything runs; a short one is not."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", LongSimulationWarning)
        with pytest.raises(LongSimulationWarning) as info:
            tl.simulate(_counting(1 << 15, 1 << 15), 1, [{"out": np.zeros(16, np.float32)}])
        msg = str(info.value)
        turns = 2 * 2 * (1 << 15) * (1 + (1 << 15))          # launches x tasks x outer x (1 + inner)
        assert "about 4 scheduler steps expected" in msg and f"turn about {turns:,} times in all" in msg, msg
        got = tl.simulate(_counting(64, 4), 1, [{"out": np.zeros(16, np.float32)}])[0]["out"]
    assert (got == 256).all()
