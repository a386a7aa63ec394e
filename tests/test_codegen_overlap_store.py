"""Overlapped stores: where the plain and grouped GEMM recipes hold a tile's 16-bit C in registers
and store it during the consumer warpgroup's next K loop (``Cfg::kOverlapStore``, ``HeldTile`` in
sm90_gemm.hpp), where they store at once, and what NVRTC makes of it: the chunk stores sit between
a stage's WGMMAs and the wait for them, without spills. The results on a GPU are checked by the GEMM
and grouped-GEMM GPU tests (``tests/test_gpu_gemm.py``, ``tests/test_gpu_run.py``, ``tests/test_gpu_moe.py``),
every one of which now runs held tiles where this plans them."""
import pytest

import tldsl as tl
from tldsl.codegen import lower_gemm
from tldsl.codegen.plan.grouped_gemm import HELD_REGS, REGISTER_POOL
from tldsl.codegen.recipes.grouped_gemm import lower_grouped_gemm
from tldsl.codegen.toolchain import toolchain_available
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import CompileJob, compile_many

from test_codegen_comm import rs_kernel
from test_codegen_grouped_k_major import trace_experts
from test_codegen_host import trace_plain
from test_codegen_moe import trace_ag, trace_rs

LINE = "static constexpr bool kOverlapStore = true;"


@pytest.mark.parametrize("tile", [(128, 256, 64), (128, 128, 64), (256, 128, 64), (64, 256, 64)])
def test_a_plain_16_bit_gemm_holds_its_tiles(tile):
    lg = lower_gemm(trace_plain(M=1000, N=776, K=520, tile=tile, stages=3, dt=tl.bfloat16, odt=tl.bfloat16))
    assert lg.config.overlap_store and LINE in lg.source


def test_an_f32_output_or_a_gemm_that_waits_and_notifies_stores_at_once():
    f32 = lower_gemm(trace_plain(tile=(128, 128, 64), dt=tl.float16, odt=tl.float32))
    rs_f32 = lower_gemm(rs_kernel(W=4, comm=tl.CommSchedule(tile_m=64, order="ring", mode="push"), Ms=256,
                                  dt=tl.bfloat16, tile=(128, 256, 64), stages=4))          # an f32 partial
    # a part whose next tile may wait on what this tile notifies (through another part): deferring
    # the notify to after the next tile's K loop would deadlock, so it notifies each tile at once
    from test_codegen_tile_order import row_fed_by_row
    specs = [tl.TensorSpec(s, tl.float16) for s in ((256, 128), (128, 128), (256, 128))]
    fed = lower_gemm(row_fed_by_row.trace(1, *specs, compute=tl.ComputeSchedule(tile=(128, 128, 64), stages=2)),
                     "gemm")
    assert fed.waits == 1 and fed.notifies == 1
    for lg in (f32, rs_f32, fed):
        assert not lg.config.overlap_store and "kOverlapStore" not in lg.source


def test_gemm_reduce_scatter_holds_its_tiles_and_notifies_a_tile_later():
    """GEMM+ReduceScatter's compute part (partials in the output's dtype, the op's default) never
    waits: each tile is notified once its held chunks, stored during the next tile's K loop, are
    complete (the last tile's after the loop)."""
    for mode, order in (("push", "ring"), ("pull", "full_mesh")):
        lg = lower_gemm(rs_kernel(W=4, comm=tl.CommSchedule(tile_m=64, order=order, mode=mode), Ms=256,
                                  dt=tl.bfloat16, tile=(128, 256, 64), stages=4, partial_dtype="out"))
        assert lg.config.overlap_store and LINE in lg.source and lg.notifies == 1 and lg.waits == 0


def test_grouped_gemms_hold_tiles_where_notifies_can_wait_a_tile():
    rs = lower_grouped_gemm(trace_rs(tile=(128, 256, 64), dt=tl.bfloat16), "grouped_gemm")
    ag = lower_grouped_gemm(trace_ag(tile=(128, 256, 64), dt=tl.bfloat16), "grouped_gemm")
    # MoE+ReduceScatter's GEMM notifies and never waits: its notifies already run a tile late; the
    # held pairs and that state take the registers HELD_REGS moves to the consumers
    assert rs.config.overlap_store and LINE in rs.source
    assert (rs.config.producer_regs, rs.config.consumer_regs) == HELD_REGS
    assert 128 * HELD_REGS[0] + 256 * HELD_REGS[1] <= REGISTER_POOL
    # AllGather+MoE's GEMM: its producer gathers the rows and sets the pace (held tiles measured slower)
    assert not ag.config.overlap_store and "kOverlapStore" not in ag.source
    # a part folded in keeps its consumers at fewer registers: stores at once
    folded = lower_grouped_gemm(trace_rs(tile=(128, 256, 64), dt=tl.bfloat16), "grouped_gemm", side="combine")
    assert not folded.config.overlap_store and "kOverlapStore" not in folded.source
    # ping-pong already stores one warpgroup's tile while the other computes
    pp = lower_grouped_gemm(trace_rs(tile=(128, 128, 64), dt=tl.bfloat16), "grouped_gemm")
    assert pp.config.pingpong and not pp.config.overlap_store


def _stores_inside_k_loop(k) -> bool:
    """Whether a chunk's STSM sits between a stage's last issued HGMMA and the wait for the stage
    before it (``WARPGROUP.DEPBAR.LE gsb0, 0x1``): the store runs while the tensor cores do."""
    issued = False
    for line in k.lines:
        if "HGMMA" in line and "gsb0" in line:
            issued = True
        elif "WARPGROUP.DEPBAR.LE" in line:
            issued = False
        elif issued and line.split()[0].startswith("STSM"):
            return True
    return False


_OK, _WHY = toolchain_available()


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
def test_held_tiles_are_stored_inside_the_next_k_loop_without_spills(tmp_path):
    lgs = {"plain 128x256": lower_gemm(trace_plain(M=1000, N=776, K=520, tile=(128, 256, 64), stages=4,
                                                    dt=tl.bfloat16, odt=tl.bfloat16)),
           "plain 256x128 cluster": lower_gemm(trace_plain(M=1000, N=776, K=520, tile=(256, 128, 64), stages=4,
                                                           dt=tl.bfloat16, odt=tl.bfloat16, cluster=(2, 1))),
           "gemm+rs notifying": lower_gemm(rs_kernel(W=4, comm=tl.CommSchedule(tile_m=64, order="ring", mode="push"),
                                                     Ms=256, dt=tl.bfloat16, tile=(128, 256, 64), stages=4,
                                                     partial_dtype="out")),
           "moe rs W=4": lower_grouped_gemm(trace_rs(tile=(128, 256, 64), stages=4, dt=tl.bfloat16,
                                                     cluster=(2, 1)), "grouped_gemm"),
           "experts half tiles, cluster 2": lower_grouped_gemm(trace_experts(tile=(128, 256, 64), stages=4, N=512,
                                                                           cluster=2), "gg"),
           "experts [E, N, K] pairs": lower_grouped_gemm(trace_experts(tile=(64, 128, 64), stages=4, NT=8), "gg"),
           "experts split columns": lower_grouped_gemm(trace_experts(tile=(64, 256, 64), stages=4, NT=8, N=512,
                                                                     mask=False), "gg")}
    cks = compile_many([CompileJob(lg.source, lg.entry, lg.options) for lg in lgs.values()],
                       cache=KernelCache(tmp_path), progress=False)
    for (name, lg), ck in zip(lgs.items(), cks):
        assert lg.config.overlap_store, name
        info = ck.ptxas_info()[ck.name]
        assert info["spill_store_bytes"] == 0 and info["stack_bytes"] == 0, (name, info)
        k = ck.sass()[ck.name]
        assert k.count("BPT.TRAP") == 0 and k.count("UTMASTG") > 0, name
        assert _stores_inside_k_loop(k), name
