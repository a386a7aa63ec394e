"""Property tests: every library op, in the simulator, equals its numpy reference for random
shapes (mostly not multiples of the tile), tiles, world sizes 1-8, schedules and seeds;
and communication schedules never change a result, not even by one bit."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tldsl.ops import OPS as REGISTRY
from tldsl.testing import check_case, describe
from tldsl.testing import strategies as tst

EXAMPLES = int(os.environ.get("TLDSL_EXAMPLES", "20"))
OPS = sorted(REGISTRY)
_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_all_five_workloads_are_registered():
    # AllGather+GEMM, GEMM+ReduceScatter, AllGather+MoE, MoE+ReduceScatter, SP attention
    assert set(OPS) >= {"allgather_gemm", "gemm_reduce_scatter", "allgather_moe", "moe_reduce_scatter",
                        "sp_attention"}, OPS


@pytest.mark.parametrize("name", OPS)
@_settings
@given(data=st.data())
def test_op_matches_numpy_reference(name, data):
    spec = REGISTRY[name]
    world_size = data.draw(tst.world_sizes(1, 8), label="world_size")
    params = data.draw(spec.params(world_size), label="params")
    seed = data.draw(tst.seeds(), label="seed")
    case = spec.make_case(np.random.default_rng(seed), world_size, **params)
    check_case(spec, case, world_size, seed, label=describe(spec, world_size, params, seed))


def _comm_schedules_the_op_takes(name, params, world_size):
    """The communication schedules ``name`` takes with these shapes and this compute schedule,
    so that every draw runs: a rejection here is a failure, not a skipped example. (The copy
    engine's reduce-scatter pull, which the reduce-scatters refuse, is checked by the ops' own
    tests.)"""
    import tldsl as tl
    compute = params["compute"]
    if name in ("allgather_gemm", "allgather_moe", "sp_attention"):
        # the all-gathers: any engine and mode, column slices on the copy engine
        return tst.comm_schedules(compute=compute, col_tiles=True)
    sm = tst.comm_schedules(engines=("sm",), compute=compute)
    if name == "moe_reduce_scatter":
        # or the copy engine pushing whole segments, summed on SMs (the epilogue sum is refused:
        # its combine stores its own tiles; test_op_moe)
        return st.one_of(sm, st.just(tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="comm")))
    if name == "gemm_reduce_scatter":
        # or the copy engine pushing; summing in the GEMM's epilogue only where no producer tile
        # straddles two ranks' rows and the compute order leaves no ranks waiting on each other in a cycle
        from tldsl.ops.gemm_reduce_scatter import _own_rows_waiting_in_a_cycle
        rows = params["rows_per_rank"]

        def takes(comm):
            return comm.reduce_in == "comm" or rows % compute.BM == 0 and _own_rows_waiting_in_a_cycle(
                compute, comm, world_size * rows, params["n"], world_size) is None
        return st.one_of(sm, st.builds(
            lambda t, place: tl.CommSchedule(engine="copy_engine", mode="push", tile_m=t, reduce_in=place),
            st.sampled_from((None, 8, 16)), st.sampled_from(("comm", "epilogue"))).filter(takes))
    raise AssertionError(f"{name}: a new op; say here which communication schedules it takes")


@pytest.mark.parametrize("name", OPS)
@_settings
@given(data=st.data())
def test_comm_schedule_never_changes_a_bit(name, data):
    """Halide's rule: a schedule changes how, never what. Only the communication schedule
    varies here, so outputs must be bitwise identical — and both must match the numpy
    reference, so an element neither schedule wrote (still NaN poison) fails."""
    spec = REGISTRY[name]
    world_size = data.draw(tst.world_sizes(1, 4), label="world_size")
    params = data.draw(spec.params(world_size), label="params")
    assert "comm" in params, f"{name}: every op of the library takes a communication schedule"
    # another schedule: hypothesis often draws the same one twice, which would compare a run with itself
    other = data.draw(_comm_schedules_the_op_takes(name, params, world_size).filter(lambda c: c != params["comm"]),
                      label="other comm")
    seed = data.draw(tst.seeds(), label="seed")
    outs = []
    for comm in (params["comm"], other):
        p = dict(params, comm=comm)
        case = spec.make_case(np.random.default_rng(seed), world_size, **p)
        res = check_case(spec, case, world_size, seed, label=describe(spec, world_size, p, seed))
        outs.append([{k: np.asarray(res[r][k]) for k in case.expected[r]} for r in range(world_size)])
    for r in range(world_size):
        assert outs[0][r].keys() == outs[1][r].keys()
        for k in outs[0][r]:
            a, b = outs[0][r][k], outs[1][r][k]
            for comm, x in ((params["comm"], a), (other, b)):
                # every output of the library is written whole: poison left is an unwritten element
                assert not np.isnan(x).any(), (
                    f"{describe(spec, world_size, params, seed)}: output '{k}' of rank {r} keeps "
                    f"{int(np.isnan(x).sum())} NaN element(s) under {comm}")
            # bit for bit (no NaN left, so equal bytes mean equal values, -0.0 and 0.0 apart)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (
                f"{describe(spec, world_size, params, seed)}: output '{k}' of rank {r} changed when the "
                f"communication schedule changed from {params['comm']} to {other}")
