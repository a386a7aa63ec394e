"""Simulated memory: every rank's buffers, plus the shadow state the detectors need.

For each (rank, buffer) the simulator keeps a log of accesses as boxes with the accessing
task and its clock (:mod:`.access_log`), and checks every new access against the log with
vector clocks: a conflicting pair (same region, one a write, different tasks) not ordered by
happens-before is a race, whatever order the scheduler happened to pick. Workspaces also keep
which elements this launch wrote, for the uninitialised-read report.
"""
from __future__ import annotations

import sys

import numpy as np

from ...errors import InputError, OutOfBoundsError, RaceError, UninitializedReadError
from ...ir.semantics import bf16_rounded
from ...ir.types import DType, bfloat16
from .access_log import ADD, READ, WRITE, Access, AccessLog
from .dot_stacks import DotStacks

_KIND = {READ: "read", WRITE: "write", ADD: "add"}


def host_array(x) -> np.ndarray:
    """A caller's array as a fresh numpy array: anything numpy takes, or a torch tensor on any
    device (bf16 as float32, which numpy can hold; torch refuses to hand numpy its bf16), its
    negative or conjugate bit resolved (a lazy view some torch ops return, whose ``.numpy()`` torch
    refuses: the values it stands for are what the caller means)."""
    torch = sys.modules.get("torch")           # (a caller holding a tensor has imported torch)
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu().resolve_conj().resolve_neg()
        return (t.float() if str(t.dtype) == "torch.bfloat16" else t).numpy().copy()
    return np.array(x, copy=True)


def host_float32(what: str, x, ndim: int | None = None) -> np.ndarray:
    """A numpy reference's operand as a host float32 array (of ``ndim`` dimensions where given):
    anything numpy takes (ml_dtypes' bf16 too), or a torch tensor (bf16, on a GPU, requiring grad),
    as the simulator takes it. Anything else is an :class:`InputError` naming ``what``."""
    try:
        arr = host_array(x)
    except (ValueError, TypeError) as e:
        raise InputError(f"{what}: an array or tensor, got {type(x).__name__} ({e})") from None
    numeric = arr.dtype.kind in "fiu" or arr.dtype.name == "bfloat16"     # ml_dtypes' bf16 is of kind 'V'
    if not numeric or (ndim is not None and arr.ndim != ndim):
        shape = f"a {ndim}-d array" if ndim is not None else "an array"
        raise InputError(f"{what}: {shape} of numbers, got {arr.dtype} {list(arr.shape)}")
    return arr.astype(np.float32)


def _is_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def host_operand(x):
    """A caller's array as ``tl.simulate`` takes it, for a host-side wrapper (the op library's
    ``simulate_*``) to inspect (``np.shape``, :meth:`TensorSpec.of <tldsl.TensorSpec.of>`) and pass
    on: a torch tensor unchanged — bf16, requires_grad or on a GPU, which ``np.asarray`` refuses
    and :func:`host_array` copies when the simulator takes it — anything else as a numpy array."""
    return x if _is_tensor(x) else np.asarray(x)


def nan_like(x, shape) -> np.ndarray:
    """A NaN-filled (poisoned) output of ``shape`` in ``x``'s dtype, for a wrapper to hand
    ``tl.simulate``: a CPU torch tensor where ``x`` is a tensor (numpy holds no bf16), else a
    numpy array."""
    if _is_tensor(x):
        return sys.modules["torch"].full(tuple(int(d) for d in shape), float("nan"), dtype=x.dtype)
    return np.full(shape, np.nan, np.asarray(x).dtype)


def to_storage(x, dtype: DType) -> np.ndarray:
    """Convert values to how a dtype is stored, rounding to bf16 where needed."""
    arr = np.asarray(x)
    if dtype.name == bfloat16.name:
        return bf16_rounded(arr)
    target = dtype.np
    if arr.dtype == target:
        return arr
    with np.errstate(invalid="ignore", over="ignore"):
        return arr.astype(target, copy=False)


def poison_value(dtype: DType):
    if dtype.is_float:
        return np.nan
    if dtype.kind == "int":
        return -0x5A5A5A5A
    return True


class Buffer:
    """One rank's tensor. Write it through :meth:`write` / :meth:`fill` (never ``data[...] =``):
    they drop the float32 stacks of the tiles they overwrite (:mod:`.dot_stacks`)."""

    def __init__(self, name: str, dtype: DType, data: np.ndarray, initialized: bool, symmetric: bool):
        self.name, self.dtype, self.data, self.symmetric = name, dtype, data, symmetric
        self.written = None if initialized else np.zeros(data.shape, bool)
        self.log = AccessLog(data.shape)
        self.dot_stacks = DotStacks(data)

    def write(self, sl, values):
        """``data[sl] = values``; ``sl`` a tuple of slices."""
        self.data[sl] = values
        self.dot_stacks.written(sl)

    def fill(self, value):
        self.data[...] = value
        self.dot_stacks.written(())


class Memory:
    """All ranks' buffers, with race and uninitialised-read detection."""

    def __init__(self, world_size: int, check_races: bool, check_uninit: bool):
        self.world_size = world_size
        self.ranks: list[dict[str, Buffer]] = [dict() for _ in range(world_size)]
        self.check_races, self.check_uninit = check_races, check_uninit
        self.uninit: list[UninitializedReadError] = []
        self.seq = 0             # orders the accesses of a launch (the race report names the earliest)

    def add(self, rank: int, name: str, dtype: DType, data: np.ndarray, initialized: bool, symmetric: bool):
        self.ranks[rank][name] = Buffer(name, dtype, data, initialized, symmetric)

    def buffer(self, rank: int, name: str, task=None, op=None) -> Buffer:
        if not 0 <= rank < self.world_size:
            raise OutOfBoundsError(
                f"{_who(task, op)}: rank {rank} is outside the group of {self.world_size} ranks",
                at=(getattr(op, "loc", None),), rank=task.rank if task is not None else None, target_rank=rank,
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
                    b.fill(poison_value(b.dtype))
                    b.written[...] = False

    @staticmethod
    def clip(buf: Buffer, offsets, shape):
        """The in-bounds part of a box: (lo, hi) in the buffer, and the slices into the tile."""
        lo, hi, buf_sl, tile_sl, empty = [], [], [], [], False
        for o, s, d in zip(offsets, shape, buf.data.shape):
            o = int(o)
            a, b = (o if o > 0 else 0), (o + s if o + s < d else d)
            empty = empty or b <= a
            lo.append(a)
            hi.append(b)
            buf_sl.append(slice(a, b))
            tile_sl.append(slice(a - o, b - o))
        return tuple(lo), tuple(hi), tuple(buf_sl), tuple(tile_sl), empty

    def access(self, rank: int, buf: Buffer, lo, hi, kind: int, task, op):
        """Record an access; raise on a race or a read of uninitialised workspace memory."""
        lo, hi = tuple(int(x) for x in lo), tuple(int(x) for x in hi)
        if kind != WRITE and self.check_uninit and buf.written is not None and not self.uninit:
            self._check_written(rank, buf, lo, hi, task, op, kind)      # (an add reads what it adds to)
        if kind != READ and buf.written is not None:
            buf.written[tuple(slice(a, b) for a, b in zip(lo, hi))] = True
        if not self.check_races:
            return
        clock = task.vc[task.tid]
        prev = buf.log.first_conflict(lo, hi, task.tid, kind, task.vc)
        if prev is not None:
            raise _race(rank, buf, lo, hi, kind, task, op, prev)
        self.seq += 1
        buf.log.add(Access(self.seq, lo, hi, task.tid, clock, kind, (task, op, kind, lo, hi), 0))

    def _check_written(self, rank, buf, lo, hi, task, op, kind=READ):
        w = buf.written[tuple(slice(a, b) for a, b in zip(lo, hi))]
        if not w.all():
            # Not raised yet: if a write of this region follows without ordering, the race
            # detector names both sides; only a read that nothing ever writes is reported
            # as uninitialised, at the end of the launch.
            first = tuple(a + int(i) for a, i in zip(lo, np.argwhere(~w)[0]))
            self.uninit.append(UninitializedReadError(
                f"{_who(task, op)} {'adds into' if kind == ADD else 'reads'} {buf.name}{_box(lo, hi)} on rank "
                f"{rank}, but element {first} was not written before it in this launch, and no unordered write "
                f"followed (missing data movement, or a read ordered before its write?)",
                at=(op.loc,), rank=task.rank, tile=task.coords, buffer=buf.name, region=(lo, hi), primitive=op.name))

    # -- the reads of a loop run in bulk (see .bulk_loop) -------------------------------------------
    def bulk_read_is_clean(self, buf: Buffer, lo, hi, task) -> bool:
        """Whether reading the box [lo, hi) now can report nothing: every element is written
        (or no uninitialised read is being looked for), and no write races with it. Then its
        loads may be recorded as one entry; otherwise they are replayed one by one."""
        if self.check_uninit and buf.written is not None and not self.uninit:
            if not buf.written[tuple(slice(a, b) for a, b in zip(lo, hi))].all():
                return False
        return not self.check_races or buf.log.first_conflict(lo, hi, task.tid, READ, task.vc) is None

    def reserve_seq(self, count: int) -> int:
        """The first of ``count`` sequence numbers, for accesses recorded in bulk."""
        first = self.seq + 1
        self.seq += count
        return first

    def record_bulk_read(self, buf: Buffer, lo, hi, task, op, run, seq: int, stride: int):
        """Log one load's boxes over a loop's iterations (``run``) with bounding box [lo, hi)."""
        if self.check_races:
            buf.log.add(Access(seq, lo, hi, task.tid, task.vc[task.tid], READ, (task, op, READ), 0, run, stride))


def _race(rank, buf, lo, hi, kind, task, op, prev) -> RaceError:
    ptask, pop, pkind, plo, phi = prev
    order = ("the read ran before the write it needs" if pkind == READ and kind == WRITE
             else "unordered accesses")
    return RaceError(
        f"race on {buf.name} of rank {rank} ({order}):\n"
        f"  {_KIND[kind]:5} {buf.name}{_box(lo, hi)} by {_who(task, op)}\n"
        f"  {_KIND[pkind]:5} {buf.name}{_box(plo, phi)} by {_who(ptask, pop)}\n"
        f"  and no notify -> wait chain orders them (a missing wait, a missing notify, a wait "
        f"count too low, or a release at too narrow a scope)" + _hints(task) + _lagged(ptask),
        at=(op.loc, pop.loc), rank=rank, buffer=buf.name, region=(lo, hi), tile=task.coords,
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
    for p in dict.fromkeys(getattr(task, "partial", ())):
        out += (f"\n  its wait on {p} is ordered only after the notifies that reached its count: "
                f"a task needing a later one must wait for a higher count")
    return out


def _lagged(task) -> str:
    """The other task's waits that counted an earlier launch's notifies (``lag``): they order it
    after nothing of this launch, a likely cause where ``lag=0`` was meant."""
    lagged = [w for w in dict.fromkeys(getattr(task, "waited", None) or ()) if "(lag=" in w]
    return "".join(f"\n  {task} had waited on {w}" for w in lagged)


def _box(lo, hi) -> str:
    return "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(lo, hi)) + "]"


def _who(task, op) -> str:
    where = f" at {op.loc.short()}" if op is not None and op.loc is not None else ""
    opname = f" ({op.name}{where})" if op is not None else ""
    return f"{task}{opname}" if task is not None else f"host{opname}"
