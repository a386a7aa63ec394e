"""Phase timelines of one fused launch: CUDA events recorded on the streams where each phase
ends (staging, barrier, each peer copy, the GEMM, the reduce-scatter), read back as
milliseconds since the launch's first event. They show where a fused op loses time against
``max(t_gemm, t_comm)`` without a profiler, and feed the tutorial's timeline plot."""
from __future__ import annotations


class PhaseTimeline:
    """Set ``op.timeline = PhaseTimeline()`` before a call; the op marks its phases; after the
    call (and a synchronise) :meth:`phases` gives ``[(label, stream, ms), ...]``."""

    def __init__(self):
        self.marks: list[tuple[str, str, object]] = []
        self.host: list[float] = []     # host clock (s) when each mark was enqueued

    def mark(self, label: str, stream, stream_name: str) -> None:
        import time
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        self.marks.append((label, stream_name, ev))
        self.host.append(time.perf_counter())

    def host_ms(self) -> list[float]:
        """Milliseconds since the first mark at which the host had enqueued each mark: where a
        device time equals its host time, the device was waiting for the host."""
        return [1e3 * (t - self.host[0]) for t in self.host] if self.host else []

    def phases(self) -> list[tuple[str, str, float]]:
        """``(label, stream name, ms since the first mark)``, in recording order."""
        if not self.marks:
            return []
        first = self.marks[0][2]
        first.synchronize()
        out = []
        for label, name, ev in self.marks:
            ev.synchronize()
            out.append((label, name, first.elapsed_time(ev)))
        return out

    def format(self, prefix: str = "", host: bool = False) -> str:
        """``label @ms (stream)``; ``host=True`` adds when the host had enqueued it."""
        hs = self.host_ms() if host else None
        return prefix + ", ".join(f"{label} @{ms:.3f} ({name}{f'; host {hs[i]:.3f}' if hs else ''})"
                                  for i, (label, name, ms) in enumerate(self.phases()))


def segments(phases) -> list[tuple[str, str, float, float]]:
    """``(stream, phase, t0, t1)`` from one rank's marks: a mark ends the phase that began at the
    previous mark of its stream, or — for a stream's first mark — at the latest mark recorded
    before it that is not later in time (the point that stream waited for)."""
    out, last = [], {}
    seen: list[tuple[str, float]] = []
    for label, stream, ms in phases:
        if stream in last:
            t0 = last[stream]
        else:
            earlier = [t for _, t in seen if t <= ms]
            t0 = max(earlier) if earlier else ms
        if seen:
            out.append((stream, _phase_name(label), t0, ms))
        last[stream] = ms
        seen.append((label, ms))
    return out


def _phase_name(label: str) -> str:
    if label.startswith("shard ") and label.endswith(" copied"):          # AG: a peer's shard pulled
        return "copy " + label[len("shard "):-len(" copied")]
    if label.startswith("shard pushed to "):                              # AG push: this rank's shard to a peer
        return "copy to " + label[len("shard pushed to "):]
    if label.startswith("rows of ") and label.endswith(" sent"):          # RS: a peer's partial rows pushed
        return "copy " + label[len("rows of "):-len(" sent")]
    named = {"staged": "stage", "gemm done": "GEMM", "reduce-scatter done": "reduce-scatter", "reduced": "sum",
             # the parts of the library programs on the fused-op runtime (``<part> done``)
             "reduce_scatter done": "reduce-scatter", "gather_a done": "all-gather"}
    if label in named:
        return named[label]
    if label.endswith(" start"):            # a part's stream until it starts: the entry handshake's wait
        return "barrier"
    return label[:-len(" done")] if label.endswith(" done") else label


_GLYPH = {"stage": "s", "barrier": "b", "GEMM": "G", "reduce-scatter": "R", "sum": "+", "all-gather": "A"}


def format_phases(every_rank, width: int = 72) -> str:
    """A text timeline of one launch on every rank: a row per (rank, stream), one glyph per
    ``span / width`` ms — ``s`` staging copies, ``b`` waiting in the group barrier (or the entry
    handshake), ``c`` an NVLink copy, ``A`` the all-gather kernel, ``G`` the GEMM, ``R`` the
    reduce-scatter kernel, ``+`` the sum of this rank's rows after the GEMM, ``.`` idle."""
    segs = [segments(ph) for ph in every_rank]
    span = max((t1 for s in segs for *_, t1 in s), default=0.0) or 1.0
    end = f"{span:.3f} ms"
    lines = [f"{'':16}0 ms{end:>{width - 3}}"]
    for r, s in enumerate(segs):
        for stream in dict.fromkeys(st for st, *_ in s):
            row = ["."] * width
            for st, phase, t0, t1 in s:
                if st != stream:
                    continue
                a = min(width - 1, int(t0 / span * width))
                b = max(a + 1, min(width, round(t1 / span * width)))
                g = "c" if phase.startswith("copy") else _GLYPH.get(phase, "?")
                for i in range(a, b):
                    row[i] = g
            lines.append(f"rank {r} {stream:>7} |{''.join(row)}|")
    lines.append("s staging copies, b group barrier, c NVLink copy (a peer's rows), A all-gather kernel, G GEMM, "
                 "R reduce-scatter kernel, + sum of this rank's rows")
    return "\n".join(lines)


def plot_phases(every_rank, title: str = "", ax=None):
    """The same timeline as horizontal bars (needs matplotlib); returns the axes."""
    import matplotlib.pyplot as plt
    colors = {"stage": "tab:gray", "barrier": "tab:red", "GEMM": "tab:blue", "reduce-scatter": "tab:green",
              "sum": "tab:purple"}
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * sum(len({s for s, *_ in segments(p)}) for p in every_rank)))
    labels, y = [], 0
    for r, ph in enumerate(every_rank):
        segs = segments(ph)
        for stream in dict.fromkeys(st for st, *_ in segs):
            for st, phase, t0, t1 in segs:
                if st == stream:
                    ax.broken_barh([(t0, t1 - t0)], (y - 0.4, 0.8),
                                   color=colors.get(phase, "tab:orange" if phase.startswith("copy") else "k"))
                    ax.text((t0 + t1) / 2, y, phase, ha="center", va="center", fontsize=8, color="white")
            labels.append(f"rank {r} {stream}")
            y += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the launch's first event")
    if title:
        ax.set_title(title)
    return ax
