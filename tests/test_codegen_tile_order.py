"""The general lowering walks a compute part's tiles in the compute schedule's tile order — the
order the simulator runs them in (``ComputeSchedule.tile_order``) — whatever the part waits on.

It walked a part that waits or notifies row by row, whatever the schedule said, while the
simulator ran it in the schedule's order: a program whose tiles only wait on earlier tiles in
the simulator's order could, on a GPU giving the part few CTAs, wait on a tile its CTA had not
reached (a rank's own rows first under ``comm_aligned``, for instance). Here the generated task
decode, compiled on the host with ``tldsl/tile_order.hpp`` (the header the GEMM and attention
templates walk their tiles with), runs every task on every rank and is compared with
``tile_order``; the test fails with the row-major walk."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen.match.general import match_general
from tldsl.codegen.plan.general import plan_general
from tldsl.codegen.recipes.general import _decode_lines


@tl.kernel
def waiting_tiles(x, y, *, grid=(5, 3), compute: tl.ComputeSchedule = None):
    """Each tile waits on a signal a comm part notifies, then copies its block: a part that
    waits (the general lowering walked those row-major)."""
    ready = tl.signal("ready", 1)

    @tl.comm_part(grid=(1,), name="go")
    def go(i):
        tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=grid, name="tiles", align_shift=1)
    def tiles(*pid):
        tl.consumer_tile_wait(ready, 0)
        tl.store(y, (pid[0] * 8, pid[1] * 8), tl.load(x, (pid[0] * 8, pid[1] * 8), (8, 8)))


INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")
_BUILT: dict[str, Path] = {}
_TMP = tempfile.TemporaryDirectory(prefix="tile_order_")     # (removed when the interpreter exits)


def _walk(lines: list[str], tasks: int, rank: int, grid) -> list[tuple]:
    """The program ids the decode gives each task, in task order (None for a row past the grid,
    which the kernel's task loop skips): the generated lines compiled on the host with
    ``tldsl/tile_order.hpp``, as NVRTC compiles them."""
    key = "\n".join(lines) + f"\n{tasks} {grid}"
    if key not in _BUILT:
        d = Path(_TMP.name) / str(len(_BUILT))
        d.mkdir()
        fmt = " ".join(["%d"] * len(grid))
        args = ", ".join(f"pid{a}" for a in range(len(grid)))
        (d / "walk.cpp").write_text("\n".join([
            '#include "tldsl/tile_order.hpp"', "#include <cstdio>", "#include <cstdlib>",
            "int main(int argc, char** argv) {", "  const int rank = atoi(argv[1]); (void)rank;",
            f"  for (int task = 0; task < {tasks}; ++task) {{", *lines,
            f'    if (pid0 >= {grid[0]}) {{ printf("-\\n"); continue; }}', f'    printf("{fmt}\\n", {args});', "  }", "}",
            ""]))
        subprocess.run(["g++", "-std=c++17", "-O0", f"-I{INCLUDE}", str(d / "walk.cpp"), "-o", str(d / "walk")],
                       check=True)
        _BUILT[key] = d / "walk"
    out = subprocess.run([str(_BUILT[key]), str(rank)], check=True, capture_output=True, text=True).stdout
    return [None if ln == "-" else tuple(map(int, ln.split())) for ln in out.splitlines()]


SCHEDULES = [
    dict(order="row_major"),
    dict(order="swizzled", group_m=2),
    dict(order="swizzled", group_m=8),
    dict(order="comm_aligned", group_m=1),
    dict(order="comm_aligned", group_m=2),
    dict(order="comm_aligned", group_m=3, cluster=(2, 1)),       # 5 tile rows: a short last cluster row
    dict(order="row_major", cluster=(2, 1)),
    dict(order="swizzled", group_m=2, cluster=(2, 1)),
]


@needs_gxx
@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("grid", [(5, 3), (4, 2), (6, 2, 2)])
@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_the_general_lowering_walks_the_schedules_tile_order(W, grid, sched):
    compute = tl.ComputeSchedule(tile=(8, 8, 8), **sched)
    g0, g1 = grid[0], grid[1]
    x = tl.TensorSpec((8 * g0, 8 * g1), tl.float32)
    k = waiting_tiles.trace(W, x, x, compute=compute, grid=grid)
    part = k.part("tiles")
    plan = plan_general(k, part, match_general(k, part))
    lines = _decode_lines(plan)
    cm = compute.cluster[0]
    walk = -(-g0 // cm) * cm * int(np.prod(grid[1:]))
    for rank in range(W):
        slots = [None if t is None else tuple(t) for t in compute.tile_slots(grid, rank, W, align_shift=1)]
        assert _walk(lines, walk, rank, grid) == slots, (rank, lines)         # holes where the kernel has them
        assert [t for t in slots if t is not None] == [tuple(t) for t in compute.tile_order(grid, rank, W, 1)]
    from tldsl.codegen import lower
    lk = lower(k, "tiles")
    assert f"task < {walk};" in lk.source
    assert (f"if (pid0 >= {g0}) continue;" in lk.source) == bool(g0 % cm)     # a short last cluster row
    assert all(ln in lk.source for ln in lines)


@tl.kernel
def waiting_column(x, y, *, n=7, compute: tl.ComputeSchedule = None):
    """A one-axis grid of waiting tiles (as attention's query tiles)."""
    ready = tl.signal("ready", 1)

    @tl.comm_part(grid=(1,), name="go")
    def go(i):
        tl.producer_tile_notify(ready, 0)

    @tl.compute_part(grid=(n,), name="tiles", align_shift=1)
    def tiles(p):
        tl.consumer_tile_wait(ready, 0)
        tl.store(y, (p * 8, 0), tl.load(x, (p * 8, 0), (8, 8)))


@needs_gxx
@pytest.mark.parametrize("cluster", [(1, 1), (2, 1)])
@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("order", ["row_major", "swizzled", "comm_aligned"])
def test_a_column_of_tiles_is_rotated_by_comm_aligned_only(W, order, cluster):
    """A one-axis grid: in order, or, with comm_aligned, starting on rank (rank + shift)'s share —
    as the attention recipe walks its query tiles (``tile_at`` on a grid of one column); the
    schedule's clusters change nothing there (no lowering launches clusters on one axis)."""
    n = 7
    compute = tl.ComputeSchedule(tile=(8, 8, 8), order=order, cluster=cluster)
    x = tl.TensorSpec((8 * n, 8), tl.float32)
    k = waiting_column.trace(W, x, x, compute=compute, n=n)
    part = k.part("tiles")
    plan = plan_general(k, part, match_general(k, part))
    assert (plan.order is not None) == (order == "comm_aligned")
    for rank in range(W):
        want = [tuple(t) for t in compute.tile_order((n,), rank, W, align_shift=1)]
        assert sorted(want) == [(i,) for i in range(n)]
        start = (rank + 1) % W * n // W if order == "comm_aligned" else 0
        assert want == [((start + i) % n,) for i in range(n)]
        assert _walk(_decode_lines(plan), n, rank, (n,)) == want


def test_a_row_major_part_keeps_the_plain_decode():
    x = tl.TensorSpec((40, 24), tl.float32)
    k = waiting_tiles.trace(2, x, x, compute=tl.ComputeSchedule(tile=(8, 8, 8), order="row_major"))
    part = k.part("tiles")
    plan = plan_general(k, part, match_general(k, part))
    assert plan.order is None
    assert _decode_lines(plan)[0].strip() == "const int pid0 = task / 3;"


BM, BN, BK = 128, 128, 64


@tl.kernel
def row_fed_by_row(a, b, c, *, compute: tl.ComputeSchedule = None):
    """Tile row 1 of a GEMM reads (through a comm part) what tile row 0 stored: the part waits,
    through ``feed``, on what it notifies itself."""
    M, K = a.shape
    N = b.shape[1]
    a2 = tl.local_buffer((M, K), a.dtype, "a2")
    ready = tl.signal("ready", M // BM)
    stored = tl.signal("stored", 1)

    @tl.comm_part(grid=(M // BM,), name="feed")
    def feed(i):
        with tl.when(i == 0):
            tl.store(a2, (0, 0), tl.load(a, (0, 0), (BM, K)))
        with tl.when(i > 0):
            tl.consumer_tile_wait(stored, 0, count=N // BN)
            tl.store(a2, (i * BM, 0), tl.load(c, (0, 0), (BM, K)))
        tl.producer_tile_notify(ready, i)

    @tl.compute_part(grid=(M // BM, N // BN))
    def gemm(pm, pn):
        tl.consumer_tile_wait(ready, pm)
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a2, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(c, (pm * BM, pn * BN), acc)
        with tl.when(pm == 0):
            tl.producer_tile_notify(stored, 0)


def test_a_part_waiting_on_itself_through_others_is_walked_in_the_schedules_order():
    """The simulator checks such a part on one slot in the schedule's tile order (clusters of two
    tile rows order the tiles too), as a GPU giving it fewer CTAs than tiles walks them: a GEMM
    lowered without the schedule's clusters would walk another order, so that override is
    refused, and the part is lowered by the general recipe, which walks the clusters' order."""
    from tldsl.codegen import LoweringError, lower, lower_gemm
    M, K, N = 256, 128, 128
    specs = [tl.TensorSpec((M, K), tl.float16), tl.TensorSpec((K, N), tl.float16), tl.TensorSpec((M, N), tl.float16)]
    k = row_fed_by_row.trace(1, *specs, compute=tl.ComputeSchedule(tile=(BM, BN, BK), stages=2, cluster=(2, 1)))
    with pytest.raises(LoweringError, match=r"cluster \(1, 1\) in place of the schedule's \(2, 1\): the kernel "
                                            r"would walk its tiles without the clusters"):
        lower_gemm(k, "gemm", cluster=(1, 1))
    with pytest.warns(tl.FallbackWarning):
        assert type(lower(k, "gemm")).__name__ == "LoweredGeneral"


@tl.kernel
def combine_fed_by_itself(y, pos, wts, out, *, compute: tl.ComputeSchedule = None):
    """A row-gather combine whose tile (0, 1) waits, through ``relay``, for its tile (1, 0): in
    row-major order a later tile, in the order of clusters of two tile rows an earlier one."""
    T, topk = wts.shape
    TM, TN, _ = compute.tile
    gm, gn = tl.cdiv(T, TM), tl.cdiv(y.shape[1], TN)
    done = tl.signal("done", gm * gn)
    moved = tl.signal("moved", 1)

    @tl.comm_part(grid=(1,), name="relay")
    def relay(i):
        tl.consumer_tile_wait(done, 1 * gn + 0)
        tl.producer_tile_notify(moved, 0)

    @tl.compute_part(grid=(gm, gn), name="comb")
    def comb(j, pn):
        m0, c0 = j * TM, pn * TN
        with tl.when((j == 0) & (pn == 1)):
            tl.consumer_tile_wait(moved, 0)
        acc = tl.fragment((TM, TN), tl.float32)
        for k in tl.range(0, topk):     # the weighted sum of each token's top-k rows
            acc += tl.load_rows(y, tl.load(pos, (k * T + m0,), (TM,)), c0, TN) * tl.load(wts, (m0, k), (TM, 1))
        tl.store(out, (m0, c0), acc)
        tl.producer_tile_notify(done, j * gn + pn)


def test_a_combine_waiting_on_itself_through_others_keeps_the_clusters_order():
    """The combine recipe walks its tiles in the schedule's order without clusters: for such a part
    under clusters of two tile rows it refuses (the general recipe, walking the clusters' order,
    lowers it). The simulator agrees on why it matters: row-major, tile (0, 1) waits for the later
    tile (1, 0) — a deadlock on one slot; in the clusters' order it comes first."""
    from tldsl.codegen import LoweringError, lower_all, lower_combine
    T, topk, R, C = 128, 2, 256, 128
    rng = np.random.default_rng(0)
    inputs = [{"y": rng.standard_normal((R, C)).astype(np.float32),
               "pos": rng.integers(0, R, topk * T).astype(np.int32),
               "wts": rng.standard_normal((T, topk)).astype(np.float32),
               "out": np.full((T, C), np.nan, np.float32)}]
    specs = [tl.TensorSpec(v.shape, {np.dtype(np.float32): tl.float32, np.dtype(np.int32): tl.int32}[v.dtype])
             for v in inputs[0].values()]
    plain = tl.ComputeSchedule(tile=(64, 64, 16))
    with pytest.raises(tl.DeadlockError, match="ran on 1 slot"):
        tl.simulate(combine_fed_by_itself, 1, inputs, compute=plain)
    assert type(lower_combine(combine_fed_by_itself.trace(1, *specs, compute=plain), "comb")).__name__ == \
        "LoweredCombine"
    clustered = plain.with_(cluster=(2, 1))
    tl.simulate(combine_fed_by_itself, 1, inputs, compute=clustered)
    k = combine_fed_by_itself.trace(1, *specs, compute=clustered)
    with pytest.raises(LoweringError, match=r"cluster \(1, 1\) in place of the schedule's \(2, 1\)"):
        lower_combine(k, "comb")
    with pytest.warns(tl.FallbackWarning):
        assert type(lower_all(k)["comb"]).__name__ == "LoweredGeneral"


def test_clusters_are_refused_where_a_tile_may_wait_on_its_cluster_partner():
    """With clusters of two tile rows the two CTAs share B by multicast: neither tile finishes
    before both have passed their waits. Row 1 waits (through ``feed``) for row 0's store, so
    the pair would hang on any grid — while the simulator, running the tiles apart, accepts the
    program. The GEMM recipe refuses the clusters (the lowering falls back, saying why); without
    the cycle, clusters stay."""
    from tldsl.codegen import lower
    M, K, N = 256, 128, 128
    specs = [tl.TensorSpec((M, K), tl.float16), tl.TensorSpec((K, N), tl.float16), tl.TensorSpec((M, N), tl.float16)]
    clustered = tl.ComputeSchedule(tile=(BM, BN, BK), stages=2, cluster=(2, 1))
    k = row_fed_by_row.trace(1, *specs, compute=clustered)
    with pytest.warns(tl.FallbackWarning, match=r"cluster \(2, 1\): the CTAs of a cluster share B, so neither tile "
                                                r"finishes before both have passed their waits.*Use cluster \(1, 1\)"):
        lk = lower(k, "gemm")
    assert type(lk).__name__ == "LoweredGeneral"
    k1 = row_fed_by_row.trace(1, *specs, compute=clustered.with_(cluster=(1, 1)))
    assert type(lower(k1, "gemm")).__name__ == "LoweredGemm"
    from tldsl.ops.allgather_gemm import allgather_gemm      # waits on the gather only: clusters stay
    x = tl.TensorSpec((256, 128), tl.float16)
    ag = allgather_gemm.trace(2, x, tl.TensorSpec((128, 256), tl.float16), tl.TensorSpec((512, 256), tl.float16),
                              compute=tl.ComputeSchedule(tile=(128, 128, 64), stages=2, order="comm_aligned",
                                                         cluster=(2, 1)),
                              comm=tl.CommSchedule(engine="sm", mode="push", tile_m=128, sms=2))
    assert lower(ag, "gemm").config.cluster == (2, 1)


# -- align_shift and group_m of any size the schedule takes: the simulator's order on the GPU ----------

@tl.kernel
def rows_shifted(a: tl.Symmetric, g: tl.Symmetric, y, *, shift=0, compute: tl.ComputeSchedule = None):
    """Every rank pushes its rows to every peer; the compute part, in the comm_aligned order
    rotated by ``shift``, waits for a row's owner and squares it."""
    W = tl.world_size()
    Ms, N = a.shape
    BM, BN, _ = compute.tile
    arrived = tl.signal("arr", W, scope="symmetric")

    @tl.comm_part(grid=(W,))
    def push(s):
        me = tl.rank()
        p = (me + s) % W
        tl.tile_push_data(g.at(p), (me * Ms, 0), a, (0, 0), (Ms, N))
        tl.peer_tile_notify(arrived, me, p)

    @tl.compute_part(grid=(W * Ms // BM, tl.cdiv(N, BN)), align_shift=shift)
    def part(pm, pn):
        tl.peer_tile_wait(arrived, pm * BM // Ms)
        t = tl.load(g, (pm * BM, pn * BN), (BM, BN))
        tl.store(y, (pm * BM, pn * BN), t * t + 1.0)


@needs_gxx
@pytest.mark.parametrize("shift", [-1, -5, 10**12, -(10**12) - 1])
def test_a_negative_or_huge_align_shift_starts_where_the_simulator_does(shift, tmp_path):
    """``align_shift`` is any int: the simulator rotates the rows to those of rank (rank + shift)
    % W with Python's %, never negative. The generated code used C++'s % (negative for a negative
    rank + shift: the walk started on a negative row, and a block of tiles was never computed) on
    the shift rendered as given (10**12 narrowed to a negative int). It is now reduced modulo W on
    the host and the header's modulo is never negative: the kernel, emulated on every rank at
    once, writes what the simulator does, walking the simulator's order."""
    from tldsl.codegen import lower
    from test_codegen_general import NP, _stored_inputs, emulate_kernel
    W, Ms = 3, 16
    rng = np.random.default_rng(0)
    xs = [rng.integers(-4, 5, (Ms, 16)).astype(np.float32) / 4 for _ in range(W)]
    ins = [{"a": xs[r], "g": np.full((W * Ms, 16), np.nan, np.float32),
            "y": np.full((W * Ms, 16), np.nan, np.float32)} for r in range(W)]
    sched = tl.ComputeSchedule(tile=(8, 8, 8), order="comm_aligned", group_m=1)
    want = tl.simulate(rows_shifted, W, ins, compute=sched, shift=shift, options={"launches": 1})
    k = want.kernel
    lowered = [lower(k, p.name) for p in k.parts]
    tiles = lowered[1]
    assert f"comm_aligned_start(6, rank, 3, {shift % W})" in tiles.source
    part = k.part("part")
    plan = plan_general(k, part, match_general(k, part))
    for rank in range(W):
        assert _walk(_decode_lines(plan), 12, rank, (6, 2)) == sched.tile_slots((6, 2), rank, W, shift)
    stored = []
    for r in range(W):
        arr = _stored_inputs(k, ins[r])
        for b in k.workspaces:
            arr[b.name] = np.full(b.type.shape, np.nan, NP[b.type.dtype.name])
        stored.append(arr)
    got = emulate_kernel(k, lowered, stored, tmp_path, grid=2)
    full = np.concatenate(xs)
    for r in range(W):
        np.testing.assert_array_equal(want[r]["y"], full * full + 1)
        np.testing.assert_array_equal(got[r]["y"], want[r]["y"])


@tl.kernel
def tripled(x, y, *, compute: tl.ComputeSchedule = None):
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        tl.store(y, (pm * BM, pn * BN), tl.load(x, (pm * BM, pn * BN), (BM, BN)) * 3.0)


@needs_gxx
@pytest.mark.parametrize("order", ["swizzled", "comm_aligned"])
@pytest.mark.parametrize("group_m", [2**31 - 1, 2**40])
def test_a_group_of_more_rows_than_the_grid_walks_one_group(order, group_m, tmp_path):
    """``group_m`` is any positive int; one of the grid's rows or more is one group (column-major
    order). ``tile_at`` computed ``group_m * gn`` in 32 bits (2**31 - 1 groups of 2 columns: -2, a
    negative first row, tiles skipped; 2**40 rendered as an int literal is 0). The header bounds
    the group by the rows it walks and the host renders at most INT_MAX: the simulator's order,
    every tile written."""
    from tldsl.codegen import lower
    from test_codegen_general import _stored_inputs, emulate
    x = np.arange(40 * 16, dtype=np.float32).reshape(40, 16)
    sched = tl.ComputeSchedule(tile=(8, 8, 8), order=order, group_m=group_m)
    ins = {"x": x, "y": np.full_like(x, np.nan)}
    sim = tl.simulate(tripled, 1, [ins], compute=sched)
    np.testing.assert_array_equal(sim[0]["y"], 3 * x)
    k = sim.kernel
    lk = lower(k, "part")
    assert ", 2147483647, " in lk.source
    part = k.part("part")
    plan = plan_general(k, part, match_general(k, part))
    assert _walk(_decode_lines(plan), 10, 0, (5, 2)) == sched.tile_slots((5, 2), 0, 1)
    got = emulate(k, lk, _stored_inputs(k, ins), tmp_path)
    np.testing.assert_array_equal(got["y"], sim[0]["y"])
