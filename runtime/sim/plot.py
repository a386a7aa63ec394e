"""``SimResult.plot_timeline()``: the simulator's event log of the last launch as a matplotlib
figure — one lane per rank and engine, each task a bar coloured by its part (solid while it
runs, faded while it is blocked on a wait), and arrows from the notifies that released one
chosen tile's waits to the moment it resumed: the overlap that the text timeline only hints at.

The figure is made off pyplot's list of open figures, so a notebook shows it once, as the
cell's value, and a script is not left holding it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import InputError
from ...ir import core


class PlotInputError(InputError, ValueError):
    """A figure's argument is not what it draws (a tl.InputError; a ValueError too, as a tile
    that did not run always was): the message names the argument and the form it takes."""


@dataclass
class TaskLife:
    """One task of the last launch: where it ran and when."""
    rank: int
    part: str
    role: str
    coords: tuple
    engine: str = "sm"
    running: list[tuple[int, int]] = field(default_factory=list)    # [start, end) scheduler steps
    blocked: list[tuple[int, int, str]] = field(default_factory=list)  # [start, end) and the slot "sig[ch]"
    notifies: list[tuple[int, str]] = field(default_factory=list)    # (step, "sig[ch]@rank")
    row: int = 0          # sub-row inside its lane, so tasks that overlap in time do not cover each other


def task_lives(result) -> dict[tuple, TaskLife]:
    """Every task's running and blocked segments and its notifies, from ``result.events``."""
    engines = {p.name: p.engine for p in result.kernel.parts}
    lives: dict[tuple, TaskLife] = {}
    opened: dict[tuple, tuple[str, int, str]] = {}
    end_of_log = max((e[0] for e in result.events), default=0) + 1
    for step, _launch, rank, part, role, coords, what, detail in result.events:
        key = (rank, part, coords)
        life = lives.setdefault(key, TaskLife(rank, part, role, coords, engines.get(part, "sm")))
        if what == "notify":
            life.notifies.append((step, detail))
            continue
        seg = opened.pop(key, None)
        if seg is not None:
            _close(life, seg, step)
        if what == "start" or what == "resume":
            opened[key] = ("run", step, "")
        elif what == "block":
            opened[key] = ("block", step, detail)
    for key, seg in opened.items():
        _close(lives[key], seg, end_of_log)
    return lives


def _close(life: TaskLife, seg, end: int) -> None:
    kind, start, slot = seg
    if kind == "run":
        life.running.append((start, max(end, start + 1)))
    else:
        life.blocked.append((start, max(end, start + 1), slot))


def longest_blocked(lives: dict[tuple, TaskLife]):
    """The key of the task that spent the most steps blocked (the one worth following), or None."""
    waited = {k: sum(b - a for a, b, _ in life.blocked) for k, life in lives.items()}
    best = max(waited, key=waited.get, default=None)
    return best if best is not None and waited[best] > 0 else None


def _pack(lives) -> int:
    """Give each task of one lane the first sub-row free at its start; returns the rows used."""
    ends: list[int] = []
    for life in sorted(lives, key=lambda t: _span(t)[0]):
        start, end = _span(life)
        for i, e in enumerate(ends):
            if e <= start:
                life.row, ends[i] = i, end
                break
        else:
            life.row = len(ends)
            ends.append(end)
    return max(len(ends), 1)


def _span(life: TaskLife) -> tuple[int, int]:
    segs = life.running + [(a, b) for a, b, _ in life.blocked]
    return (min(a for a, _ in segs), max(b for _, b in segs)) if segs else (0, 0)


def plot_timeline(result, tile=None, save=None, figsize=None):
    """Draw ``result``'s last launch; ``tile`` = ``(rank, part name, coords)`` picks the tile
    whose notify → wait arrows are drawn (default: the one blocked longest; ``False``: none).
    ``save``: a path to write the figure to as well (format from its suffix). Returns the
    matplotlib Figure, which a notebook shows inline."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_timeline needs matplotlib: pip install 'tldsl[plot]' "
                          "(result.timeline() is the same as text)") from None
    from matplotlib.patches import Patch

    _check_result(result)
    lives = task_lives(result)
    k = result.kernel
    lanes = {(r, e): [] for r in range(k.world_size) for e in dict.fromkeys(p.engine for p in k.parts)}
    for life in lives.values():
        lanes[(life.rank, life.engine)].append(life)
    lanes = {key: tasks for key, tasks in lanes.items() if tasks}
    rows = {key: _pack(tasks) for key, tasks in lanes.items()}
    base, y = {}, 0.0
    for key in lanes:
        base[key] = y
        y += 1.0
    colours = {p.name: f"C{i % 10}" for i, p in enumerate(k.parts)}

    def y_of(life: TaskLife) -> tuple[float, float]:
        lane = (life.rank, life.engine)
        h = 0.8 / rows[lane]
        return base[lane] + 0.1 + life.row * h, h

    fig = plt.figure(figsize=figsize or (11, 1.0 + 0.7 * len(lanes)))
    plt.close(fig)                 # off pyplot's list: shown once, as the cell's value
    ax = fig.add_subplot()
    for life in lives.values():
        y0, h = y_of(life)
        colour = colours[life.part]
        ax.broken_barh([(a, b - a) for a, b in life.running], (y0, h * 0.9), color=colour)
        ax.broken_barh([(a, b - a) for a, b, _ in life.blocked], (y0, h * 0.9), color=colour, alpha=0.25)
    chosen = longest_blocked(lives) if tile is None else (None if tile is False else _key(tile, lives))
    if chosen is not None:
        _arrows(ax, lives, lives[chosen], y_of)
    ax.set_yticks([base[key] + 0.5 for key in lanes], [f"rank {r} {e}" for r, e in lanes])
    ax.set_ylim(len(lanes), 0)
    ax.set_xlabel("scheduler step")
    launch = result.events[-1][1] if result.events else 0
    ax.set_title(f"{k.name}: launch {launch} on {k.world_size} simulated ranks (faded: blocked on a wait)")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colours.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    if save is not None:
        fig.savefig(save, bbox_inches="tight")
    return fig


def _check_result(result) -> None:
    """``result`` is a simulation's result, whose event log the figure draws."""
    if not isinstance(getattr(result, "kernel", None), core.Kernel) or not isinstance(getattr(result, "events", None),
                                                                                      list):
        raise PlotInputError(f"plot_timeline draws a tl.simulate result (its event log), got {type(result).__name__} "
                             f"{_short(result)}: r = tl.simulate(kernel, W, inputs); plot_timeline(r), or "
                             f"r.plot_timeline()")
    if not result.events:
        raise PlotInputError("plot_timeline: this result has no event log (a GPU run records none): run the same "
                             "call with tl.simulate to see the timeline")


def _short(value, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _key(tile, lives):
    try:
        rank, part, coords = tile
        key = (rank, part, tuple(coords))      # coords a tuple of program ids: (0,), not 0
    except (TypeError, ValueError):
        raise PlotInputError(f"tile must be (rank, part name, coords) with coords a tuple, e.g. (0, 'gemm', (0, 0)), "
                             f"got {tile!r}") from None
    if key not in lives:
        raise PlotInputError(f"tile {key} did not run in the last launch; tiles are (rank, part name, coords), "
                             f"e.g. {next(iter(lives), None)}")
    return key


def _arrows(ax, lives, chosen: TaskLife, y_of) -> None:
    """An arrow from every notify that reached a slot the chosen tile blocked on, to where the
    tile resumed after that wait; the tile itself is outlined."""
    y0, h = y_of(chosen)
    a, b = _span(chosen)
    ax.add_patch(_outline(a, y0, b - a, h))
    for start, end, slot in chosen.blocked:
        target = f"{slot}@{chosen.rank}"
        for life in lives.values():
            for step, detail in life.notifies:
                if detail == target and step <= end:
                    ys, hs = y_of(life)
                    ax.annotate("", xy=(end, y0 + h / 2), xytext=(step, ys + hs / 2),
                                arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8})
        ax.annotate(slot, (end, y0), fontsize=7, va="bottom")


def _outline(x, y, w, h):
    from matplotlib.patches import Rectangle
    return Rectangle((x, y), w, h, fill=False, edgecolor="black", lw=1.2)
