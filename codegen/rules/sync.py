"""Index code plus the signal primitives a kernel's hooks run: the emitter the recipes'
wait / notify hooks share (the GEMM producer's waits, its epilogue's notifies, the grouped
GEMM's and attention's hooks).

It renders waits and notifies through :mod:`.primitives` on the signal parameters named by
:mod:`..abi`, and records which signals a kernel reads so the planner can list them as
parameters: ``signals`` (this rank's copy, ``sig_<name>``) and ``peer_signals`` (every rank's
copies, ``sig_<name>_peers``)."""
from __future__ import annotations

from ...ir import core
from ..abi import is_this_rank, signal_slot
from ..errors import fail
from ..ir_queries import needed_ops, scope_of, wait_site
from . import primitives
from .scalars import ScalarEmitter


class SignalEmitter(ScalarEmitter):
    """Emits only the ops of ``roots`` among ``ops`` (and the index code, loops and conditions
    they need, see :func:`..ir_queries.needed_ops`); subclasses say what each root becomes in
    :meth:`emit_other`, rendering signal ops with :meth:`wait_statement` /
    :meth:`notify_statement`. ``what`` prefixes errors ("GEMM lowering"); ``grid_rank`` is
    the number of program-id axes the kernel has. ``needed``: the ops to emit when the plan
    has already worked them out (else they are computed from :meth:`is_root`)."""

    roots: frozenset = frozenset()
    grid_rank = 2

    def __init__(self, kernel: core.Kernel, ops: list[core.Op], what: str, needed: set[int] | None = None):
        super().__init__(needed_ops(ops, self.is_root) if needed is None else needed)
        self.kernel = kernel
        self.ops = ops
        self.what = what
        self.signals: list[core.Signal] = []        # this rank's copy: params sig_<name>
        self.peer_signals: list[core.Signal] = []   # every rank's copy: params sig_<name>_peers

    def fail(self, msg, op=None):
        return fail(self.what, msg, op)

    def is_root(self, op: core.Op) -> bool:
        """Whether the hooks run ``op`` (by default: its name is in ``roots``); called while
        ``__init__`` collects the ops to emit."""
        return op.name in self.roots

    def pid_expr(self, axis, op):
        if axis >= self.grid_rank:
            raise self.fail(f"program_id({axis}): the grid is at most {self.grid_rank}-d", op)
        return f"pid{axis}"

    def emit(self, indent: str = "    ") -> list[str]:
        return super().emit(self.ops, indent)

    def use(self, sig: core.Signal, peers: bool = False) -> None:
        lst = self.peer_signals if peers else self.signals
        if sig not in lst:
            lst.append(sig)

    def wait_statement(self, op: core.Op, *, cta: bool = False) -> str:
        """A wait op on this rank's copy of its signal (a ``sig_<name>`` parameter)."""
        sig = op.operands[0].owner
        self.use(sig)
        return primitives.wait(op, signal_slot(sig, self.name(op.operands[1], op)),
                               self.name(op.operands[2], op), cta=cta, site=wait_site(op))

    def notify_statement(self, op: core.Op, *, cta: bool = False, note: str = "") -> tuple[str, str]:
        """A notify op as (its scope, its statement): on this rank's copy of the signal, or
        through the table of every rank's copies when it targets another rank."""
        sig = op.operands[0].owner
        ch = self.name(op.operands[1], op)
        if op.name == "producer_tile_notify" or is_this_rank(op.operands[2]):
            self.use(sig)
            slot = signal_slot(sig, ch)
        else:
            self.use(sig, peers=True)
            slot = signal_slot(sig, ch, self.name(op.operands[2], op))
        return scope_of(op), primitives.notify(op, slot, cta=cta, note=note)
