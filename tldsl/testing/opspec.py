"""How an op of the library describes itself to the test machinery.

Every op module registers one :class:`OpSpec`: its kernel, a function that builds a
test case (per-rank inputs with poisoned outputs, expected outputs from a numpy reference,
and the schedules), a hypothesis strategy over its parameters, and the fixed parameter
sets the mutation check uses (one per schedule variant worth mutating).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..ir.display import one_line


@dataclass
class OpCase:
    """One concrete run of an op: what goes in, what must come out."""
    inputs: list[dict[str, np.ndarray]]          # per rank; outputs pre-filled with NaN (poison)
    expected: list[dict[str, np.ndarray]]        # per rank: output name -> numpy reference
    kwargs: dict[str, Any]                       # compute=..., comm=..., other compile-time values
    rtol: float = 2e-2
    atol: float = 2e-2
    description: str = ""


@dataclass
class OpSpec:
    name: str
    kernel: Any                                  # a tl.kernel
    make_case: Callable[..., OpCase]             # make_case(rng, world_size, **params) -> OpCase
    params: Callable[[int], Any]                 # params(world_size) -> hypothesis strategy of dicts
    mutant_params: list[dict] = field(default_factory=list)   # fixed params (each with world_size)
    doc: str = ""

    def __repr__(self) -> str:
        kernel = getattr(self.kernel, "name", None) or getattr(self.kernel, "__name__", type(self.kernel).__name__)
        return one_line(f"OpSpec({self.name}: kernel {kernel}, {len(self.mutant_params)} mutant case(s)"
                        + (f"; {self.doc}" if self.doc else "") + ")")


def describe(spec: OpSpec, world_size: int, params: dict, seed: int) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"op={spec.name} world_size={world_size} {shown} seed={seed}"


def check_case(spec: OpSpec, case: OpCase, world_size: int, seed: int, options=None, label: str = ""):
    """Simulate ``case`` and compare every rank's outputs with the reference.

    Raises AssertionError naming the op, shapes, schedule and seed on a mismatch."""
    import tldsl as tl
    result = tl.simulate(spec.kernel, world_size, case.inputs, seed=seed, options=options, **case.kwargs)
    for r in range(world_size):
        for name, want in case.expected[r].items():
            got = np.asarray(result[r][name], np.float64)
            want = np.asarray(want, np.float64)
            if got.shape != want.shape:
                raise AssertionError(f"{label or spec.name}: rank {r} output '{name}' has shape {got.shape}, "
                                     f"expected {want.shape}")
            bad = ~np.isclose(got, want, rtol=case.rtol, atol=case.atol, equal_nan=False)
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                raise AssertionError(
                    f"{label or spec.name}: rank {r} output '{name}' differs from the numpy reference at "
                    f"{int(bad.sum())} of {bad.size} elements; first at {idx}: got {got[idx]}, "
                    f"expected {want[idx]} (rtol={case.rtol}, atol={case.atol})\n  {case.description}")
    return result
