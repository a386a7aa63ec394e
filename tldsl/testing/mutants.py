"""The mutation check: delete each synchronisation primitive of every library op, one at a
time, and confirm the simulator reports a race, a deadlock or a stale signal for each.

    python -m tldsl.testing.mutants [--op NAME] [--seeds N] [-v]

A deleted primitive that nothing detects is either redundant (remove it from the op) or a
hole in the simulator (fix it). Exit status 0 only when every mutant is caught.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..errors import DeadlockError, RaceError, SimulationError, StaleSignalError
from ..ir.core import Block, Kernel
from ..ir.opdefs import SYNC_OPS
from ..ops import OPS
from ..runtime.sim import SimOptions, simulate
from ..cli.arg_types import positive_int

CAUGHT = (RaceError, DeadlockError, StaleSignalError)


@dataclass
class Mutant:
    op: str
    variant: str
    part: str
    primitive: str
    index: int
    where: str
    outcome: str = ""
    caught: bool = False


def _blocks(block: Block):
    yield block
    for op in block.ops:
        for r in op.regions:
            yield from _blocks(r)


def sync_sites(kernel: Kernel):
    """(part name, op) for every synchronisation primitive, in program order."""
    return [(p.name, op) for p in kernel.parts for op in p.walk() if op.name in SYNC_OPS]


def delete_site(kernel: Kernel, index: int) -> Kernel:
    """A deep copy of ``kernel`` with its ``index``-th synchronisation primitive (in
    :func:`sync_sites`' order, the one reports name) removed."""
    mutant = copy.deepcopy(kernel)
    part_name, target = sync_sites(mutant)[index]
    for block in _blocks(mutant.part(part_name).body):
        if any(op is target for op in block.ops):
            block.ops.remove(target)
            return mutant
    raise IndexError(index)


def _variant_name(params: dict) -> str:
    comm = params.get("comm")
    compute = params.get("compute")
    bits = []
    if comm is not None:
        bits.append(f"{comm.engine}/{comm.mode}/{comm.order}" + (f"/tile_m={comm.tile_m}" if comm.tile_m else "")
                    + (f"/reduce_in={comm.reduce_in}" if comm.reduce_in != "comm" else ""))
    if compute is not None:
        bits.append(f"{compute.order}")
    rest = [f"{k}={v}" for k, v in params.items() if k not in ("comm", "compute", "world_size")
            and isinstance(v, (bool, str))]
    return " ".join(bits + rest) or "default"


def run(op_filter=None, seeds=2, verbose=False, out=sys.stdout) -> tuple[int, int, list[Mutant]]:
    options = SimOptions(static_checks=False, launches=2)
    mutants: list[Mutant] = []
    for name, spec in sorted(OPS.items()):
        if op_filter and name not in op_filter:
            continue
        for params in spec.mutant_params:
            params = dict(params)
            W = params.pop("world_size")
            case = spec.make_case(np.random.default_rng(0), W, **params)
            variant = _variant_name(params)
            args = [case.inputs[0][a] for a in spec.kernel.arg_names]
            kernel = spec.kernel.trace(W, *args, **case.kwargs)
            # the unmutated kernel must be clean, or nothing below means anything
            simulate(kernel, W, case.inputs, seed=0, options=options)
            for index, (part, op) in enumerate(sync_sites(kernel)):
                m = Mutant(name, variant, part, op.name, index, op.loc.short() if op.loc else "?")
                mutated = delete_site(kernel, index)
                outcomes = []
                for seed in range(seeds):
                    try:
                        simulate(mutated, W, case.inputs, seed=seed, options=options)
                        outcomes.append("not detected")
                    except CAUGHT as e:
                        outcomes.append(type(e).__name__)
                        m.caught = True
                        break
                    except SimulationError as e:
                        outcomes.append(f"only {type(e).__name__}")
                m.outcome = outcomes[-1]
                mutants.append(m)
                if verbose or not m.caught:
                    mark = "caught" if m.caught else "MISSED"
                    print(f"  {mark:6} {m.op:<22} {m.variant:<42} delete {m.primitive:<21} in {m.part:<12} "
                          f"({m.where}) -> {m.outcome}", file=out)
    caught = sum(m.caught for m in mutants)
    return caught, len(mutants), mutants


_KIND_WORDS = {"DeadlockError": "deadlocks", "RaceError": "races", "StaleSignalError": "stale signals",
               "UninitializedReadError": "uninitialised reads"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", action="append", help="only this op (repeatable)")
    ap.add_argument("--seeds", type=positive_int, default=2, help="scheduler seeds tried per mutant")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every mutant, not only missed ones")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.op or ()) - set(OPS))
    if unknown:
        ap.error(f"--op: no op {', '.join(map(repr, unknown))} (choose from {', '.join(sorted(OPS))})")
    t0 = time.perf_counter()
    caught, total, mutants = run(args.op, args.seeds, args.verbose)
    by_kind: dict[str, int] = {}
    for m in mutants:
        if m.caught:
            by_kind[m.outcome] = by_kind.get(m.outcome, 0) + 1
    # "detected as deadlock", not "DeadlockError": a passing run prints no error-looking line
    kinds = ", ".join(f"{v} as {_KIND_WORDS.get(k, k)}" for k, v in sorted(by_kind.items()))
    print(f"caught {caught}/{total} mutants ({kinds}) in {time.perf_counter() - t0:.1f}s")
    return 0 if total and caught == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
