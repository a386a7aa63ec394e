"""Figures for notebooks (``pip install 'tldsl[plot]'``): each function returns a matplotlib
Figure — shown inline as a notebook cell's value — and writes it to ``save=`` as well when given
a path, so one call both shows and keeps it.

* :func:`plot_timeline` — a simulation's tasks per rank and engine (``SimResult.plot_timeline``);
* :func:`plot_phases` — the phases of one fused launch on GPUs, per rank and stream, as recorded
  by :class:`tldsl.runtime.dist.timeline.PhaseTimeline` (``bench ag_gemm --json`` keeps them).
"""
from __future__ import annotations

import numbers

from .runtime.dist.timeline import plot_phases as _draw_phases, segments
from .runtime.sim.plot import PlotInputError, plot_timeline

__all__ = ["plot_timeline", "plot_phases", "PlotInputError"]

#: the form plot_phases takes, for its errors
_PHASES_FORM = ("one launch's phases, [[(label, stream, ms), ...] per rank] (label and stream strs, ms a number; "
                "a bench --json row's row[\"phases\"])")


def _short(value, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _check_phases(every_rank) -> None:
    """``every_rank`` has plot_phases's form, or a PlotInputError says what it got instead."""
    def bad(what: str):
        raise PlotInputError(f"plot_phases takes {_PHASES_FORM}; {what}")
    if isinstance(every_rank, dict):
        hint = " — a whole row of bench --json: pass row[\"phases\"]" if "phases" in every_rank else ""
        bad(f"got a dict with keys {_short(list(every_rank))}{hint}")
    if isinstance(every_rank, (str, bytes)) or not isinstance(every_rank, (list, tuple)):
        bad(f"got {type(every_rank).__name__} {_short(every_rank)}")
    for r, phases in enumerate(every_rank):
        if (isinstance(phases, (list, tuple)) and len(phases) == 3 and isinstance(phases[0], str)
                and isinstance(phases[1], str)):
            bad(f"item {r} is a mark {_short(phases)}, not a rank's list of them — one rank's phases go in a list: "
                f"plot_phases([phases])")
        if isinstance(phases, (str, bytes)) or not isinstance(phases, (list, tuple)):
            bad(f"rank {r}'s phases are {type(phases).__name__} {_short(phases)}, not a list of (label, stream, ms)")
        for mark in phases:
            ok = (isinstance(mark, (list, tuple)) and len(mark) == 3 and isinstance(mark[0], str)
                  and isinstance(mark[1], str) and isinstance(mark[2], numbers.Real) and not isinstance(mark[2], bool))
            if not ok:
                why = (f" (ms is a {type(mark[2]).__name__}, not a number)" if isinstance(mark, (list, tuple))
                       and len(mark) == 3 and isinstance(mark[0], str) and isinstance(mark[1], str) else "")
                bad(f"rank {r} has the mark {_short(mark)}{why}")


def plot_phases(every_rank, title: str = "", save=None, figsize=None):
    """One launch's phases (``[[(label, stream, ms), ...] per rank]``) as bars per rank and
    stream, against milliseconds since the launch's first event; returns the Figure. Anything
    else is a :class:`PlotInputError` (a ``tl.InputError``) saying what it got."""
    _check_phases(every_rank)
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_phases needs matplotlib: pip install 'tldsl[plot]' "
                          "(tldsl.runtime.dist.timeline.format_phases is the same as text)") from None
    lanes = sum(len({stream for stream, *_ in segments(phases)}) for phases in every_rank)
    fig = plt.figure(figsize=figsize or (10, 0.8 + 0.5 * max(lanes, 1)))
    plt.close(fig)                 # off pyplot's list: shown once, as the cell's value
    _draw_phases(every_rank, title=title, ax=fig.add_subplot())
    fig.tight_layout()
    if save is not None:
        fig.savefig(save, bbox_inches="tight")
    return fig
