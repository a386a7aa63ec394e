"""Text timelines of a simulation: which tasks ran when, per rank and part."""
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
    for rank in range(k.world_size):
        for part in k.parts:
            running = [0] * width
            blocked = [0] * width
            active = {}
            status = {}
            order = []
            for step, _launch, r, pname, _role, coords, what, _d in events:
                if r != rank or pname != part.name:
                    continue
                if what == "start":
                    active[coords] = step
                    status[coords] = ("run", step)
                    order.append(coords)
                elif what == "block":
                    status[coords] = ("block", step)
                elif what == "end":
                    _mark(running, blocked, status.pop(coords, ("run", step)), step, t0, span, width)
                    active.pop(coords, None)
                elif what == "notify" and status.get(coords, ("",))[0] == "block":
                    pass
            row = "".join("#" if running[i] else ("~" if blocked[i] else ".") for i in range(width))
            first = " ".join(",".join(map(str, c)) for c in order[:6])
            more = " ..." if len(order) > 6 else ""
            lines.append(f"rank {rank} {part.role:<7} {part.name:<10} |{row}|  order: {first}{more}")
    return "\n".join(lines)


def _mark(running, blocked, status, end, t0, span, width):
    kind, start = status
    a = (start - t0) * width // span
    b = max(a + 1, (end - t0) * width // span)
    for i in range(a, min(b, width)):
        running[i] += 1
