"""A kernel without some of its signals: every notify and wait on them gone, and the code that
only fed them.

Why: a part launched after the part that notifies it, on the same stream, finds every wait
already satisfied — the stream's order is the synchronisation. Its producer's notifies (per-tile
flag adds, and in the grouped GEMM a notify ring and a warp that drains it) and its own flag
reads are then pure cost. The runtime decides which signals that holds for
(:func:`tldsl.runtime.gpu.chains.stream_ordered_signals`); this pass only rewrites the IR, so
that every recipe lowers the program as if it had been written without them.

The result is for lowering only: run in the simulator, where every part runs beside the others,
the dropped waits would be missing synchronisation. ``Kernel.stream_ordered`` names what was
dropped, so that a launch plan can refuse to run such kernels side by side. One behaviour differs
from the program as written: a wait that too few notifies could ever satisfy (a count larger than
the producer's notifies, say from a wrong routing table) no longer hangs or traps — the part reads
what its producer finished writing. The simulator reports such a program as a deadlock, and
``tl.run``'s static checks refuse it before launch where the counts are constants.
"""
from __future__ import annotations

from dataclasses import replace

from .core import Block, Kernel, Op
from .opdefs import OPS, SYNC_OPS

#: ops without effects: dropped once nothing reads their results (scalar arithmetic, table reads)
_PURE = frozenset(n for n, d in OPS.items() if d.category == "scalar") | {"load_scalar"}


def without_signals(kernel: Kernel, names) -> Kernel:
    """A copy of ``kernel`` whose notifies and waits on the signals ``names`` are gone, with the
    pure ops that only fed them and the loops and guards left empty. Parts that hold none of
    them are shared with ``kernel``, not copied."""
    names = frozenset(names)
    unknown = names - {s.name for s in kernel.signals}
    if unknown:
        raise KeyError(f"kernel '{kernel.name}' has no signal {sorted(unknown)}; "
                       f"its signals: {[s.name for s in kernel.signals]}")
    if not names:
        return kernel
    dropped = {id(s.value) for s in kernel.signals if s.name in names}
    parts = []
    for p in kernel.parts:
        if any(op.name in SYNC_OPS and id(op.operands[0]) in dropped for op in p.walk()):
            p = replace(p, body=_prune(_without(p.body, dropped)))
        parts.append(p)
    return replace(kernel, parts=parts, signals=[s for s in kernel.signals if s.name not in names],
                   stream_ordered=kernel.stream_ordered | names)


def _without(block: Block, dropped: set[int]) -> Block:
    """``block`` with the sync ops on ``dropped`` signals removed (regions rebuilt where they hold one)."""
    ops = []
    for op in block.ops:
        if op.name in SYNC_OPS and id(op.operands[0]) in dropped:
            continue
        if op.regions:
            op = replace(op, regions=[_without(r, dropped) for r in op.regions])
        ops.append(op)
    return Block(ops, block.args)


def _prune(block: Block) -> Block:
    """Drop, to a fixed point, pure ops whose results nothing reads and control ops (``for``,
    ``if``) left with empty regions."""
    while True:
        used = _used(block)
        out = _pruned(block, used)
        if _count(out) == _count(block):
            return out
        block = out


def _pruned(block: Block, used: set[int]) -> Block:
    ops = []
    for op in block.ops:
        if op.regions:
            op = replace(op, regions=[_pruned(r, used) for r in op.regions])
            if op.name in ("for", "if") and not op.results and all(not r.ops for r in op.regions):
                continue
        elif op.name in _PURE and not any(id(v) in used for v in op.results):
            continue
        ops.append(op)
    return Block(ops, block.args)


def _used(block: Block) -> set[int]:
    return {id(v) for op in block.walk() for v in op.operands}


def _count(block: Block) -> int:
    return sum(1 for _ in block.walk())
