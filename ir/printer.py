"""Readable text for a kernel: schedules, buffers, signals, then each part's ops with the
user's source line beside every op. Communication and compute parts are labelled.

It reads the IR's objects (:mod:`.core`) by their fields and imports nothing from there:
``Kernel.__str__`` prints through this module, so core depends on the printer, not back.
"""
from __future__ import annotations

from dataclasses import fields

_INLINE_CONST = True


class _Names:
    def __init__(self):
        self.names: dict[int, str] = {}
        self.used: set[str] = set()
        self.n = 0

    def define(self, v) -> str:
        base = v.hint
        if base:
            name = base
            i = 1
            while name in self.used:
                name = f"{base}.{i}"
                i += 1
        else:
            name = str(self.n)
            self.n += 1
        self.used.add(name)
        self.names[v.id] = "%" + name
        return self.names[v.id]

    def __call__(self, v) -> str:
        owner = v.owner
        is_op = getattr(owner, "attrs", None) is not None      # not a block argument, buffer or signal
        if _INLINE_CONST and is_op and owner.name == "const":
            return repr(owner.attrs["value"])
        return self.names.get(v.id, f"%?{v.id}")


def _attrs(op) -> str:
    skip = {"shape", "dtype"} if op.name in ("load", "full", "frag_alloc", "load_rows") else set()
    skip |= {"form"}
    items = [f"{k}={v}" for k, v in op.attrs.items() if k not in skip]
    return (" {" + ", ".join(items) + "}") if items else ""


def _format_op(op, names: _Names, indent: str, lines: list[str]):
    operands = ", ".join(names(v) for v in op.operands)
    loc = f"  // {op.loc.short()}" if op.loc else ""
    if op.name == "for":
        iv = names.define(op.regions[0].args[0])
        lo, hi, st = (names(v) for v in op.operands)
        lines.append(f"{indent}for {iv} = {lo} to {hi} step {st}{_attrs(op)} {{{loc}")
        _format_block(op.regions[0], names, indent + "  ", lines)
        lines.append(f"{indent}}}")
        return
    if op.name == "if":
        lines.append(f"{indent}if {operands} {{{loc}")
        _format_block(op.regions[0], names, indent + "  ", lines)
        lines.append(f"{indent}}}")
        return
    if op.name == "const":
        if not _INLINE_CONST:
            res = names.define(op.result)
            lines.append(f"{indent}{res} = const {op.attrs['value']} : {op.result.type}{loc}")
        return
    lhs = ", ".join(names.define(r) for r in op.results)
    types = ", ".join(str(r.type) for r in op.results)
    if op.name in ("arith", "ewise"):   # spell arithmetic by its operator: `add %a, %b`
        rest = {k: v for k, v in op.attrs.items() if k != "op"}
        text = f"{op.attrs['op']}{' ' + str(rest) if rest else ''} {operands}".rstrip()
    else:
        text = f"{op.name}{_attrs(op)} {operands}".rstrip()
    if lhs:
        lines.append(f"{indent}{lhs} = {text} : {types}{loc}")
    else:
        lines.append(f"{indent}{text}{loc}")


def _format_block(block, names: _Names, indent: str, lines: list[str]):
    for op in block.ops:
        _format_op(op, names, indent, lines)


def format_kernel(k) -> str:
    """The text of a :class:`~.core.Kernel` (what ``str(kernel)`` gives)."""
    names = _Names()
    lines = [f"kernel @{k.name}  world_size={k.world_size}"]
    if k.constexprs:
        lines.append("  constexprs " + ", ".join(f"{a}={b}" for a, b in k.constexprs.items()))
    if k.compute_schedule is not None:
        lines.append(f"  compute schedule: {_sched(k.compute_schedule)}")
    if k.comm_schedule is not None:
        lines.append(f"  comm schedule:    {_sched(k.comm_schedule)}")
    for b in k.buffers:
        lines.append(f"  {b.kind:<9} {names.define(b.value)} : {b.type}")
    for s in k.signals:
        lines.append(f"  signal    {names.define(s.value)} : {s.type}")
    for m in k.mappings:
        lines.append(f"  mapping   {m}")
    for p in k.parts:
        label = "communication" if p.role == "comm" else "computation"
        extra = f" engine={p.engine}" + (f" lanes={p.lanes}" if p.lanes else "") + (" fused" if p.fused else "")
        lines.append("")
        lines.append(f"  {p.role} part @{p.name} grid={p.grid}{extra} {{  // {label}")
        _format_block(p.body, names, "    ", lines)
        lines.append("  }")
    return "\n".join(lines)


def _sched(s) -> str:
    return " ".join(f"{f.name}={getattr(s, f.name)}" for f in fields(s))
