"""What one launch of a traced program runs on one GPU, decided before anything is launched.

Every rank's parts run at once on the one GPU (``tl.run`` with W ranks): each lowered kernel of
each rank on a stream of its own, each copy-engine part of each rank on its own stream (driver
copies and stream memory operations, :class:`~tldsl.runtime.gpu.plan_exec.PlanExecutor`). A
kernel may wait for another rank's kernel, so all of them must be resident together, or a
waiting kernel holding the SMs would starve the one it waits for. The plan makes sure they fit:

* every kernel must fit one CTA on an empty SM (its occupancy, asked of the driver);
* the CTAs of all kernels of a launch add up to at most the GPU's SMs — each CTA counted as a
  whole SM, so the block scheduler always finds an empty SM for a CTA still waiting to start —
  less :data:`RESERVED_FOR_COPIES` SMs where copy-engine parts run (the driver runs a copy
  within one GPU as an SM kernel, which must find an SM beside the persistent kernels);
* communication kernels keep their lanes; the persistent compute kernels share the SMs left,
  each never more CTAs than it has tiles. They share them by work (``split="work"``, the
  default): in proportion to each part's estimated cost (:mod:`.work`), so that a light kernel
  waiting on another's tiles (an MoE combine behind its grouped GEMM) does not take half the GPU
  from the kernel it waits for — but never below an eighth of an even share
  (:data:`~.sm_split.LIGHT_FLOOR`), nor below what a part waiting on its own tasks needs
  resident (:mod:`.sm_split`).
  ``split="even"`` splits them evenly, as every launch did before (kept for measurements);
* a compute part that waits only on another compute part of its rank, which never waits on it
  (an MoE combine behind its grouped GEMM: :func:`~.chains.chained_parts`), runs **after** it on its
  stream with the SMs it leaves (``chain="after"``, the default), not beside it: it could only
  start a token tile once every GEMM tile holding its tokens is done — with a dynamic mapping,
  the GEMM's last wave — and beside it held SMs the GEMM needed. Measured on one H200 with the
  MoE ops' defaults (BENCHMARKS.md, twenty-second session): every MoE+ReduceScatter row faster
  after than beside (Mixtral 8192 tokens 3.59 against 4.40 ms, Qwen3-30B 1.05 against 1.43).
  There the stream's order keeps every wait of the chained part, so the signals between the two
  are dropped before lowering (:func:`stream_ordered`): no notifies in the producer, no flag reads
  in the part.
  ``chain="beside"`` keeps the shared layout; ``chain="folded"`` runs the pair as one kernel
  where the grouped GEMM's recipe can host the other (:mod:`.fold`: the combine behind its GEMM,
  AllGather+MoE's staged row gather ahead of its GEMM; no launch of its own; measured slower or
  within noise at the ops' level);
* where copy-engine parts run, streams never outnumber the hardware queues: a stream wait
  (``cuStreamWaitValue64``) at the head of a queue two streams share blocks the other stream's
  work behind it, which it may be waiting for. Kernels alone may share queues: a launch
  enqueues every stream's kernel before any stream's closing event (breadth first), so nothing
  that blocks stands between two kernels in a queue.

* kernels whose tiles overflow shared memory take a global-memory scratch for every CTA: where
  all of it would not fit the memory the launch may take, those kernels get fewer CTAs
  (:mod:`.scratch_fit`; their CTAs walk the tasks in a loop, so the result is the same).

Anything that does not fit is a :class:`~.run_errors.ResidencyError` naming what to shrink.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ...ir import core
from ...ir.opdefs import WAIT_OPS
from ...ir.display import clipped, html_card, one_line
from .bind import bind, is_kernel
from ...ir.drop_signals import without_signals
from .chains import self_signals, at_once_needed, chained_parts, stream_ordered_signals
from .fold import fold_chained, is_folded
from .plan_exec import local_copies_left
from .scratch_fit import fit_scratch
from ...errors import InputError
from .run_errors import ResidencyError, UnboundParameterError
from .sm_split import check_split, share
from .work import part_work

#: SMs left free of persistent kernels where copy-engine parts run (their same-GPU copies)
RESERVED_FOR_COPIES = 4
#: CUDA's hardware work queues per process unless CUDA_DEVICE_MAX_CONNECTIONS says otherwise
DEFAULT_CONNECTIONS = 8
_UNBOUNDED = 1 << 30


def hardware_queues() -> int:
    """The hardware work queues this process gets (``CUDA_DEVICE_MAX_CONNECTIONS``, default 8)."""
    try:
        return max(1, int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", DEFAULT_CONNECTIONS)))
    except ValueError:
        return DEFAULT_CONNECTIONS


#: the most hardware queues CUDA gives a process (CUDA_DEVICE_MAX_CONNECTIONS's ceiling)
MAX_CONNECTIONS = 32


def reserve_hardware_queues(kernel: core.Kernel, lowered: dict, cuda_started: Callable[[], bool]) -> None:
    """Ask CUDA for a hardware queue per stream of ``kernel``'s launch where it has copy-engine
    parts (:func:`plan_run` refuses fewer: a copy engine's stream wait would block the streams
    sharing its queue): sets ``CUDA_DEVICE_MAX_CONNECTIONS`` where the caller has not and CUDA
    has not started in this process (``cuda_started()``; it is read once, when CUDA makes its
    context), up to :data:`MAX_CONNECTIONS`. A launch that needs more, or a process whose CUDA
    started first, meets plan_run's error, which says what to set."""
    parts = [lowered[p.name] for p in kernel.parts if not p.fused and not is_folded(lowered[p.name])]
    need = kernel.world_size * len(parts)
    if all(is_kernel(lk) for lk in parts) or need <= hardware_queues():
        return
    if "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ or cuda_started():
        return
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(MAX_CONNECTIONS)


def _schedule_fuses(sched) -> bool:
    """Whether a communication schedule asks for parts fused into the compute part."""
    return getattr(sched, "own_rows", None) == "compute" or getattr(sched, "engine", None) == "compute"


def lower_for_run(kernel: core.Kernel, *, wait_timeout_ns: int | None = None, transports=("ptr",),
                  chain: str = "after", **options) -> dict:
    """Every part of ``kernel`` lowered for ``tl.run`` (``lower_all``): waits that trap after
    ``wait_timeout_ns`` where the recipe takes the option; with ``chain="folded"`` each chained
    pair folded into one kernel where the recipe can (:mod:`.fold`). Refused before lowering: schedules
    whose parts only the fused ops' own launchers can bind (parts fused into the GEMM) and
    transports other than ``transports`` (one GPU: peer-pointer tables only; across GPUs the
    fused-op runtime also allocates from NVSHMEM's heap)."""
    from ...codegen import lower_all
    fused = [p.name for p in kernel.parts if p.fused]
    sched = kernel.comm_schedule
    if fused and (sched is None or not _schedule_fuses(sched)):
        raise UnboundParameterError(
            f"part(s) {fused} of '{kernel.name}' are declared @tl.comm_part(..., fused=True): a part run inside the "
            "compute part's kernel takes arguments only a fused op's own launcher chooses, so tl.run cannot run it. "
            "Drop fused=True (tl.run runs each part as its own kernel, ordered by its notifies and waits)")
    if fused:
        raise UnboundParameterError(
            f"the communication schedule fuses parts {fused} into the compute part of '{kernel.name}' "
            f"(own_rows='compute' or engine='compute'); its kernel takes arguments only the fused op's own launcher "
            f"chooses. tl.run runs each part as its own kernel: use a schedule with own_rows='comm'")
    if sched is not None and getattr(sched, "transport", "ptr") not in transports:
        raise UnboundParameterError(f"transport={sched.transport!r}: tl.run runs every rank on one GPU with tables of "
                                    "peer pointers; use the schedule's default transport='ptr'")
    if "entry" in options:
        raise UnboundParameterError("lowering option 'entry' would give every part the same kernel name; tl.run names "
                                    "each part's kernel itself")
    if "side" in options:
        raise UnboundParameterError("lowering option 'side' would run a part inside another part's kernel as well as in "
                                    "its own; tl.run folds parts itself: pass chain='folded'")
    check_chain(chain)
    if wait_timeout_ns is not None:
        options["wait_timeout_ns"] = int(wait_timeout_ns)
    if chain == "after":
        return lower_all(stream_ordered(kernel), **options)
    lowered = lower_all(kernel, **options)
    if chain != "folded":
        return lowered
    return fold_chained(kernel, lowered, options, {n for n, lk in lowered.items() if is_kernel(lk)})


def stream_ordered(kernel: core.Kernel) -> core.Kernel:
    """``kernel`` as lowered for ``chain="after"``: without the signals its chained parts wait on
    (:func:`~.chains.stream_ordered_signals`). Each such part runs after its producer on one
    stream, so its waits would find every count reached; the producer's notifies and the part's
    flag reads are dropped rather than paid for (measured: BENCHMARKS.md, twenty-ninth session)."""
    compute = {p.name for p in kernel.parts if p.role == "compute" and not p.fused}
    return without_signals(kernel, stream_ordered_signals(kernel, chained_parts(kernel, compute)))


@dataclass(frozen=True)
class PlannedKernel:
    """One rank's lowered kernel of one part: its launch shape and stream. ``after``: the part
    whose kernel it follows on that stream (a chained part, :func:`~.chains.chained_parts`), else None."""
    rank: int
    part: str
    lowered: object
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    cluster: tuple[int, int, int]
    stream: int
    after: str | None = None

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def __repr__(self) -> str:
        """One line (``describe()``: the launch shape in full; ``lowered``: the kernel)."""
        return one_line(f"<PlannedKernel rank {self.rank} {self.part}: {getattr(self.lowered, 'entry', '?')}, "
                        f"{self.ctas} CTAs, stream {self.stream}" + (f" after {self.after}" if self.after else "") + ">")

    def describe(self) -> str:
        lk = self.lowered
        return (f"rank {self.rank} {self.part}: kernel {lk.entry} ({type(lk).__name__}) grid {self.grid} block "
                f"{self.block} smem {self.smem_bytes} B" + (f" cluster {self.cluster}" if self.cluster != (1, 1, 1)
                                                            else "") + f", stream {self.stream}"
                + (f" after {self.after}" if self.after else ""))


@dataclass(frozen=True)
class PlannedCopies:
    """One rank's copy-engine part: its plan's actions, on a stream of its own."""
    rank: int
    part: str
    plan: object
    stream: int

    def __repr__(self) -> str:
        """One line (``describe()``; ``plan``: the copy-engine plan of every rank)."""
        return one_line(f"<PlannedCopies rank {self.rank} {self.part}: copy engine, stream {self.stream}>")

    def describe(self) -> str:
        acts = self.plan.actions[self.rank]
        return f"rank {self.rank} {self.part}: copy engine, {len(acts)} action(s), stream {self.stream}"


@dataclass(frozen=True)
class RunPlan:
    """Everything one launch enqueues, rank by rank (the order of :attr:`items`; each launch
    may take them in another order), and the SMs it was fitted into."""
    kernel: core.Kernel
    items: tuple
    sm_count: int
    reserved_sms: int
    split: str = "work"

    @property
    def kernels(self) -> list[PlannedKernel]:
        return [x for x in self.items if isinstance(x, PlannedKernel)]

    @property
    def copies(self) -> list[PlannedCopies]:
        return [x for x in self.items if isinstance(x, PlannedCopies)]

    @property
    def streams(self) -> int:
        """Streams one launch uses (numbered from 0; a chained part shares its producer's)."""
        return len({x.stream for x in self.items})

    @property
    def resident_ctas(self) -> int:
        """CTAs resident at once at most: every kernel's but the chained ones, which start on an
        SM only once the kernel they follow has left it."""
        return sum(k.ctas for k in self.kernels if k.after is None)

    def shuffled(self, rng) -> list:
        """The items in a random enqueue order (``rng.shuffle``), each chained part still right
        after the kernel it follows on their stream."""
        order = [x for x in self.items if getattr(x, "after", None) is None]
        rng.shuffle(order)
        for x in self.items:
            if getattr(x, "after", None) is not None:
                at = next(i for i, y in enumerate(order) if y.rank == x.rank and y.part == x.after)
                order.insert(at + 1, x)
        return order

    def __repr__(self) -> str:
        """One line: how many kernels and copy-engine parts, CTAs and streams (``describe()``:
        every item's launch shape; in a notebook, a card)."""
        copies = f", {len(self.copies)} copy-engine part(s)" if self.copies else ""
        return one_line(f"<RunPlan {self.kernel.name}: {self.kernel.world_size} rank(s), {len(self.kernels)} "
                        f"kernel(s){copies}, {self.resident_ctas} CTAs of {self.sm_count} SMs, {self.streams} "
                        f"stream(s)>")

    def _repr_html_(self) -> str:
        k = self.kernel
        facts = [("kernel", k.name), ("ranks", k.world_size), ("kernels launched", len(self.kernels)),
                 ("copy-engine parts", len(self.copies)), ("streams", self.streams),
                 ("CTAs resident at once", f"{self.resident_ctas} of {self.sm_count} SMs"),
                 ("SMs left to the copy engine's copies", self.reserved_sms), ("SMs shared by", self.split)]
        parts: dict[str, list] = {}
        for x in self.items:
            parts.setdefault(x.part, []).append(x)
        for part, xs in parts.items():
            shapes = {_launch_shape(x) for x in xs}
            shape = shapes.pop() if len(shapes) == 1 else "a launch shape per rank (describe())"
            facts.append((f"part {part}", f"{shape}; on {len(xs)} rank(s)"))
        return html_card(f"RunPlan of {k.name} (one launch)", facts,
                         [("describe()", clipped(self.describe(), where="plan.describe()"))], open_first=True)

    def describe(self) -> str:
        head = (f"{self.kernel.name} on one GPU: {self.kernel.world_size} rank(s), {self.streams} stream(s), "
                f"{self.resident_ctas} CTAs of {self.sm_count} SMs"
                + (f" ({self.reserved_sms} left to the copy engine's copies)" if self.reserved_sms else "")
                + f", shared by {self.split}")
        return "\n".join([head] + [f"  {x.describe()}" for x in self.items])

    def bind(self, mem) -> dict[tuple[int, str], list]:
        """Every kernel's arguments for launch 1 against ``mem`` (:func:`.bind.bind`), by (rank, part)."""
        return {(k.rank, k.part): bind(k.lowered, k.rank, mem, ctas=k.ctas) for k in self.kernels}


def _launch_shape(x) -> str:
    """A planned item's launch shape, without its rank and stream (a plan card's per-part fact)."""
    if not isinstance(x, PlannedKernel):
        return "copy engine"
    return (f"kernel {x.lowered.entry} ({type(x.lowered).__name__}), grid {x.grid}, block {x.block}, "
            f"smem {x.smem_bytes} B" + (f", cluster {x.cluster}" if x.cluster != (1, 1, 1) else "")
            + (f", after {x.after}" if x.after else ""))


#: where a compute part waiting only on another compute part of its rank runs: "after" it, on
#: its stream with the SMs it leaves (the default), "beside" it, resident at once with a share,
#: or "folded" with it into one kernel where the grouped GEMM's recipe can host the other
#: (:mod:`.fold`; after it where not). Folding is decided when the parts are lowered
#: (:func:`lower_for_run`).
CHAINS = ("after", "beside", "folded")


def plan_run(kernel: core.Kernel, lowered: dict, *, sm_count: int, occupancy: Callable[[object], int] | None = None,
             queues: int | None = None, split: str = "work", chain: str = "after",
             hoist_local_copies: bool = False, spare_sms: int = 0, scratch_budget: int | None = None) -> RunPlan:
    """The launch plan of ``kernel``'s lowered parts (``{part: lowered}``, :func:`lower_for_run`)
    on ``sm_count`` SMs of a GPU that has ``spare_sms`` more, which the plan leaves alone (a run
    on some of the SMs, ``tl.run(sms=)``): the same-GPU copies that need SMs free of persistent
    kernels take those first. ``occupancy(lowered)``: CTAs of that kernel an empty SM holds
    (the driver's answer; None: taken as 1). ``queues``: hardware queues (default
    :func:`hardware_queues`). ``split``: how the compute kernels share the SMs (``"work"`` or
    ``"even"``: :mod:`.sm_split`). ``chain``: where the chained parts run (:data:`CHAINS`,
    :func:`~.chains.chained_parts`). ``hoist_local_copies``: the launch runs the copy-engine
    parts' hoistable same-GPU copies before forking any part (:func:`~.plan_exec.hoistable`; the
    fused-op runtime, one rank a GPU): SMs are left free only where same-GPU copies remain.
    ``scratch_budget``: the bytes the kernels' global-memory scratch may take together (None: any;
    :mod:`.scratch_fit` gives the kernels that take it fewer CTAs where it would not fit)."""
    check_split(split)
    check_chain(chain)
    W = kernel.world_size
    parts = [(p.name, lowered[p.name]) for p in kernel.parts if not p.fused and not is_folded(lowered[p.name])]
    chained = chained_parts(kernel, {n for n, lk in parts if is_kernel(lk)}) if chain != "beside" else {}
    _check_stream_order(kernel, lowered, chained)
    # a chained part follows its producer on the producer's stream: listed right after it
    order = [n for n, _ in parts if n not in chained]
    for n in [n for n, _ in parts if n in chained]:
        order.insert(order.index(chained[n]) + 1, n)
    parts = sorted(parts, key=lambda x: order.index(x[0]))
    for name, lk in parts:
        if not is_kernel(lk) and not hasattr(lk, "actions"):
            raise UnboundParameterError(f"part '{name}' lowered to a {type(lk).__name__}, which is neither a kernel "
                                        "nor a copy-engine plan")
        if is_kernel(lk) and occupancy is not None and occupancy(lk) < 1:
            raise ResidencyError(f"kernel {lk.entry} (part '{name}') cannot run even one CTA on an SM: "
                                 f"{lk.block[0]} threads and {lk.smem_bytes} B of shared memory per CTA are more than "
                                 "an SM has; use smaller tiles (the compute schedule's tile) or fewer threads")
    has_copies = any(not is_kernel(lk) for _, lk in parts)
    reserved = max(0, RESERVED_FOR_COPIES - spare_sms) if needs_free_sms([lk for _, lk in parts], W,
                                                                          hoist_local_copies) else 0
    available = sm_count - reserved
    slots = [(r, name, lk) for r in range(W) for name, lk in parts if is_kernel(lk) and name not in chained]
    # a producer's share is its chained parts' too (they run on its SMs after it): as many SMs as
    # either can use, at least as many as either needs
    followers = {name: [lk] + [lowered[c] for c, p in chained.items() if p == name] for _, name, lk in slots}
    lows = [max(f.grid(1)[0] for f in followers[name]) for _, name, _ in slots]
    highs = [max([lo] + [f.grid(_UNBOUNDED)[0] for f in followers[name]]) for lo, (_, name, _) in zip(lows, slots)]
    # a launch in which nothing waits needs none of its kernels resident beside another: each then
    # runs on what it needs at least, and the GPU runs them one after another where they do not fit
    independent = not any(op.name in WAIT_OPS for _, op in kernel.walk())
    if sum(lows) > available and not independent:
        fixed = ", ".join(f"rank {r} {name}: {lo}" for (r, name, _), lo in zip(slots, lows))
        raise ResidencyError(
            f"the kernels of one launch need at least {sum(lows)} CTAs resident at once ({fixed}) but "
            + (f"it runs on {sm_count} of the GPU's {sm_count + spare_sms} SMs" if spare_sms else
               f"the GPU has {sm_count} SMs")
            + (f", {reserved} of them left to the copy engine's copies" if reserved else "")
            + ": a kernel waiting for another could wait forever. Use fewer communication lanes (the communication "
              "schedule's sms), fewer ranks, or fewer parts")
    if sum(lows) > available:
        grants = lows
    elif split == "even":
        grants = share(lows, highs, available)
    else:
        part_of = {p.name: p for p in kernel.parts}
        works = {name: part_work(part_of[name]) + sum(part_work(part_of[c]) for c, p in chained.items() if p == name)
                 for name in {n for _, n, _ in slots}}
        needs = {name: at_once_needed(part_of[name], kernel) for name in works}
        grants = share(lows, highs, available, [works[n] for _, n, _ in slots], [needs[n] for _, n, _ in slots])
    n_items = len(slots) + sum(W for _, lk in parts if not is_kernel(lk))     # streams (chained parts share)
    q = hardware_queues() if queues is None else queues
    if has_copies and n_items > q:
        raise ResidencyError(
            f"one launch runs {n_items} streams at once ({W} rank(s) x {len(parts)} part(s)), copy-engine parts "
            f"among them, but CUDA gives this process {q} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS): a copy "
            f"engine's stream wait would block the streams sharing its queue. Set CUDA_DEVICE_MAX_CONNECTIONS=32 in "
            f"the environment before CUDA starts (tl.run sets it where CUDA had not started), or run fewer ranks")
    items, grant, streams = [], iter(grants), 0
    for r in range(W):
        mine: dict[str, PlannedKernel] = {}
        granted: dict[str, int] = {}
        for name, lk in parts:
            if name in chained:
                # the SMs its producer leaves: the producer's grant (not its grid, which may be smaller: a
                # short row gather before a wide GEMM), never more CTAs than it can use
                prev = mine[chained[name]]
                cl = max(1, lk.cluster_dims[0])
                g = max(lk.grid(1)[0], min(granted[prev.part] // cl * cl, lk.grid(_UNBOUNDED)[0]))
                items.append(PlannedKernel(r, name, lk, tuple(lk.grid(g)), tuple(lk.block), int(lk.smem_bytes),
                                           tuple(lk.cluster_dims), prev.stream, after=prev.part))
                continue
            if is_kernel(lk):
                g = granted[name] = next(grant)
                grid = tuple(lk.grid(g))
                mine[name] = PlannedKernel(r, name, lk, grid, tuple(lk.block), int(lk.smem_bytes),
                                           tuple(lk.cluster_dims), streams)
                items.append(mine[name])
            else:
                items.append(PlannedCopies(r, name, lk, streams))
            streams += 1
    items = fit_scratch(kernel, items, scratch_budget, "free on the GPU beside the program's tensors")
    for k in items:
        if isinstance(k, PlannedKernel):
            _check_self_waits(kernel, kernel.part(k.part), k)
    used = sum(k.ctas for k in items if isinstance(k, PlannedKernel) and k.after is None)
    for k in items:
        if isinstance(k, PlannedKernel) and k.after is not None:
            prev = next(x for x in items if isinstance(x, PlannedKernel) and x.rank == k.rank and x.part == k.after)
            used = max(used, used - prev.ctas + k.ctas)
    if used > available and not independent:    # a recipe's grid() gave more CTAs than asked: refuse, not hang
        raise ResidencyError(f"the kernels' grids add up to {used} CTAs, over the {available} SMs they were fitted to: "
                             + "; ".join(k.describe() for k in items if isinstance(k, PlannedKernel)))
    return RunPlan(kernel, tuple(items), sm_count, reserved, split)


def needs_free_sms(lowered, world_size: int, hoist_local_copies: bool) -> bool:
    """Whether SMs must stay free of persistent kernels for same-GPU copies (:data:`RESERVED_FOR_COPIES`):
    where a copy-engine part runs — on one GPU every rank's copies are same-GPU copies — unless the
    launch hoists them (``hoist_local_copies``) and no rank keeps one past its hoisted segments
    (:func:`~.plan_exec.local_copies_left`). ``lowered``: the parts' lowered forms (an iterable)."""
    plans = [lk for lk in lowered if not is_kernel(lk) and not is_folded(lk) and hasattr(lk, "actions")]
    if not plans:
        return False
    if not hoist_local_copies:
        return True
    return any(local_copies_left(p, r) for p in plans for r in range(world_size))


def _check_stream_order(kernel: core.Kernel, lowered: dict, chained: dict[str, str]) -> None:
    """Refuse kernels lowered without signals (:func:`stream_ordered`) that this plan would not
    run one after the other: their waits are gone, so side by side they would race."""
    need = stream_ordered_signals(kernel, chained)
    for name, lk in lowered.items():
        program = getattr(lk, "program", None)
        dropped = program[0].stream_ordered if program else frozenset()
        if dropped - need:
            raise UnboundParameterError(
                f"part '{name}' was lowered without the signals {sorted(dropped - need)} (for chain='after': its "
                "waits are kept by the stream's order), but this plan runs the parts that notify and wait on them "
                "side by side. Lower and plan with the same chain")


def check_chain(chain) -> None:
    """Refuse a ``chain`` that is not one of :data:`CHAINS` (before anything is built)."""
    if chain not in CHAINS:
        raise InputError(f"chain={chain!r}: a compute part waiting only on another runs 'after' it (the default), "
                         "'beside' it, or 'folded' into its kernel")


def _check_self_waits(kernel: core.Kernel, part: core.Part, planned: PlannedKernel) -> None:
    """A part whose tasks wait for other tasks of the same part (a signal it both notifies and
    waits on) may deadlock when its tasks do not all fit on the GPU at once: a persistent CTA
    holding a waiting task never reaches the task it waits for. The simulator runs every task of
    such a compute part at once (and a communication part's tasks ``lanes`` at a time, in the
    schedule's order, as its kernel walks them), so a launch with fewer CTAs than that is
    refused rather than left to hang."""
    need = at_once_needed(part, kernel)
    if need and planned.ctas < need:
        raise ResidencyError(
            f"part '{part.name}' waits for its own tasks (signal(s) {', '.join(self_signals(part))}) but only "
            f"{planned.ctas} of its "
            f"{part.num_tasks} tasks can be resident at once on this GPU: a task holding a CTA could wait for one "
            "that never starts (some task waits for one after it in the order the part's CTAs take them, or on "
            "a channel or count read from memory; waits on earlier tasks only would run on any number). Give "
            "the part fewer tasks (bigger tiles) or move the waiting into another part; "
            f"tl.SimOptions(compute_slots={planned.ctas}) simulates it on as many CTAs")
