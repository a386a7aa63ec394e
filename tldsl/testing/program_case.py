"""A generated program ready to run: its kernel, inputs for every rank, the tolerances its
outputs are compared with, and what it exercises (read from its traced IR, not from how it was
generated, so the fuzzer's distribution figures measure what reaches the compiler).

Tolerances are fixed per dtype (:data:`TOLERANCES`). An output is compared as
``|got - want| <= atol * max(1, max|want|) + rtol * |want|``: the absolute part scales with the
output's magnitude, so a GEMM over K = 48 and an elementwise tile share one table. A float output
takes the loosest row among the float types its program computes in; an fp32 ``dot`` counts as
``tf32`` (the GPU runs fp32 dots on tensor cores as TF32, :data:`FP32_DOT_RUNS_AS_TF32`).
Integer outputs are computed exactly and must agree to the bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ir.opdefs import DATA_OPS, NOTIFY_OPS, WAIT_OPS
from .program_inputs import make_inputs
from .program_tree import Program

#: whether the GPU runs an fp32 ``tl.dot`` as TF32 on tensor cores (it does: WGMMA / mma.sync)
FP32_DOT_RUNS_AS_TF32 = True
#: (rtol, atol) per dtype; atol is relative to max(1, max |reference|)
TOLERANCES = {
    "i32": (0.0, 0.0),
    "f32": (1e-4, 1e-4),
    "tf32": (1e-2, 1e-2),
    "f16": (2e-2, 2e-2),
    "bf16": (5e-2, 5e-2),
}
_LOOSENESS = ("i32", "f32", "tf32", "f16", "bf16")
_TL_DTYPE = {"f16": "float16", "f32": "float32", "i32": "int32"}


@dataclass
class Features:
    """What a traced program exercises."""
    dot: bool
    range_loop: bool              # a tl.range loop (tl.static_range unrolls: no loop in the IR)
    linked_parts: bool            # a signal notified in one part and waited on in another
    communicates: bool            # W >= 2 and a data primitive (a peer's memory or the copy engine)
    ragged: bool                  # a tile that does not divide the tensor it reads or writes
    dtypes: frozenset[str] = field(default_factory=frozenset)
    parts: int = 1


@dataclass(repr=False)
class FuzzCase:
    """One generated program with everything a run needs. ``source`` is a standalone module:
    paste it into a test, then ``tl.simulate(tile_program, WORLD_SIZE, make_inputs(ARGS,
    WORLD_SIZE))``."""
    program: Program
    label: str
    input_seed: int = 0

    def __post_init__(self):
        self.kernel = self.program.build(f"<{self.label}>", self._header, self.input_seed)
        self.world_size = self.program.world_size
        self.inputs = make_inputs(self.program.args, self.world_size, self.input_seed)

    def __repr__(self) -> str:
        return f"<FuzzCase {self.label}:\n{self.source}>"

    def _repr_pretty_(self, printer, cycle) -> None:    # how hypothesis shows a falsifying example: as the program
        printer.text(repr(self))

    @property
    def _header(self) -> str:
        return f"{self.label} (inputs: make_inputs(ARGS, WORLD_SIZE, seed={self.input_seed}))"

    @property
    def source(self) -> str:
        """What was traced, as a standalone module (the lines errors point at)."""
        return self.program.source(self._header, self.input_seed)

    def trace(self):
        """The traced IR kernel (verified; cached by the kernel function)."""
        import tldsl as tl
        specs = [tl.TensorSpec(a.shape, getattr(tl, _TL_DTYPE[a.dtype])) for a in self.program.args]
        return self.kernel.trace(self.world_size, *specs)

    def simulate(self, seed: int = 0, options=None):
        import tldsl as tl
        return tl.simulate(self.kernel, self.world_size, self.inputs, seed=seed, options=options)

    @property
    def outputs(self) -> list[str]:
        return [a.name for a in self.program.args if a.kind == "output"]

    def tolerance(self, output: str) -> tuple[float, float]:
        """(rtol, atol) for ``output`` (see the module's docstring)."""
        arg = next(a for a in self.program.args if a.name == output)
        if arg.dtype == "i32":
            return TOLERANCES["i32"]
        return TOLERANCES[_loosest(computed_dtypes(self.trace()) | {arg.dtype})]

    def mismatches(self, reference, result) -> list[str]:
        """Where ``result`` (another backend's outputs, per rank) differs from ``reference``."""
        out = []
        for r in range(self.world_size):
            for name in self.outputs:
                rtol, atol = self.tolerance(name)
                why = compare(np.asarray(result[r][name]), np.asarray(reference[r][name]), rtol, atol)
                if why:
                    out.append(f"rank {r} '{name}': {why}")
        return out


def compare(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> str | None:
    """None where ``got`` agrees with ``want``, else what differs (see the module's docstring)."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    finite = np.isfinite(want)
    scale = max(1.0, float(np.abs(want[finite]).max())) if finite.any() else 1.0
    same_special = ~finite & (np.isnan(got) == np.isnan(want)) & ((got == want) | np.isnan(want))
    bad = ~same_special & ~(np.abs(got - want) <= atol * scale + rtol * np.abs(want))
    if not bad.any():
        return None
    i = tuple(int(v) for v in np.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} elements differ; first at {i}: {got[i]!r}, expected {want[i]!r} "
            f"(rtol={rtol}, atol={atol} x {scale:.3g})")


def computed_dtypes(kernel) -> set[str]:
    """The dtype names of every tile, fragment and tensor of ``kernel``; ``tf32`` for an fp32 dot."""
    names = set()
    for b in kernel.buffers:
        names.add(b.type.dtype.name)
    for _, op in kernel.walk():
        for v in op.results:
            dt = getattr(v.type, "dtype", None)
            if dt is not None and op.name not in ("const", "program_id", "rank", "arith", "select", "load_scalar"):
                names.add(dt.name)
        if op.name == "dot" and op.operands[0].type.dtype.name == "f32" and FP32_DOT_RUNS_AS_TF32:
            names.add("tf32")
    return {n for n in names if n in _LOOSENESS}


def _loosest(names) -> str:
    return max(names, key=_LOOSENESS.index)


def features(kernel) -> Features:
    notified: dict[int, set[str]] = {}
    waited: dict[int, set[str]] = {}
    ops = list(kernel.walk())
    for part, op in ops:
        if op.name in NOTIFY_OPS:
            notified.setdefault(op.operands[0].id, set()).add(part.name)
        elif op.name in WAIT_OPS:
            waited.setdefault(op.operands[0].id, set()).add(part.name)
    linked = any(n != w for s, waiters in waited.items() for w in waiters for n in notified.get(s, ()))
    return Features(
        dot=any(op.name == "dot" for _, op in ops),
        range_loop=any(op.name == "for" for _, op in ops),
        linked_parts=len(kernel.parts) > 1 and linked,
        communicates=kernel.world_size >= 2 and any(op.name in DATA_OPS for _, op in ops),
        ragged=any(_ragged(op) for _, op in ops),
        dtypes=frozenset(computed_dtypes(kernel) - {"tf32"}),
        parts=len(kernel.parts))


def _ragged(op) -> bool:
    """A load or store whose box does not divide the tensor's extents."""
    if op.name not in ("load", "store", "tile_pull_data", "tile_push_data"):
        return False
    tensor = op.operands[0].type
    if op.name == "tile_push_data" and op.attrs.get("form") == "tile":
        tensor = op.operands[1].type
    box = op.attrs.get("shape") or op.operands[-1].type.shape
    dims = tensor.shape[len(tensor.shape) - len(box):]
    return any(d % b for d, b in zip(dims, box))
