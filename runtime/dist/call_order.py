"""Launches of one fused op run on the device in the order they were called, whatever stream
each call is made on.

Every fused op's protocol counts launches: a counter holding L says "launch L (and so every
launch before it) got this far", and buffers are reused every other launch on that promise. A
caller that switches streams between calls would let launch L+1 overtake launch L on the device
(a counter would then vouch for a launch that has not run — the two-rank protocol model in
tests/test_dist_protocols.py finds the overwritten landing slot within a few dozen random
schedules). So a call on another stream than the previous call's first makes its stream wait for
everything enqueued on the previous one: one event record and one stream wait, only when the
stream changes (never on the measured path, which calls on one stream).

While a CUDA graph is being captured the wait is left out (a capture may not wait for an event
recorded outside it): a graph's replays are ordered by the stream they are launched on, and each
replay starts with a barrier of the group behind which every counter is reset (:mod:`.fused_op`).
"""
from __future__ import annotations

from ..gpu import plan_exec


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    import torch
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError, AttributeError):    # a build or a machine without CUDA
        return False


class CallOrder:
    """The stream of an op's previous call, and the event that orders the next call after it."""

    def __init__(self):
        self._last: int | None = None
        self._event = None

    def follow(self, stream: int) -> None:
        """Before a call's first work on ``stream`` (a raw handle): if the previous call used
        another stream, ``stream`` waits for all of that stream's work enqueued so far."""
        last = self._last
        if last == stream:
            return
        self._last = stream
        if last is None:
            return
        if capturing():             # an event recorded outside a capture cannot be waited on inside it:
            return                  # a graph is ordered by the stream it is replayed on
        cu = plan_exec.load_driver()
        if self._event is None:
            self._event = plan_exec.driver_event(cu, self)
        plan_exec.checked(cu, cu.cuEventRecord(self._event, last), "cuEventRecord(previous call's stream)")
        plan_exec.checked(cu, cu.cuStreamWaitEvent(stream, self._event, 0), "cuStreamWaitEvent(previous call)")
