"""Which compute parts of a traced program run after another rather than beside it.

Read from the IR alone (who notifies and who waits on which signal), before anything is
lowered: :func:`~.run_plan.plan_run` puts a chained part on its producer's stream and
:func:`~.fold.fold_chained` folds the pair into one kernel where the recipe can (the part into
its producer's, or its producer into the part's).
"""
from __future__ import annotations

from ...ir import core
from ...ir.part_graph import notifiers, reaches, self_signals, waited_signals, waits_on
from ..sim.engine import walks_forward


def chained_parts(kernel: core.Kernel, kernels: set[str]) -> dict[str, str]:
    """``{part: producer}`` for the compute parts that run after another rather than beside it:
    every wait of the part is on a local signal that one other compute part of the rank alone
    notifies (an MoE combine behind its grouped GEMM), the producer never waits — directly or
    through other parts — for anything the part notifies, and the part's tasks never wait for
    each other. Such a part can only start a task once its producer finished the tiles it
    reads; with a dynamic mapping that is where it may be anywhere, often the producer's last
    wave. Beside it, the part held SMs the producer needed, spinning; after it (on the
    producer's stream), it gets every SM the producer leaves and its waits hold at once. Both
    kernels are of ``kernels`` (parts lowered to SM kernels, not copy-engine plans)."""
    by_signal = notifiers(kernel)
    deps = waits_on(kernel)
    role = {p.name: p.role for p in kernel.parts}
    out = {}
    for p in kernel.parts:
        sigs = waited_signals(p)
        if p.role != "compute" or p.fused or p.name not in kernels or not sigs or self_signals(p):
            continue
        producers = {q for s in sigs for q in by_signal.get(s.name, ())}
        if any(getattr(s.type, "scope", "local") != "local" for s in sigs) or len(producers) != 1:
            continue
        (q,) = producers
        if q != p.name and role[q] == "compute" and q in kernels and not reaches(deps, q, p.name):
            out[p.name] = q
    return {p: q for p, q in out.items() if q not in out}     # never after a part that is itself after one


def at_once_needed(part: core.Part, kernel: core.Kernel | None = None) -> int:
    """CTAs ``part`` needs resident at once: where its tasks wait for tasks of the same part (a
    signal it both notifies and waits on), as many as the simulator runs at once (every task
    of a compute part; a communication part's ``lanes``) — but one for a compute part of
    ``kernel`` whose every such wait is met by tasks before it in the schedule's walk, which any
    number of CTAs runs (:func:`~tldsl.ir.analysis.earlier_tasks_satisfy`); else 0."""
    if not self_signals(part):
        return 0
    if part.role != "compute":
        return min(part.num_tasks, part.lanes or part.num_tasks)
    if kernel is not None and walks_forward(kernel, part):
        return 1
    return part.num_tasks


def stream_ordered_signals(kernel: core.Kernel, chained: dict[str, str]) -> frozenset:
    """The signals whose every wait is satisfied by the stream's order once the ``chained`` parts
    (``{part: producer}``, :func:`chained_parts`) run after their producers: those their producer
    alone notifies and only parts chained after it wait on. Their notifies and waits can go
    (:func:`tldsl.ir.drop_signals.without_signals`)."""
    by_signal = notifiers(kernel)
    waiters: dict[str, set[str]] = {}
    for p in kernel.parts:
        for s in waited_signals(p):
            waiters.setdefault(s.name, set()).add(p.name)
    out = set()
    for part, producer in chained.items():
        for s in waited_signals(kernel.part(part)):
            if by_signal.get(s.name) == {producer} and all(chained.get(w) == producer for w in waiters[s.name]):
                out.add(s.name)
    return frozenset(out)
