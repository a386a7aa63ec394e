"""``tl.simulate``: check inputs, build W ranks' memory, run the launches, return results."""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
import warnings
from dataclasses import dataclass, field

import numpy as np

from ... import env
from ...errors import InputError
from ...ir import core
from ...ir.display import clipped, html_card, one_line
from ...ir.opdefs import written_arguments
from ...ir.types import bfloat16, dtype_of, float32
from .blas_threads import one_blas_thread
from ...ir.part_graph import parts_waiting_through_others
from .engine import Engine
from .memory import Memory, host_array, poison_value, to_storage
from .options import SimOptions
from .progress import LongSimulationWarning, ProgressReporter, long_run_message, print_progress
from .step_estimate import estimate_steps

#: loop turns that take about as long as one scheduler step (a turn of tile math in a loop with no
#: primitive runs without the scheduler): SimOptions.warn_steps times this many turns warn too
TURNS_PER_STEP = 25
from .timeline import format_timeline


class EventLog(list):
    """The scheduler's event log: tuples ``(step, launch, rank, part, role, coords, what,
    detail)``, a list as any other, shown in one line (a W-rank run logs thousands)."""

    def __repr__(self) -> str:
        launches = sorted({e[1] for e in self})
        which = f"launch {launches[0]}" if len(launches) == 1 else f"{len(launches)} launches"
        return (f"<EventLog of {len(self)} events of {which}: (step, launch, rank, part, role, coords, what, "
                f"detail); result.timeline() draws them>")


@dataclass
class SimResult:
    """What a simulation produced: every rank's argument buffers after the last launch,
    the event log, and counters."""
    kernel: core.Kernel
    outputs: list[dict[str, np.ndarray]]
    workspaces: list[dict[str, np.ndarray]]
    events: list[tuple] = field(repr=False)
    steps: int = 0
    launches: int = 1
    seed: int = 0
    expected_steps: int = 0      # estimated before the run (SimOptions.warn_steps)

    def __getitem__(self, rank: int) -> dict[str, np.ndarray]:
        """Rank ``rank``'s outputs by name (``result[0]["c"]``)."""
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool):
            raise InputError(f"a result is indexed by rank first: result[rank][{rank!r}], not result[{rank!r}]")
        if not -len(self.outputs) <= rank < len(self.outputs):
            raise InputError(f"rank {rank}: this result has ranks 0..{len(self.outputs) - 1}")
        return self.outputs[rank]

    def __len__(self) -> int:
        """The number of ranks (``for outs in result`` walks their outputs)."""
        return len(self.outputs)

    def __iter__(self):
        return iter(self.outputs)

    def __contains__(self, name) -> bool:
        raise InputError(f"a result is indexed by rank first: {name!r} in result[rank], not {name!r} in result")

    def timeline(self, width: int = 64) -> str:
        """A per-rank text timeline of communication and compute tasks (last launch)."""
        return format_timeline(self, width)

    def plot_timeline(self, tile=None, save=None, figsize=None):
        """The timeline as a matplotlib figure (``pip install 'tldsl[plot]'``): one lane per rank
        and engine, tasks coloured by part, notify → wait arrows for ``tile`` (``(rank, part,
        coords)``; default: the tile blocked longest). ``save=path`` also writes it to a file."""
        from .plot import plot_timeline
        return plot_timeline(self, tile=tile, save=save, figsize=figsize)

    def __repr__(self) -> str:
        """One line: the arrays, the event log and the IR are behind ``[r]``, ``.events``, ``.kernel``."""
        k = self.kernel
        return one_line(f"<SimResult {k.name}: {k.world_size} ranks, {self.launches} launch(es), "
                        f"{self.steps} steps, seed {self.seed}; outputs {', '.join(self.outputs[0]) if self.outputs else '-'}>")

    def _repr_html_(self) -> str:
        """A notebook's view: the run, each output of rank 0 (every rank's have the same shapes),
        and the text timeline and IR folded away."""
        k = self.kernel
        facts = [("ranks", k.world_size), ("launches", self.launches), ("scheduler steps", self.steps),
                 ("seed", self.seed)]
        for name, arr in (self.outputs[0].items() if self.outputs else ()):
            facts.append((f"output {name}", f"{arr.shape} {arr.dtype}; NaN on any rank: "
                          f"{any(_has_nan(out[name]) for out in self.outputs)}"))
        return html_card(f"SimResult of {k.name}", facts,
                         [("timeline (plot_timeline() draws it)", clipped(self.timeline(), where="result.timeline()")),
                          ("IR", clipped(str(k), where="print(result.kernel)"))])


def _has_nan(arr) -> bool:
    return arr.dtype.kind == "f" and bool(np.isnan(arr).any())


def _per_rank_inputs(kernel_args: list[str], inputs, world_size: int):
    if inputs is None:
        raise InputError("simulate needs inputs: one dict (or sequence, in argument order) per rank")
    if isinstance(inputs, dict):
        raise InputError("inputs must be a list with one entry per rank, not a single dict")
    if isinstance(inputs, (str, bytes, np.ndarray)) or not isinstance(inputs, Iterable):
        raise InputError(f"inputs must be a list with one entry per rank (a dict of arrays, or the arrays in "
                         f"argument order), got {type(inputs).__name__}")
    inputs = list(inputs)
    if len(inputs) != world_size:
        raise InputError(f"got inputs for {len(inputs)} ranks but world_size is {world_size}")
    per_rank = []
    for r, inp in enumerate(inputs):
        if isinstance(inp, dict):
            missing = [a for a in kernel_args if a not in inp]
            extra = [a for a in inp if a not in kernel_args]
            if missing or extra:           # both at once: a misspelt name is one of each
                said = [f"missing argument(s) {missing}"] * bool(missing) + [f"unknown argument(s) {extra}"] * bool(extra)
                raise InputError(f"rank {r}: {' and '.join(said)} (the kernel takes {kernel_args})")
            per_rank.append([inp[a] for a in kernel_args])
        elif isinstance(inp, (list, tuple)):
            inp = list(inp)
            if len(inp) != len(kernel_args):
                raise InputError(f"rank {r}: {len(inp)} arrays for arguments {kernel_args}")
            per_rank.append(inp)
        else:
            raise InputError(f"inputs[{r}] must be a dict from argument name to array (or a list of the arrays "
                             f"in argument order {kernel_args}), got {type(inp).__name__}")
    return per_rank


def sim_options(options) -> SimOptions:
    """``options`` as a :class:`SimOptions`: None (the defaults), a SimOptions, or a dict of its
    fields (``{"launches": 1}``); anything else is an InputError naming what is accepted."""
    if options is None:
        return SimOptions()
    if isinstance(options, SimOptions):
        return options
    if isinstance(options, Mapping):
        fields = [f.name for f in dataclasses.fields(SimOptions)]
        unknown = sorted(str(k) for k in options if k not in fields)
        if unknown:
            raise InputError(f"options: unknown simulator option(s) {unknown}; SimOptions has {fields}")
        try:
            return SimOptions(**options)
        except ValueError as e:
            raise InputError(f"options: {e}") from None
    raise InputError(f"options must be a tl.SimOptions(...) or a dict of its fields, got {type(options).__name__}")


def _check_traced_for(ir, per_rank) -> None:
    """Every rank's arrays have the shapes and dtypes ``ir`` was traced for (a float32 array may
    stand for bf16, which numpy cannot hold): else an InputError naming the argument — a value of
    another dtype would otherwise be converted silently (an int array's 70000 into f16's inf)."""
    from ...kernel import TensorSpec
    for r, arrays in enumerate(per_rank):
        on = f" on rank {r}" if r else ""
        for b, arr in zip(ir.args, arrays):
            spec = TensorSpec.of(arr, b.name)
            if spec.shape != b.type.shape:
                raise InputError(f"argument '{b.name}': shape {np.shape(arr)}{on}, the kernel was traced for "
                                 f"{b.type.shape}")
            want = b.type.dtype
            if spec.dtype != want and not (want == bfloat16 and spec.dtype == float32):
                also = " (or float32 holding bf16 values)" if want == bfloat16 else ""
                raise InputError(f"argument '{b.name}': dtype {spec.dtype.name}{on}, the kernel was traced for "
                                 f"{want.name}{also}")


def checked_call(kernel, world_size, inputs, seed, options, kwargs: dict, who: str, seed_means: str,
                 channels: bool = True):
    """The checks of a call that runs a program (``tl.simulate``, ``tl.run``) and its trace, the
    same errors for both: returns (the traced kernel, every rank's arrays in argument order, the
    options). ``channels=False`` leaves the static channel analysis to the caller."""
    from ...kernel import KernelFunction
    options = sim_options(options)
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise InputError(f"seed must be an int >= 0 ({seed_means}), got {seed!r}")
    if isinstance(kernel, KernelFunction):
        if world_size is None:
            raise InputError(f"{who} needs world_size")
        if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
            raise InputError(f"world size must be a positive int, got {world_size!r}")
        world_size = int(world_size)        # a numpy int made the estimates numpy too
        per_rank = _per_rank_inputs(kernel.arg_names, inputs, world_size)
        _check_uniform(kernel.arg_names, per_rank, kernel.symmetric)
        return kernel.trace_checked(world_size, per_rank[0], kwargs, channels=channels and options.static_checks), \
            per_rank, options
    if not isinstance(kernel, core.Kernel):
        raise InputError(f"{who} needs a @tl.kernel function or a traced kernel, got {type(kernel).__name__}")
    if kwargs:
        raise InputError(f"keyword values {sorted(kwargs)} need a @tl.kernel function, not a traced kernel")
    ir = kernel
    if world_size is not None and world_size != ir.world_size:
        raise InputError(f"kernel was traced for {ir.world_size} ranks, {who} got world_size={world_size}")
    names = [b.name for b in ir.args]
    per_rank = _per_rank_inputs(names, inputs, ir.world_size)
    _check_uniform(names, per_rank, {b.name for b in ir.args if b.symmetric})
    _check_traced_for(ir, per_rank)
    if options.static_checks:
        from ...ir.verifier import verify
        verify(ir, channels=False)
        if channels:
            from ...ir.analysis import check_channels
            check_channels(ir)
    return ir, per_rank, options


def simulate(kernel, world_size: int | None = None, inputs=None, seed: int = 0,
             options: SimOptions | None = None, **kwargs) -> SimResult:
    """Run ``kernel`` on ``world_size`` simulated ranks.

    ``kernel`` is a ``@tl.kernel`` function (traced here for the inputs' shapes/dtypes and the
    keyword values in ``kwargs``, e.g. schedules) or an already traced IR kernel.
    ``inputs`` has one entry per rank: a dict name -> array, or arrays in argument order; an
    array is a numpy array (of any strides; a Python list is refused: np.asarray it) or a torch
    tensor on any device (numpy has no bf16: a bf16
    kernel takes torch bf16 tensors, or float32 arrays once traced for bf16). Arrays are
    copied; outputs come back in the result as numpy arrays (bf16 as float32). Raises the
    simulator's typed errors (RaceError, DeadlockError, StaleSignalError, UninitializedReadError,
    OutOfBoundsError).
    """
    from ...kernel import KernelFunction
    # traced without the static channel analysis first: at large W the analysis takes a while,
    # and the warning about the run's length should come before it
    ir, per_rank, options = checked_call(kernel, world_size, inputs, seed, options, kwargs, "simulate",
                                         "it seeds the scheduler's interleaving", channels=False)
    world_size = ir.world_size

    memory = _memory(ir, per_rank, options)
    estimate = estimate_steps(ir, memory, options.launches, options.max_steps + 1)
    looping = parts_waiting_through_others(ir) if options.compute_slots is None else []
    runs = 2 if looping else 1          # (such a kernel is also run with those parts on one slot: below)
    long_turns = options.warn_steps is not None and estimate.loop_iterations * runs > TURNS_PER_STEP * options.warn_steps
    long_run = options.warn_steps is not None and estimate.steps * runs > options.warn_steps
    if long_run or long_turns:
        warnings.warn(long_run_message(world_size, estimate.steps * runs, estimate.tasks, options.launches,
                                       options.max_steps, options.static_checks,
                                       loop_turns=estimate.loop_iterations * runs if long_turns else 0),
                      LongSimulationWarning, stacklevel=2)
    if options.static_checks:
        if isinstance(kernel, KernelFunction):
            ir = kernel.trace_checked(world_size, per_rank[0], kwargs, channels=True)   # cached once checked
        else:
            from ...ir.analysis import check_channels
            check_channels(ir)
    if options.compute_slots is None:
        _warn_of_parts_waiting_on_later_tasks(ir)
    reporter = _reporter(options, estimate.steps * runs, long_run, options.launches * runs)
    if looping:
        # first with those parts on one slot, their tiles in order, as a GPU giving them fewer CTAs
        # than tiles runs them: a tile waiting for a later one is a deadlock here, not a hang there.
        # Then every tile resident, whose interleavings the race detector needs (on one slot a
        # part's tiles always notify in order), and whose results are returned
        quiet = dataclasses.replace(options, record_timeline=False)
        one_slot = Engine(ir, _memory(ir, per_rank, options), quiet, np.random.default_rng(seed), one_slot=looping)
        if reporter is not None:
            one_slot.report_progress(reporter)
        _run_launches(one_slot, options.launches)
        if reporter is not None:
            reporter.next_run(one_slot.steps, options.launches)
    engine = Engine(ir, memory, options, np.random.default_rng(seed))
    if reporter is not None:
        engine.report_progress(reporter)
    _run_launches(engine, options.launches)
    if reporter is not None:
        reporter.finish(engine.steps)
    outputs = [{b.name: memory.ranks[r][b.name].data.copy() for b in ir.args} for r in range(world_size)]
    workspaces = [{b.name: memory.ranks[r][b.name].data.copy() for b in ir.workspaces} for r in range(world_size)]
    return SimResult(ir, outputs, workspaces, EventLog(engine.events), engine.steps, options.launches, seed,
                     estimate.steps)


#: the SMs of an H100 or H200: the most CTAs a launch keeps resident at once (tl.run's plan: one an SM)
HOPPER_SMS = 132


def _warn_of_parts_waiting_on_later_tasks(ir) -> None:
    """A ``ResidencyWarning`` for each compute part this run holds with every task at once although
    a task waits for a later one of its own (not every such wait is met by tasks before it in the
    walk: :func:`.engine.walks_forward`) and it has more tasks than a Hopper GPU
    has SMs: ``tl.run`` would refuse it there."""
    from ...errors import ResidencyWarning
    from ...ir.part_graph import self_signals
    from .engine import walks_forward
    for part in ir.parts:
        if part.role != "compute" or part.num_tasks <= HOPPER_SMS or not self_signals(part):
            continue
        if not walks_forward(ir, part):
            warnings.warn(
                f"part '{part.name}' waits for its own tasks (signal(s) {', '.join(self_signals(part))}), some for "
                f"one after it in the order a GPU's CTAs take them (or where that is not known here): simulated with "
                f"all {part.num_tasks} tasks at once, it runs on a GPU only with as many CTAs resident, and tl.run "
                f"refuses it on one of {HOPPER_SMS} SMs (an H100's, an H200's). SimOptions(compute_slots={HOPPER_SMS}) "
                "simulates it as such a GPU runs it; waits on earlier tasks only run on any number",
                ResidencyWarning, stacklevel=3)


def _run_launches(engine: Engine, launches: int) -> None:
    """``launches`` launches of ``engine``'s kernel, one after another, each on the caller's
    arguments (:func:`restore_arguments`); the event log keeps the last."""
    restore = restore_arguments(engine.kernel, engine.memory)
    with one_blas_thread():
        for launch in range(launches):
            if launch:
                restore()
            engine.events.clear()
            engine.run_launch()


def restore_arguments(ir, memory: Memory):
    """A function putting back the caller's values of the arguments ``ir`` writes, as they are in
    ``memory`` now: between launches, so that every launch runs on the caller's arguments and an
    in-place kernel (``y += x``) returns one application of itself, not one per launch. Signals
    and workspaces carry over from launch to launch (stale signals, workspaces the program must
    not trust)."""
    args = written_arguments(ir)
    saved = [(m[b.name], m[b.name].data.copy()) for m in memory.ranks for b in args]

    def restore():
        for buf, original in saved:
            buf.write((), original)
    return restore


def _memory(ir, per_rank, options) -> Memory:
    """Every rank's arguments (copied) and workspaces (poisoned)."""
    memory = Memory(len(per_rank), options.check_races, options.check_uninitialized)
    for r, arrays in enumerate(per_rank):
        for b, arr in zip(ir.args, arrays):
            data = to_storage(host_array(arr), b.type.dtype).copy()
            memory.add(r, b.name, b.type.dtype, data, True, b.symmetric)
        for b in ir.workspaces:
            data = np.full(b.type.shape, poison_value(b.type.dtype), b.type.dtype.np)
            memory.add(r, b.name, b.type.dtype, data, False, b.symmetric)
    return memory


def _reporter(options: SimOptions, expected_steps: int, long_run: bool, launches: int):
    """Who hears of progress: the caller's function, stderr, or nobody (see SimOptions.progress;
    ``TLDSL_QUIET`` silences the lines a long run would print unasked)."""
    show = options.progress
    if show is None:        # (bool(): an estimate from numpy ints is a numpy bool, never ``is False``)
        show = bool(long_run) and env.get("TLDSL_QUIET", "0") == "0"
    if not callable(show) and not show:
        return None
    callback = print_progress if show is True else show
    return ProgressReporter(callback, options.progress_interval_s, expected_steps, launches)


def _check_uniform(names, per_rank, symmetric):
    """One compiled kernel serves every rank: each rank's argument is an array of a supported
    dtype (:func:`_check_array`), and shapes and dtypes agree across ranks."""
    for i, name in enumerate(names):
        for r, arrs in enumerate(per_rank):
            _check_array(name, r, arrs[i])
        ref = per_rank[0][i]
        for r, arrs in enumerate(per_rank[1:], 1):
            a = arrs[i]
            if tuple(a.shape) != tuple(ref.shape):
                kind = "symmetric buffer" if name in symmetric else "argument"
                raise InputError(f"non-uniform {kind} '{name}': shape {tuple(ref.shape)} on rank 0 but "
                                 f"{tuple(a.shape)} on rank {r}"
                                 + (" (symmetric buffers must have the same shape on every rank)"
                                    if name in symmetric else " (one kernel is compiled for every rank)"))
            if dtype_of(a.dtype) != dtype_of(ref.dtype):
                raise InputError(f"argument '{name}': dtype {ref.dtype} on rank 0 but {a.dtype} on rank {r}")


def _check_array(name: str, r: int, a) -> None:
    """Rank ``r``'s argument ``name`` is values to run on: an array or a dense torch tensor (not a
    TensorSpec, a list, a meta or sparse tensor) of a dtype tldsl supports."""
    from ...kernel import TensorSpec
    if isinstance(a, TensorSpec):
        raise InputError(f"argument '{name}' on rank {r} is a tl.TensorSpec: it has a shape and a dtype but no values "
                         "to run on (a TensorSpec traces a kernel, kernel.trace(world_size, spec, ...); pass an array "
                         "or a tensor here)")
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise InputError(f"argument '{name}' on rank {r} is a {type(a).__name__}, not an array (pass np.asarray(...) "
                         "of it)")
    try:
        dtype_of(a.dtype)
    except TypeError as e:
        on = f" on rank {r}" if r else ""
        raise InputError(f"argument '{name}'{on}: {e}") from None
    if getattr(getattr(a, "device", None), "type", None) == "meta":
        raise InputError(f"argument '{name}' on rank {r} is a tensor on torch's meta device: it has a shape "
                         "and a dtype but no values to run on (trace it with its TensorSpec instead)")
    layout = getattr(a, "layout", None)
    if layout is not None and str(layout) != "torch.strided":
        raise InputError(f"argument '{name}' on rank {r} is a torch tensor of layout {layout}: tldsl runs on dense "
                         "(strided) tensors; pass .to_dense() of it")
