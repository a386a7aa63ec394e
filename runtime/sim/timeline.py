"""Text timelines of a simulation: which tasks ran when, per rank and part.

Each task's life is cut into segments by its events: ``start`` and ``resume`` open a
running segment, ``block`` closes it and opens a blocked one, ``end`` closes the last.
A cell shows ``#`` if some task of the part was running (or ready) then, ``~`` if the
part's resident tasks were all blocked on waits, ``.`` if none was resident.
"""
from __future__ import annotations


def format_timeline(result, width: int = 64) -> str:
    events = result.events
    if not events:
        return "(no events recorded)"
    t0 = min(e[0] for e in events)
    t1 = max(e[0] for e in events) + 1
    span = max(t1 - t0, 1)
    k = result.kernel
    lines = [f"timeline of launch {events[-1][1]} ({span} scheduler steps; "
             f"#=running, ~=blocked on a wait, .=idle)"]
    name_w = max([10] + [len(p.name) for p in k.parts])      # the bars line up
    for rank in range(k.world_size):
        for part in k.parts:
            cells = {"run": [0] * width, "block": [0] * width}
            status = {}          # coords -> (kind of the open segment, its first step)
            order = []
            for step, _launch, r, pname, _role, coords, what, _d in events:
                if r != rank or pname != part.name:
                    continue
                if what == "start":
                    status[coords] = ("run", step)
                    order.append(coords)
                elif what in ("block", "resume", "end"):
                    seg = status.pop(coords, None)
                    if seg is not None:
                        _mark(cells[seg[0]], seg[1], step, t0, span, width)
                    if what != "end":
                        status[coords] = ("block" if what == "block" else "run", step)
            for kind, start in status.values():      # segments still open when the log ends
                _mark(cells[kind], start, t1, t0, span, width)
            running, blocked = cells["run"], cells["block"]
            row = "".join("#" if running[i] else ("~" if blocked[i] else ".") for i in range(width))
            first = " ".join(",".join(map(str, c)) for c in order[:6])
            more = " ..." if len(order) > 6 else ""
            lines.append(f"rank {rank} {part.role:<7} {part.name:<{name_w}} |{row}|  order: {first}{more}")
    return "\n".join(lines)


def _mark(counts, start, end, t0, span, width):
    """Count the segment [start, end) of scheduler steps in the cells it covers (at least one)."""
    a = (start - t0) * width // span
    b = max(a + 1, (end - t0) * width // span)
    for i in range(a, min(b, width)):
        counts[i] += 1
