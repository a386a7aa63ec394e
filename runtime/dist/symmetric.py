"""Symmetric memory with explicit lifetimes: allocated when an op is built, freed only when the
op is closed or by :func:`release_unclosed` — collective points every rank of the group reaches
in the same order — and never by garbage collection.

Why: freeing symmetric memory is a group event. A block freed whenever the last Python reference
happens to go — or whenever the collector finds a cycle, perhaps while a persistent GEMM spins on
a peer's flag — can race a peer still writing into it, and NVSHMEM's ``nvshmem_free`` is itself
a collective that deadlocks when one rank calls it from a finaliser. So every symmetric block
is held by this module's ledger, not only by its op:

* **building an op** allocates (``symm_mem.empty`` + ``rendezvous``, or ``nvshmem_malloc``) into
  a :class:`Lease` owned by the op;
* **``op.close()``** calls :meth:`Lease.release`: this GPU's streams synchronised, a barrier of
  the group (so no rank's kernel still reads or writes the blocks), then the blocks freed then
  and there; a block something outside the op still views (say a tensor from
  ``workspace_tensors()``) is kept, with a :class:`SymmetricMemoryWarning`, until the next
  :func:`release_unclosed` after that view is gone;
* **an op dropped without ``close()``** frees nothing: its lease warns and waits in the ledger
  until :func:`release_unclosed` (collective), which frees the blocks every rank has dropped.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable


class SymmetricMemoryWarning(RuntimeWarning):
    """Symmetric memory whose release waits for an explicit collective point (shown by default,
    unlike ResourceWarning: a leak of GPU memory on every rank should not pass unseen)."""


@dataclass
class _Block:
    what: str
    tensor: object = None           # torch symmetric memory: the allocation's base tensor
    handle: object = None           # its rendezvous handle
    uses: int = 0                   # the storage's use count when it was only ours
    free: Callable[[], None] | None = None      # NVSHMEM: nvshmem_free (collective)
    spans: tuple = ()               # (start, end) device addresses of the block on every rank, as mapped here

    def held_elsewhere(self) -> bool:
        """Something besides the ledger still references the storage (a view, the handle)."""
        return self.tensor is not None and _use_count(self.tensor) > self.uses


@dataclass
class _Entry:
    lease: "Lease"
    state: str = "live"             # live | dropped (owner gone, no close) | lingering (closed, a view held)
    blocks: list = field(default_factory=list)


#: every lease not yet freed, by (group name, sequence number): the references that keep the
#: blocks alive between their op's collective points, whatever happens to the op
_LEDGER: dict[tuple[str, int], _Entry] = {}
_SEQ: dict[str, int] = {}


def _use_count(t) -> int:
    import torch
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class Lease:
    """The symmetric blocks of one owner (an op or one of its engines), freed together.

    Built at a collective point: every rank creates its leases of a group in the same order, so
    the (group, sequence) key names the same blocks on every rank."""

    def __init__(self, ctx, what: str, owner):
        self.ctx, self.what = ctx, what
        group_name = getattr(ctx, "group_name", "")
        n = _SEQ.get(group_name, 0)
        _SEQ[group_name] = n + 1
        self.key = (group_name, n)
        self._entry = _Entry(self)
        _LEDGER[self.key] = self._entry
        self._finalizer = weakref.finalize(owner, _owner_dropped, self.key)
        self._finalizer.atexit = False          # at exit the process's memory goes anyway

    @property
    def released(self) -> bool:
        return self.key not in _LEDGER or _LEDGER[self.key].state == "lingering"

    def empty(self, shape, dtype):
        """A torch symmetric tensor and its rendezvous handle (collective): held here until
        released. The caller may keep views; :meth:`release` expects them dropped."""
        import torch
        import torch.distributed._symmetric_memory as symm_mem
        t = symm_mem.empty(shape, dtype=dtype, device=torch.device("cuda", self.ctx.device))
        uses = _use_count(t)
        h = symm_mem.rendezvous(t, self.ctx.group_name)
        n = t.untyped_storage().nbytes()
        peers = [int(p) for p in getattr(h, "buffer_ptrs", ())]
        spans = tuple((p, p + n) for p in {t.data_ptr(), *peers})
        self._entry.blocks.append(_Block(f"{tuple(t.shape)} {t.dtype}", tensor=t, handle=h, uses=uses, spans=spans))
        return t, h

    def hold(self, what: str, free: Callable[[], None], spans=()) -> None:
        """A block another allocator made (NVSHMEM's heap; ``spans``: its addresses on every rank,
        as mapped here): ``free`` runs at the release."""
        self._entry.blocks.append(_Block(what, free=free, spans=tuple(spans)))

    def barrier(self, stream, channel: int = 0) -> None:
        """A stream-ordered barrier of the group on ``stream`` (torch symmetric memory's barrier
        kernel on this lease's first block: its signal pads reset themselves, so it can be captured
        in a CUDA graph and replayed). Blocks from NVSHMEM's heap have no such handle here."""
        import torch
        for b in self._entry.blocks:
            if b.handle is not None and hasattr(b.handle, "barrier"):
                with torch.cuda.stream(stream):
                    b.handle.barrier(channel=channel)
                return
        raise RuntimeError(f"{self.what}: no torch symmetric-memory block to run a barrier on (an NVSHMEM "
                           f"workspace): this op cannot start a launch from fresh counters (CUDA graphs)")

    def forget(self, *objs) -> None:
        """Drop the attributes of ``objs`` (an op, its engine; ``None`` skipped) that reach this
        lease's blocks — a tensor viewing a block here or on a peer, a block's handle, a dict,
        list or tuple holding one — so that :meth:`release` can free them: what an owner's
        ``close()`` does first."""
        blocks = _LEDGER[self.key].blocks if self.key in _LEDGER else []
        spans = [s for b in blocks for s in b.spans]
        handles = {id(b.handle) for b in blocks if b.handle is not None}
        for obj in objs:
            for name, value in list(vars(obj).items() if obj is not None else ()):
                if _reaches(value, spans, handles, 3):
                    setattr(obj, name, None)

    def release(self) -> None:
        """Free the blocks now (collective: every rank of the group, same point). Idempotent."""
        entry = _LEDGER.get(self.key)
        self._finalizer.detach()
        if entry is None or entry.state == "lingering":
            return
        quiesce(getattr(self.ctx, "group", None), self.ctx.device)
        _free(entry)


def _reaches(value, spans, handles, depth: int) -> bool:
    if id(value) in handles:
        return True
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return depth > 0 and any(_reaches(v, spans, handles, depth - 1) for v in value)
    import torch
    if not isinstance(value, torch.Tensor):
        return False
    p = int(value.data_ptr())
    return any(lo <= p < hi for lo, hi in spans)


def _owner_dropped(key) -> None:
    entry = _LEDGER.get(key)
    if entry is not None and entry.state == "live" and not entry.blocks:
        del _LEDGER[key]                # built nothing (its construction stopped first): nothing to free
    elif entry is not None and entry.state == "live":
        entry.state = "dropped"
        warnings.warn(f"{entry.lease.what} was dropped without close(): its symmetric memory "
                      f"({_size(entry)}) stays allocated until tldsl.runtime.dist.release_unclosed() — a "
                      f"collective call — frees it", SymmetricMemoryWarning, stacklevel=2)


def _size(entry: _Entry) -> str:
    n = sum(b.tensor.untyped_storage().nbytes() for b in entry.blocks if b.tensor is not None)
    return f"{n / 2**20:.1f} MiB" if n else f"{len(entry.blocks)} block(s)"


def _free(entry: _Entry) -> None:
    """Drop the ledger's references (the torch blocks go now) and run the NVSHMEM frees; a block
    still viewed elsewhere lingers (warned) so that it is never freed by garbage collection."""
    for b in entry.blocks:
        b.handle = None
    gc.collect()        # an explicit point: references held only by dropped cycles go here
    kept = []
    for b in entry.blocks:
        if b.free is not None:
            b.free()
        elif b.held_elsewhere():
            kept.append(b)
    if kept:
        entry.state, entry.blocks = "lingering", kept
        warnings.warn(f"{entry.lease.what}: {', '.join(b.what for b in kept)} still viewed outside the op after "
                      f"close(); kept allocated until the next tldsl.runtime.dist.release_unclosed() after those "
                      f"views are gone", SymmetricMemoryWarning, stacklevel=3)
        return
    entry.blocks.clear()
    _LEDGER.pop(entry.lease.key, None)


def quiesce(group, device: int) -> None:
    """Nothing on any rank of ``group`` still touches symmetric memory once this returns: this
    GPU's streams synchronised, then a barrier of the group (every peer synchronised too)."""
    import torch
    import torch.distributed as dist
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)
    if dist.is_available() and dist.is_initialized():
        g = group or dist.group.WORLD
        if dist.get_world_size(g) > 1:
            dist.barrier(group=g, device_ids=[device])


def outstanding(group_name: str | None = None) -> list[tuple[str, str]]:
    """``(what, state)`` of every lease not yet freed (of ``group_name``, default all):
    ``live`` (its op is open), ``dropped`` (dropped without close()), ``lingering`` (closed, a view
    still held)."""
    return [(e.lease.what, e.state) for k, e in sorted(_LEDGER.items()) if group_name in (None, k[0])]


def release_unclosed(group=None) -> int:
    """Free the symmetric memory of ops dropped without ``close()`` (and of closed ops whose
    outside views are gone) — collective: every rank of ``group`` (default WORLD) calls it at the
    same point. A lease is freed only where every rank has it freeable, in the same order on
    all. Returns how many leases were freed."""
    import torch
    import torch.distributed as dist
    gc.collect()        # dropped owners in cycles: their finalisers mark their leases here
    if dist.is_available() and dist.is_initialized():
        g = group or dist.group.WORLD
        name, W = g.group_name, dist.get_world_size(g)
    else:                               # one process: every group is ours alone
        g, name, W = None, None, 1
    mine = sorted(k for k, e in _LEDGER.items() if name in (None, k[0]) and _freeable(e))
    if W > 1:
        every = [None] * W
        dist.all_gather_object(every, mine, group=g)
        common = sorted(set(mine).intersection(*(map(tuple, e) for e in every)))
    else:
        common = mine
    if not common:
        return 0
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    quiesce(g, device)
    for key in common:
        entry = _LEDGER[key]
        entry.state = "live"
        _free(entry)
    return sum(1 for key in common if key not in _LEDGER)


def _freeable(entry: _Entry) -> bool:
    if entry.state == "dropped":
        return True
    return entry.state == "lingering" and not any(b.held_elsewhere() for b in entry.blocks)
