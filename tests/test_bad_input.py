"""Bad input to the public API never escapes as an AttributeError, IndexError, KeyError or a
bare unpacking ValueError: it is a TldslError, or a TypeError/ValueError whose message names
the argument — and it is refused quickly, before anything long runs.

The property test corrupts one argument of an otherwise valid call (a small AllGather+GEMM) of
``tl.simulate``, ``kernel.trace``, ``tl.TensorSpec``, ``lower``, ``tl.SimOptions``,
``tl.ComputeSchedule`` / ``tl.CommSchedule`` and the simulator's ``fused_all_gather_matmul``,
with values of the wrong type, sign, rank, dtype or size.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tldsl as tl
from tldsl.codegen import lower
from tldsl.errors import TldslError
from tldsl.ops.allgather_gemm import allgather_gemm, fused_all_gather_matmul
from tldsl.ops.moe import moe_routing, random_routing, simulate_allgather_moe, simulate_moe_reduce_scatter

#: no malformed call may take longer (the valid call it is made from takes well under a second)
SECONDS = 10.0
W, MS, K, N = 2, 16, 16, 16
COMPUTE = tl.ComputeSchedule(tile=(16, 16, 16))
COMM = tl.CommSchedule(tile_m=8)


def shards():
    rng = np.random.default_rng(0)
    return [rng.integers(-3, 4, (MS, K)).astype(np.float16) for _ in range(W)]


def b_matrix():
    return np.random.default_rng(1).integers(-3, 4, (K, N)).astype(np.float16)


def inputs():
    b = b_matrix()
    return [{"a": a, "b": b, "c": np.full((W * MS, N), np.nan, np.float16)} for a in shards()]


#: values of every kind a hurried caller passes where something else belongs
BAD_VALUES = [
    None, 0, -1, 1, 3, 2 ** 40, 1.5, float("nan"), True, "", "x", "float64", b"\x00", (), [], {}, (1,), [[1, 2]],
    (16, 16), (16, -16), ("16", 16), {"launches": 0}, {"bogus": 1}, object(), np.float64, np.int8, np.float16,
    np.zeros((2, 2)), np.zeros((16, 16), np.float64), np.zeros((16,), np.float16), np.zeros((0, 16), np.float16),
    np.full((16, 16), np.nan, np.float16), COMPUTE, COMM, tl.SimOptions(launches=1), tl.float16, allgather_gemm,
]
BAD = st.sampled_from(BAD_VALUES)


def _simulate(arg, bad):
    kw = dict(kernel=allgather_gemm, world_size=W, inputs=inputs(), seed=0, options=tl.SimOptions(launches=1),
              compute=COMPUTE, comm=COMM)
    if arg.startswith("inputs."):              # one array of rank 0's inputs
        kw["inputs"][0][arg.split(".")[1]] = bad
    else:
        kw[arg] = bad
    return lambda: tl.simulate(**kw)


def _trace(arg, bad):
    specs = [tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((K, N), tl.float16),
             tl.TensorSpec((W * MS, N), tl.float16)]
    kw = dict(compute=COMPUTE, comm=COMM)
    world = W
    if arg == "world_size":
        world = bad
    elif arg in ("compute", "comm"):
        kw[arg] = bad
    else:
        specs[["a", "b", "c"].index(arg)] = bad
    return lambda: allgather_gemm.trace(world, *specs, **kw)


def _spec(arg, bad):
    kw = dict(shape=(MS, K), dtype=tl.float16)
    kw[arg] = bad
    return lambda: tl.TensorSpec(**kw)


_IR = allgather_gemm.trace(W, *[tl.TensorSpec(s, tl.float16) for s in ((MS, K), (K, N), (W * MS, N))],
                           compute=COMPUTE, comm=COMM)


#: one the GEMM recipe lowers, so that a bad option value reaches its planner
_IR_LOWERED = allgather_gemm.trace(2, *[tl.TensorSpec(s, tl.float16) for s in ((256, 256), (256, 256), (512, 256))],
                                   compute=tl.ComputeSchedule(tile=(128, 128, 64)), comm=tl.CommSchedule(tile_m=128))


def _lower(arg, bad):
    if arg == "kernel":
        return lambda: lower(bad, "gemm")
    if arg == "part":
        return lambda: lower(_IR, bad)
    return lambda: lower(_IR_LOWERED, "gemm", **{arg: bad})


def _options(arg, bad):
    return lambda: tl.SimOptions(**{arg: bad})


def _schedule(cls):
    return lambda arg, bad: (lambda: cls(**{arg: bad}))


def _fused(arg, bad):
    kw = dict(a_shards=shards(), b=b_matrix(), compute=COMPUTE, comm=COMM, seed=0, options=tl.SimOptions(launches=1))
    if arg == "a_shards[0]":
        kw["a_shards"][0] = bad
    else:
        kw[arg] = bad
    return lambda: fused_all_gather_matmul(**kw)


MOE_COMPUTE = tl.ComputeSchedule(tile=(8, 16, 16))


def _moe(arg, bad):
    rng = np.random.default_rng(2)
    kw = dict(x_shards=[rng.integers(-3, 4, (7, 20)).astype(np.float16) for _ in range(W)],
              w1_slices=[rng.integers(-3, 4, (5, 20, 24)).astype(np.float16) for _ in range(W)],
              topk_ids=np.stack([rng.permutation(5)[:2] for _ in range(W * 7)]), compute=MOE_COMPUTE,
              comm=tl.CommSchedule(tile_m=8), seed=0, options=tl.SimOptions(launches=1))
    if arg.endswith("[0]"):
        kw[arg[:-3]][0] = bad
    else:
        kw[arg] = bad
    return lambda: simulate_allgather_moe(**kw)


def _moe_rs(arg, bad):
    rng = np.random.default_rng(3)
    ids, wts = random_routing(rng, W * 8, 5, 2)
    routing = moe_routing(ids, 5, W, 8, MOE_COMPUTE.BM)
    kw = dict(h_slices=[rng.integers(-3, 4, (routing.num_rows, 24)).astype(np.float16) for _ in range(W)],
              w2_slices=[rng.integers(-3, 4, (5, 24, 20)).astype(np.float16) for _ in range(W)],
              topk_weights=wts, routing=routing, compute=MOE_COMPUTE, comm=tl.CommSchedule(tile_m=8, mode="push"),
              seed=0, options=tl.SimOptions(launches=1))
    if arg.endswith("[0]"):
        kw[arg[:-3]][0] = bad
    else:
        kw[arg] = bad
    return lambda: simulate_moe_reduce_scatter(**kw)


CALLS = {
    "tl.simulate": (_simulate, ["kernel", "world_size", "inputs", "seed", "options", "compute", "comm",
                                "inputs.a", "inputs.b", "inputs.c"]),
    "kernel.trace": (_trace, ["world_size", "a", "b", "c", "compute", "comm"]),
    "tl.TensorSpec": (_spec, ["shape", "dtype"]),
    "lower": (_lower, ["kernel", "part", "wait_timeout_ns", "entry"]),
    "tl.SimOptions": (_options, ["launches", "compute_slots", "check_races", "check_uninitialized", "static_checks",
                                 "repoison", "record_timeline", "max_steps", "warn_steps", "progress",
                                 "progress_interval_s", "bulk_loops"]),
    "tl.ComputeSchedule": (_schedule(tl.ComputeSchedule), ["tile", "order", "stages", "group_m", "cluster"]),
    "tl.CommSchedule": (_schedule(tl.CommSchedule), ["tile_m", "order", "mode", "engine", "sms", "transport",
                                                     "reduce_in", "col_tile"]),
    "fused_all_gather_matmul": (_fused, ["a_shards", "a_shards[0]", "b", "compute", "comm", "seed", "options"]),
    "simulate_allgather_moe": (_moe, ["x_shards", "x_shards[0]", "w1_slices", "w1_slices[0]", "topk_ids", "compute",
                                      "comm", "seed", "options"]),
    "simulate_moe_reduce_scatter": (_moe_rs, ["h_slices", "h_slices[0]", "w2_slices", "w2_slices[0]", "topk_weights",
                                              "routing", "compute", "comm", "seed", "options"]),
}


@st.composite
def malformed_calls(draw):
    api = draw(st.sampled_from(sorted(CALLS)))
    make, args = CALLS[api]
    arg = draw(st.sampled_from(args))
    bad = draw(BAD)
    return api, arg, bad, make(arg, bad)


def _named(arg: str, message: str) -> bool:
    root = arg.split(".")[-1].split("[")[0]
    return root in message


def check_refusal(api: str, arg: str, bad, call) -> None:
    start = time.perf_counter()
    try:
        call()
    except TldslError:
        pass
    except (TypeError, ValueError) as e:
        assert _named(arg, str(e)), f"{api}({arg}={bad!r}): {type(e).__name__} that does not name '{arg}': {e}"
    except Exception as e:   # noqa: BLE001 - what this test is about
        raise AssertionError(f"{api}({arg}={bad!r}) escaped as {type(e).__name__}: {e}") from e
    took = time.perf_counter() - start
    assert took < SECONDS, f"{api}({arg}={bad!r}) took {took:.1f} s"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(malformed_calls())
def test_malformed_calls_get_clear_typed_errors_quickly(case):
    check_refusal(*case)


@pytest.mark.parametrize("api", sorted(CALLS))
def test_every_argument_of_every_api_with_every_bad_value(api):
    """The exhaustive sweep the property test samples: every (argument, bad value) pair once."""
    make, args = CALLS[api]
    failures = []
    for arg in args:
        for bad in BAD_VALUES:
            try:
                check_refusal(api, arg, bad, make(arg, bad))
            except AssertionError as e:
                failures.append(str(e).splitlines()[0][:300])
    assert not failures, "\n".join(failures)


def test_the_valid_call_the_bad_ones_are_made_from_works():
    assert lower(_IR_LOWERED, "gemm", wait_timeout_ns=10 ** 9).entry
    res = tl.simulate(allgather_gemm, W, inputs(), seed=0, options=tl.SimOptions(launches=1),
                      compute=COMPUTE, comm=COMM)
    want = np.concatenate(shards()).astype(np.float32) @ b_matrix().astype(np.float32)
    np.testing.assert_array_equal(res[0]["c"].astype(np.float32), want)
    (a_full, c), _ = fused_all_gather_matmul(shards(), b_matrix(), compute=COMPUTE, comm=COMM,
                                             options=tl.SimOptions(launches=1))
    np.testing.assert_array_equal(c.astype(np.float32), want)
    _moe("seed", 0)()                                                   # the MoE base calls run too
    _moe_rs("seed", 0)()


@pytest.mark.parametrize("bad", [2 ** 64, 2 ** 70, 0, -1])
def test_a_wait_timeout_the_kernels_cannot_count_is_refused_naming_it(bad):
    """2**64 ns or more was accepted and became -DTLDSL_WAIT_TIMEOUT_NS=18446744073709551616ull,
    which NVRTC makes 0: every wait that spins at all trapped at once, while the simulator ran the
    program fine."""
    with pytest.raises(tl.InputError, match=rf"wait_timeout_ns={bad}: a positive int of nanoseconds below 2\*\*64"):
        lower(_IR_LOWERED, "gemm", wait_timeout_ns=bad)
    assert f"-DTLDSL_WAIT_TIMEOUT_NS={2 ** 64 - 1}ull" in lower(_IR_LOWERED, "gemm", wait_timeout_ns=2 ** 64 - 1).options


# -- tl.TensorSpec: numpy and torch dtypes mapped, anything else refused naming it -----------------

@pytest.mark.parametrize("given_dtype, expected", [
    (tl.float16, tl.float16), ("bf16", tl.bfloat16), ("float32", tl.float32), (np.float16, tl.float16),
    (np.dtype("int32"), tl.int32), (np.bool_, tl.bool_),
])
def test_tensor_spec_maps_dtypes(given_dtype, expected):
    spec = tl.TensorSpec([np.int64(8), 16], given_dtype)
    assert spec.dtype is expected and spec.shape == (8, 16) and all(type(d) is int for d in spec.shape)


def test_tensor_spec_maps_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert tl.TensorSpec((8, 16), torch.bfloat16).dtype is tl.bfloat16
    assert tl.TensorSpec((8, 16), torch.float16) == tl.TensorSpec((8, 16), tl.float16)
    with pytest.raises(tl.InputError, match="dtype torch.float64: unsupported dtype float64"):
        tl.TensorSpec((8, 16), torch.float64)


@pytest.mark.parametrize("shape, dtype, message", [
    (("8", 16), tl.float16, r"shape \('8', 16\): every dimension must be an int >= 0 \(got '8' of type str\)"),
    ((8, -1), tl.float16, r"shape \(8, -1\): .*got -1"),
    ((8.0, 16), tl.float16, r"shape .*got 8.0 of type float"),
    ((True, 16), tl.float16, r"shape .*got True of type bool"),
    (8, tl.float16, r"shape must be a tuple of ints, got 8"),
    ("8x16", tl.float16, r"shape must be a tuple of ints"),
    ((8, 16), np.float64, r"dtype .*float64.*: unsupported dtype float64"),
    ((8, 16), "half", r"dtype 'half': unknown dtype"),
    ((8, 16), None, r"dtype is required"),
    ((), tl.float16, r"shape \(\) is a 0-d tensor, which a tile program cannot index: pass shape \(1,\)"),
    ((8, 2 ** 31), tl.float16, r"shape \(8, 2147483648\): dimension 1 is 2,147,483,648, .*below 2\*\*31"),
])
def test_tensor_spec_refuses_what_the_language_does_not_take(shape, dtype, message):
    with pytest.raises(tl.InputError, match=r"^tl\.TensorSpec: " + message):
        tl.TensorSpec(shape, dtype)


def test_a_shape_of_another_rank_is_refused_at_the_line_that_unpacks_it():
    with pytest.raises(tl.InputError, match=r"kernel 'allgather_gemm' at .*allgather_gemm.py:\d+ \(Ms, K = a.shape\): "
                                            r"not enough values to unpack .* got a \[16\], b \[16, 16\]"):
        allgather_gemm.trace(W, np.zeros((MS,), np.float16), np.zeros((K, N), np.float16),
                             np.zeros((W * MS, N), np.float16), compute=COMPUTE, comm=COMM)


def test_tracing_an_unsupported_array_names_the_argument():
    with pytest.raises(tl.InputError, match="argument 'b': dtype"):
        allgather_gemm.trace(W, np.zeros((MS, K), np.float16), np.zeros((K, N)), np.zeros((W * MS, N), np.float16),
                             compute=COMPUTE, comm=COMM)


# -- torch process groups: an unknown name says which names there are ---------------------------------

@pytest.fixture
def gloo_world():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.fail("a process group was left initialised by an earlier test")
    # an in-memory store: no TCP port another pytest worker could hold
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield torch, dist
    finally:
        dist.destroy_process_group()


def test_an_unknown_group_name_is_an_input_error_listing_the_known_ones(gloo_world):
    torch, dist = gloo_world
    import tldsl.torch_ops  # noqa: F401 - registers torch.ops.tldsl.*
    from tldsl.runtime.dist.group import resolve_group
    world = dist.group.WORLD.group_name
    assert resolve_group(world) is dist.group.WORLD
    with pytest.raises(tl.InputError, match=rf"group_name 'tp': no process group .*registered: \['{world}'\]"):
        resolve_group("tp")
    with pytest.raises(tl.InputError, match="group_name must be a process group's name"):
        resolve_group(0)
    a, b = torch.zeros(32, 16, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16)
    with pytest.raises(tl.InputError, match="group_name 'tp'"):
        torch.ops.tldsl.fused_all_gather_matmul(a, [b], 0, "tp")
    with pytest.raises(tl.InputError, match="group_name 'tp'"):
        torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "sum", 0, "tp")
