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

    def mark(self, label: str, stream, stream_name: str) -> None:
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        self.marks.append((label, stream_name, ev))

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

    def format(self, prefix: str = "") -> str:
        return prefix + ", ".join(f"{label} @{ms:.3f} ({name})" for label, name, ms in self.phases())
