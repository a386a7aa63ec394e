"""The WGMMA GEMM configuration (`codegen.plan.wgmma.choose_config`) over the schedules a user may
write: every configuration it returns fits an sm_90 block and one consumer thread's accumulators,
ping-pong only where asked for and at 128 x 128, the shared memory counted the way GemmTraits
counts it (computed again here from the layout); everything else a LoweringError that says why."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tldsl.codegen.errors import LoweringError
from tldsl.codegen.plan.wgmma import ACC_LIMIT, SMEM_LIMIT, choose_config
from tldsl.ir.schedule import ComputeSchedule

POW2 = [16, 32, 64, 128, 256]


def _smem(BM, BN, BK, stages, wgs, bufs, in_bytes, out_bytes, ring):
    """GemmTraits' map, written out: stages of A (BM x BK) and B (BK x BN), 1 KiB-aligned; each
    consumer warpgroup's epilogue buffers of 64 rows (at most 128 bytes a row, 1 KiB-aligned); a
    full and an empty barrier per stage and per ring slot; 1 KiB of slack to align the base."""
    def up(x):
        return -(-x // 1024) * 1024
    stage_bytes = stages * (BM * BK + BK * BN) * in_bytes
    epi = up(64 * min(128, BN * out_bytes))
    return up(stage_bytes) + wgs * bufs * epi + 16 * stages + 16 * ring + 1024


@settings(max_examples=300, deadline=None)
@given(BM=st.sampled_from([32, 64, 128, 256]), BN=st.sampled_from(POW2), BK=st.sampled_from(POW2),
       stages=st.integers(1, 8), in_dt=st.sampled_from(["f16", "bf16"]), out_dt=st.sampled_from(["f16", "bf16", "f32"]),
       split_n=st.booleans(), pingpong=st.booleans(), ring=st.sampled_from([0, 2]),
       cluster=st.sampled_from([(1, 1), (2, 1)]), k_steps=st.integers(1, 4))
def test_every_configuration_fits_an_sm90_block(BM, BN, BK, stages, in_dt, out_dt, split_n, pingpong, ring, cluster,
                                                k_steps):
    sched = ComputeSchedule(tile=(BM, BN, BK), stages=stages, cluster=cluster)
    try:
        c = choose_config("test", sched, in_dt, out_dt, K=BK * k_steps, split_n=split_n, notify_slots=ring,
                          pingpong=pingpong)
    except LoweringError as e:
        # refused: a reason a user can act on, never a silent fallback
        assert any(w in str(e) for w in ("stages", "BM=", "BK=", "BN=", "accumulators", "shared memory")), str(e)
        return
    assert (c.BM, c.BN, c.BK, c.stages, c.cluster) == (BM, BN, BK, stages, cluster)
    assert c.pingpong == (pingpong and (BM, BN) == (128, 128))
    assert not (c.pingpong and c.split_n)
    assert c.split_n == (split_n and BM == 64 and BN >= 256)
    wgs = 2 if BM >= 128 or c.split_n else 1
    assert c.consumer_wgs == wgs and c.threads == 128 * (1 + wgs)
    # a consumer thread's accumulators: its m64 blocks of the tile, each 64 x (its columns) / 128 threads
    rows_per_wg = BM if (c.pingpong or wgs == 1) else (64 if c.split_n else BM // 2)
    cols_per_wg = BN // 2 if c.split_n else BN
    assert c.m_blocks == rows_per_wg // 64 and c.acc_per_thread == rows_per_wg * cols_per_wg // 128 <= ACC_LIMIT
    assert c.notify_slots == ring * (2 if c.pingpong else 1)
    ib, ob = 2, (4 if out_dt == "f32" else 2)
    assert c.smem_bytes == _smem(BM, BN, BK, stages, wgs, c.epi_buffers, ib, ob, c.notify_slots) <= SMEM_LIMIT
    # two epilogue buffers per warpgroup unless only one fits
    if c.epi_buffers == 1:
        assert _smem(BM, BN, BK, stages, wgs, 2, ib, ob, c.notify_slots) > SMEM_LIMIT


def test_a_refusal_names_the_fix():
    with pytest.raises(LoweringError, match="lower `stages` or the tile"):
        choose_config("test", ComputeSchedule(tile=(128, 256, 128), stages=4), "bf16", "bf16", K=1024)
    with pytest.raises(LoweringError, match="use stages >= 2"):
        choose_config("test", ComputeSchedule(tile=(128, 128, 64), stages=1), "bf16", "bf16", K=1024)
