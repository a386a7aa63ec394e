"""The description of a generated tile program: a small tree of dataclasses that prints as the
Python source of a ``@tl.kernel``. The source is the program: the fuzzer traces exactly what it
prints, so a failing case shown to a user can be pasted into a regression test as it is.

Expressions carry their tile shape and dtype (so the generator only builds well-typed trees),
a bound on their magnitude and whether they are exact (the same bits on every backend): the
generator keeps the math well-conditioned with them. Index scalars are plain source strings
(``"pm * 16"``): they are exact integers and need no structure.
"""
from __future__ import annotations

import linecache
from dataclasses import dataclass, field
from typing import Union

TL_DTYPE = {"f16": "tl.float16", "bf16": "tl.bfloat16", "f32": "tl.float32", "i32": "tl.int32"}
FLOATS = ("f16", "bf16", "f32")


# -- expressions ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Expr:
    shape: tuple[int, ...]
    dtype: str                                        # f16 | bf16 | f32 | i32 | i1
    bound: float = field(default=1.0, compare=False)  # |value| <= bound
    exact: bool = field(default=False, compare=False)  # bit-identical on every backend


@dataclass(frozen=True, kw_only=True)
class Var(Expr):
    name: str

    def src(self):
        return self.name


@dataclass(frozen=True, kw_only=True)
class Load(Expr):
    tensor: str
    offsets: tuple[str, ...]
    box: tuple[int, ...]
    peer: str | None = None              # tl.load(x.at(peer), ...): the tile_pull_data primitive

    def src(self):
        ref = self.tensor if self.peer is None else f"{self.tensor}.at({self.peer})"
        return f"tl.load({ref}, {_tuple(self.offsets)}, {_tuple(self.box)})"


@dataclass(frozen=True, kw_only=True)
class LoadRows(Expr):
    tensor: str
    rows: "Node"
    col: str
    ncols: int

    def src(self):
        return f"tl.load_rows({self.tensor}, {self.rows.src()}, {self.col}, {self.ncols})"


@dataclass(frozen=True, kw_only=True)
class Pull(Expr):
    """``tl.tile_pull_data(x.at(peer), offsets, box)``: a peer's tile, by the primitive's name."""
    tensor: str
    offsets: tuple[str, ...]
    peer: str

    def src(self):
        return f"tl.tile_pull_data({self.tensor}.at({self.peer}), {_tuple(self.offsets)}, {_tuple(self.shape)})"


@dataclass(frozen=True, kw_only=True)
class Full(Expr):
    value: float | int

    def src(self):
        if self.value == 0:
            return f"tl.zeros({_tuple(self.shape)}, {TL_DTYPE[self.dtype]})"
        return f"tl.full({_tuple(self.shape)}, {self.value!r}, {TL_DTYPE[self.dtype]})"


@dataclass(frozen=True, kw_only=True)
class Iota(Expr):
    def src(self):
        return f"tl.iota({self.shape[0]})"


UNARY_SRC = {"neg": "-{}", "exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})",
             "sqrt": "tl.sqrt({})", "abs": "tl.abs({})", "recip": 'tl.ewise("recip", {})',
             "sigmoid": "tl.sigmoid({})", "tanh": "tl.tanh({})", "erf": "tl.erf({})", "rsqrt": "tl.rsqrt({})"}


@dataclass(frozen=True, kw_only=True)
class Unary(Expr):
    fn: str
    x: "Node"

    def src(self):
        return UNARY_SRC[self.fn].format(self.x.src())


INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "lt": "<", "le": "<=",
         "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|"}


@dataclass(frozen=True, kw_only=True)
class Binary(Expr):
    op: str
    a: "Node"
    b: Union["Node", float, int, str]    # a Python number adopts the tile's dtype; a str names an index scalar

    def src(self):
        b = self.b.src() if isinstance(self.b, Expr) else self.b if isinstance(self.b, str) else repr(self.b)
        if self.op in ("max", "min"):
            return f"tl.{'maximum' if self.op == 'max' else 'minimum'}({self.a.src()}, {b})"
        return f"({self.a.src()} {INFIX[self.op]} {b})"


@dataclass(frozen=True, kw_only=True)
class Where(Expr):
    cond: "Node"
    a: "Node"
    b: Union["Node", float, int]

    def src(self):
        b = self.b.src() if isinstance(self.b, Expr) else repr(self.b)
        return f"tl.where({self.cond.src()}, {self.a.src()}, {b})"


@dataclass(frozen=True, kw_only=True)
class Cast(Expr):
    x: "Node"
    method: bool = False                 # x.to(dtype) rather than tl.cast(x, dtype)

    def src(self):
        if self.method:
            return f"{self.x.src()}.to({TL_DTYPE[self.dtype]})"
        return f"tl.cast({self.x.src()}, {TL_DTYPE[self.dtype]})"


@dataclass(frozen=True, kw_only=True)
class Reduce(Expr):
    fn: str                              # sum | max | min
    x: "Node"
    axis: int

    def src(self):
        return f"tl.{self.fn}({self.x.src()}, {self.axis})"


@dataclass(frozen=True, kw_only=True)
class ExpandDims(Expr):
    x: "Node"
    axis: int
    indexing: bool = False               # t[:, None] rather than tl.expand_dims(t, 1)

    def src(self):
        if self.indexing:
            return f"{self.x.src()}[{'None, :' if self.axis == 0 else ':, None'}]"
        return f"tl.expand_dims({self.x.src()}, {self.axis})"


@dataclass(frozen=True, kw_only=True)
class Broadcast(Expr):
    x: "Node"

    def src(self):
        return f"tl.broadcast_to({self.x.src()}, {_tuple(self.shape)})"


@dataclass(frozen=True, kw_only=True)
class Trans(Expr):
    x: "Node"

    def src(self):
        return f"tl.trans({self.x.src()})"


@dataclass(frozen=True, kw_only=True)
class Dot(Expr):
    a: "Node"
    b: "Node"

    def src(self):
        return f"tl.dot({self.a.src()}, {self.b.src()})"


@dataclass(frozen=True, kw_only=True)
class FragRead(Expr):
    name: str

    def src(self):
        return f"{self.name}[...]"


Node = Expr


# -- statements ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Assign:
    """``name = code``: an index scalar."""
    name: str
    code: str

    def lines(self):
        return [f"{self.name} = {self.code}"]


@dataclass(frozen=True)
class Let:
    name: str
    value: Expr

    def lines(self):
        return [f"{self.name} = {self.value.src()}"]


@dataclass(frozen=True)
class Store:
    tensor: str
    offsets: tuple[str, ...]
    value: Expr
    peer: str | None = None              # tl.store(y.at(peer), ...): the tile_push_data primitive

    def lines(self):
        ref = self.tensor if self.peer is None else f"{self.tensor}.at({self.peer})"
        return [f"tl.store({ref}, {_tuple(self.offsets)}, {self.value.src()})"]


@dataclass(frozen=True)
class AddRows:
    """``tl.add_rows(tensor, rows, col, value)``: the value's rows added into rows of ``tensor``."""
    tensor: str
    rows: "Node"
    col: str
    value: Expr

    def lines(self):
        return [f"tl.add_rows({self.tensor}, {self.rows.src()}, {self.col}, {self.value.src()})"]


@dataclass(frozen=True)
class Fragment:
    name: str
    shape: tuple[int, ...]
    dtype: str
    fill: float | int = 0.0

    def lines(self):
        fill = "" if self.fill == 0 else f", fill={self.fill!r}"
        return [f"{self.name} = tl.fragment({_tuple(self.shape)}, {TL_DTYPE[self.dtype]}{fill})"]


@dataclass(frozen=True)
class Update:
    """``acc += value`` or ``acc[...] = value``."""
    name: str
    value: Expr
    add: bool = True

    def lines(self):
        return [f"{self.name} += {self.value.src()}" if self.add else f"{self.name}[...] = {self.value.src()}"]


@dataclass(frozen=True)
class Loop:
    """``for var in tl.range(...)`` (stays a loop) or ``tl.static_range(...)`` (unrolled)."""
    var: str
    start: str
    stop: str
    step: str
    body: tuple
    static: bool = False

    def lines(self):
        fn = "tl.static_range" if self.static else "tl.range"
        return [f"for {self.var} in {fn}({self.start}, {self.stop}, {self.step}):", *_indent(self.body)]


@dataclass(frozen=True)
class When:
    cond: str
    body: tuple

    def lines(self):
        return [f"with tl.when({self.cond}):", *_indent(self.body)]


@dataclass(frozen=True)
class Call:
    """A call of the tile language by name (the primitives): ``tl.fn(arg, ...)``."""
    fn: str
    args: tuple[str, ...]

    def lines(self):
        return [f"tl.{self.fn}({', '.join(self.args)})"]


@dataclass(frozen=True)
class Invoke:
    """A call of something the program declared: ``rows0.wait_rows(ready0, r0, hi, wait=...)``."""
    target: str
    args: tuple[str, ...]

    def lines(self):
        return [f"{self.target}({', '.join(self.args)})"]


Stmt = Union[Assign, Let, Store, Fragment, Update, Loop, When, Call, Invoke]


# -- the program -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Arg:
    """A tensor argument and how its inputs are made (:mod:`.program_inputs`): ``kind`` is
    ``input`` (uniform in [low, high], integers for i32), ``output`` (poisoned), ``rows`` (row
    indices in [low, high), negatives read as zero rows) or ``table`` (i32 in [low, high))."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    symmetric: bool = False
    kind: str = "input"
    low: float = -1.0
    high: float = 1.0


@dataclass(frozen=True)
class Workspace:
    name: str
    shape: tuple[int, ...]
    dtype: str
    symmetric: bool = False

    def lines(self):
        fn = "tl.symmetric_buffer" if self.symmetric else "tl.local_buffer"
        return [f'{self.name} = {fn}({_tuple(self.shape)}, {TL_DTYPE[self.dtype]}, "{self.name}")']


@dataclass(frozen=True)
class SignalDecl:
    name: str
    slots: int
    scope: str = "local"

    def lines(self):
        scope = "" if self.scope == "local" else f', scope="{self.scope}"'
        return [f'{self.name} = tl.signal("{self.name}", {self.slots}{scope})']


@dataclass(frozen=True)
class StaticMappingDecl:
    """``tl.StaticMapping``: ``rows`` rows per rank of ``tensor``, in tiles of ``tile`` rows."""
    name: str
    tensor: str
    rows: int
    tile: int | None = None

    def lines(self):
        tile = "" if self.tile is None else f", {self.tile}"
        return [f'{self.name} = tl.StaticMapping("{self.name}", {self.tensor}, {self.rows}{tile})']


@dataclass(frozen=True)
class DynamicMappingDecl:
    """``tl.DynamicMapping`` over ``tiles`` tiles: ``key`` reads the i32 table ``table``."""
    name: str
    tiles: int
    key: str
    table: str

    def lines(self):
        return [f'{self.name} = tl.DynamicMapping("{self.name}", {self.tiles}, {self.key}={self.table})']


@dataclass(frozen=True)
class Part:
    name: str
    role: str                            # compute | comm
    grid: tuple[int, ...]
    params: tuple[str, ...]
    body: tuple
    engine: str | None = None            # comm parts: sm | copy_engine

    def lines(self):
        if self.role == "compute":
            deco = f"@tl.compute_part(grid={_tuple(self.grid)})"
        else:
            engine = f', engine="{self.engine}"' if self.engine else ""
            deco = f'@tl.comm_part(grid={_tuple(self.grid)}, name="{self.name}"{engine})'
        return [deco, f"def {self.name}({', '.join(self.params)}):", *_indent(self.body)]


KERNEL_NAME = "tile_program"


@dataclass(frozen=True)
class Program:
    world_size: int
    args: tuple[Arg, ...]
    decls: tuple = ()                    # Workspace | SignalDecl | StaticMappingDecl | DynamicMappingDecl
    parts: tuple[Part, ...] = ()
    comm: str | None = None              # a tl.CommSchedule(...) for the collectives: the kernel's comm= default
    compute: str | None = None           # a tl.ComputeSchedule(...): the kernel's compute= default (tile order)

    def kernel_source(self) -> str:
        params = ", ".join(a.name + (": tl.Symmetric" if a.symmetric else "") for a in self.args)
        keywords = (["comm: tl.CommSchedule = COMM"] if self.comm is not None else []) + \
                   (["compute: tl.ComputeSchedule = COMPUTE"] if self.compute is not None else [])
        if keywords:
            params += ", *, " + ", ".join(keywords)
        body: list[str] = []
        for d in self.decls:
            body += d.lines()
        for p in self.parts:
            body += ["", *p.lines()]
        return "\n".join(["@tl.kernel", f"def {KERNEL_NAME}({params}):", *_indent_lines(body)]) + "\n"

    @staticmethod
    def inputs_call(input_seed: int = 0, exact: bool = True) -> str:
        """The ``make_inputs`` call that makes a program's inputs."""
        return f"make_inputs(ARGS, WORLD_SIZE, seed={input_seed}{'' if exact else ', exact=False'})"

    def source(self, header: str = "", input_seed: int = 0, exact_inputs: bool = True) -> str:
        """A standalone module: the kernel, its world size and its arguments' description.
        ``tl.simulate(tile_program.trace(WORLD_SIZE, *specs(ARGS)), WORLD_SIZE, make_inputs(ARGS,
        WORLD_SIZE))`` runs it (and so does running the module: it prints every rank's outputs)."""
        doc = f'"""{header}"""\n' if header else ""
        args = "\n".join(f"    {a!r}," for a in self.args)
        main = ('\n\nif __name__ == "__main__":\n'
                f"    kernel = {KERNEL_NAME}.trace(WORLD_SIZE, *specs(ARGS))   # bf16 arguments are float32 arrays\n"
                f"    result = tl.simulate(kernel, WORLD_SIZE, {self.inputs_call(input_seed, exact_inputs)})\n"
                "    for rank, outputs in enumerate(result.outputs):\n"
                "        print(f\"rank {rank}:\", {k: v for k, v in outputs.items() if k.startswith(\"y\")})\n")
        collectives = "from tldsl import collectives\n" if self.comm is not None else ""
        comm = f"COMM = {self.comm}\n" if self.comm is not None else ""
        comm += f"COMPUTE = {self.compute}\n" if self.compute is not None else ""
        return (f"{doc}import tldsl as tl\n{collectives}from tldsl.testing.program_inputs import make_inputs, specs\n"
                f"from tldsl.testing.program_tree import Arg\n\nWORLD_SIZE = {self.world_size}\n{comm}"
                f"ARGS = [\n{args}\n]\n\n\n{self.kernel_source()}{main}")

    def build(self, filename: str = "<tile program>", header: str = "", input_seed: int = 0,
              exact_inputs: bool = True):
        """The ``@tl.kernel`` function of ``source(header, input_seed, exact_inputs)`` (its lines are
        registered with :mod:`linecache` under ``filename``, so errors and the IR point at the lines
        shown)."""
        text = self.source(header, input_seed, exact_inputs)
        linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
        namespace: dict = {"__name__": "tldsl_fuzz_program"}
        exec(compile(text, filename, "exec"), namespace)      # noqa: S102 - our own generated source
        return namespace[KERNEL_NAME]


def _tuple(items) -> str:
    items = [str(i) for i in items]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _indent(stmts) -> list[str]:
    out = []
    for s in stmts:
        out += s.lines()
    return _indent_lines(out or ["pass"])


def _indent_lines(lines) -> list[str]:
    return [("    " + line) if line else "" for line in lines]
