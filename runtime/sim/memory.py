"""Simulated memory: every rank's buffers, plus the shadow state the detectors need.

For each (rank, buffer) the simulator keeps a log of accesses as boxes with the accessing
task and its clock, and checks every new access against the log with vector clocks: a
conflicting pair (same region, one a write, different tasks) not ordered by happens-before
is a race, whatever order the scheduler happened to pick.
"""
from __future__ import annotations

import numpy as np

from ...errors import OutOfBoundsError, RaceError, UninitializedReadError
from ...ir.types import DType, bfloat16

READ, WRITE = 0, 1
_KIND = {READ: "read", WRITE: "write"}


def to_storage(x, dtype: DType) -> np.ndarray:
    """Convert values to how a dtype is stored, rounding to bf16 where needed."""
    arr = np.asarray(x)
    if dtype == bfloat16:
        f = arr.astype(np.float32, copy=True)
        bits = f.view(np.uint32)
        nan = np.isnan(f)
        # round to nearest even on the 16 dropped bits
        bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        bits &= np.uint32(0xFFFF0000)
        f[nan] = np.nan
        return f
    with np.errstate(invalid="ignore", over="ignore"):
        return arr.astype(dtype.np, copy=False)


def poison_value(dtype: DType):
    if dtype.is_float:
        return np.nan
    if dtype.kind == "int":
        return -0x5A5A5A5A
    return True


class AccessLog:
    """Boxes accessed in one buffer of one rank during the current launch."""

    def __init__(self, ndim: int):
        self.ndim = ndim
        self.n = 0
        cap = 64
        self.lo = np.zeros((cap, ndim), np.int64)
        self.hi = np.zeros((cap, ndim), np.int64)
        self.task = np.zeros(cap, np.int64)
        self.clock = np.zeros(cap, np.int64)
        self.kind = np.zeros(cap, np.int8)
        self.info: list = []

    def clear(self):
        self.n = 0
        self.info.clear()

    def _grow(self):
        cap = self.lo.shape[0] * 2
        for name in ("lo", "hi", "task", "clock", "kind"):
            old = getattr(self, name)
            new = np.zeros((cap,) + old.shape[1:], old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def check_and_add(self, lo, hi, task, clock, kind, vc, info):
        n = self.n
        if n:
            ov = np.all(self.lo[:n] < hi, axis=1) & np.all(self.hi[:n] > lo, axis=1)
            ov &= self.task[:n] != task
            if kind == READ:
                ov &= self.kind[:n] == WRITE
            if ov.any():
                idx = np.nonzero(ov)[0]
                unordered = self.clock[idx] > vc[self.task[idx]]
                if unordered.any():
                    return self.info[idx[np.argmax(unordered)]]
        if n == self.lo.shape[0]:
            self._grow()
        self.lo[n], self.hi[n] = lo, hi
        self.task[n], self.clock[n], self.kind[n] = task, clock, kind
        self.info.append(info)
        self.n = n + 1
        return None


class Buffer:
    def __init__(self, name: str, dtype: DType, data: np.ndarray, initialized: bool, symmetric: bool):
        self.name, self.dtype, self.data, self.symmetric = name, dtype, data, symmetric
        self.written = None if initialized else np.zeros(data.shape, bool)
        self.log = AccessLog(data.ndim)


class Memory:
    """All ranks' buffers, with race and uninitialised-read detection."""

    def __init__(self, world_size: int, check_races: bool, check_uninit: bool):
        self.world_size = world_size
        self.ranks: list[dict[str, Buffer]] = [dict() for _ in range(world_size)]
        self.check_races, self.check_uninit = check_races, check_uninit
        self.uninit: list[UninitializedReadError] = []

    def add(self, rank: int, name: str, dtype: DType, data: np.ndarray, initialized: bool, symmetric: bool):
        self.ranks[rank][name] = Buffer(name, dtype, data, initialized, symmetric)

    def buffer(self, rank: int, name: str, task=None, op=None) -> Buffer:
        if not 0 <= rank < self.world_size:
            raise OutOfBoundsError(
                f"{_who(task, op)}: rank {rank} is outside the group of {self.world_size} ranks",
                rank=task.rank if task is not None else None, target_rank=rank,
                tile=task.coords if task is not None else None, primitive=op.name if op is not None else None)
        return self.ranks[rank][name]

    def finish_launch(self):
        """Report the first read of memory that nothing wrote during the launch."""
        if self.uninit:
            err = self.uninit[0]
            self.uninit = []
            raise err

    def new_launch(self, repoison: bool):
        self.uninit = []
        for bufs in self.ranks:
            for b in bufs.values():
                b.log.clear()
                if repoison and b.written is not None:
                    b.data[...] = poison_value(b.dtype)
                    b.written[...] = False

    @staticmethod
    def clip(buf: Buffer, offsets, shape):
        """The in-bounds part of a box: (lo, hi) in the buffer, and the slices into the tile."""
        dims = buf.data.shape
        lo = np.array([max(int(o), 0) for o in offsets], np.int64)
        hi = np.array([min(int(o) + s, d) for o, s, d in zip(offsets, shape, dims)], np.int64)
        empty = bool(np.any(hi <= lo))
        tile_sl = tuple(slice(int(l - o), int(h - o)) for l, h, o in zip(lo, hi, offsets))
        buf_sl = tuple(slice(int(l), int(h)) for l, h in zip(lo, hi))
        return lo, hi, buf_sl, tile_sl, empty

    def access(self, rank: int, buf: Buffer, lo, hi, kind: int, task, op):
        """Record an access; raise on a race or a read of uninitialised workspace memory."""
        if kind == READ and self.check_uninit and buf.written is not None and not self.uninit:
            sl = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
            w = buf.written[sl]
            if not w.all():
                # Not raised yet: if a write of this region follows without ordering, the race
                # detector names both sides; only a read that nothing ever writes is reported
                # as uninitialised, at the end of the launch.
                first = tuple(int(a) + int(i) for a, i in zip(lo, np.argwhere(~w)[0]))
                self.uninit.append(UninitializedReadError(
                    f"{_who(task, op)} reads {buf.name}{_box(lo, hi)} on rank {rank}, but element "
                    f"{first} was not written before it in this launch, and no unordered write "
                    f"followed (missing data movement, or a read ordered before its write?)",
                    rank=task.rank, tile=task.coords, buffer=buf.name,
                    region=(tuple(int(x) for x in lo), tuple(int(x) for x in hi)),
                    primitive=op.name))
        if kind == WRITE and buf.written is not None:
            buf.written[tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))] = True
        if not self.check_races:
            return
        prev = buf.log.check_and_add(lo, hi, task.tid, task.vc[task.tid], kind, task.vc,
                                     (task, op, kind, tuple(lo), tuple(hi)))
        if prev is not None:
            ptask, pop, pkind, plo, phi = prev
            order = ("the read ran before the write it needs" if pkind == READ and kind == WRITE
                     else "unordered accesses")
            raise RaceError(
                f"race on {buf.name} of rank {rank} ({order}):\n"
                f"  {_KIND[kind]:5} {buf.name}{_box(lo, hi)} by {_who(task, op)}\n"
                f"  {_KIND[pkind]:5} {buf.name}{_box(plo, phi)} by {_who(ptask, pop)}\n"
                f"  and no notify -> wait chain orders them (a missing wait, a missing notify, or a "
                f"release at too narrow a scope)" + _hints(task),
                rank=rank, buffer=buf.name, region=(tuple(int(x) for x in lo), tuple(int(x) for x in hi)), tile=task.coords,
                task=str(task), other=str(ptask), primitive=op.name, other_primitive=pop.name)


def _hints(task) -> str:
    """What the later task waited on, and which of those releases could not order it."""
    waited = getattr(task, "waited", None)
    if waited is None:
        return ""
    out = f"\n  {task} had waited on: {', '.join(dict.fromkeys(waited)) or 'nothing'}"
    for n in dict.fromkeys(task.narrow):
        out += (f"\n  {n} was released at scope='gpu', which orders only that rank's own tasks: "
                f"a peer's wait needs scope='sys'")
    return out


def _box(lo, hi) -> str:
    return "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(lo, hi)) + "]"


def _who(task, op) -> str:
    where = f" at {op.loc.short()}" if op is not None and op.loc is not None else ""
    opname = f" ({op.name}{where})" if op is not None else ""
    return f"{task}{opname}" if task is not None else f"host{opname}"
