"""Inputs for a generated tile program, one dict per rank, from its arguments' description
(:class:`.program_tree.Arg`): values small enough that every backend stays well-conditioned,
outputs poisoned (NaN, or an unlikely integer) so that anything left unwritten shows up and a
zero is never mistaken for a result."""
from __future__ import annotations

import numpy as np

NUMPY_DTYPE = {"f16": np.float16, "f32": np.float32, "i32": np.int32}
#: what an output holds before the program runs
POISON = {"f16": np.nan, "f32": np.nan, "i32": -0x5A5A5A5A}


def make_inputs(args, world_size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Every rank's arrays, different on each rank (a collective that mixes ranks up shows)."""
    rng = np.random.default_rng(seed)
    return [{a.name: _array(a, rng) for a in args} for _ in range(world_size)]


def _array(arg, rng) -> np.ndarray:
    if arg.dtype not in NUMPY_DTYPE:
        raise ValueError(f"argument '{arg.name}': the simulator takes numpy arrays, which have no {arg.dtype}")
    dt = NUMPY_DTYPE[arg.dtype]
    if arg.kind == "output":
        return np.full(arg.shape, POISON[arg.dtype], dt)
    if arg.kind in ("rows", "table") or arg.dtype == "i32":
        return rng.integers(int(arg.low), int(arg.high) + (arg.kind == "input"), arg.shape).astype(dt)
    if arg.kind != "input":
        raise ValueError(f"argument '{arg.name}': unknown kind {arg.kind!r}")
    # multiples of 1/64: exact in every float type, so loads and exact math agree to the bit
    steps = int(round((arg.high - arg.low) * 64))
    return (arg.low + rng.integers(0, steps + 1, arg.shape) / 64.0).astype(dt)
