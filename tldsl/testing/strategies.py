"""Hypothesis strategies for tile programs: shapes (not multiples of the tile), tiles,
world sizes and schedules. Use them to property-test your own kernels:

    from hypothesis import given
    from tldsl.testing import strategies as tst

    @given(compute=tst.compute_schedules(), comm=tst.comm_schedules(), world_size=tst.world_sizes())
    def test_mine(compute, comm, world_size): ...

and random whole tile programs (what the differential fuzzer runs), with inputs for every rank:

    @given(case=tst.tile_programs())
    def test_backend(case):
        reference = case.simulate()
        assert not case.mismatches(reference.outputs, my_backend(case))   # case.source shows the program
"""
from __future__ import annotations

import hashlib

from hypothesis import strategies as st

from ..ir.schedule import COMPUTE_ORDERS, CommSchedule, ComputeSchedule
from .program_case import FuzzCase
from .program_families import generate

TILE_SIZES = (8, 16, 32)


def world_sizes(min_size: int = 1, max_size: int = 8):
    return st.integers(min_size, max_size)


def dims(min_value: int = 1, max_value: int = 48):
    """A tensor extent; most draws are not multiples of any tile."""
    return st.integers(min_value, max_value)


def tile_sizes(choices=TILE_SIZES):
    return st.sampled_from(choices)


@st.composite
def compute_schedules(draw, tiles=TILE_SIZES, orders=COMPUTE_ORDERS):
    return ComputeSchedule(tile=(draw(tile_sizes(tiles)), draw(tile_sizes(tiles)), draw(tile_sizes(tiles))),
                           order=draw(st.sampled_from(orders)),
                           stages=draw(st.integers(1, 4)),
                           group_m=draw(st.integers(1, 4)),
                           cluster=draw(st.sampled_from(((1, 1), (2, 1)))))


@st.composite
def comm_schedules(draw, engines=("sm", "copy_engine"), modes=("push", "pull"), tiles=TILE_SIZES,
                   compute: ComputeSchedule | None = None, col_tiles: bool = False):
    """Valid communication schedules (compatible with ``compute`` when given). ``col_tiles``: the
    copy engine may move column slices (the all-gather's ``col_tile``: one or two of the compute
    tile's K steps, or whole shards)."""
    engine = draw(st.sampled_from(engines))
    mode = draw(st.sampled_from(modes))
    order = draw(st.sampled_from(("ring", "full_mesh")))
    if engine == "copy_engine":
        bk = compute.BK if compute is not None else 16
        col_tile = draw(st.sampled_from((None, bk, 2 * bk))) if col_tiles else None
        return CommSchedule(tile_m=None, order=order, mode=mode, engine=engine, col_tile=col_tile)
    options = [t for t in tiles if compute is None or compute.BM % t == 0 or t % compute.BM == 0]
    tile_m = draw(st.sampled_from(options + [None]))
    return CommSchedule(tile_m=tile_m, order=order, mode=mode, engine=engine, sms=draw(st.integers(1, 4)),
                        transport=draw(st.sampled_from(("ptr", "nvshmem"))))


def seeds():
    return st.integers(0, 2**31 - 1)


class _DrawChooser:
    """The generator's choices as hypothesis draws, so a failing program shrinks (towards the
    first option of every choice: the simplest)."""

    def __init__(self, draw):
        self.draw = draw

    def integer(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def choice(self, options):
        return self.draw(st.sampled_from(options))


@st.composite
def tile_programs(draw, families=None, input_seeds=st.integers(0, 2**16 - 1)) -> FuzzCase:
    """A random well-formed tile program (:class:`~tldsl.testing.program_case.FuzzCase`): a
    ``@tl.kernel`` the simulator accepts, with inputs for every rank (outputs poisoned), fixed
    per-dtype tolerances and its standalone source (``case.source``). The programs cover the
    language: loads (plain, rows, scalars, from peers), stores, tile math, reductions, dots,
    loops, guards, mappings, parts linked by signals, and communication over 2-4 ranks (the
    primitives, and the library's collectives). ``families``: only some kinds of program, among
    ``"single"`` (one compute part), ``"pipeline"`` (two parts linked by signals on each rank)
    and ``"comm"`` (communication over W >= 2 ranks), or only when named ``"combine"`` (row-gather
    combines), ``"grouped_gemm"`` (expert GEMMs over run-time tile tables) and ``"attention"``
    (flash attention): the MoE and attention kernels' shapes, which their recipes lower. Float
    inputs are multiples of 1/64 or, in about half the cases, any value in [-1, 1]
    (:func:`~tldsl.testing.program_inputs.make_inputs`' ``exact``)."""
    program = generate(_DrawChooser(draw), families)
    digest = hashlib.sha1(program.source().encode()).hexdigest()[:10]     # one file name per program
    return FuzzCase(program, f"tile_programs() {digest}", draw(input_seeds), draw(st.booleans()))
