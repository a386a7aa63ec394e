"""The figures: ``SimResult.plot_timeline()`` (one lane per rank and engine, tasks coloured by
part, notify → wait arrows for one tile) and ``tldsl.plots.plot_phases`` (a GPU launch's phases,
per rank and stream); each returns a Figure and saves it with ``save=`` in the same call."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib", reason="the plot extra: pip install -e '.[plot]' (in [test])")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

import tldsl as tl  # noqa: E402
from tldsl.ops.allgather_gemm import allgather_gemm  # noqa: E402
from tldsl.plots import PlotInputError, plot_phases  # noqa: E402
from tldsl.runtime.sim.plot import longest_blocked, task_lives  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tutorials" / "data"


@pytest.fixture(scope="module")
def result():
    W, Ms, K, N = 3, 32, 32, 32
    rng = np.random.default_rng(1)
    b = rng.integers(-3, 4, (K, N)).astype(np.float16)
    inputs = [{"a": rng.integers(-3, 4, (Ms, K)).astype(np.float16), "b": b,
               "c": np.full((W * Ms, N), np.nan, np.float16)} for _ in range(W)]
    return tl.simulate(allgather_gemm, W, inputs, seed=3, compute=tl.ComputeSchedule(tile=(16, 16, 16)),
                       comm=tl.CommSchedule(engine="copy_engine", mode="pull"))


def test_task_lives_follow_the_event_log(result):
    lives = task_lives(result)
    parts = {p.name: p for p in result.kernel.parts}
    per_part = {name: sum(1 for life in lives.values() if life.part == name and life.rank == 0) for name in parts}
    assert per_part == {name: p.num_tasks for name, p in parts.items()}        # every task of the launch
    for life in lives.values():
        assert life.running, life                                               # each ran at some point
        segs = sorted(life.running + [(a, b) for a, b, _ in life.blocked])
        assert all(a < b for a, b in segs) and all(b1 <= a2 for (_, b1), (a2, _) in zip(segs, segs[1:]))
    chosen = lives[longest_blocked(lives)]
    assert chosen.role == "compute" and chosen.blocked


def test_plot_timeline_lanes_colours_and_arrows(result, tmp_path):
    path = tmp_path / "timeline.png"
    fig = result.plot_timeline(save=path)
    assert isinstance(fig, Figure) and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    W = result.kernel.world_size
    lanes = [t.get_text() for t in ax.get_yticklabels()]
    engines = list(dict.fromkeys(p.engine for p in result.kernel.parts))     # in the kernel's part order
    assert sorted(engines) == ["copy_engine", "sm"]
    assert lanes == [f"rank {r} {e}" for r in range(W) for e in engines]
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert legend == {p.name for p in result.kernel.parts}
    colours = {tuple(c.get_facecolor()[0][:3]) for c in ax.collections}
    assert len(colours) == len(result.kernel.parts)                            # one colour per part
    arrows = [a for a in ax.texts if isinstance(a, Annotation) and a.arrow_patch is not None]
    lives = task_lives(result)
    chosen = lives[longest_blocked(lives)]
    slots = {f"{slot}@{chosen.rank}" for *_, slot in chosen.blocked}
    notifies = sum(1 for life in lives.values() for step, d in life.notifies
                   if d in slots and step <= max(b for _, b, _ in chosen.blocked))
    assert 0 < len(arrows) <= notifies                                         # notify -> wait, this tile only
    none = result.plot_timeline(tile=False)
    assert not [a for a in none.axes[0].texts if isinstance(a, Annotation) and a.arrow_patch is not None]


def test_plot_timeline_names_a_tile_that_did_not_run(result):
    """A typed tl.InputError (it was a bare ValueError; still one, for code that caught that)."""
    with pytest.raises(tl.InputError, match="did not run in the last launch") as ei:
        result.plot_timeline(tile=(0, "gemm", (99, 99)))
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, PlotInputError)
    with pytest.raises(tl.InputError, match="tile must be"):
        result.plot_timeline(tile="gemm")
    with pytest.raises(tl.InputError, match=r"with coords a tuple, e.g. \(0, 'gemm', \(0, 0\)\)"):
        result.plot_timeline(tile=(0, "gemm", 0))           # coords an int: was a TypeError from inside


def test_plot_timeline_of_something_other_than_a_simulation_says_what_it_draws(result):
    from tldsl.plots import plot_timeline
    with pytest.raises(tl.InputError, match=r"draws a tl.simulate result \(its event log\), got str 'not a result'"):
        plot_timeline("not a result")                       # was AttributeError: 'str' object has no attribute
    from tldsl.runtime.gpu.run_result import RunResult
    gpu = RunResult(result.kernel, result.outputs, [{}], [], 0, 1, 0, 0, device="H200", launch_ms=[0.5])
    with pytest.raises(tl.InputError, match="no event log"):
        plot_timeline(gpu)


@pytest.mark.parametrize("make,says", [
    (lambda row: row, r"got a dict with keys \['M', .*a whole row of bench --json: pass row\[\"phases\"\]"),
    (lambda row: {"phases": []}, r"got a dict with keys \['phases'\]"),
    (lambda row: "phases", r"got str 'phases'"),
    (lambda row: None, r"got NoneType None"),
    (lambda row: row["phases"][0], r"item 0 is a mark .*one rank's phases go in a list: plot_phases\(\[phases\]\)"),
    (lambda row: [[("start", "s0", "0"), ("gemm done", "s0", "1.0")]], r"\(ms is a str, not a number\)"),
    (lambda row: [[("start", 0.0)]], r"rank 0 has the mark \('start', 0.0\)"),
    (lambda row: [row["phases"][0], 7], r"rank 1's phases are int 7"),
])
def test_plot_phases_says_what_it_takes(make, says):
    """Anything but [[(label, stream, ms), ...] per rank] — the whole JSON row is an easy slip —
    was a ValueError or TypeError from deep inside the drawing; now a typed error naming the
    argument's form and what it got."""
    row = json.loads((DATA / "ag_gemm_2xH200.json").read_text())["rows"][0]
    with pytest.raises(tl.InputError, match=r"plot_phases takes one launch's phases, \[\[\(label, stream, ms\)") as ei:
        plot_phases(make(row))
    assert isinstance(ei.value, PlotInputError)
    assert re.search(says, str(ei.value)), str(ei.value)


def test_plot_phases_of_a_recorded_gpu_launch(tmp_path):
    row = json.loads((DATA / "ag_gemm_2xH200.json").read_text())["rows"][0]
    path = tmp_path / "phases.svg"
    fig = plot_phases(row["phases"], title="AG+GEMM", save=path)
    assert isinstance(fig, Figure) and path.read_text().lstrip().startswith("<?xml")
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels and all(label.startswith(("rank 0 ", "rank 1 ")) for label in labels)
    assert fig.axes[0].get_title() == "AG+GEMM"
