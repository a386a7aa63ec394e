"""The nine TileLink primitives: the only links between compute and communication.

Memory-ordering contract (what the simulator checks and the code generator must emit):

* every ``*_notify`` is a **release**: memory operations of the task before it are visible
  to whoever acquires the value it wrote. ``scope`` is ``"gpu"`` (observers on this GPU)
  or ``"sys"`` (observers on other GPUs too). A release at ``gpu`` scope observed by a
  peer rank orders nothing: the simulator reports the resulting race.
* every ``*_wait`` is an **acquire**: nothing after it (loads, TMA, stores) happens before
  it. It blocks until the slot received ``count`` notifies *in this launch*: signals are
  counters that are never reset, and the target is ``launch_index * count`` (epoch
  counting), so no reset kernel is needed and a stale value cannot satisfy a wait. A slot
  notified ``per_launch`` times per launch can be waited on for its first ``count`` of them
  (``count <= per_launch``; target ``per_launch * (launch_index - 1) + count``): a consumer
  starts on the first pieces of a transfer while the rest is still moving.
  ``epoch=False`` waits for an absolute value instead (the simulator reports a stale
  signal when a later launch is satisfied by an earlier one's notifies). ``lag=n`` waits for
  the notifies of the launch ``n`` back (none before the first): a buffer reused every other
  launch is free once every reader has reached the launch before.
* data primitives move memory only; they order nothing by themselves.
"""
from __future__ import annotations

import numbers

from .ir import core, types as T
from .operands import check_tile_shape, offset_values, rank_value
from .tiles import Tile, as_tile, tile_for_store
from .tracing import RemoteRef, SignalRef, TensorRef, as_scalar, current, fail, rank as this_rank

_SCOPES = ("gpu", "sys")


def _signal(sig, prim: str, scope: str):
    if not isinstance(sig, SignalRef):
        fail(f"{prim}: the first argument must be a signal made by tl.signal, got {type(sig).__name__}")
    if sig.scope != scope:
        need = "tl.signal(..., scope='symmetric')" if scope == "symmetric" else "tl.signal(..., scope='local')"
        fail(f"{prim} works on {scope} signals, but '{sig.name}' is {sig.scope}: declare it with {need}")
    return sig


def _channel(sig: SignalRef, channel, prim: str):
    ch = as_scalar(channel)
    if ch.dtype != T.int32:
        fail(f"{prim}: channel must be an i32 scalar")
    op = ch.value.owner
    if isinstance(op, core.Op) and op.name == "const" and not 0 <= op.attrs["value"] < sig.slots:
        fail(f"{prim}: channel {op.attrs['value']} is outside signal '{sig.name}' ({sig.slots} slots)")
    return ch.value


def _count(count, prim):
    if isinstance(count, numbers.Integral) and count <= 0:
        fail(f"{prim}: count must be positive, got {count}")
    c = as_scalar(count)
    if c.dtype != T.int32:
        fail(f"{prim}: count must be an i32")
    return c.value


def _notify(prim, sig, channel, rank, scope):
    if scope not in _SCOPES:
        fail(f"{prim}: scope must be one of {_SCOPES}, got {scope!r}")
    operands = [sig.value, _channel(sig, channel, prim)]
    if rank is not None:
        operands.append(rank_value(rank))
    current().emit(prim, operands, [], {"scope": scope})


def _wait(prim, sig, channel, count, epoch, per_launch=None, lag=0):
    if not isinstance(epoch, bool) and type(epoch).__name__ != "bool_":
        fail(f"{prim}: epoch takes True or False, got {epoch!r}")
    attrs = {"epoch": bool(epoch)}
    if not isinstance(lag, numbers.Integral) or isinstance(lag, bool) or lag < 0:
        fail(f"{prim}: lag must be an int >= 0 (how many launches back the notifies waited for were made), "
             f"got {lag!r}")
    if lag:
        if not epoch:
            fail(f"{prim}: lag counts launches back; it needs epoch=True")
        attrs["lag"] = int(lag)
    if per_launch is not None:
        if not isinstance(per_launch, numbers.Integral) or isinstance(per_launch, bool) or per_launch <= 0:
            fail(f"{prim}: per_launch must be a positive int (the slot's notifies per launch), got {per_launch!r}")
        if not epoch:
            fail(f"{prim}: per_launch counts notifies per launch; it needs epoch=True")
        if isinstance(count, numbers.Integral) and count > per_launch:
            fail(f"{prim}: count {count} exceeds per_launch={per_launch} (the slot's notifies per launch)")
        attrs["per_launch"] = int(per_launch)
    current().emit(prim, [sig.value, _channel(sig, channel, prim), _count(count, prim)], [], attrs)


# -- signals ------------------------------------------------------------------------

def producer_tile_notify(signal, channel, *, scope: str = "gpu") -> None:
    """Release: the producer finished the tile(s) behind ``channel`` on this rank."""
    _notify("producer_tile_notify", _signal(signal, "producer_tile_notify", "local"), channel, None, scope)


def consumer_tile_wait(signal, channel, *, count=1, epoch: bool = True, per_launch: int | None = None,
                       lag: int = 0) -> None:
    """Acquire: block until ``channel`` got ``count`` producer notifies in this launch.
    It orders this task after the first ``count`` of them only (whichever landed first): a task
    that reads what a later notify released must wait for a higher count."""
    _wait("consumer_tile_wait", _signal(signal, "consumer_tile_wait", "local"), channel, count, epoch, per_launch, lag)


def peer_tile_notify(signal, channel, rank, *, scope: str = "sys") -> None:
    """Release to a peer: add one to slot ``channel`` of ``rank``'s copy of a symmetric signal."""
    if rank is None:
        fail("peer_tile_notify needs the rank whose copy of the signal it adds to "
             "(tl.rank() for this rank's own; rank_notify defaults to it)")
    _notify("peer_tile_notify", _signal(signal, "peer_tile_notify", "symmetric"), channel, rank, scope)


def peer_tile_wait(signal, channel, *, count=1, epoch: bool = True, per_launch: int | None = None,
                   lag: int = 0) -> None:
    """Acquire from peers: block until this rank's slot got ``count`` notifies in this launch.
    It orders this task after the first ``count`` of them only (whichever landed first): a task
    that reads what a later notify released must wait for a higher count."""
    _wait("peer_tile_wait", _signal(signal, "peer_tile_wait", "symmetric"), channel, count, epoch, per_launch, lag)


def rank_notify(signal, channel, rank=None, *, scope: str = "sys") -> None:
    """Release at rank granularity (a whole chunk, e.g. after a copy-engine transfer).
    ``rank`` defaults to this rank."""
    _notify("rank_notify", _signal(signal, "rank_notify", "symmetric"), channel,
            this_rank() if rank is None else rank, scope)


def rank_wait(signal, channel, *, count=1, epoch: bool = True, per_launch: int | None = None,
              lag: int = 0) -> None:
    """Acquire at rank granularity.
    Like :func:`consumer_tile_wait`, it orders this task after the first ``count`` notifies only."""
    _wait("rank_wait", _signal(signal, "rank_wait", "symmetric"), channel, count, epoch, per_launch, lag)


# -- data -----------------------------------------------------------------------------

def _local_or_remote(ref, what):
    """(tensor ref, rank value) of a local tensor or ``tensor.at(rank)``."""
    if isinstance(ref, RemoteRef):
        return ref.tensor, rank_value(ref.rank)
    if isinstance(ref, TensorRef):
        return ref, this_rank().value
    fail(f"{what}: expected a tensor or tensor.at(rank), got {type(ref).__name__}")


def tile_push_data(dst, dst_offsets, src, src_offsets=None, shape=None) -> None:
    """SMs write into a peer: ``dst`` is ``tensor.at(rank)``; ``src`` is a tile, or a tensor
    (this rank's, or ``tensor.at(rank)``) with ``src_offsets`` and ``shape`` (a memory-to-memory copy)."""
    if not isinstance(dst, RemoteRef):
        fail("tile_push_data writes to a peer: pass dst as symmetric_tensor.at(rank)")
    dref, drank = dst.tensor, rank_value(dst.rank)
    doffs = offset_values(dref, dst_offsets, "tile_push_data")
    b = current()
    if isinstance(src, (TensorRef, RemoteRef)):
        if src_offsets is None or shape is None:
            fail("tile_push_data from a tensor needs src_offsets and shape")
        sref, srank = _local_or_remote(src, "tile_push_data")
        shape = check_tile_shape(shape, len(sref.shape), "tile_push_data")
        _check_same_dtype(sref, dref, "tile_push_data")
        _check_same_rank(sref, dref, "tile_push_data")
        soffs = offset_values(sref, src_offsets, "tile_push_data")
        b.emit("tile_push_data", [sref.value, srank, *soffs, dref.value, drank, *doffs], [],
               {"form": "copy", "shape": shape})
    else:
        if src_offsets is not None or shape is not None:
            fail("tile_push_data pushes a tile whole: src_offsets and shape are for a tensor source (slice the "
                 "tile by loading only what to push, or pass the tensor with src_offsets and shape)")
        tile = tile_for_store(dref, as_tile(src), "tile_push_data")
        b.emit("tile_push_data", [tile.value, dref.value, drank, *doffs], [],
               {"form": "tile", "shape": tile.shape})


def tile_pull_data(src, src_offsets, shape, dst=None, dst_offsets=None):
    """SMs read from a peer: ``src`` is ``tensor.at(rank)``. Returns the tile, or copies it
    into the local tensor ``dst`` at ``dst_offsets`` when given."""
    if not isinstance(src, RemoteRef):
        fail("tile_pull_data reads from a peer: pass src as symmetric_tensor.at(rank)")
    sref, srank = src.tensor, rank_value(src.rank)
    soffs = offset_values(sref, src_offsets, "tile_pull_data")
    shape = check_tile_shape(shape, len(sref.shape), "tile_pull_data")
    b = current()
    if dst is None:
        op = b.emit("tile_pull_data", [sref.value, srank, *soffs],
                    [T.TileType(shape, sref.dtype, T.MemSpace.SHARED)], {"form": "tile", "shape": shape})
        return Tile(op.result)
    dref, drank = _local_or_remote(dst, "tile_pull_data")
    if dst_offsets is None:
        fail("tile_pull_data into a tensor needs dst_offsets")
    _check_same_dtype(sref, dref, "tile_pull_data")
    _check_same_rank(sref, dref, "tile_pull_data")
    doffs = offset_values(dref, dst_offsets, "tile_pull_data")
    b.emit("tile_pull_data", [sref.value, srank, *soffs, dref.value, drank, *doffs], [],
           {"form": "copy", "shape": shape})
    return None


def rank_copy_data(dst, dst_offsets, src, src_offsets, shape) -> None:
    """Copy engine: move a region between buffers of any two ranks; a buffer on another rank
    (``tensor.at(rank)``, symmetric by construction) or this rank's own tensor."""
    sref, srank = _local_or_remote(src, "rank_copy_data")
    dref, drank = _local_or_remote(dst, "rank_copy_data")
    _check_same_dtype(sref, dref, "rank_copy_data")
    _check_same_rank(sref, dref, "rank_copy_data")
    shape = check_tile_shape(shape, len(sref.shape), "rank_copy_data")
    soffs = offset_values(sref, src_offsets, "rank_copy_data")
    doffs = offset_values(dref, dst_offsets, "rank_copy_data")
    current().emit("rank_copy_data", [sref.value, srank, *soffs, dref.value, drank, *doffs], [],
                   {"form": "copy", "shape": shape})


def _check_same_rank(src: TensorRef, dst: TensorRef, prim):
    """A copy moves a box between tensors of the same rank (a tile, ``tl.load``-ed first, may
    be stored into a tensor with more axes)."""
    if len(src.shape) != len(dst.shape):
        fail(f"{prim}: a copy moves a box between tensors of the same rank, but '{src.name}' is "
             f"{len(src.shape)}-d and '{dst.name}' is {len(dst.shape)}-d (load a tile and store that instead)")


def _check_same_dtype(a: TensorRef, b: TensorRef, prim):
    if a.dtype != b.dtype:
        fail(f"{prim}: '{a.name}' is {a.dtype} but '{b.name}' is {b.dtype}")


__all__ = ["producer_tile_notify", "consumer_tile_wait", "peer_tile_notify", "peer_tile_wait",
           "rank_notify", "rank_wait", "tile_push_data", "tile_pull_data", "rank_copy_data"]
