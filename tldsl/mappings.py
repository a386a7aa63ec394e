"""Tile-centric mappings: from a tile id to the tensor region it covers (shape mapping),
the rank that owns it (rank mapping) and the signal slot that guards it (channel mapping).

* :class:`StaticMapping` is affine in the tile id and resolved while tracing: the rows of a
  tensor made of ``world_size`` equal shards, cut into communication tiles of ``tile`` rows.
* :class:`DynamicMapping` reads its answers from integer tables filled at run time (MoE
  routing): the tables are kernel arguments, so the same compiled kernel serves any routing.

Compute and communication tiles may differ in size: ``wait_rows`` waits on every
communication tile that overlaps a compute tile's rows, whatever the two sizes are.
"""
from __future__ import annotations

import numbers

from .language import load_scalar, range as tl_range
from .primitives import consumer_tile_wait, producer_tile_notify
from .ir.display import one_line
from .tiles import maximum, minimum
from .tracing import TensorRef, cdiv, current, fail


class StaticMapping:
    """Rows ``[0, world_size * rows_per_rank)`` of ``tensor``, shard ``r`` owned by rank ``r``,
    each shard cut into ``tiles_per_rank`` tiles of ``tile`` rows (the last one may be short).
    Tile id ``t`` = ``rank * tiles_per_rank + j``; its channel is ``t``."""

    def __init__(self, name: str, tensor: TensorRef, rows_per_rank: int, tile: int | None = None):
        b = current()
        if b.blocks:
            fail("declare mappings in the kernel body, outside parts")
        if not isinstance(rows_per_rank, numbers.Integral) or rows_per_rank <= 0:
            fail(f"mapping '{name}': rows_per_rank must be a positive int, got {rows_per_rank}")
        total = tensor.shape[0]
        if rows_per_rank * b.world_size != total:
            fail(f"mapping '{name}' does not cover '{tensor.name}': {b.world_size} shards of "
                 f"{rows_per_rank} rows give {rows_per_rank * b.world_size} rows, the tensor has {total}")
        tile = rows_per_rank if tile is None else tile
        if not isinstance(tile, numbers.Integral) or tile <= 0:
            fail(f"mapping '{name}': tile must be a positive int, got {tile}")
        self.name, self.tensor = name, tensor
        self.world_size, self.rows_per_rank, self.tile = b.world_size, int(rows_per_rank), int(tile)
        self.tiles_per_rank = cdiv(self.rows_per_rank, self.tile)
        self.num_tiles = self.tiles_per_rank * self.world_size
        b.mappings.append(self)

    # shape / rank / channel mappings of a tile id (ints or traced scalars) ----------------
    def rank(self, t):
        return t // self.tiles_per_rank

    def channel(self, t):
        return t

    def tile_id(self, rank, j):
        return rank * self.tiles_per_rank + j

    def row_start(self, t):
        """First row (in the whole tensor) of tile ``t``."""
        return self.rank(t) * self.rows_per_rank + (t % self.tiles_per_rank) * self.tile

    def local_row_start(self, j):
        """First row of tile ``j`` inside its owner's shard."""
        return j * self.tile

    def rows(self, j):
        """Rows in local tile ``j`` (the last tile of a shard may be short)."""
        return minimum(self.tile, self.rows_per_rank - j * self.tile)

    def wait_rows(self, signal, row_lo, row_hi, wait=None, count=1, per_launch=None):
        """Wait on every tile overlapping rows ``[row_lo, row_hi)`` (e.g. one compute tile's rows).

        ``wait`` is the primitive to use (``consumer_tile_wait`` by default); ``count`` and
        ``per_launch`` are passed on (a slot notified ``per_launch`` times per launch, its first
        ``count`` notifies)."""
        wait = wait or consumer_tile_wait
        R, tile, tpr = self.rows_per_rank, self.tile, self.tiles_per_rank
        for q in tl_range(row_lo // R, cdiv(row_hi, R)):
            lo = maximum(row_lo - q * R, 0)
            hi = minimum(row_hi - q * R, R)
            for j in tl_range(lo // tile, cdiv(hi, tile)):
                if per_launch is None:
                    wait(signal, q * tpr + j, count=count)
                else:
                    wait(signal, q * tpr + j, count=count, per_launch=per_launch)

    def notify_rows(self, signal, row_lo, row_hi, notify=None):
        """Notify every tile overlapping rows ``[row_lo, row_hi)`` once (e.g. after a producer
        tile stored them): the mirror of :meth:`wait_rows`, whose waiters then expect one
        notify per overlapping producer tile. ``notify`` is the primitive to use
        (``producer_tile_notify`` by default)."""
        notify = notify or producer_tile_notify
        R, tile, tpr = self.rows_per_rank, self.tile, self.tiles_per_rank
        for q in tl_range(row_lo // R, cdiv(row_hi, R)):
            lo = maximum(row_lo - q * R, 0)
            hi = minimum(row_hi - q * R, R)
            for j in tl_range(lo // tile, cdiv(hi, tile)):
                notify(signal, q * tpr + j)

    def __str__(self):
        return (f"{self.name}: static rows of '{self.tensor.name}' — {self.world_size} shards x "
                f"{self.rows_per_rank} rows, tile {self.tile} rows -> {self.num_tiles} tiles; "
                f"rank(t) = t // {self.tiles_per_rank}, channel(t) = t")

    def __repr__(self):
        return one_line(f"<StaticMapping {self.name}: rows of '{self.tensor.name}', {self.world_size} shards x "
                        f"{self.rows_per_rank} rows, tile {self.tile} rows -> {self.num_tiles} tiles>")


class DynamicMapping:
    """Named i32 tables (kernel arguments) indexed by tile id, filled at run time.

    ``m["expert", t]`` reads ``tables["expert"][t]`` as a traced scalar."""

    def __init__(self, name: str, num_tiles: int, **tables: TensorRef):
        b = current()
        if b.blocks:
            fail("declare mappings in the kernel body, outside parts")
        if not isinstance(num_tiles, numbers.Integral) or num_tiles <= 0:
            fail(f"dynamic mapping '{name}' needs a positive number of tiles, got {num_tiles}")
        for key, t in tables.items():
            if not isinstance(t, TensorRef):
                fail(f"dynamic mapping '{name}': table '{key}' must be a kernel tensor argument")
            if t.dtype.name != "i32":
                fail(f"dynamic mapping '{name}': table '{key}' ('{t.name}') must be i32, is {t.dtype}")
            if t.shape[0] < num_tiles:
                fail(f"dynamic mapping '{name}' does not cover its {num_tiles} tiles: table '{key}' "
                     f"('{t.name}') has {t.shape[0]} entries")
        self.name, self.num_tiles, self.tables = name, int(num_tiles), tables
        b.mappings.append(self)

    def __getitem__(self, key):
        table, *idx = key
        if table not in self.tables:
            fail(f"dynamic mapping '{self.name}' has no table '{table}' (has {sorted(self.tables)})")
        return load_scalar(self.tables[table], tuple(idx))

    def __str__(self):
        tabs = ", ".join(f"{k}={v.name}{list(v.shape)}" for k, v in self.tables.items())
        return f"{self.name}: dynamic over {self.num_tiles} tiles, run-time tables {tabs}"

    def __repr__(self):
        return one_line(f"<DynamicMapping {self}>")
