"""The race detector's record of one buffer's accesses (on one rank) in the current launch.

Each access is a box with the accessing task, that task's own clock entry at the time, and a
sequence number (the order accesses happened in). A new access conflicts with an earlier one
of another task when their boxes overlap, one of them is a write, and the earlier one is not
ordered before it (its clock entry is not covered by the new task's vector clock); the report
names the earliest such access, as a scan of the whole log in order would.

Adds (``tl.add_rows``: a read-modify-write the hardware makes atomic) commute with each other:
two unordered adds to the same element do not race, an add and a read or a write do.

Two things keep a check cheap however long the launch: reads and writes are kept apart (a read
only needs the writes), and each is indexed by bands along the buffer's longest axis, so a box
is compared only with the accesses that share a band with it. Reads are indexed only once a
write needs them: a buffer that is only read (a GEMM's weights) never pays for it. A loop run
in bulk records all its iterations' boxes of one load as one entry (:class:`BoxRun` /
:class:`BoxList`): its bounding box is indexed, and the boxes inside it are looked at only
when a report needs the exact one.
"""
from __future__ import annotations

READ, WRITE, ADD = 0, 1, 2
_BANDS = 64          # about this many bands along the indexed axis


def overlaps(alo, ahi, blo, bhi) -> bool:
    for a0, a1, b0, b1 in zip(alo, ahi, blo, bhi):
        if a0 >= b1 or b0 >= a1:
            return False
    return True


class BoxRun:
    """The boxes of one load over the ``n`` iterations of a loop, ``step`` apart along ``axis``
    (0: the same box every time): iteration ``i`` reads the box at ``offsets``, moved by
    ``i * step`` along ``axis``, of ``shape``, clipped to ``dims`` (empty boxes, wholly
    outside the buffer, were not accesses)."""
    __slots__ = ("offsets", "shape", "axis", "step", "n", "dims")

    def __init__(self, offsets, shape, axis, step, n, dims):
        self.offsets, self.shape, self.axis, self.step, self.n, self.dims = offsets, shape, axis, step, n, dims

    def parts(self):
        """(iteration, lo, hi) of every non-empty box, in iteration order."""
        offs, shape, ax, dims = list(self.offsets), self.shape, self.axis, self.dims
        for i in range(self.n):
            offs[ax] = self.offsets[ax] + i * self.step
            lo = tuple(max(o, 0) for o in offs)
            hi = tuple(min(o + s, d) for o, s, d in zip(offs, shape, dims))
            if all(h > l for l, h in zip(lo, hi)):
                yield i, lo, hi


class BoxList:
    """The boxes of one load over a loop's iterations, given one by one: (iteration, lo, hi)."""
    __slots__ = ("boxes",)

    def __init__(self, boxes):
        self.boxes = boxes

    def parts(self):
        return iter(self.boxes)


class Access:
    """One logged access; for a loop run in bulk, all its iterations' boxes of one load:
    iteration ``i``'s box then has sequence number ``seq + i * stride``."""
    __slots__ = ("seq", "lo", "hi", "task", "clock", "kind", "info", "band0", "run", "stride")

    def __init__(self, seq, lo, hi, task, clock, kind, info, band0, run=None, stride=0):
        self.seq, self.lo, self.hi, self.task, self.clock, self.kind = seq, lo, hi, task, clock, kind
        self.info, self.band0, self.run, self.stride = info, band0, run, stride

    def first_overlap(self, lo, hi):
        """(sequence number, report info) of this entry's earliest box that overlaps [lo, hi)."""
        if self.run is None:
            return self.seq, self.info
        task, op, kind = self.info
        for i, blo, bhi in self.run.parts():
            if overlaps(blo, bhi, lo, hi):
                return self.seq + i * self.stride, (task, op, kind, blo, bhi)
        return None


class AccessLog:
    """Accesses of one buffer of one rank during the current launch."""

    def __init__(self, shape):
        shape = tuple(shape)
        self.axis = max(range(len(shape)), key=lambda d: shape[d]) if shape else None   # None: a 0-d buffer
        extent = max(shape[self.axis], 1) if shape else 1
        band = 1
        while band * _BANDS < extent:
            band *= 2
        self.band = band
        self.reads: dict[int, list[Access]] = {}
        self.writes: dict[int, list[Access]] = {}
        self.adds: dict[int, list[Access]] = {}
        self.unindexed_reads: list[Access] = []

    def clear(self):
        self.reads.clear()
        self.writes.clear()
        self.adds.clear()
        self.unindexed_reads.clear()

    def _bands(self, lo, hi):
        ax, band = self.axis, self.band
        if ax is None:
            return 0, 0
        return lo[ax] // band, (hi[ax] - 1) // band

    def first_conflict(self, lo, hi, task, kind, vc):
        """Report info of the earliest access that races with this one, or None. ``vc``: the
        new access's task's vector clock (a dict task -> clock)."""
        best = self._scan(self.writes, lo, hi, task, vc, None)
        if kind != ADD:                          # adds commute with adds only
            best = self._scan(self.adds, lo, hi, task, vc, best)
        if kind != READ:
            for entry in self.unindexed_reads:
                self._index(self.reads, entry)
            self.unindexed_reads.clear()
            best = self._scan(self.reads, lo, hi, task, vc, best)
        return None if best is None else best[1]

    def _scan(self, index, lo, hi, task, vc, best):
        if not index:
            return best
        q0, q1 = self._bands(lo, hi)
        get = vc.get
        for b in range(q0, q1 + 1):
            for e in index.get(b, ()):
                if e.task == task or e.clock <= get(e.task, 0):
                    continue                     # the same task, or ordered before this access
                if (e.band0 if e.band0 > q0 else q0) != b or not overlaps(e.lo, e.hi, lo, hi):
                    continue                     # met in an earlier band of this query, or apart
                found = e.first_overlap(lo, hi)
                if found is not None and (best is None or found[0] < best[0]):
                    best = found
        return best

    def add(self, entry: Access):
        if entry.kind == WRITE:
            self._index(self.writes, entry)
        elif entry.kind == ADD:
            self._index(self.adds, entry)
        else:
            self.unindexed_reads.append(entry)

    def _index(self, index, entry: Access):
        b0, b1 = self._bands(entry.lo, entry.hi)
        entry.band0 = b0
        for b in range(b0, b1 + 1):
            lst = index.get(b)
            if lst is None:
                index[b] = [entry]
            else:
                lst.append(entry)
