"""Communication parts written with the primitives, chosen by the communication schedule.

A tile program calls one of these in its kernel body and links its compute part to the
result through the returned handle's waits; switching push/pull, ring/full-mesh, SMs/copy
engine or the communication tile size changes only the schedule, never the program.
"""
from __future__ import annotations

from .ir.schedule import CommSchedule
from .language import signal, static_range, world_size
from .mappings import StaticMapping
from .primitives import (consumer_tile_wait, peer_tile_notify, peer_tile_wait, producer_tile_notify,
                         rank_copy_data, rank_notify, rank_wait, tile_pull_data, tile_push_data)
from .kernel import comm_part
from .tracing import fail
from . import language as tl


class AllGather:
    """Handle of an all-gather along rows: ``dst`` holds every rank's ``src`` shard, row block
    ``r`` from rank ``r``. ``wait_rows(lo, hi)`` makes a compute tile wait for exactly the
    communication tiles its rows need."""

    def __init__(self, mapping: StaticMapping, ready, wait):
        self.mapping, self.ready, self._wait = mapping, ready, wait

    def wait_rows(self, row_lo, row_hi):
        self.mapping.wait_rows(self.ready, row_lo, row_hi, wait=self._wait)


def all_gather(src, dst, comm: CommSchedule, name: str = "all_gather") -> AllGather:
    """Gather the symmetric ``src`` shards ([rows, ...] on each rank) into ``dst`` ([W*rows, ...])."""
    W = world_size()
    rows = src.shape[0]
    if not src.symmetric:
        fail(f"all_gather: source '{src.name}' must be symmetric (peers read it)")
    if tuple(dst.shape) != (W * rows,) + tuple(src.shape[1:]):
        fail(f"all_gather: destination '{dst.name}' has shape {dst.shape}, expected {(W * rows,) + tuple(src.shape[1:])}")
    tile = comm.tile_m if comm.engine == "sm" else None
    mapping = StaticMapping(f"{name}_rows", dst, rows, tile)
    tail = tuple(src.shape[1:])
    zeros_tail = (0,) * len(tail)
    tpr = mapping.tiles_per_rank

    if comm.engine == "copy_engine":
        ready = signal(f"{name}_ready", W, scope="symmetric")

        @comm_part(grid=(W,), name=name)
        def copy_chunks(step):
            me = tl.rank()
            if comm.mode == "pull":
                peer = (me + step) % W
                rank_copy_data(dst, (peer * rows,) + zeros_tail, src.at(peer), (0,) + zeros_tail, (rows,) + tail)
                rank_notify(ready, peer)
            else:
                peer = (me + (W - step)) % W
                rank_copy_data(dst.at(peer), (me * rows,) + zeros_tail, src, (0,) + zeros_tail, (rows,) + tail)
                rank_notify(ready, me, peer)

        return AllGather(mapping, ready, rank_wait)

    if comm.mode == "pull":
        ready = signal(f"{name}_ready", mapping.num_tiles, scope="local")

        @comm_part(grid=(W, tpr), name=name)
        def pull_tiles(step, j):
            peer = (tl.rank() + step) % W
            r0 = j * mapping.tile
            tile_pull_data(src.at(peer), (r0,) + zeros_tail, (mapping.tile,) + tail,
                           dst, (peer * rows + r0,) + zeros_tail)
            producer_tile_notify(ready, mapping.tile_id(peer, j))

        return AllGather(mapping, ready, consumer_tile_wait)

    ready = signal(f"{name}_ready", mapping.num_tiles, scope="symmetric")

    @comm_part(grid=(W, tpr), name=name)
    def push_tiles(step, j):
        me = tl.rank()
        peer = (me + (W - step)) % W
        r0 = j * mapping.tile
        tile_push_data(dst.at(peer), (me * rows + r0,) + zeros_tail, src, (r0,) + zeros_tail,
                       (mapping.tile,) + tail)
        peer_tile_notify(ready, mapping.tile_id(me, j), peer)

    return AllGather(mapping, ready, peer_tile_wait)


_ = static_range
