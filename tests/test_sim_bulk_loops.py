"""Loops run in bulk change nothing the simulator reports or computes: every library op, clean
and with each of its synchronisation primitives deleted (the mutation check's mutants), gives
the same outputs to the bit, the same scheduler steps and event log, and the same error word
for word, with loops in bulk and op by op (``SimOptions(bulk_loops=False)``)."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.ops import OPS
from tldsl.testing.mutants import CAUGHT, delete_site, sync_sites


def _outcome(kernel, W, inputs, seed, bulk, launches=2):
    options = tl.SimOptions(static_checks=False, launches=launches, bulk_loops=bulk)
    try:
        res = tl.simulate(kernel, W, inputs, seed=seed, options=options)
    except tl.SimulationError as e:
        return type(e).__name__, str(e), e.details
    arrays = [(name, np.ascontiguousarray(arr).tobytes()) for per in (res.outputs, res.workspaces)
              for d in per for name, arr in sorted(d.items())]
    return "ok", arrays, res.steps, res.events


def _traced(spec, params):
    params = dict(params)
    W = params.pop("world_size")
    case = spec.make_case(np.random.default_rng(0), W, **params)
    kernel = spec.kernel.trace(W, *[case.inputs[0][a] for a in spec.kernel.arg_names], **case.kwargs)
    return kernel, W, case


def _mutant_sets():
    for name, spec in sorted(OPS.items()):
        for i, params in enumerate(spec.mutant_params):
            yield pytest.param(name, i, id=f"{name}-{i}")


@pytest.mark.parametrize("name, variant", list(_mutant_sets()))
def test_mutants_caught_with_the_same_report_in_bulk_and_op_by_op(name, variant):
    kernel, W, case = _traced(OPS[name], OPS[name].mutant_params[variant])
    clean = _outcome(kernel, W, case.inputs, 0, True)
    assert clean[0] == "ok", clean[:2]
    assert clean == _outcome(kernel, W, case.inputs, 0, False)
    for index, (part, op) in enumerate(sync_sites(kernel)):
        mutant = delete_site(kernel, index)
        caught = False
        for seed in range(2):                   # the mutation check's seeds
            bulk = _outcome(mutant, W, case.inputs, seed, True)
            assert bulk == _outcome(mutant, W, case.inputs, seed, False), (
                f"{name} without {op.name} #{index} ({part}), seed {seed}: bulk and op by op differ")
            if bulk[0] in {c.__name__ for c in CAUGHT}:
                caught = True
                break
        assert caught, f"{name} without {op.name} #{index} ({part}) went undetected: {bulk[:2]}"


# shapes that are not multiples of the tile (short tiles, zero-filled loads), float32 inputs, both partial dtypes
EXTRA_CASES = [
    ("allgather_gemm", dict(world_size=3, rows_per_rank=13, n=21, k=37, compute=tl.ComputeSchedule(tile=(16, 8, 16)),
                            comm=tl.CommSchedule(tile_m=8, mode="push", order="full_mesh"))),
    ("allgather_gemm", dict(world_size=2, rows_per_rank=20, n=24, k=40, dtype="float32",
                            compute=tl.ComputeSchedule(tile=(16, 16, 16)),
                            comm=tl.CommSchedule(engine="copy_engine", mode="push", col_tile=16))),
    ("gemm_reduce_scatter", dict(world_size=3, rows_per_rank=11, n=19, k_per_rank=29, partial_dtype="out",
                                 compute=tl.ComputeSchedule(tile=(8, 16, 8)), comm=tl.CommSchedule(tile_m=8))),
    ("gemm_reduce_scatter", dict(world_size=4, rows_per_rank=8, n=16, k_per_rank=24, dtype="float32",
                                 compute=tl.ComputeSchedule(tile=(8, 16, 16)), comm=tl.CommSchedule(mode="pull"))),
]


@pytest.mark.parametrize("name, params", EXTRA_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(EXTRA_CASES)])
@pytest.mark.parametrize("seed", [0, 1])
def test_library_ops_bit_for_bit_in_bulk_and_op_by_op(name, params, seed):
    kernel, W, case = _traced(OPS[name], params)
    bulk = _outcome(kernel, W, case.inputs, seed, True)
    assert bulk[0] == "ok", bulk[:2]
    assert bulk == _outcome(kernel, W, case.inputs, seed, False)
