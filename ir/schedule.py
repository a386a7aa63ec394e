"""Schedules: how a kernel runs, never what it computes.

The **compute schedule** shapes and orders the compute part's tiles; the **communication
schedule** sizes, orders and places the communication. Both are frozen values stored in
the IR beside the parts, so either can change without touching the tile program; each
validates itself, and :func:`check_compatible` rejects combinations that cannot work.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace

from ..errors import ScheduleError
from .field_types import check_field_names, check_field_types
from .location import user_location

COMPUTE_ORDERS = ("row_major", "swizzled", "comm_aligned")
COMM_ORDERS = ("ring", "full_mesh")
CLUSTER_SHAPES = ((1, 1), (2, 1))
COMM_TRANSPORTS = ("ptr", "nvshmem")
COMM_MODES = ("push", "pull")
COMM_ENGINES = ("sm", "copy_engine", "compute")
OWN_ROWS = ("comm", "compute")
REDUCE_PLACES = ("comm", "epilogue")


def _invalid(message: str) -> ScheduleError:
    """The error for a schedule that cannot be, at the user's line that built or used it."""
    return ScheduleError(message, user_location())


def _python_ints(schedule) -> None:
    """numpy integers (a size computed with numpy in a notebook) as the Python ints they stand for,
    alone or inside a tuple, so that ``stages=np.int64(2)`` is 2 rather than refused as not 1..8."""
    def plain(v):
        if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
            return int(v)
        if isinstance(v, (tuple, list)):
            return type(v)(plain(x) for x in v)
        return v
    for f in fields(schedule):
        v = getattr(schedule, f.name)
        w = plain(v)
        if w is not v:
            object.__setattr__(schedule, f.name, w)


#: a communication tile's rows or columns (tile_m, col_tile) are below this: a tensor dimension is
#: (the kernels index one in 32-bit ints), so a larger one can only mean "whole", which None says
MAX_COMM_TILE = 2 ** 31


def _comm_size(value) -> bool:
    """Whether ``value`` is a communication tile's size: a positive int below :data:`MAX_COMM_TILE`."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_COMM_TILE


def _pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class ComputeSchedule:
    """How a compute part runs: its tile, tile order, pipeline depth and clusters (never what it computes).

    tile=(BM, BN, BK), each a power of two from 8 to 256; order of output tiles;
    software-pipeline stages (1..8; the WGMMA GEMM recipes need 2 or more where K spans several
    BK steps, else the program takes the general lowering); swizzle group; cluster=(CM, 1): thread-block clusters of CM CTAs
    on vertically adjacent tiles that share their B tile (loaded once per cluster, TMA
    multicast on GPUs). The order then walks
    *cluster tiles* (CM tile rows each), and a cluster's CTAs take its rows in turn."""
    tile: tuple[int, int, int] = (128, 128, 64)
    order: str = "row_major"
    stages: int = 3
    group_m: int = 8
    cluster: tuple[int, int] = (1, 1)

    def __post_init__(self):
        _python_ints(self)
        check_field_types(self, _invalid)
        t = tuple(self.tile)
        object.__setattr__(self, "tile", t)
        if len(t) != 3 or not all(_pow2(x) and 8 <= x <= 256 for x in t):
            raise _invalid(f"compute tile {t}: need three powers of two between 8 and 256 (BM, BN, BK)")
        if self.order not in COMPUTE_ORDERS:
            raise _invalid(f"compute order {self.order!r}: choose one of {COMPUTE_ORDERS}")
        if not (isinstance(self.stages, int) and 1 <= self.stages <= 8):
            raise _invalid(f"pipeline stages {self.stages}: need 1..8")
        if not (isinstance(self.group_m, int) and self.group_m >= 1):
            raise _invalid(f"group_m {self.group_m}: need a positive int")
        cl = tuple(self.cluster) if isinstance(self.cluster, (tuple, list)) else self.cluster
        object.__setattr__(self, "cluster", cl)
        if cl not in CLUSTER_SHAPES:
            raise _invalid(f"cluster {self.cluster!r}: choose one of {CLUSTER_SHAPES} (CTAs along M sharing "
                           "their B tile)")

    @property
    def BM(self): return self.tile[0]
    @property
    def BN(self): return self.tile[1]
    @property
    def BK(self): return self.tile[2]

    def __new__(cls, *args, **kwargs):
        check_field_names(cls, args, kwargs, _invalid)      # a schedule field it has not: a ScheduleError
        return super().__new__(cls)

    def with_(self, **kw) -> "ComputeSchedule":
        return replace(self, **kw)

    def tile_order(self, grid: tuple[int, ...], rank: int, world_size: int, align_shift: int = 0):
        """The sequence in which a persistent kernel visits the grid's tiles on ``rank``."""
        return [t for t in self.tile_slots(grid, rank, world_size, align_shift) if t is not None]

    def tile_slots(self, grid: tuple[int, ...], rank: int, world_size: int, align_shift: int = 0):
        """:meth:`tile_order` as a persistent kernel numbers its tasks: with clusters of rows and a
        short last cluster row, the rows past the grid are tasks too (None here), which the kernel
        skips — so CTA ``b`` of ``n`` takes slots ``b, b + n, ...``, holes included."""
        if len(grid) == 1:      # a column of tiles: in order, rotated by comm_aligned (as attention walks it);
            if self.order != "comm_aligned":        # no clusters (the lowerings launch none on one axis)
                return [(i,) for i in range(grid[0])]
            return [(m,) for m, _ in replace(self, cluster=(1, 1)).tile_order((grid[0], 1), rank, world_size,
                                                                            align_shift)]
        cm = self.cluster[0]
        if cm > 1:
            # cluster tiles of cm rows in this order; a cluster's CTAs take its rows in turn
            # (on a GPU, rows past the grid are computed on zeros and dropped; here, skipped)
            inner = replace(self, cluster=(1, 1)).tile_order(((grid[0] + cm - 1) // cm,) + tuple(grid[1:]),
                                                             rank, world_size, align_shift)
            return [(c[0] * cm + i,) + tuple(c[1:]) if c[0] * cm + i < grid[0] else None
                    for c in inner for i in range(cm)]
        gm, gn = grid[0], grid[1]
        rest = grid[2:]
        if self.order == "row_major":
            seq = [(m, n) for m in range(gm) for n in range(gn)]
        else:
            # swizzled: groups of group_m tile rows, column by column inside a group (a wave
            # of CTAs shares A row blocks and B column blocks in L2); comm_aligned: the same,
            # over the rows rotated to start where this rank's data is (or is needed) first
            start = 0 if self.order == "swizzled" else (((rank + align_shift) % world_size) * gm) // world_size
            seq = []
            g = self.group_m
            for first in range(0, gm, g):
                size = min(g, gm - first)
                for n in range(gn):
                    for m in range(first, first + size):
                        seq.append(((start + m) % gm, n))
        if rest:
            import itertools
            seq = [s + r for s in seq for r in itertools.product(*(range(x) for x in rest))]
        return seq


@dataclass(frozen=True)
class CommSchedule:
    """How a communication part moves data: engine, direction, peer order, tile rows, transport.

    tile_m: rows per communication tile (None = a whole rank's chunk; on the copy engine:
    rows per copy, where the collective copies in pieces — the reduce-scatter does);
    order: ``ring`` (one peer at a time: rank+1, rank+2, ...) or ``full_mesh`` (all peers
    at once, tile by tile); mode: ``push`` (owners write to peers) or ``pull`` (consumers
    read from peers); engine: ``sm`` (tile_push/pull_data on ``sms`` SMs) or ``copy_engine``
    (rank_copy_data on DMA engines, no SMs); transport (SM engine): how a communication kernel
    reaches peers — ``ptr`` (loads / stores through a table of peer pointers the runtime
    passes: torch symmetric memory's ``buffer_ptrs``, or ``nvshmem_ptr`` on the host) or
    ``nvshmem`` (NVSHMEM device calls compiled in header-only mode: ``nvshmem_ptr`` on the device
    for peer data, ``nvshmemx_signal_op`` for peer notifies; needs NVSHMEM-allocated buffers);
    reduce_in (reductions): where this rank's rows are summed — ``comm`` (a communication part
    adds them) or ``epilogue`` (the compute part adds what peers sent into its own tiles before
    storing them: no pass over the rows after the GEMM; the copy-engine push reduce-scatter);
    col_tile (the copy-engine all-gather): columns per slice — each shard moves in column
    slices of this width, each behind its own notify, and a compute tile waits for a slice only
    when its K loop reaches it, so a late peer's shard lets tiles start on its first slice while
    the rest still moves (None: whole shards);
    own_rows (the all-gather): who moves this rank's own rows — ``comm`` (the communication, like
    every shard) or ``compute`` (parts fused into the compute part's kernel, which reads its rows
    from the shard and stores each stage where the schedule needs it: with ``mode='pull'`` into
    the symmetric slot peers pull from, publishing its arrival to them; with ``mode='push'`` into
    the gathered output ``<dst>_out``, every row as it loads it, so the landing buffer is free
    at once); engine ``compute`` (with own_rows='compute', mode='push'): no copy engine either —
    the compute part pushes its rows into every peer's landing buffer as it loads them."""
    tile_m: int | None = None
    order: str = "ring"
    mode: str = "pull"
    engine: str = "sm"
    sms: int | None = None
    transport: str = "ptr"
    reduce_in: str = "comm"
    col_tile: int | None = None
    own_rows: str = "comm"

    def __post_init__(self):
        _python_ints(self)
        check_field_types(self, _invalid)
        if self.order not in COMM_ORDERS:
            raise _invalid(f"communication order {self.order!r}: choose one of {COMM_ORDERS}")
        if self.mode not in COMM_MODES:
            raise _invalid(f"communication mode {self.mode!r}: choose one of {COMM_MODES}")
        if self.engine not in COMM_ENGINES:
            raise _invalid(f"communication engine {self.engine!r}: choose one of {COMM_ENGINES}")
        if self.tile_m is not None and not _comm_size(self.tile_m):
            raise _invalid(f"communication tile_m {self.tile_m!r}: need a positive int below 2**31 (or None for "
                           "whole chunks)")
        if self.col_tile is not None:
            if not _comm_size(self.col_tile):
                raise _invalid(f"col_tile {self.col_tile!r}: need a positive int below 2**31 (or None for whole "
                               "shards)")
            if self.engine != "copy_engine":
                raise _invalid(f"col_tile={self.col_tile}: column slices are the copy-engine all-gather's; "
                               f"got engine={self.engine!r} (the SM engine's tiles are rows: tile_m)")
        if self.own_rows not in OWN_ROWS:
            raise _invalid(f"own_rows={self.own_rows!r}: choose one of {OWN_ROWS}")
        if self.own_rows == "compute":
            if self.engine == "sm":
                raise _invalid("own_rows='compute' fuses this rank's rows into the compute part beside the copy engine "
                               "(engine='copy_engine') or with the compute part pushing (engine='compute'); "
                               "got engine='sm'")
            if self.mode == "pull" and self.col_tile is not None:
                raise _invalid(f"own_rows='compute' with mode='pull': the compute part stages whole shards, so "
                               f"col_tile={self.col_tile} cannot slice them; use mode='push' or col_tile=None")
        if self.engine == "compute":
            if (self.mode, self.own_rows) != ("push", "compute"):
                raise _invalid("engine='compute' (the compute part pushes its rows as it loads them) needs "
                               f"mode='push' and own_rows='compute'; got mode={self.mode!r}, own_rows={self.own_rows!r}")
            if self.col_tile is not None or self.tile_m is not None or self.sms not in (None, 0):
                raise _invalid("engine='compute' moves the compute part's own tiles: col_tile, tile_m and sms do "
                               "not apply")
        if self.transport not in COMM_TRANSPORTS:
            raise _invalid(f"communication transport {self.transport!r}: choose one of {COMM_TRANSPORTS}")
        if self.reduce_in not in REDUCE_PLACES:
            raise _invalid(f"reduce_in={self.reduce_in!r}: choose one of {REDUCE_PLACES}")
        if self.reduce_in == "epilogue" and (self.engine, self.mode) != ("copy_engine", "push"):
            raise _invalid("reduce_in='epilogue' (peers' rows added in the compute part's epilogue) is the "
                           f"copy-engine push schedule: engine='copy_engine', mode='push'; got engine="
                           f"{self.engine!r}, mode={self.mode!r}")
        if self.engine in ("copy_engine", "compute") and self.transport != "ptr":
            raise _invalid("the copy engine copies through the driver: transport='nvshmem' needs engine='sm'")
        if self.engine == "copy_engine":
            if self.sms not in (None, 0):
                raise _invalid(f"the copy engine uses no SMs: sms={self.sms} makes no sense with engine='copy_engine'")
        elif self.sms is not None and not (isinstance(self.sms, int) and 1 <= self.sms <= 132):
            raise _invalid(f"sms={self.sms}: SM communication needs 1..132 SMs")

    @property
    def lanes(self) -> int:
        """How many communication tasks run at once on one rank."""
        if self.engine in ("copy_engine", "compute"):
            return 1
        return self.sms if self.sms is not None else 2

    def __new__(cls, *args, **kwargs):
        check_field_names(cls, args, kwargs, _invalid)      # a schedule field it has not: a ScheduleError
        return super().__new__(cls)

    def with_(self, **kw) -> "CommSchedule":
        return replace(self, **kw)

    def task_order(self, grid: tuple[int, ...]):
        """Order of a comm part's tasks; axis 0 of the grid is the peer step."""
        import itertools
        seq = list(itertools.product(*(range(g) for g in grid)))
        if self.order == "full_mesh" and len(grid) >= 2:
            seq.sort(key=lambda c: (c[1:], c[0]))
        return seq


def check_compatible(compute: ComputeSchedule, comm: CommSchedule) -> None:
    """Reject schedule pairs whose tiles cannot be linked by one channel mapping, or that fuse
    this rank's rows into a compute part that cannot carry them."""
    if comm.own_rows == "compute" and compute.cluster != (1, 1):
        raise _invalid(f"own_rows='compute': the compute part stores the stages it loads without thread-block "
                       f"clusters; got cluster={compute.cluster}")
    if comm.tile_m is not None:
        bm = compute.BM
        if bm % comm.tile_m and comm.tile_m % bm:
            raise _invalid(f"communication tile_m={comm.tile_m} and compute BM={bm}: one must divide "
                           "the other so that a channel mapping can link the tiles")
