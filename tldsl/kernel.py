"""``@tl.kernel``: specialise a Python tile program on world size, tensor shapes, dtypes,
constexprs and schedules, trace it once into an IR :class:`~tldsl.ir.Kernel`, verify it
and cache the result."""
from __future__ import annotations

import functools
import inspect
import numbers
import types
from dataclasses import dataclass

import numpy as np

from .errors import CompilationError, InputError
from .ir.display import html_card, one_line
from .ir import core, types as T
from .ir.location import Location, user_location
from .ir.schedule import CommSchedule, ComputeSchedule, check_compatible
from .ir.verifier import verify
from .language import Symmetric, constexpr
from .tracing import Builder, Scalar, TensorRef, current, fail, tracing


@dataclass(frozen=True)
class TensorSpec:
    """What a kernel is specialised on for one tensor argument: its shape (Python or numpy ints
    >= 0) and its dtype — a tl dtype, its name (``"bf16"``, ``"float16"``), or a numpy or torch
    dtype, mapped to the tl one. Anything else is refused here, naming the argument, rather than
    surfacing later as a strange shape or a dtype mismatch inside the kernel — so is a 0-d shape
    (pass ``(1,)``) and a dimension of 2**31 or more (kernels index each dimension in 32-bit ints)."""
    shape: tuple[int, ...]
    dtype: T.DType

    def __post_init__(self):
        object.__setattr__(self, "shape", spec_shape(self.shape))
        object.__setattr__(self, "dtype", spec_dtype(self.dtype))

    @staticmethod
    def of(x, name: str = "") -> "TensorSpec":
        """``x`` (an array, a tensor or a TensorSpec) as a TensorSpec; ``name``: the argument, for errors."""
        if isinstance(x, TensorSpec):
            return x
        what = f"argument {name!r}" if name else "an argument"
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return TensorSpec(spec_shape(x.shape, what), spec_dtype(x.dtype, what))
        raise InputError(f"{what}: expected an array or tl.TensorSpec, got {type(x).__name__}")


def spec_shape(shape, what: str = "tl.TensorSpec") -> tuple[int, ...]:
    """A TensorSpec's shape as a tuple of ints >= 0, or an InputError saying what was wrong."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise InputError(f"{what}: shape must be a tuple of ints, got {shape!r}")
    dims = tuple(shape)
    bad = [d for d in dims if not isinstance(d, numbers.Integral) or isinstance(d, bool) or d < 0]
    if bad:
        raise InputError(f"{what}: shape {dims!r}: every dimension must be an int >= 0 "
                         f"(got {bad[0]!r} of type {type(bad[0]).__name__})")
    if not dims:        # (the GPU's lowering has no index for it: tbl_s[], and tl.run's copy is 1-d)
        raise InputError(f"{what}: shape () is a 0-d tensor, which a tile program cannot index: pass shape (1,) "
                         "instead (np.reshape(x, 1), t.reshape(1)) and read its element at (0,)")
    big = [i for i, d in enumerate(dims) if d >= 2 ** 31]
    if big:
        raise InputError(f"{what}: shape {dims!r}: dimension {big[0]} is {dims[big[0]]:,}, but kernels index each "
                         "dimension with 32-bit ints (offsets are i32): every dimension must be below 2**31; split "
                         "the tensor (a long 1-d one into rows of a 2-d one)")
    return tuple(int(d) for d in dims)


def spec_dtype(dtype, what: str = "tl.TensorSpec") -> T.DType:
    """A TensorSpec's dtype as a tl dtype (from a tl, numpy or torch dtype or a name), or an
    InputError naming what tldsl takes."""
    if dtype is None:
        raise InputError(f"{what}: dtype is required (tl.float16, tl.bfloat16, tl.float32, tl.int32, tl.bool_, "
                         "or a numpy or torch dtype)")
    try:
        return T.dtype_of(dtype)
    except TypeError as e:
        raise InputError(f"{what}: dtype {dtype!r}: {e}") from None


#: the parameters of tl.simulate, tl.run and FusedProgram besides the kernel's own keywords: a kernel
#: keyword of one of these names would be taken by the call (seed=3 as the scheduler's seed, sms=5 by
#: tl.run only, so the simulator and the GPU would compute different programs)
CALL_PARAMETERS = frozenset({"kernel", "world_size", "inputs", "seed", "options", "timeout_s", "lowering",
                             "progress", "group", "sms", "specs", "static_checks", "device", "sm_split", "chain"})


def _check_parameter_kinds(fn, tensor_params, kw_params) -> None:
    """Refuse, where the kernel is defined, keyword names the calls take themselves, and compile-time
    parameters written before the ``*`` (they would be taken for tensors)."""
    loc = Location(fn.__code__.co_filename, fn.__code__.co_firstlineno)
    taken = sorted(set(kw_params) & CALL_PARAMETERS)
    if taken:
        raise CompilationError(
            f"tl.kernel '{fn.__name__}' has keyword parameter(s) {taken}, which tl.simulate / tl.run / FusedProgram "
            "take as their own (seed=3 would seed the simulator's schedule, not reach the kernel): rename them",
            loc)
    for p in tensor_params:
        if p.annotation in (constexpr, "tl.constexpr", "constexpr", ComputeSchedule, CommSchedule,
                            "tl.ComputeSchedule", "tl.CommSchedule") or p.name in ("compute", "comm"):
            raise CompilationError(
                f"tl.kernel '{fn.__name__}': parameter '{p.name}' is compile-time but comes before the `*`, so it "
                "would be taken for a tensor: write the tensors first, then `*,`, then the compile-time parameters "
                f"(def {fn.__name__}(x, y, *, {p.name}...))", loc)


def specialisation_key(v):
    """A keyword value as the trace cache tells values apart: by type and, for floats, by bits, so
    ``-0.0`` after ``0.0``, ``2.0`` after ``np.float32(2)`` or ``2.0`` after ``2`` trace again (equal
    under ``==``, they are different programs)."""
    if isinstance(v, (float, np.floating)):
        return (type(v), np.asarray(v).tobytes())
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(specialisation_key(x) for x in v))
    if isinstance(v, frozenset):
        return (type(v), frozenset(specialisation_key(x) for x in v))
    return (type(v), v)


class ReadGlobals:
    """The module globals and closure cells a kernel's code reads by name (its nested part functions'
    too), as part of the trace cache's key: a notebook cell that sets ``SCALE = 3.0`` after a run must
    not get the program traced with ``SCALE = 2.0``. Modules are left out (they are not values); plain
    values (numbers, strings, tuples, dtypes, functions, schedules) count by value, anything else (an
    array, a list) by identity."""

    def __init__(self, fn):
        names, code_objects = set(), [fn.__code__]
        while code_objects:
            code = code_objects.pop()
            names.update(code.co_names)
            code_objects.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        self.fn = fn
        self.names = sorted(names)         # (looked up at each call: a global may be defined after the kernel)
        self.cells = [(n, c) for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())]

    def key(self) -> tuple:
        g = self.fn.__globals__
        out = []
        for name, value in [(n, g[n]) for n in self.names if n in g] + [(n, _cell(c)) for n, c in self.cells]:
            if isinstance(value, types.ModuleType):
                continue
            out.append((name, specialisation_key(value) if _by_value(value) else (type(value), id(value))))
        return tuple(out)


#: globals that count by value (equal values, one program); anything else counts by identity
_VALUES = (numbers.Number, str, bytes, type(None), tuple, frozenset, np.generic, np.dtype, T.DType, type,
           types.FunctionType, types.BuiltinFunctionType, functools.partial, ComputeSchedule, CommSchedule)


def _by_value(value) -> bool:
    """Whether a global counts by value: one of :data:`_VALUES`, hashable (a tuple of arrays is not)."""
    if not isinstance(value, _VALUES):
        return False            # (a tensor, a list...: by identity, never compared)
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:                      # a cell not yet bound
        return None


class NotCalledDirectly(InputError, TypeError):
    """A tile program called like a Python function (``kernel(x, y)``): an InputError, and the
    TypeError Python gives a call of what cannot be called so."""


class KernelFunction:
    """A traced tile program. Positional parameters are tensors (annotate ``tl.Symmetric``
    for symmetric ones); keyword-only parameters are compile-time values, and the ones named
    ``compute`` and ``comm`` receive the schedules."""

    def __init__(self, fn, name: str | None = None):
        if name is not None and not (isinstance(name, str) and name.isidentifier()):
            raise CompilationError(f"tl.kernel(name={name!r}): a kernel's name is a Python identifier (it names "
                                   f"the generated CUDA entry points)", user_location())
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = name or fn.__name__
        sig = inspect.signature(fn)
        varying = [("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name for p in sig.parameters.values()
                   if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if varying:
            raise CompilationError(
                f"tl.kernel '{fn.__name__}' takes {' and '.join(varying)}: a kernel's tensors are named positional "
                "parameters (each one an argument the caller passes, its shape and type traced) and its compile-time "
                "values keyword-only ones; write them out", Location(fn.__code__.co_filename, fn.__code__.co_firstlineno))
        self.tensor_params = [p for p in sig.parameters.values()
                              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.kw_params = {p.name: p for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY}
        _check_parameter_kinds(fn, self.tensor_params, self.kw_params)
        self.symmetric = {p.name for p in self.tensor_params if p.annotation is Symmetric
                          or p.annotation == "tl.Symmetric" or p.annotation == "Symmetric"}
        self._cache: dict = {}
        self._globals = ReadGlobals(fn)
        code = fn.__code__
        self.loc = Location(code.co_filename, code.co_firstlineno)

    @property
    def arg_names(self) -> list[str]:
        return [p.name for p in self.tensor_params]

    def default_schedules(self, **kwargs):
        """The ``compute`` and ``comm`` schedules a call gives, or the kernel's defaults; anything
        but a schedule (or None) is an InputError naming the keyword."""
        compute = kwargs.get("compute")
        comm = kwargs.get("comm")
        self._check_schedules(compute, comm)
        if "compute" in self.kw_params and compute is None:
            d = self.kw_params["compute"].default
            compute = ComputeSchedule() if d is inspect.Parameter.empty or d is None else d
        if "comm" in self.kw_params and comm is None:
            d = self.kw_params["comm"].default
            comm = CommSchedule() if d is inspect.Parameter.empty or d is None else d
        return compute, comm

    def trace(self, world_size: int, *specs, **kwargs) -> core.Kernel:
        """Trace (or fetch from cache) the IR for these argument specs and keyword values,
        and verify it, including the static channel analysis."""
        return self.trace_checked(world_size, specs, kwargs, channels=True)

    def trace_checked(self, world_size: int, specs, kwargs: dict, *, channels: bool = True) -> core.Kernel:
        """:meth:`trace` with the static channel analysis optional (the simulator's
        ``static_checks=False`` turns it off to exercise its dynamic detectors)."""
        kwargs = dict(kwargs)
        if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
            raise InputError(f"world size must be a positive int, got {world_size!r}")
        # a plain int: a numpy one (equal, so one cache key) made the IR's world size and every
        # estimate from it numpy, and the cached trace then broke later calls with the int
        world_size = int(world_size)
        if len(specs) != len(self.tensor_params):
            raise InputError(f"kernel '{self.name}' takes {len(self.tensor_params)} tensors "
                             f"({', '.join(self.arg_names)}), got {len(specs)}")
        specs = tuple(TensorSpec.of(s, name) for s, name in zip(specs, self.arg_names))
        unknown = set(kwargs) - set(self.kw_params)
        if unknown:
            raise InputError(f"kernel '{self.name}' has no keyword parameter(s) {sorted(unknown)}")
        for name, p in self.kw_params.items():   # defaults are part of the specialisation
            if name not in kwargs and name not in ("compute", "comm") and p.default is not inspect.Parameter.empty:
                kwargs[name] = p.default
        missing = [n for n, p in self.kw_params.items() if n not in kwargs and n not in ("compute", "comm")
                   and p.default is inspect.Parameter.empty]
        if missing:
            raise InputError(f"kernel '{self.name}' needs keyword value(s) {missing}")
        compute, comm = self.default_schedules(**kwargs)
        if compute is not None:
            kwargs["compute"] = compute
        if comm is not None:
            kwargs["comm"] = comm
        for k, v in kwargs.items():
            try:
                hash(v)
            except TypeError:
                raise InputError(f"keyword '{k}' of kernel '{self.name}' is compile-time and must be "
                                 f"hashable (got {type(v).__name__})") from None
        key = (world_size, specs, tuple(sorted(((k, specialisation_key(v)) for k, v in kwargs.items()),
                                               key=lambda kv: kv[0])),
               channels, self._globals.key())
        if key not in self._cache:
            self._cache[key] = self._trace(world_size, specs, kwargs, compute, comm, channels)
        return self._cache[key]

    def _check_schedules(self, compute, comm) -> None:
        for key, val, want in (("compute", compute, ComputeSchedule), ("comm", comm, CommSchedule)):
            if val is not None and not isinstance(val, want):
                raise InputError(f"kernel '{self.name}': {key}= takes a tl.{want.__name__}, got "
                                 f"{type(val).__name__}" + (" (compute and comm swapped?)"
                                                            if isinstance(val, (ComputeSchedule, CommSchedule)) else ""))

    def _trace(self, world_size, specs, kwargs, compute, comm, channels=True) -> core.Kernel:
        self._check_schedules(compute, comm)
        if compute is not None and comm is not None:
            check_compatible(compute, comm)
        b = Builder(self.name, world_size)
        b.compute_schedule, b.comm_schedule = compute, comm
        refs = []
        for p, s in zip(self.tensor_params, specs):
            space = T.MemSpace.SYMMETRIC if p.name in self.symmetric else T.MemSpace.GLOBAL
            buf = core.Buffer(p.name, T.TensorType(s.shape, s.dtype, space), "arg", loc=self.loc,
                              cname=b.c_name(p.name, b.buffers))
            b.buffers.append(buf)
            refs.append(TensorRef(buf))
        try:
            with tracing(b):
                self.fn(*refs, **kwargs)
        except ValueError as e:
            if "values to unpack" not in str(e):
                raise
            raise self._rank_mismatch(e, specs) from None
        if not any(p.role == "compute" for p in b.parts) and not b.parts:
            raise CompilationError(f"kernel '{self.name}' defines no parts: decorate its tile "
                                   "functions with @tl.compute_part / @tl.comm_part", self.loc)
        kernel = core.Kernel(self.name, world_size, b.buffers, b.signals, b.parts, compute, comm,
                             b.mappings, {k: v for k, v in kwargs.items() if k not in ("compute", "comm")},
                             self.loc)
        verify(kernel, channels=channels)
        return kernel

    def _rank_mismatch(self, e: ValueError, specs) -> InputError:
        """A shape unpacked in the tile program (``Ms, K = a.shape``) with another number of
        dimensions: an InputError at that line, listing the shapes given — not a bare ValueError."""
        import traceback
        frame = traceback.extract_tb(e.__traceback__)[-1]
        shapes = ", ".join(f"{n} {list(s.shape)}" for n, s in zip(self.arg_names, specs))
        return InputError(f"kernel '{self.name}' at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()}): "
                          f"{e} — an argument has another number of dimensions than the kernel unpacks; "
                          f"got {shapes}")

    def __call__(self, *args, **kwargs):
        raise NotCalledDirectly(f"'{self.name}' is a tile program, not a Python function: run it with "
                                f"tl.simulate({self.name}, world_size, inputs) or tl.run(...), or inspect it with "
                                ".trace(world_size, *specs)", user_location())

    def __repr__(self):
        return one_line(f"<tl.kernel {self.name}({', '.join(self.arg_names)})>")

    def _repr_html_(self) -> str:
        keywords = ", ".join(n if p.default is inspect.Parameter.empty else f"{n}={p.default!r}"
                             for n, p in self.kw_params.items())
        facts = [("tensors", ", ".join(f"{n} (symmetric)" if n in self.symmetric else n for n in self.arg_names)),
                 ("compile-time keywords", keywords or "none"), ("defined at", self.loc.short()),
                 ("traced specialisations", len(self._cache))]
        doc = inspect.getdoc(self.fn)
        return html_card(f"tile program @tl.kernel {self.name}", facts,
                         [("docstring", doc)] if doc else [], open_first=True)


def kernel(fn=None, *, name: str | None = None):
    """Decorator turning a Python function into a traced tile program."""
    if fn is None:
        return lambda f: kernel(f, name=name)
    if isinstance(fn, KernelFunction):
        raise CompilationError(f"tl.kernel: '{fn.name}' is a tl.kernel already; decorate its function once",
                               user_location())
    if not inspect.isfunction(fn):
        raise CompilationError(f"tl.kernel decorates a Python function (def ...), got {type(fn).__name__} {fn!r}",
                               user_location())
    return KernelFunction(fn, name)


def _grid(grid) -> tuple[int, ...]:
    if isinstance(grid, numbers.Integral):
        grid = (grid,)
    if isinstance(grid, (str, bytes)) or not hasattr(grid, "__iter__"):
        fail(f"a part's grid must be a tuple of Python ints (static), got {grid!r}")
    grid = tuple(grid)
    if not grid:
        fail("a part's grid is empty: give it one Python int per axis, e.g. grid=(1,) for a single task")
    if not all(isinstance(g, numbers.Integral) and not isinstance(g, bool) for g in grid):
        fail(f"a part's grid must be Python ints (static), got {grid}")
    if any(g <= 0 for g in grid):
        fail(f"a part's grid must be positive, got {grid} (is a tensor dimension zero?)")
    tasks = functools.reduce(lambda n, g: n * int(g), grid, 1)
    if tasks >= 2 ** 30:    # (a GPU's task loop steps past the last task in an int: 2**31 - 1 would wrap)
        fail(f"a part's grid {tuple(int(g) for g in grid)} has {tasks:,} tasks, but program ids and task counters "
             "are 32-bit ints: a part has fewer than 2**30 tasks; use bigger tiles, or loop over several tiles in "
             "a task (tl.range)")
    return tuple(int(g) for g in grid)


def _part(fn, grid, role, name, engine, lanes, align_shift):
    b = current()
    if b.blocks:
        fail("parts cannot be nested: define every part in the kernel body")
    grid = _grid(grid)
    _check_arity(fn, len(grid))
    loc = user_location()
    body = core.Block()
    part = core.Part(b.unique(name or fn.__name__, b.parts), role, grid, engine, body, loc, lanes)
    part.align_shift = align_shift
    b.parts.append(part)
    b.part_role, b.part_engine = role, engine
    with b.region(body):
        pids = [Scalar(b.emit("program_id", [], [T.i32], {"axis": a}, hints=[f"pid{a}"]).result)
                for a in range(len(grid))]
        returned = fn(*pids)
        b.raise_left_early()
    if returned is not None:
        fail(f"part '{part.name}' returned a {type(returned).__name__}: a part's results are what it stores "
             f"(tl.store / tl.tile_push_data); a returned value would be dropped")
    b.part_role = b.part_engine = None
    return part


def _check_arity(fn, axes: int) -> None:
    """A part is called with one program id per grid axis: refuse one that takes another number of
    arguments at its line, rather than as Python's TypeError from inside the tracer."""
    try:
        inspect.signature(fn).bind(*range(axes))
    except TypeError:
        fail(f"part '{getattr(fn, '__name__', fn)}' must take {axes} argument(s), one program id per axis of its "
             f"{axes}-d grid: def {getattr(fn, '__name__', 'part')}({', '.join(f'p{a}' for a in range(axes))})")
    except ValueError:
        pass                        # no signature to read (a builtin): let the call say


def _grid_given(grid, what: str) -> None:
    """``@tl.compute_part`` without its ``(grid=...)`` would take the function for the grid and
    silently drop the part: refuse it at the decorator's line."""
    if callable(grid):
        fail(f"@tl.{what} needs its grid: write @tl.{what}(grid=(...)) above def {getattr(grid, '__name__', '')}")


def compute_part(grid, *, name: str | None = None, align_shift: int = 0):
    """Decorate the compute tile function; it is called once per grid point, with the
    program ids as arguments, in the order the compute schedule chooses. ``align_shift``
    tells the ``comm_aligned`` order which rank's rows to start on (rank + shift)."""
    _grid_given(grid, "compute_part")
    _part_options("compute_part", name, None, align_shift)

    def deco(fn):
        return _part(fn, grid, "compute", name, "sm", None, align_shift)
    return deco


def comm_part(grid, *, name: str | None = None, engine: str | None = None, lanes: int | None = None,
              fused: bool = False):
    """Decorate a communication tile function. ``engine``/``lanes`` default to the kernel's
    communication schedule (``engine``, ``sms``). Axis 0 of the grid is the peer step,
    which the schedule's ring / full-mesh order walks. ``fused``: the kernel's compute part
    does this part's work as it loads its tiles (a schedule's choice, e.g. ``own_rows='compute'``):
    the simulator runs the part as written, every task at once; codegen lowers it inside the
    compute part's kernel (``engine='compute'``)."""
    _grid_given(grid, "comm_part")
    _part_options("comm_part", name, lanes, 0)

    def deco(fn):
        sched = current().comm_schedule
        if fused:
            if engine not in (None, "compute"):
                fail(f"a fused comm part runs in the compute part's kernel: engine must be 'compute', got {engine!r}")
            part = _part(fn, grid, "comm", name, "compute", lanes or _tasks(grid), 0)
            part.fused = True
            return part
        eng = engine or (sched.engine if sched else "sm")
        if eng not in ("sm", "copy_engine"):
            fail(f"comm part engine must be 'sm' or 'copy_engine' (or fused=True: run by the compute part), "
                 f"got {eng!r}")
        ln = lanes or (sched.lanes if sched else (1 if eng == "copy_engine" else 2))
        return _part(fn, grid, "comm", name, eng, ln, 0)
    return deco


def _part_options(what: str, name, lanes, align_shift) -> None:
    """A part's name is an identifier, its lanes a positive int (the GPU runs that many CTAs: a
    negative count once deadlocked the simulator while the GPU ran one), align_shift an int."""
    if name is not None and not (isinstance(name, str) and name.isidentifier()):
        fail(f"@tl.{what}(name={name!r}): a part's name is a Python identifier")
    if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, numbers.Integral) or lanes < 1):
        fail(f"@tl.{what}(lanes={lanes!r}): lanes is a positive int (how many CTAs run the part), or None for "
             f"the communication schedule's")
    if isinstance(align_shift, bool) or not isinstance(align_shift, numbers.Integral):
        fail(f"@tl.{what}(align_shift={align_shift!r}): an int (which rank's rows the comm_aligned order starts on)")


def _tasks(grid) -> int:
    n = 1
    for g in _grid(grid):
        n *= g
    return n
