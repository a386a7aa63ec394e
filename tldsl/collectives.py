"""Communication parts written with the primitives, chosen by the communication schedule.

A tile program calls one of these in its kernel body and links its compute part to the
result through the returned handle's waits; switching push/pull, ring/full-mesh, SMs/copy
engine or the communication tile size changes only the schedule, never the program.
"""
from __future__ import annotations

import numbers

from .errors import ScheduleError
from .ir.location import user_location
from .ir.schedule import CommSchedule
from .language import signal, static_range, world_size
from .mappings import StaticMapping
from .primitives import (consumer_tile_wait, peer_tile_notify, peer_tile_wait, producer_tile_notify,
                         rank_copy_data, rank_notify, rank_wait, tile_pull_data, tile_push_data)
from .kernel import comm_part
from .tiles import minimum
from .tracing import cdiv, current, fail
from . import language as tl


class AllGather:
    """Handle of an all-gather along rows: ``dst`` holds every rank's ``src`` shard, row block
    ``r`` from rank ``r``. ``wait_rows(lo, hi)`` makes a compute tile wait for exactly the
    communication its rows need (every column slice of them, where the schedule moves shards in
    column slices: ``col_tile``). A tile whose K loop reads the columns in order can instead call
    ``wait_rows(lo, hi, then_cols=True)`` before the loop and ``wait_cols(lo, hi, k, step)`` in
    it: with column slices it waits for each slice only as the loop reaches it (without, the
    rows are waited for before the loop, as before). The program is the same for every schedule."""

    def __init__(self, mapping: StaticMapping, ready, wait, col_tile: int | None = None, slices: int = 1):
        self.mapping, self.ready, self._wait = mapping, ready, wait
        self.col_tile, self.slices = col_tile, slices

    def wait_rows(self, row_lo, row_hi, *, then_cols: bool = False):
        if self.col_tile is None:
            self.mapping.wait_rows(self.ready, row_lo, row_hi, wait=self._wait)
        elif not then_cols:
            self.mapping.wait_rows(self.ready, row_lo, row_hi, wait=self._wait, count=self.slices,
                                   per_launch=self.slices)

    def wait_cols(self, row_lo, row_hi, k, step: int):
        """Before reading columns ``[k, k + step)`` of rows ``[row_lo, row_hi)`` (``k`` a multiple
        of ``step``, a constant dividing the schedule's ``col_tile``), after
        ``wait_rows(..., then_cols=True)``: with column slices, where ``k`` starts a slice, wait
        until the slices up to it have landed (a peer's slices are notified in order); without,
        nothing (``wait_rows`` waited for the whole rows)."""
        if self.col_tile is None:
            return
        if not isinstance(step, numbers.Integral) or step <= 0 or self.col_tile % step:
            fail(f"all_gather: the compute loop's step ({step}) must divide the communication's col_tile "
                 f"({self.col_tile}), so that each slice starts at a step")
        with tl.when(k % self.col_tile == 0):
            self.mapping.wait_rows(self.ready, row_lo, row_hi, wait=self._wait,
                                   count=k // self.col_tile + 1, per_launch=self.slices)


def all_gather(src, dst, comm: CommSchedule, name: str = "all_gather") -> AllGather:
    """Gather the symmetric ``src`` shards ([rows, ...] on each rank) into ``dst`` ([W*rows, ...])."""
    W = world_size()
    rows = src.shape[0]
    if not src.symmetric:
        fail(f"all_gather: source '{src.name}' must be symmetric (peers read it)")
    if tuple(dst.shape) != (W * rows,) + tuple(src.shape[1:]):
        fail(f"all_gather: destination '{dst.name}' has shape {dst.shape}, expected {(W * rows,) + tuple(src.shape[1:])}")
    if comm.reduce_in != "comm":
        raise ScheduleError(f"all_gather has nothing to reduce: reduce_in={comm.reduce_in!r} applies to "
                            "reduce-scatters", user_location())
    if comm.engine == "copy_engine" and comm.tile_m is not None:
        raise ScheduleError("the copy-engine all-gather copies whole shards (in column slices with col_tile): set "
                            "tile_m=None with engine='copy_engine'", user_location())
    cols = int(src.shape[1]) if len(src.shape) == 2 else None
    if comm.col_tile is not None and cols is None:
        raise ScheduleError(f"col_tile slices the columns of 2-D shards; '{src.name}' has shape {tuple(src.shape)}",
                            user_location())
    col_tile = None if comm.col_tile is None or comm.col_tile >= cols else comm.col_tile
    slices = 1 if col_tile is None else -(-cols // col_tile)
    tile = comm.tile_m if comm.engine == "sm" else None
    mapping = StaticMapping(f"{name}_rows", dst, rows, tile)
    tail = tuple(src.shape[1:])
    zeros_tail = (0,) * len(tail)
    tpr = mapping.tiles_per_rank

    if comm.engine in ("copy_engine", "compute"):
        ready = signal(f"{name}_ready", W, scope="symmetric")

        # whole shards, or column slices [c0, c0 + width) in order, each notified
        pieces = [((0,) + zeros_tail, (rows,) + tail)] if col_tile is None else \
            [((0, c0), (rows, min(col_tile, cols - c0))) for c0 in range(0, cols, col_tile)]

        def move(step, me, source):
            """One peer step's copies, each followed by its notify (step 0: this rank's own
            rows). Pull: rank ``me + step``'s shard, read from ``source(peer)``."""
            for offs, shape in pieces:
                if comm.mode == "pull":
                    peer = (me + step) % W
                    rank_copy_data(dst, (peer * rows + offs[0],) + offs[1:], source(peer), offs, shape)
                    rank_notify(ready, peer)
                else:
                    peer = (me + (W - step)) % W
                    rank_copy_data(dst.at(peer), (me * rows + offs[0],) + offs[1:], src, offs, shape)
                    rank_notify(ready, me, peer)

        if comm.own_rows == "comm":
            @comm_part(grid=(W,), name=name)
            def copy_chunks(step):
                move(step, tl.rank(), src.at)
        else:
            _own_rows_in_compute(src, dst, comm, name, ready, move, pieces, rows, W)
        return AllGather(mapping, ready, rank_wait, col_tile, slices)

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


def _own_rows_in_compute(src, dst, comm: CommSchedule, name: str, ready, move, pieces, rows: int, W: int) -> None:
    """``own_rows='compute'``: this rank's rows are moved by parts fused into the compute part
    (it reads them from the shard and stores each stage it loads where these parts put it);
    the copy engine moves only the peers' shards (or, ``engine='compute'``, nothing: the
    compute part pushes its rows to the peers too)."""
    zeros = (0,) * len(src.shape)
    compute = current().compute_schedule
    if len(src.shape) != 2 or (compute is not None and rows % compute.BM):
        raise ScheduleError(f"own_rows='compute': the compute part carries this rank's rows in whole tiles of its "
                            f"2-d shard, but '{src.name}' is {list(src.shape)} and the compute tile has "
                            f"{compute.BM if compute is not None else '?'} rows; use own_rows='comm'", user_location())
    if comm.mode == "pull":
        # the shard is staged into a symmetric slot, which peers pull from once its arrival is
        # published; the runtime keeps two slots (launch parity), so a slot is free once every
        # peer has staged the launch before (its copies of the one before that are done)
        slot = tl.symmetric_buffer(tuple(src.shape), src.dtype, f"{src.name}_slot")
        arrive = signal(f"{name}_arrive", W, scope="symmetric")
        if W > 1:
            @comm_part(grid=(W - 1,), name=name, engine="copy_engine", lanes=1)
            def pull_peers(i):
                me = tl.rank()
                peer = (me + i + 1) % W
                rank_wait(arrive, peer)                   # the peer's slot holds this launch's shard
                move(i + 1, me, slot.at)

        @comm_part(grid=(1,), name=f"{name}_own", fused=True)
        def stage_own(_):
            me = tl.rank()
            for p in static_range(W):
                with tl.when(me != p):
                    rank_wait(arrive, p, lag=1)           # the slot is free (see above)
            rank_copy_data(slot, zeros, src, zeros, tuple(src.shape))
            move(0, me, lambda peer: src)                 # this rank's rows of the gathered tensor
            for p in static_range(W):
                with tl.when(me != p):
                    rank_notify(arrive, me, p)            # published: peer p may pull the slot
        return
    if W > 1:
        if comm.engine == "compute":
            @comm_part(grid=(W - 1,), name=name, fused=True)
            def push_peers(i):
                move(i + 1, tl.rank(), None)
        else:
            @comm_part(grid=(W - 1,), name=name, engine="copy_engine", lanes=1)
            def push_peers(i):
                move(i + 1, tl.rank(), None)

    @comm_part(grid=(1,), name=f"{name}_own", fused=True)
    def own_rows(_):
        move(0, tl.rank(), None)

    # every row, as the compute part loads it, into the gathered output (the landing buffer is
    # reused by the next launch at once)
    out = tl.local_buffer(tuple(dst.shape), dst.dtype, f"{dst.name}_out")

    @comm_part(grid=(W,), name=f"{name}_out", fused=True)
    def copy_out(p):
        for j, (offs, shape) in enumerate(pieces):
            if len(pieces) > 1:
                rank_wait(ready, p, count=j + 1, per_launch=len(pieces))
            else:
                rank_wait(ready, p)
            at = (p * rows + offs[0],) + tuple(offs[1:])
            rank_copy_data(out, at, dst, at, shape)


class ReduceScatter:
    """Handle of a reduce-scatter along rows: rank ``r`` ends with the sum over ranks of
    rows ``[r*Ms, (r+1)*Ms)`` of their ``partial``. A producer (compute) tile hands its result
    over with ``store_tile(acc, row, col)`` (or stores rows ``[lo, hi)`` of ``partial`` itself
    and calls ``notify_rows(lo, hi)``).

    ``align_shift`` is the shift to give ``tl.compute_part(..., align_shift=...)``: with the
    ``comm_aligned`` compute order, the producer then finishes the segments in the order
    the communication consumes them (rank+1, rank+2, ..., rank)."""

    align_shift = 1

    def __init__(self, mapping: StaticMapping, ready, tile_rows: int, *, partial=None, out=None,
                 producer_rows: int = 0, epilogue=None, comm: CommSchedule | None = None, name: str = ""):
        self.mapping, self.ready, self.tile_rows = mapping, ready, tile_rows
        self.partial, self.out, self.producer_rows = partial, out, producer_rows
        self._epilogue = epilogue       # (recv, done, chunks per peer) where reduce_in='epilogue'
        self._comm, self._name = comm, name
        self._orders_checked: set = set()   # the compute parts whose order was checked (_check_order)

    def notify_rows(self, row_lo, row_hi):
        """Rows ``[row_lo, row_hi)`` of ``partial`` are stored. Refused where the epilogue sums
        (``reduce_in='epilogue'``): this rank's own rows must reach ``out`` through
        :meth:`store_tile`, or nothing would ever write them."""
        if self._epilogue is not None:
            raise ScheduleError("reduce_in='epilogue' sums this rank's own rows in the producer's epilogue: hand "
                                "each tile over with store_tile(acc, row, col), not tl.store + notify_rows "
                                "(or use reduce_in='comm')", user_location())
        self._notify(row_lo, row_hi)

    def _notify(self, row_lo, row_hi):
        self.mapping.notify_rows(self.ready, row_lo, row_hi)

    def store_tile(self, acc, row, col):
        """Hand over the producer tile ``acc`` at (``row``, ``col``) of ``partial``.

        Summing in the communication part (``reduce_in='comm'``): store it into ``partial`` and
        notify its rows. Summing in the epilogue (``reduce_in='epilogue'``): a tile of another
        rank's rows is stored and notified the same way (the copy engine sends it); a tile of
        this rank's own rows waits until every peer's copy of those rows has arrived, adds them
        in the SM schedules' order, ``P[me] + (P[me+1] + (... + P[me-1]))``, with this rank's term
        rounded to ``partial``'s dtype as if it had been stored, and stores the sum straight into
        ``out``: bit for bit what the other schedules compute."""
        M = self.partial.shape[0]

        def store_partial():
            tl.store(self.partial, (row, col), acc)
            self._notify(row, minimum(row + self.producer_rows, M))
        if self._epilogue is None:
            store_partial()
            return
        self._check_order()
        recv, done, tpr = self._epilogue
        W = world_size()
        Ms = M // W
        me = tl.rank()
        lo = me * Ms
        with tl.when((row < lo) | (row >= lo + Ms)):
            store_partial()
        with tl.when((row >= lo) & (row < lo + Ms)):
            total = None
            for s in static_range(1, W):               # from rank me-1, me-2, ..., me+1
                src = (me + (W - s)) % W
                rank_wait(done, src, count=tpr)          # every chunk of src's copy of our rows is here
                got = tl.load(recv, (src * Ms + (row - lo), col), tuple(acc.shape))
                total = got if total is None else got + total
            own = acc if self.partial.dtype == tl.float32 else acc.read().to(self.partial.dtype)
            tl.store(self.out, (row - lo, col), own if total is None else own + total)


    def _check_order(self) -> None:
        """Summing in the epilogue, refuse a compute order in which the ranks' own tiles would wait
        for each other in a cycle (:func:`own_rows_waiting_in_a_cycle`): the compute part handing
        tiles over here (its grid and ``align_shift``) under the kernel's compute schedule — at the
        line that hands them over, before anything runs, where the simulator would deadlock and a
        GPU hang."""
        b = current()
        part = b.parts[-1] if b.part_role == "compute" and b.parts else None
        compute, W = b.compute_schedule, world_size()
        if part is None or compute is None or self._comm is None or W == 1 or id(part) in self._orders_checked:
            return
        self._orders_checked.add(id(part))
        why = own_rows_waiting_in_a_cycle(compute, self._comm, self.partial.shape[0], W, tuple(part.grid),
                                          self.producer_rows, getattr(part, "align_shift", 0), who=self._name)
        if why is not None:
            raise ScheduleError(why, user_location())


def own_rows_waiting_in_a_cycle(compute, comm: CommSchedule, M: int, W: int, grid: tuple[int, ...], BM: int,
                                align_shift: int = ReduceScatter.align_shift, who: str = "reduce_scatter") -> str | None:
    """Why a reduce-scatter summing in the epilogue (``reduce_in='epilogue'``) can hang under the
    compute schedule ``compute``, or None: the producers, a compute part of ``grid`` (its first
    axis: tiles of ``BM`` rows of the ``M`` rows of ``partial``) and ``align_shift``.

    A tile of this rank's rows waits for every peer's copy of those rows. Peer q's copy engine
    pushes the chunks of its peers' rows one after another, in the communication schedule's task
    order, each once q's producer tiles over that chunk are done. A GPU may run the producers on
    few CTAs (one, at worst), each taking its tiles one after another in the compute schedule's
    order (``tile_order``, as the GEMM recipes walk it). So where q reaches an own tile (which
    waits) before a tile its push to rank r needs (those of r's rows, and of every chunk pushed
    before them), rank r's own tiles wait for q's. A cycle of such waits hangs; without one, the
    ranks' own tiles finish in the cycle-free order. Every rank reaching its own rows last
    (``comm_aligned`` with whole groups: the copy engine pushes to rank+1, rank+2, ... in that
    order) is safe, and ``row_major`` is too where each rank pushes one peer; a swizzled group
    straddling two ranks' rows walks both column by column, each rank reaching an own tile before
    the other's last. The one check of both the collective (:meth:`ReduceScatter.store_tile`) and
    the op library's ``gemm_reduce_scatter``."""
    Ms = M // W
    if W < 2 or Ms % BM:
        return None     # (refused by the reduce-scatter, with its reason)
    t = Ms if comm.tile_m is None else min(comm.tile_m, Ms)
    tpr = -(-Ms // t)
    pushes = comm.task_order((W - 1, tpr))          # the copy engine's (peer step, chunk) in turn
    last_push = {s: i for i, (s, _) in enumerate(pushes)}
    waits_for: dict[int, dict[int, tuple[int, int]]] = {r: {} for r in range(W)}   # r -> {q: (own row, row)}
    for q in range(W):
        rows = [c[0] for c in compute.tile_order(grid, q, W, align_shift=align_shift)]
        first = next((i for i, m in enumerate(rows) if m * BM // Ms == q), None)
        if first is None:
            continue                                                     # no own tile: q waits for nobody
        late = set(rows[first + 1:])                                     # tile rows with a tile past the first own
        needed: set[int] = set()                                         # tile rows q's pushes so far wait for
        for i, (s, j) in enumerate(pushes):
            dest = (q + s + 1) % W
            lo = dest * Ms + j * t
            needed.update(range(lo // BM, -(-min(lo + t, (dest + 1) * Ms) // BM)))
            if i == last_push[s] and needed & late:                      # dest's copy, complete after this push
                waits_for[dest][q] = (rows[first], max(needed & late))
    cycle = _a_cycle(waits_for)
    if cycle is None:
        return None
    links = "; ".join(f"rank {q} reaches its own tile row {own} before tile row {row}, which its copy of rank {r}'s "
                      f"rows waits for" for r, q in zip(cycle, cycle[1:] + cycle[:1]) for own, row in [waits_for[r][q]])
    return (f"{who}: reduce_in='epilogue' with {compute} and {comm} can hang: a tile of a rank's own "
            f"rows waits for every peer's copy of them, and {links}; on a GPU running the producer tiles on few CTAs "
            f"these ranks wait for each other. Use order='comm_aligned' with this rank's {Ms // BM} tile row(s) filling "
            f"whole groups (group_m={compute.group_m} now; and clusters) and align_shift={ReduceScatter.align_shift} "
            f"(the handle's align_shift), or reduce_in='comm'")


def _a_cycle(waits_for: dict[int, dict[int, tuple]]) -> list[int] | None:
    """A shortest cycle r0 -> r1 -> ... -> r0 of ``waits_for`` (rank -> the ranks it waits for)
    through the first rank on one, or None."""
    for start in sorted(waits_for):
        parent, todo = {}, [start]
        while todo:
            r = todo.pop(0)
            for q in sorted(waits_for[r]):
                if q == start:
                    cycle = [r]
                    while cycle[-1] != start:
                        cycle.append(parent[cycle[-1]])
                    return cycle[::-1]
                if q not in parent:
                    parent[q] = r
                    todo.append(q)
    return None


#: what a reduce-scatter's partial may hold: fp32, or the output's dtype (rounded once per rank)
PARTIAL_DTYPES = ("f32", "out")


def partial_buffer(shape, out, partial_dtype: str, who: str):
    """The local ``partial`` workspace a reduce-scatter into ``out`` sums: fp32 (``"f32"``) or
    ``out``'s dtype (``"out"``); any other choice refused when traced, naming ``who``."""
    if partial_dtype not in PARTIAL_DTYPES:
        tl.static_assert(False, f"{who}: partial_dtype={partial_dtype!r}: choose 'f32' or 'out'")
    return tl.local_buffer(shape, tl.float32 if partial_dtype == "f32" else out.dtype, "partial")


def reduce_scatter(partial, out, comm: CommSchedule, name: str = "reduce_scatter", *,
                   producer_rows: int, producers_per_row: int = 1) -> ReduceScatter:
    """Sum every rank's ``partial`` ([M, N], written by this kernel's producer tiles) and give
    rank ``r`` rows ``[r*M/W, (r+1)*M/W)`` of the sum in ``out`` ([M/W, N]).

    Producers write tiles of ``producer_rows`` rows aligned at multiples of it,
    ``producers_per_row`` tiles per row block, and call ``notify_rows`` after each. The
    communication runs on SMs (it adds), in tiles of ``comm.tile_m`` rows (None: a whole
    segment of M/W rows) by the full width N. Tasks are walked step-major (every tile of one
    step before any tile of the next), so early sends never wait behind this rank's own rows:

    * ``order='ring'``: W steps; at step ``s`` rank ``r`` reduces segment ``(r+s+1) % W``:
      its own partial tile plus the running sum its right neighbour sent at step ``s-1``,
      and hands the new sum to its left neighbour (the last step, on segment ``r``, stores
      into ``out``). ``mode='push'`` writes the sum into the left neighbour's receive slot
      (``tile_push_data``); ``mode='pull'`` stores it into this rank's send slot and the left
      neighbour reads it (``tile_pull_data``). Each rank sends (W-1)/W of the partials over
      one link, adding on the way.
    * ``order='full_mesh'``: direct (one-hop) reduce-scatter: each rank sends its partial
      tile of segment ``p`` straight to rank ``p`` (peers ``r+1, r+2, ...`` in turn), then sums
      its own tile and the W-1 it received. Same traffic, one hop instead of W-1, all links
      at once; ``mode`` chooses push into the owner's receive slots or a pull by the owner
      from the sender's send slots. The owner adds in the ring's order, so ``ring`` and
      ``full_mesh`` (and push/pull, any ``tile_m``) give bitwise identical results.

    Ring traffic and the staging workspace have ``partial``'s dtype (use fp32 partials for
    an fp32 sum). The staging workspace is symmetric, ``((W-1) * slot, N)`` with ``slot`` =
    M/W rounded up to whole communication tiles: one slot per step, so no memory is reused
    within a launch (launches are separated by the host's stream order).
    """
    W = world_size()
    if comm.own_rows != "comm" or comm.engine == "compute":
        raise ScheduleError(f"reduce_scatter sums every rank's rows in its communication: own_rows={comm.own_rows!r}, "
                            f"engine={comm.engine!r} are the all-gather's (use own_rows='comm', engine 'sm' or "
                            "'copy_engine')", user_location())
    if comm.col_tile is not None:
        raise ScheduleError(f"{name}: col_tile={comm.col_tile} slices the copy-engine all-gather's columns; the "
                            "reduce-scatter moves rows (tile_m)", user_location())
    if comm.engine == "copy_engine" and comm.mode != "push":
        raise ScheduleError(f"{name}: on the copy engine the reduce-scatter pushes each owner its rows and the "
                            f"owner adds them on SMs: use CommSchedule(engine='copy_engine', mode='push'), got "
                            f"mode={comm.mode!r}", user_location())
    for what, v in (("producer_rows", producer_rows), ("producers_per_row", producers_per_row)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:
            fail(f"{name}: {what} must be a positive Python int, got {v!r}")
    if len(partial.shape) != 2 or len(out.shape) != 2:
        fail(f"{name}: partial and out must be 2-d, got '{partial.name}' {list(partial.shape)} and "
             f"'{out.name}' {list(out.shape)}")
    M, N = partial.shape
    tl.static_assert(M % W == 0, f"{name}: the {M} rows of '{partial.name}' cannot be split evenly over "
                                 f"{W} ranks (M must be divisible by the world size)")
    Ms = M // W
    tl.static_assert(tuple(out.shape) == (Ms, N), f"{name}: '{out.name}' must be [{Ms}, {N}] (M/W rows of "
                                                  f"'{partial.name}' [{M}, {N}]), got {list(out.shape)}")
    if not (partial.dtype.is_float and out.dtype.is_float):
        fail(f"{name}: partial and out must be floating point, got {partial.dtype} and {out.dtype}")
    t = Ms if comm.tile_m is None else min(comm.tile_m, Ms)
    mapping = StaticMapping(f"{name}_rows", partial, Ms, t)
    tpr = mapping.tiles_per_rank
    slot = tpr * t                      # a staging slot: one segment, padded to whole tiles
    ready = signal(f"{name}_ready", mapping.num_tiles, scope="local")
    BM, per_row = int(producer_rows), int(producers_per_row)

    def wait_partial(seg, j):
        """Acquire tile j of segment seg of ``partial``: every producer tile overlapping it."""
        lo = seg * Ms + j * t
        hi = seg * Ms + minimum(j * t + t, Ms)
        consumer_tile_wait(ready, mapping.tile_id(seg, j), count=(cdiv(hi, BM) - lo // BM) * per_row)

    def load_segment_tile(buf, seg, j):
        """Tile j of segment seg of ``buf`` ([W*Ms, N] in segments), rows past the segment read
        as zero (never the next segment's)."""
        if Ms % t == 0:
            return tl.load(buf, (seg * Ms + j * t, 0), (t, N))
        local = tl.iota(t) + j * t
        return tl.load_rows(buf, tl.where(local < Ms, local + seg * Ms, -1), 0, N)

    def load_partial(seg, j):
        return load_segment_tile(partial, seg, j)

    handle = dict(partial=partial, out=out, producer_rows=BM, comm=comm, name=name)
    if comm.engine == "copy_engine":
        if comm.reduce_in == "epilogue" and Ms % BM:
            raise ScheduleError(f"{name}: reduce_in='epilogue' adds peers' rows into this rank's own producer "
                                f"tiles, so a tile must not straddle two ranks' rows: M/W = {Ms} is not a multiple of "
                                f"the producer tile's {BM} rows (use reduce_in='comm')", user_location())
        fused = _reduce_scatter_copy_engine(partial, out, name, mapping, wait_partial, load_segment_tile,
                                            sum_part=comm.reduce_in == "comm")
        return ReduceScatter(mapping, ready, t, epilogue=fused, **handle)
    if W > 1:
        stage = tl.symmetric_buffer(((W - 1) * slot, N), partial.dtype,
                                    f"{name}_recv" if comm.mode == "push" else f"{name}_send")
        arrived = signal(f"{name}_arrived", (W - 1) * tpr, scope="symmetric")

    def send(acc, step, j, dest):
        """Hand ``acc`` to ``dest`` through staging slot ``step``, then notify it."""
        r0 = step * slot + j * t
        if comm.mode == "push":
            tile_push_data(stage.at(dest), (r0, 0), acc)
        else:
            tl.store(stage, (r0, 0), acc)
        peer_tile_notify(arrived, step * tpr + j, dest)

    def receive(step, j, src):
        """What ``src`` handed over through staging slot ``step``, after its notify."""
        peer_tile_wait(arrived, step * tpr + j)
        r0 = step * slot + j * t
        if comm.mode == "push":
            return tl.load(stage, (r0, 0), (t, N))
        return tile_pull_data(stage.at(src), (r0, 0), (t, N))

    # Both orders add in the same sequence, so they agree to the last bit: the sum of segment
    # p is P[p] + (P[p+1] + (... + (P[p-2] + P[p-1]))), P[q] being rank q's partial.

    # Tasks are (step, tile) pairs walked step-major: a lane finishes every tile of step s
    # before any of step s+1, so the sends of early steps (the segments the GEMM finishes
    # first) never queue behind a wait for this rank's own segment (which it finishes last).

    if comm.order == "ring":
        @comm_part(grid=(W, tpr), name=name)
        def ring(s, j):
            me = tl.rank()
            left, right = (me + (W - 1)) % W, (me + 1) % W
            seg = (me + (s + 1)) % W
            wait_partial(seg, j)
            if W == 1:
                tl.store(out, (j * t, 0), load_partial(seg, j))
                return
            with tl.when(s == 0):
                send(load_partial(seg, j), s, j, left)
            if W > 2:
                with tl.when(s > 0):
                    with tl.when(s < W - 1):
                        send(load_partial(seg, j) + receive(s - 1, j, right), s, j, left)
            with tl.when(s == W - 1):
                tl.store(out, (j * t, 0), load_partial(seg, j) + receive(s - 1, j, right))
    else:
        @comm_part(grid=(2 * tpr,), name=name)
        def full_mesh(i):
            # tasks [0, tpr): send tile j of every peer's segment; [tpr, 2 tpr): sum tile j of ours
            me = tl.rank()
            j = i % tpr
            with tl.when(i < tpr):
                for s in static_range(1, W):
                    dest = (me + s) % W
                    wait_partial(dest, j)
                    send(load_partial(dest, j), s - 1, j, dest)
            with tl.when(i >= tpr):
                acc = None
                for s in static_range(1, W):       # from rank me-1, me-2, ..., me+1
                    got = receive(s - 1, j, (me + (W - s)) % W)
                    acc = got if acc is None else got + acc
                wait_partial(me, j)
                own = load_partial(me, j)
                tl.store(out, (j * t, 0), own if acc is None else own + acc)

    return ReduceScatter(mapping, ready, t, **handle)


def _reduce_scatter_copy_engine(partial, out, name, mapping: StaticMapping, wait_partial, load_segment_tile,
                                sum_part: bool = True):
    """The copy-engine reduce-scatter (``CommSchedule(engine='copy_engine', mode='push')``):
    the producers (e.g. a GEMM on every SM) keep all SMs while the copy engine pushes each
    peer's rows, chunk by chunk (``comm.tile_m`` rows, None: the whole segment) as soon as the
    producer tiles covering the chunk are stored, into block ``rank`` of the owner's symmetric
    receive buffer, notifying the owner after each chunk. The owner's sum part (on SMs) adds
    its own rows and the W-1 received blocks, chunk by chunk, once all of a peer's chunks are
    in — on GPUs the runtime runs it once every producer is done, as one elementwise kernel,
    and, its copy stream being in order, writes each peer's count once, after the last chunk.
    ``partial``'s dtype travels (fp32 partials: fp32 traffic). ``wait_partial`` /
    ``load_segment_tile``: the SM schedules' chunk wait and masked chunk load.

    ``sum_part=False`` (``reduce_in='epilogue'``): no sum part; the producers add the received
    blocks into their own tiles (:meth:`ReduceScatter.store_tile`). Returns what they need,
    ``(recv, done, chunks per peer)``, or None with a sum part."""
    W = world_size()
    M, N = partial.shape
    Ms, t, tpr = M // W, mapping.tile, mapping.tiles_per_rank
    last = Ms - (tpr - 1) * t                   # rows of the last chunk of a segment

    if W > 1:
        recv = tl.symmetric_buffer((W * Ms, N), partial.dtype, f"{name}_recv")    # block q: rows from rank q
        done = signal(f"{name}_done", W, scope="symmetric")                       # slot q: rank q's rows are here

        @comm_part(grid=(W - 1, tpr), name=name, engine="copy_engine")
        def push_rows(s, j):
            me = tl.rank()
            dest = (me + s + 1) % W
            wait_partial(dest, j)
            with tl.when(j < tpr - 1):
                rank_copy_data(recv.at(dest), (me * Ms + j * t, 0), partial, (dest * Ms + j * t, 0), (t, N))
            with tl.when(j == tpr - 1):
                rank_copy_data(recv.at(dest), (me * Ms + j * t, 0), partial, (dest * Ms + j * t, 0), (last, N))
            rank_notify(done, me, dest)

    if not sum_part:
        return (recv, done, tpr) if W > 1 else (None, None, tpr)

    @comm_part(grid=(tpr,), name=f"{name}_sum", engine="sm", lanes=min(tpr, 8))
    def sum_rows(j):
        # the SM schedules' association, to the last bit: P[me] + (P[me+1] + (... + P[me-1]))
        me = tl.rank()
        acc = None
        for s in static_range(1, W):               # from rank me-1, me-2, ..., me+1
            src = (me + (W - s)) % W
            rank_wait(done, src, count=tpr)           # every chunk of src's rows is here
            got = load_segment_tile(recv, src, j)
            acc = got if acc is None else got + acc
        wait_partial(me, j)
        own = load_segment_tile(partial, me, j)
        tl.store(out, (j * t, 0), own if acc is None else own + acc)
    return None
