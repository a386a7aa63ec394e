"""Index arithmetic compiled once per op: the scalar ops are most of the ops a task runs
(tile coordinates, channel numbers, loop bounds), and looking up an op's operands, result
and attributes again every time it runs cost more than the arithmetic. Each function here
does what the interpreter's rule for the op does, with the same results."""
from __future__ import annotations

from ...ir.semantics import ARITH, wrap_i32

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def compile_scalar(op, rule):
    """A function (op, env, task) doing what ``rule`` does for ``op``, or None where the op is
    not index arithmetic. ``rule`` is the interpreter's own rule, which raises the errors."""
    make = _MAKERS.get(op.name)
    return None if make is None else make(op, rule)


def _const(op, rule):
    r, value = op.results[0].id, op.attrs["value"]

    def run(op, env, task):
        env[r] = value
    return run


def _program_id(op, rule):
    r, axis = op.results[0].id, op.attrs["axis"]

    def run(op, env, task):
        env[r] = task.coords[axis]
    return run


def _rank(op, rule):
    r = op.results[0].id

    def run(op, env, task):
        env[r] = task.rank
    return run


def _arith(op, rule):
    a, b, r = op.operands[0].id, op.operands[1].id, op.results[0].id
    fn = ARITH[op.attrs["op"]]

    def run(op, env, task):
        try:
            x = fn(env[a], env[b])
        except ZeroDivisionError:
            return rule(op, env, task)          # raises the rule's error
        env[r] = x if type(x) is int and _I32_MIN <= x <= _I32_MAX else wrap_i32(x)
    return run


def _select(op, rule):
    c, a, b = (v.id for v in op.operands)
    r = op.results[0].id

    def run(op, env, task):
        env[r] = env[a] if env[c] else env[b]
    return run


_MAKERS = {"const": _const, "program_id": _program_id, "rank": _rank, "arith": _arith, "select": _select}
