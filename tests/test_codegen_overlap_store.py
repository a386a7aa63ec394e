"""Overlapped stores: where the plain GEMM recipe holds a tile's 16-bit C in registers and stores it
during the consumer warpgroup's next K loop (``Cfg::kOverlapStore``, ``HeldTile`` in sm90_gemm.hpp),
where it stores at once, and what NVRTC makes of it: the chunk stores sit between a stage's WGMMAs
and the wait for them, without spills. The results on a GPU are checked by the GEMM GPU tests
(``tests/test_gpu_gemm.py``, the GEMM cases of ``tests/test_gpu_run.py``), every one of which runs
held tiles where this plans them."""
import pytest

import tldsl as tl
from tldsl.codegen import lower_gemm
from tldsl.codegen.recipes.grouped_gemm import lower_grouped_gemm
from tldsl.codegen.toolchain import toolchain_available
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import CompileJob, compile_many

from test_codegen_comm import rs_kernel
from test_codegen_host import trace_ag, trace_plain
from test_codegen_moe import trace_ag as trace_moe_ag, trace_rs

LINE = "static constexpr bool kOverlapStore = true;"


@pytest.mark.parametrize("tile", [(128, 256, 64), (128, 128, 64), (256, 128, 64), (64, 256, 64)])
def test_a_plain_16_bit_gemm_holds_its_tiles(tile):
    lg = lower_gemm(trace_plain(M=1000, N=776, K=520, tile=tile, stages=3, dt=tl.bfloat16, odt=tl.bfloat16))
    assert lg.config.overlap_store and LINE in lg.source


def test_an_f32_output_or_a_notifying_gemm_stores_at_once():
    f32 = lower_gemm(trace_plain(tile=(128, 128, 64), dt=tl.float16, odt=tl.float32))
    # GEMM+ReduceScatter's compute part notifies each tile once its stores are complete
    rs = lower_gemm(rs_kernel(W=4, comm=tl.CommSchedule(tile_m=64, order="ring", mode="push"), Ms=256,
                              dt=tl.bfloat16, tile=(128, 256, 64), stages=4))
    for lg in (f32, rs):
        assert not lg.config.overlap_store and "kOverlapStore" not in lg.source


def test_grouped_gemms_store_at_once():
    """The grouped GEMM recipe does not hold tiles: its held-tile epilogue gave MoE+ReduceScatter's
    DeepSeek-MoE row a wrong result on the GPU (BENCHMARKS.md, fifty-eighth session)."""
    for k in (trace_rs(tile=(128, 256, 64), dt=tl.bfloat16), trace_moe_ag(tile=(128, 256, 64), dt=tl.bfloat16)):
        lg = lower_grouped_gemm(k, "grouped_gemm")
        assert not lg.config.overlap_store and "kOverlapStore" not in lg.source


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
           "plain 64x256 fp16": lower_gemm(trace_plain(M=1000, N=776, K=520, tile=(64, 256, 64), stages=4,
                                                        dt=tl.float16, odt=tl.float16)),
           "all-gather's GEMM (waits)": lower_gemm(trace_ag(W=4, tile=(128, 256, 64), stages=4, dt=tl.bfloat16))}
    cks = compile_many([CompileJob(lg.source, lg.entry, lg.options) for lg in lgs.values()],
                       cache=KernelCache(tmp_path), progress=False)
    for (name, lg), ck in zip(lgs.items(), cks):
        assert lg.config.overlap_store, name
        info = ck.ptxas_info()[ck.name]
        assert info["spill_store_bytes"] == 0 and info["stack_bytes"] == 0, (name, info)
        k = ck.sass()[ck.name]
        assert k.count("BPT.TRAP") == 0 and k.count("UTMASTG") > 0, name
        assert _stores_inside_k_loop(k), name
