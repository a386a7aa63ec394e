"""Float32 stacks of a buffer's tiles for the dots of loops run in bulk, kept until written.

``tl.dot`` computes in float32, and a GEMM reads each of its operands' tiles once per tile of
the other operand (every A row block once per column of C): converting and copying the same
tiles again for every product costs more than the products. A stack is the loop's tiles of
one load, converted to float32 and laid out [iterations, *tile] as the products need them; it
is reused by every task that loads the same tiles, until a write to its rows drops it.
"""
from __future__ import annotations

import numpy as np


class DotStacks:
    """The stacks of one buffer (one rank), keyed by where their tiles lie."""
    __slots__ = ("stacks", "nbytes", "limit")

    def __init__(self, data: np.ndarray):
        self.stacks: dict[tuple, tuple[int, int, np.ndarray]] = {}   # key -> (first row, end row, stack)
        self.nbytes = 0
        self.limit = 8 * data.nbytes + (1 << 20)      # beyond this, start over

    def get(self, data, key, rows, make) -> np.ndarray:
        """The stack for ``key`` (its tiles span ``rows`` of the buffer), made by ``make(data)``
        if not kept. Read-only: it is shared by every task that loads these tiles."""
        hit = self.stacks.get(key)
        if hit is not None:
            return hit[2]
        stack = make(data)
        stack.flags.writeable = False
        if self.nbytes + stack.nbytes > self.limit:
            self.drop_all()
        self.stacks[key] = (rows[0], rows[1], stack)
        self.nbytes += stack.nbytes
        return stack

    def written(self, sl):
        """Rows ``sl[0]`` (a slice; every row if ``sl`` is empty) were written."""
        if not self.stacks:
            return
        if not sl:
            self.drop_all()
            return
        start, stop = sl[0].start or 0, sl[0].stop
        stale = [k for k, (r0, r1, _) in self.stacks.items() if (stop is None or r0 < stop) and start < r1]
        for k in stale:
            self.nbytes -= self.stacks.pop(k)[2].nbytes

    def drop_all(self):
        self.stacks.clear()
        self.nbytes = 0
