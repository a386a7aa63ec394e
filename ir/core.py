"""The IR's containers: values, ops, blocks, parts and the kernel.

A kernel owns buffers (tensors in global or symmetric memory), signals, and *parts*.
A part is a grid of tasks with one body: the **compute** part is the tile program
(runs on SMs, ordered by the compute schedule); **comm** parts move data and are
placed by the communication schedule (SMs or the copy engine). Parts talk to each
other only through signals, which is what lets either schedule change alone.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

from .display import html_card, one_line
from .location import Location
from .printer import format_kernel
from .types import SignalType, TensorType

_ids = itertools.count()


class Value:
    """An SSA value: the result of one op, a block argument, or a kernel-level handle."""
    __slots__ = ("type", "hint", "id", "owner")

    def __init__(self, type, hint: str | None = None, owner=None):
        self.type = type
        self.hint = hint
        self.id = next(_ids)
        self.owner = owner  # the Op defining it, or a Buffer / Signal / Block

    def __repr__(self) -> str:
        return f"Value({self.hint or self.id}: {self.type})"


@dataclass(eq=False)
class Block:
    ops: list["Op"] = field(default_factory=list)
    args: list[Value] = field(default_factory=list)

    def walk(self) -> Iterator["Op"]:
        for op in self.ops:
            yield op
            for region in op.regions:
                yield from region.walk()

    def __repr__(self) -> str:
        return f"Block({len(self.ops)} ops, {len(list(self.walk()))} with nested regions, {len(self.args)} args)"


@dataclass(eq=False)
class Op:
    name: str
    operands: list[Value]
    results: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    regions: list[Block] = field(default_factory=list)
    loc: Location | None = None

    @property
    def result(self) -> Value:
        assert len(self.results) == 1, self.name
        return self.results[0]

    def __repr__(self) -> str:
        return f"Op({self.name} @ {self.loc.short() if self.loc else '?'})"


@dataclass(eq=False)
class Buffer:
    """A tensor argument or a kernel-owned workspace."""
    name: str
    type: TensorType
    kind: str          # "arg" (the caller passes it) | "workspace" (the kernel owns it, persists across launches)
    value: Value = None
    loc: Location | None = None
    #: how generated code spells it (``buf_<cname>``): unique among the kernel's tensors, set by the
    #: tracer (:mod:`.names`); None: made from ``name``
    cname: str | None = None

    def __post_init__(self):
        if self.value is None:
            self.value = Value(self.type, self.name, owner=self)

    @property
    def symmetric(self) -> bool:
        return self.type.space.value == "symmetric"

    def __repr__(self) -> str:
        return f"Buffer({self.name}: {self.type}, {self.kind}{', ' + self.loc.short() if self.loc else ''})"


@dataclass(eq=False)
class Signal:
    """An array of counters. Notifies add to a slot (release); waits spin until it reaches a count (acquire)."""
    name: str
    type: SignalType
    value: Value = None
    loc: Location | None = None
    #: how generated code spells it (``sig_<cname>``): unique among the kernel's signals, set by the
    #: tracer (:mod:`.names`); None: made from ``name``
    cname: str | None = None

    def __post_init__(self):
        if self.value is None:
            self.value = Value(self.type, self.name, owner=self)

    def __repr__(self) -> str:
        return f"Signal({self.name}: {self.type}{', ' + self.loc.short() if self.loc else ''})"


@dataclass(eq=False)
class Part:
    name: str
    role: str                 # "compute" | "comm"
    grid: tuple[int, ...]
    engine: str               # "sm" | "copy_engine" | "compute" (run by the compute part's kernel)
    body: Block
    loc: Location | None = None
    lanes: int | None = None  # comm parts: how many tasks may run at once (SMs or CE streams)
    fused: bool = False       # comm parts the schedule fused into the kernel's compute part: the
    #                           simulator runs them as written, codegen inside the compute kernel

    @property
    def num_tasks(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    def walk(self) -> Iterator[Op]:
        return self.body.walk()

    def __repr__(self) -> str:
        """One line (the body is the kernel's IR: ``print(kernel)``)."""
        return one_line(f"<Part {self.name}: {self.role}, grid {self.grid} on {self.engine}, {len(self.body.ops)} ops>")


@dataclass(eq=False)
class Kernel:
    name: str
    world_size: int
    buffers: list[Buffer]
    signals: list[Signal]
    parts: list[Part]
    compute_schedule: Any = None
    comm_schedule: Any = None
    mappings: list[Any] = field(default_factory=list)
    constexprs: dict[str, Any] = field(default_factory=dict)
    loc: Location | None = None
    #: signals dropped for lowering because their waiters run after their notifier on one stream
    #: (:mod:`.drop_signals`): such a kernel's parts must never run beside each other
    stream_ordered: frozenset = frozenset()

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def args(self) -> list[Buffer]:
        return [b for b in self.buffers if b.kind == "arg"]

    @property
    def workspaces(self) -> list[Buffer]:
        return [b for b in self.buffers if b.kind == "workspace"]

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"kernel '{self.name}' has no part {name!r}; its parts: {[p.name for p in self.parts]}")

    def walk(self) -> Iterator[tuple[Part, Op]]:
        for p in self.parts:
            for op in p.walk():
                yield p, op

    def __str__(self) -> str:
        return format_kernel(self)

    def _repr_pretty_(self, p, cycle):  # IPython's console: the whole IR
        p.text(str(self))

    def __repr__(self) -> str:
        """One line (``print(kernel)`` gives the IR)."""
        parts = ", ".join(f"{p.name}({p.role} {'x'.join(map(str, p.grid))})" for p in self.parts)
        return one_line(f"<tldsl.ir.Kernel {self.name}: W={self.world_size}, parts {parts}; "
                        f"{len(self.args)} args, {len(self.workspaces)} workspaces, {len(self.signals)} signals>")

    def _repr_html_(self) -> str:
        facts = [("world size", self.world_size),
                 *((f"{p.role} part {p.name}", f"grid {p.grid}, {p.num_tasks} tasks on {p.engine}") for p in self.parts),
                 *((f"{b.kind} {b.name}", str(b.type)) for b in self.buffers),
                 *((f"signal {s.name}", str(s.type)) for s in self.signals),
                 ("compute schedule", self.compute_schedule), ("comm schedule", self.comm_schedule)]
        return html_card(f"IR kernel {self.name}", facts, [("IR", str(self))], open_first=True)
