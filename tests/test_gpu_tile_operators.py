"""The language's newer spellings on the GPU against the simulator: Python's operators on
fragments and with a traced scalar on the left (``test_tile_operators``), ``tl.where`` of two
numbers (numpy's type), numbers beside integer and bool tiles, the sum of a mask (a count), and numpy's
ufuncs traced as their tile-language twins (``test_numpy_protocol``). Outputs poisoned first. Run with
``python -m pytest -m gpu tests/test_gpu_tile_operators.py``."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.runtime.gpu import gpu_available

from test_gpu_run import both
from test_tile_operators import mixed, signs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]


@tl.kernel
def numpy_spelled(x, y):
    @tl.compute_part(grid=(4,))
    def v(p):
        acc = tl.fragment((8,), tl.float32, fill=0.25)
        t = tl.load(x, (p * 8,), (8,))
        u = np.maximum(np.exp(t) - np.float32(1.5), acc) + np.tanh(np.negative(t)) * np.sqrt(np.abs(t))
        tl.store(y, (p * 8,), u)


def test_operators_on_fragments_and_scalars_on_the_left():
    x = np.array([1, 2, 4, -1, -2, 8, 0.5, -4], np.float32)
    both(mixed, 1, [{"x": x, "out": np.full(16, np.nan, np.float32), "hits": np.full(16, -7, np.int32)}])


def test_where_of_two_numbers():
    x = np.array([-4, -3, -1, 0, 0.5, 2, -2.5, 7], np.float32)
    got = both(signs, 1, [{"x": x, "s": np.full(8, 99, np.int32), "m": np.full(8, 99, np.int32)}])
    np.testing.assert_array_equal(got[0]["s"], np.where(x > 0, 1, -1) + np.where(x < -2, True, 5))


def test_numpy_ufuncs_traced_as_their_twins():
    x = np.random.default_rng(3).standard_normal(32).astype(np.float32)
    got = both(numpy_spelled, 1, [{"x": x, "y": np.full(32, np.nan, np.float32)}])
    want = np.maximum(np.exp(x) - 1.5, 0.25) + np.tanh(-x) * np.sqrt(np.abs(x))
    np.testing.assert_allclose(got[0]["y"], want, rtol=1e-5, atol=1e-5)


def test_numbers_beside_integer_and_bool_tiles():
    from test_numpy_protocol import promoted
    x = np.array([-1, 2, 0, 3, -4, 5, 6, -7], np.float32)
    both(promoted, 1, [{"x": x, "f": np.full(16, np.nan, np.float32), "i": np.full(8, -99, np.int32)}])


def test_the_sum_of_a_mask_counts_it():
    from test_tile_operators import positives
    x = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float32) * 3
    got = both(positives, 1, [{"x": x, "counts": np.full(4, -1, np.int32), "anyall": np.full(4, -1, np.int32)}])
    np.testing.assert_array_equal(got[0]["counts"], np.sum(x > 0, 1) + np.sum(x < -1, 1))


def test_bool_scalars_in_index_math():
    from test_tile_operators import bool_index_math
    x = np.random.default_rng(6).standard_normal(16).astype(np.float32)
    got = both(bool_index_math, 1, [{"x": x, "y": np.full(16, np.nan, np.float32), "flags": np.full(8, -1, np.int32)}])
    p = np.arange(4)
    np.testing.assert_array_equal(got[0]["y"].reshape(4, 4), x[((p > 1) + 1)[:, None] * 4 + np.arange(4)])


@pytest.mark.parametrize("W", [2, 4])
def test_xor_of_traced_scalars_pairs_ranks_for_recursive_doubling(W):
    from test_tile_operators import _doubling_inputs, doubling_allreduce
    ins = _doubling_inputs(W, N=1000, seed=9)
    got = both(doubling_allreduce, W, ins, sums=True)
    for r in range(W):
        np.testing.assert_array_equal(got[r]["y"], got[0]["y"])
        np.testing.assert_array_equal(got[r]["flags"], [r ^ -3, ((r == 1) ^ (r == 2)) ^ 5])


def test_numpy_float_scalars_keep_their_type_beside_16_bit_tiles():
    import torch
    from test_numpy_protocol import typed_scalars
    h = np.array([0.3, -1.7, 2.5, 100.1, -0.01, 7, 0, 1], np.float16)
    b = torch.tensor([0.3, -1.7, 2.5, 100.1, -0.01, 7, 0, 1], dtype=torch.bfloat16)
    got = both(typed_scalars, 1, [{"h": h, "b": b, "y": np.full(24, np.nan, np.float32)}])
    np.testing.assert_array_equal(got[0]["y"][:8], np.float32(1.0009765625) * h)


def test_python_floats_beside_16_bit_tiles_are_rounded_to_the_tiles_type_first():
    import torch
    from test_numpy_protocol import _bf16, python_floats
    h = (1.0 + np.arange(64) / 64).astype(np.float16)
    b = torch.tensor(_bf16(1.0 + np.arange(64) / 37), dtype=torch.bfloat16)
    got = both(python_floats, 1, [{"h": h, "b": b, "y": np.full(256, np.nan, np.float32)}])[0]["y"]
    np.testing.assert_array_equal(got[:64], (h * 0.1).astype(np.float32))
    np.testing.assert_array_equal(got[64:128], _bf16(b.float().numpy() * _bf16(0.1)))
    np.testing.assert_array_equal(got[128:192], (h + 1e-4).astype(np.float32))


def test_max_and_min_order_negative_zero_below_positive_zero():
    from test_tile_operators import SIGNED_ZEROS_X, signed_zeros, signed_zeros_want
    got = both(signed_zeros, 1, [{"x": SIGNED_ZEROS_X, "y": np.full((24, 4), np.nan, np.float32)}],
               compute=tl.ComputeSchedule(tile=(8, 8, 8)))[0]["y"]
    np.testing.assert_array_equal(got, signed_zeros_want())

