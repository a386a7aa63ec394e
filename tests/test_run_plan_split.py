"""How a launch's compute kernels share the SMs (runtime/gpu/sm_split.py, runtime/gpu/work.py),
without a GPU: by estimated work (the default) — a light kernel waiting on another's tiles gets
a small floor, not half the GPU — or evenly (``split="even"``); the edge cases (one kernel, the
floors, a part that must have all its tasks resident, more kernels than SMs) and the refusals
the plan made before, unchanged."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.errors import InputError
from tldsl.ops.moe import moe_num_tiles, moe_reduce_scatter
from tldsl.runtime.gpu.run_errors import ResidencyError
from tldsl.runtime.gpu.run_plan import lower_for_run, plan_run
from tldsl.runtime.gpu.sm_split import LIGHT_FLOOR, SPLITS, share
from tldsl.runtime.gpu.work import FLOPS_PER_BYTE, part_work, task_cost

from test_run_plan import C128, H200_SMS, ag_gemm, planned

S, F16, BF16, F32, I32 = tl.TensorSpec, tl.float16, tl.bfloat16, tl.float32, tl.int32


# =================================================================================================
# the estimate
# =================================================================================================

@tl.kernel
def gemm_then_chain(a, b, c, x, y, *, compute: tl.ComputeSchedule = None):
    """A GEMM part and a light part whose task t waits for task t + 1 of its own part (all 16
    of its tasks must be resident at once)."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile
    done = tl.signal("done", 16)

    @tl.compute_part(grid=(M // BM, N // BN))
    def gemm(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(c, (pm * BM, pn * BN), acc)

    @tl.compute_part(grid=(16,))
    def chain(t):
        with tl.when(t < 15):
            tl.consumer_tile_wait(done, t + 1)
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)) + 1.0)
        tl.producer_tile_notify(done, t)


def chain_program(M=1024, K=1024, N=1024):
    return gemm_then_chain.trace(1, S((M, K), F16), S((K, N), F16), S((M, N), F16), S((128,), F32), S((128,), F32),
                                 compute=C128)


def test_a_task_costs_its_dots_and_the_memory_it_moves_beside_them():
    k = chain_program()
    gemm, chain = k.part("gemm"), k.part("chain")
    # 8 k-steps of a 128x128x128 product; the operand loads are the dot's; the f16 store is traffic
    assert task_cost(gemm) == 8 * 2 * 128 * 128 * 128 + 128 * 128 * 2 * FLOPS_PER_BYTE
    assert part_work(gemm) == 64 * task_cost(gemm)
    # a load and a store of 8 floats, nothing else
    assert task_cost(chain) == 2 * 8 * 4 * FLOPS_PER_BYTE and part_work(chain) == 16 * task_cost(chain)


def moe_rs_program(W=1, Ms=8192, K=4096, Nr=14336, E=8, topk=2, BM=128):
    """MoE+ReduceScatter's program at Mixtral's sizes (tensor-parallel slice of one rank)."""
    NT, T = moe_num_tiles(W * Ms * topk, E, BM), W * Ms
    TT = -(-T // BM)
    return moe_reduce_scatter.trace(
        W, S((NT * BM, Nr), BF16), S((E, Nr, K), BF16), S((T, topk), F32), S((NT,), I32), S((NT,), I32),
        S((topk * T,), I32),
        S((NT, min(BM, TT)), I32), S((NT,), I32), S((TT,), I32), S((Ms, K), BF16), compute=tl.ComputeSchedule())


def test_the_moe_combine_is_a_small_fraction_of_its_grouped_gemm():
    k = moe_rs_program()
    gemm, combine = k.part("grouped_gemm"), k.part("combine")
    # 224 k-steps of 128x128x64 and a bf16 store per GEMM tile (y_sorted in the operands' dtype);
    # per combine tile, top-2 gathered bf16 rows, their weights and positions, and the f32 store
    assert task_cost(gemm) == 224 * 2 * 128 * 128 * 64 + 128 * 128 * 2 * FLOPS_PER_BYTE
    assert task_cost(combine) == (2 * (128 * 4 + 128 * 128 * 2 + 128 * 4) + 128 * 128 * 4) * FLOPS_PER_BYTE
    share = part_work(combine) / (part_work(gemm) + part_work(combine))
    assert 0.02 < share < 0.03                          # (0.03-0.05 while y_sorted was f32)


# =================================================================================================
# the split
# =================================================================================================

def test_one_kernel_gets_every_sm_it_can_use():
    assert share([1], [500], 132, [1.0], [0]) == [132]
    assert share([1], [50], 132, [1.0], [0]) == [50]           # never more CTAs than tiles
    assert share([2, 1], [2, 500], 132, [5.0, 1.0], [0, 0]) == [2, 130]   # lanes keep theirs


def test_the_sms_are_shared_in_proportion_to_work():
    assert share([1, 1], [500, 500], 131, [3.0, 1.0], [0, 0]) == [98, 33]
    assert share([1, 1], [500, 500], 131, [1.0, 1.0], [0, 0]) == [66, 65]
    assert share([1, 1], [500, 500], 131, [1.0, 1.0]) == share([1, 1], [500, 500], 131)   # even: as before


def test_a_light_kernel_keeps_a_floor_of_an_eighth_of_an_evenshare():
    assert LIGHT_FLOOR == 8
    # 24:1 would give it 5 of 131; an even share is 65, an eighth of it 8
    assert share([1, 1], [5000, 5000], 131, [24.0, 1.0], [0, 0]) == [123, 8]
    assert share([1, 1], [5000, 5000], 131, [1.0, 0.0], [0, 0]) == [123, 8]       # no work: the floor
    assert share([1, 1], [5000, 3], 131, [24.0, 1.0], [0, 0]) == [128, 3]         # a floor past its tiles


def test_a_part_that_must_have_its_tasks_resident_gets_them_first():
    assert share([1, 1], [5000, 16], 40, [1e9, 1.0], [0, 16]) == [24, 16]
    # floors that do not fit together fall back to the least: the plan's check then refuses
    assert share([1, 1], [5000, 16], 16, [1e9, 1.0], [0, 16]) == [15, 1]


def test_a_capped_kernel_leaves_the_rest_to_the_others():
    assert share([1, 1, 1], [20, 5000, 5000], 131, [100.0, 1.0, 1.0], [0, 0, 0]) == [20, 56, 55]


def test_more_kernels_than_sms_beyond_their_least():
    assert share([1] * 10, [100] * 10, 10, [float(i) for i in range(10)], [0] * 10) == [1] * 10
    assert sum(share([1] * 5, [100] * 5, 7, [1.0, 2.0, 3.0, 4.0, 100.0], [0] * 5)) == 7
    k = ag_gemm(W=8)                   # 8 ranks: 8 x 2 communication lanes + 8 GEMMs
    with pytest.raises(ResidencyError, match="at least 24 CTAs resident at once"):
        planned(k, sm_count=20)


def test_every_split_stays_within_the_sms_and_each_kernels_bounds():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 7))
        lows = [int(v) for v in rng.integers(1, 4, n)]
        highs = [lo + int(v) for lo, v in zip(lows, rng.integers(0, 300, n))]
        available = sum(lows) + int(rng.integers(0, 400))
        works = [float(v) for v in rng.choice([0.0, 1.0, 7.0, 1e3, 1e6], n)]
        needs = [int(v) if rng.random() < 0.2 else 0 for v in rng.integers(0, 40, n)]
        got = share(lows, highs, available, works, needs)
        assert all(lo <= g <= h for lo, g, h in zip(lows, got, highs))
        assert sum(got) == min(available, sum(highs))


# =================================================================================================
# the plans
# =================================================================================================

def test_moe_reduce_scatter_gives_its_grouped_gemm_the_sms_the_combine_does_not_need():
    k = moe_rs_program()
    lowered = lower_for_run(k, chain="beside")
    even, work = (plan_run(k, lowered, sm_count=H200_SMS, split=s, chain="beside") for s in ("even", "work"))
    # beside its GEMM (the layout before chained parts ran after their producer): evenly, the
    # combine (no dot; it runs behind the GEMM's tiles) took half of the SMs
    assert {x.part: x.ctas for x in even.kernels} == {"reduce_scatter": 1, "grouped_gemm": 66, "combine": 65}
    assert {x.part: x.ctas for x in work.kernels} == {"reduce_scatter": 1, "grouped_gemm": 123, "combine": 8}
    assert "shared by work" in work.describe() and "shared by even" in even.describe()


def test_the_self_wait_rule_holds_under_either_split():
    k = chain_program()
    assert {x.part: x.ctas for x in planned(k, sm_count=40).kernels} == {"gemm": 24, "chain": 16}
    assert {x.part: x.ctas for x in planned(k, sm_count=20).kernels} == {"gemm": 4, "chain": 16}
    for split in SPLITS:
        with pytest.raises(ResidencyError, match=r"part 'chain' waits for its own tasks \(signal\(s\) done\) but "
                                                 r"only \d+ of its 16 tasks"):
            planned(k, sm_count=16, split=split)


def test_a_plan_with_one_compute_kernel_is_the_same_under_either_split():
    k = ag_gemm()
    for sms in (12, H200_SMS):
        assert [x.ctas for x in planned(k, sm_count=sms).kernels] == \
            [x.ctas for x in planned(k, sm_count=sms, split="even").kernels]


def test_an_unknown_split_is_refused():
    with pytest.raises(InputError, match="split='fair'"):
        planned(ag_gemm(), split="fair")
