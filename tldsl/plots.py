"""Figures for notebooks (``pip install 'tldsl[plot]'``): each function returns a matplotlib
Figure — shown inline as a notebook cell's value — and writes it to ``save=`` as well when given
a path, so one call both shows and keeps it.

* :func:`plot_timeline` — a simulation's tasks per rank and engine (``SimResult.plot_timeline``);
* :func:`plot_phases` — the phases of one fused launch on GPUs, per rank and stream, as recorded
  by :class:`tldsl.runtime.dist.timeline.PhaseTimeline` (``bench ag_gemm --json`` keeps them).
"""
from __future__ import annotations

from .runtime.dist.timeline import plot_phases as _draw_phases, segments
from .runtime.sim.plot import plot_timeline

__all__ = ["plot_timeline", "plot_phases"]


def plot_phases(every_rank, title: str = "", save=None, figsize=None):
    """One launch's phases (``[[(label, stream, ms), ...] per rank]``) as bars per rank and
    stream, against milliseconds since the launch's first event; returns the Figure."""
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
