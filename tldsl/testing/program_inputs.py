"""Inputs for a generated tile program, one dict per rank, from its arguments' description
(:class:`.program_tree.Arg`): values small enough that every backend stays well-conditioned,
outputs poisoned (NaN, or an unlikely integer) so that anything left unwritten shows up and a
zero is never mistaken for a result. numpy arrays in the simulator's storage types: numpy has
no bf16, so a bf16 argument is float32 holding bf16 values, and the program is traced from its
arguments' description (:func:`specs`), not from the arrays."""
from __future__ import annotations

import numpy as np

from ..ir.types import bfloat16
from ..runtime.sim.memory import to_storage

#: the numpy type of each argument dtype (bf16: float32 holding bf16 values, as the simulator stores it)
NUMPY_DTYPE = {"f16": np.float16, "bf16": np.float32, "f32": np.float32, "i32": np.int32}
#: what an output holds before the program runs
POISON = {"f16": np.nan, "bf16": np.nan, "f32": np.nan, "i32": -0x5A5A5A5A}


def make_inputs(args, world_size: int, seed: int = 0, exact: bool = True) -> list[dict[str, np.ndarray]]:
    """Every rank's arrays, different on each rank (a collective that mixes ranks up shows).
    ``exact``: float inputs multiples of 1/64, whose products and short sums are exact in every
    float type, so a backend that rounds differently (an FMA where the simulator rounds twice)
    agrees anyway; else any value of the dtype in the range, which shows such a difference."""
    rng = np.random.default_rng(seed)
    return [{a.name: _array(a, rng, exact) for a in args} for _ in range(world_size)]


def specs(args) -> list:
    """The ``tl.TensorSpec`` of each argument, to trace the program for (the arrays alone would
    trace a bf16 argument as float32)."""
    from ..kernel import TensorSpec
    return [TensorSpec(a.shape, a.dtype) for a in args]


def _array(arg, rng, exact: bool = True) -> np.ndarray:
    if arg.dtype not in NUMPY_DTYPE:
        raise ValueError(f"argument '{arg.name}': no inputs are made for {arg.dtype} (f16, bf16, f32 and i32 are)")
    dt = NUMPY_DTYPE[arg.dtype]
    if arg.kind == "output":
        return np.full(arg.shape, POISON[arg.dtype], dt)
    if arg.kind in ("rows", "table") or arg.dtype == "i32":
        return rng.integers(int(arg.low), int(arg.high) + (arg.kind == "input"), arg.shape).astype(dt)
    if arg.kind != "input":
        raise ValueError(f"argument '{arg.name}': unknown kind {arg.kind!r}")
    if exact:   # multiples of 1/64 in [-1, 1]: exact in every float type (bf16's 8 significant bits included)
        steps = int(round((arg.high - arg.low) * 64))
        values = (arg.low + rng.integers(0, steps + 1, arg.shape) / 64.0).astype(dt)
    else:
        values = rng.uniform(arg.low, arg.high, arg.shape).astype(dt)
    return to_storage(values, bfloat16) if arg.dtype == "bf16" else values

