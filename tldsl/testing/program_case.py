"""A generated program ready to run: its kernel, inputs for every rank, the tolerances its
outputs are compared with, and what it exercises (read from its traced IR, not from how it was
generated, so the fuzzer's distribution figures measure what reaches the compiler).

Another backend's outputs are compared with the simulator's element by element, each within
its own tolerance: a bound on how far the GPU may legitimately differ there (TF32 dots, other
summation orders, fp16/bf16 rounding of intermediates, CUDA's math functions), carried through
the program from the magnitudes that flow into that element (:mod:`.program_tolerance`, whose
:data:`~.program_tolerance.TOLERANCES` states the numbers per dtype). NaN and infinities must be
at the same places; an i32 element is exact wherever no float error reaches it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..ir.opdefs import DATA_OPS, NOTIFY_OPS, WAIT_OPS
from ..ir.part_graph import parts_waiting_through_others
from .program_inputs import make_inputs, specs
from .program_tolerance import FP32_DOT_RUNS_AS_TF32, TOLERANCES, compare, mismatches, reference_with_tolerances
from .program_tree import Program

__all__ = ["FP32_DOT_RUNS_AS_TF32", "TOLERANCES", "Features", "FuzzCase", "compare", "computed_dtypes", "features"]
_DTYPE_NAMES = ("i32", "f32", "tf32", "f16", "bf16")


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
    ordered_waits: bool = False   # a waiting compute part whose tiles run out of row order on some rank
    waits_back: bool = False      # a compute part waiting on its own tiles through another part (one slot)


@dataclass(repr=False)
class FuzzCase:
    """One generated program with everything a run needs. ``source`` is a standalone module:
    paste it into a test, then ``tl.simulate(tile_program.trace(WORLD_SIZE, *specs(ARGS)),
    WORLD_SIZE, make_inputs(ARGS, WORLD_SIZE))``. Runs take the traced kernel (:meth:`trace`):
    its arguments' dtypes come from the program, bf16 included, not from the numpy inputs."""
    program: Program
    label: str
    input_seed: int = 0
    exact_inputs: bool = True       # float inputs multiples of 1/64, or any value (make_inputs' exact)

    def __post_init__(self):
        self.kernel = self.program.build(f"<{self.label}>", self._header, self.input_seed, self.exact_inputs)
        self.world_size = self.program.world_size
        self.inputs = make_inputs(self.program.args, self.world_size, self.input_seed, self.exact_inputs)

    def __repr__(self) -> str:
        return f"<FuzzCase {self.label}:\n{self.source}>"

    def _repr_pretty_(self, printer, cycle) -> None:    # how hypothesis shows a falsifying example: as the program
        printer.text(repr(self))

    @property
    def _header(self) -> str:
        return f"{self.label} (inputs: {self.program.inputs_call(self.input_seed, self.exact_inputs)})"

    @property
    def source(self) -> str:
        """What was traced, as a standalone module (the lines errors point at)."""
        return self.program.source(self._header, self.input_seed, self.exact_inputs)

    def trace(self):
        """The traced IR kernel (verified; cached by the kernel function)."""
        return self.kernel.trace(self.world_size, *specs(self.program.args))

    def simulate(self, seed: int = 0, options=None):
        import tldsl as tl
        return tl.simulate(self.trace(), self.world_size, self.inputs, seed=seed, options=options)

    @property
    def outputs(self) -> list[str]:
        return [a.name for a in self.program.args if a.kind == "output"]

    def reference(self):
        """The simulator's result and, per rank and argument, each element's tolerance
        (:func:`.program_tolerance.reference_with_tolerances`; computed once)."""
        if getattr(self, "_reference", None) is None:
            self._reference = reference_with_tolerances(self.trace(), self.world_size, self.inputs)
        return self._reference

    def tolerances(self) -> list[dict]:
        """Per rank and argument, each element's tolerance (see the module's docstring)."""
        return self.reference()[1]

    def mismatches(self, reference, result) -> list[str]:
        """Where ``result`` (another backend's outputs, per rank) differs from ``reference``
        (the simulator's outputs for these inputs), each element within its tolerance."""
        return mismatches(result, reference, self.tolerances(), self.outputs)


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
    return {n for n in names if n in _DTYPE_NAMES}


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
        parts=len(kernel.parts),
        ordered_waits=any(_reordered(kernel, part) for part in kernel.parts
                          if part.role == "compute" and any(op.name in WAIT_OPS for op in part.walk())),
        waits_back=bool(parts_waiting_through_others(kernel)))


def _reordered(kernel, part) -> bool:
    """Whether the compute schedule runs ``part``'s tiles in another order than row by row on some
    rank (a schedule may name another order and still give row-major on this grid: one axis,
    one group, one rank)."""
    schedule = kernel.compute_schedule
    if schedule is None:
        return False
    grid = tuple(part.grid)
    rows = list(itertools.product(*(range(g) for g in grid)))
    return any([tuple(t) for t in schedule.tile_order(grid, r, kernel.world_size, getattr(part, "align_shift", 0))]
               != rows for r in range(kernel.world_size))


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
