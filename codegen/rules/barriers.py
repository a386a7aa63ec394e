"""Where the general lowering's task group needs a barrier: between two statements that touch the
same memory, one of them writing — not after every statement.

A statement's accesses are what its threads read and write that another thread may touch: byte
ranges of the group's shared-memory arena or global scratch (slots), and whole tensors. Values
held in registers (each thread its own chunks, or a one-element value every thread holds) are
not accesses. The tracker keeps the accesses made since the last barrier (``pending``) and puts
a barrier before a statement whose accesses meet them (read after write, write after read or
write); a statement with barriers of its own leaves its accesses pending (conservatively all of
them). Statements whose protocols rely on barriers — waits, notifies, data primitives, dots,
pipelined loops — are opaque: a barrier before them when anything is pending, their own
barriers kept, nothing pending after them.

Regions: a loop body ends with a barrier when anything is pending there (an iteration's last
statements against the next one's first); after a loop or ``if``, what was pending before it
stays pending with what its body left. The task loop is a loop too, but its body's end is
checked only against what the next task touches before its first barrier (``prefix``): a row
softmax's store of one task and the reduction of the next meet nothing."""
from __future__ import annotations

from dataclasses import dataclass, field

#: an access to everything: what an opaque statement may touch
EVERYTHING = ("*", 0, 0, 0, "w")


def slot_access(space: str, offset: int, nbytes: int, mode: str) -> tuple:
    """``mode`` ("r" or "w") of bytes [offset, offset + nbytes) of the arena or scratch."""
    return (space, 0, offset, offset + nbytes, mode)


def tensor_access(key: int, mode: str) -> tuple:
    """``mode`` of a whole tensor (``key``: its buffer's id)."""
    return ("tensor", key, 0, 1, mode)


def conflict(a: set, b: set, *, tensor_writes: bool = True) -> bool:
    """Whether an access of ``a`` and one of ``b`` touch the same memory, one of them a write
    (``tensor_writes=False``: two writes of one tensor do not count — across tasks, those are the
    program's own race, which no barrier of one group orders)."""
    if not a or not b:
        return False
    if EVERYTHING in a or EVERYTHING in b:
        return True
    for sa, ka, la, ha, ma in a:
        for sb, kb, lb, hb, mb in b:
            if sa == sb and ka == kb and la < hb and lb < ha and "w" in (ma, mb):
                if tensor_writes or sa != "tensor" or ma != mb:
                    return True
    return False


@dataclass
class BarrierTracker:
    """The accesses since the last barrier, and those the task body makes before its first
    barrier (``prefix``, collected while ``prefix_open``)."""
    pending: set = field(default_factory=set)
    prefix: set = field(default_factory=set)
    prefix_open: bool = True
    regions: list = field(default_factory=list)

    def _barrier(self) -> None:
        self.pending = set()
        self.prefix_open = False

    def _touch(self, acc: set) -> None:
        if self.prefix_open:
            self.prefix |= acc

    def before(self, acc: set) -> bool:
        """Called before a statement with accesses ``acc``: whether a barrier goes before it."""
        need = conflict(self.pending, acc)
        if need:
            self._barrier()
        self._touch(acc)
        return need

    def after(self, acc: set, barriers_inside: bool) -> None:
        """After the statement: its accesses pending (all of them, where it has barriers of its own)."""
        if barriers_inside:
            self.prefix_open = False
            self.pending = set(acc)
        else:
            self.pending |= acc

    def opaque(self) -> bool:
        """An opaque statement: whether a barrier goes before it; nothing is pending after it."""
        need = bool(self.pending)
        self._touch({EVERYTHING})
        self._barrier()
        return need

    def enter(self) -> None:
        """A region's body begins (its statements may run any number of times, or not at all)."""
        self._touch({EVERYTHING})
        self.prefix_open = False
        self.regions.append(set(self.pending))

    def leave(self, loop: bool) -> bool:
        """A region's body ends: whether a barrier ends it (a loop's, where anything is pending)."""
        before = self.regions.pop()
        need = loop and bool(self.pending)
        if need:
            self.pending = set()
        self.pending |= before
        return need

    def task_end(self) -> bool:
        """The task body ends: whether a barrier ends it (what is pending against what the next
        task touches before its first barrier)."""
        return conflict(self.pending, self.prefix, tensor_writes=False)
