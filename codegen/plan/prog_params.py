"""The kernel parameters the MoE recipes' ``Prog`` hooks add (the grouped GEMM's guard,
expert, row ids, waits and notifies; the combine's waits, body and notifies): the signals they
wait on or notify and the tensors their index code and per-row expressions read, in the
order the hooks run — so the planner knows the ABI before anything is rendered — and how each
tensor is passed: coherently when another part of the kernel writes it during the launch."""
from __future__ import annotations

from typing import Iterable

from ...ir import core
from ...ir.opdefs import DATA_OPS, NOTIFY_OPS, WAIT_OPS, data_operands
from ..abi import KernelParam, pointer_param, signal_param, table_param
from ..dtypes import c_type
from ..ir_queries import needed_ops, producers


def signal_hook(ops, kinds) -> set[int]:
    """ids of the ops a waits / notifies hook runs: the signal ops of ``kinds`` and the index
    code, loops and conditions around them (:func:`..ir_queries.needed_ops`)."""
    return needed_ops(ops, lambda op: op.name in kinds)


def value_hook(ops, values) -> set[int]:
    """ids of the ops a hook computing ``values`` runs (:func:`..ir_queries.producers`)."""
    return {id(op) for op in producers(values, ops)}


def tensors_read(ops, hooks: Iterable[set[int]]) -> tuple[core.Buffer, ...]:
    """The tensors the hooks (in the order they run) read with ``load_scalar`` or a per-row
    ``load``, first use first."""
    walk = list(core.Block(list(ops)).walk())
    out: list[core.Buffer] = []
    for hook in hooks:
        for op in walk:
            if id(op) in hook and op.name in ("load_scalar", "load") and op.operands[0].owner not in out:
                out.append(op.operands[0].owner)
    return tuple(out)


def signals_used(ops) -> tuple[core.Signal, ...]:
    """The signals of the waits, then of the notifies (the waits hook runs first), in program order."""
    walk = list(core.Block(list(ops)).walk())
    out: list[core.Signal] = []
    for kinds in (WAIT_OPS, NOTIFY_OPS):
        for op in walk:
            if op.name in kinds and op.operands[0].owner not in out:
                out.append(op.operands[0].owner)
    return tuple(out)


def tensor_name(b: core.Buffer) -> str:
    """The parameter (and ``Prog`` member) of a tensor the hooks read: ``tbl_<name>`` for i32
    tables, ``ptr_<name>`` for the rest."""
    return table_param(b) if b.type.dtype.name == "i32" else pointer_param(b)


def tensor_param(b: core.Buffer, written: frozenset[str]) -> KernelParam:
    """A read-only tensor's parameter: ``__restrict__`` (the compiler may read it through the
    non-coherent cache) unless another part writes it during the launch."""
    restrict = "" if b.name in written else " __restrict__"
    return KernelParam(tensor_name(b), f"const {c_type(b.type.dtype)}*{restrict}", "ptr", f"buffer:{b.name}")


def signal_params(signals) -> list[KernelParam]:
    """This rank's copy of each signal (``sig_<name>``)."""
    return [KernelParam(signal_param(s), "unsigned long long*", "ptr", f"signal:{s.name}") for s in signals]
