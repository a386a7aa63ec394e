"""Recipe ``general``: any compute part, as one persistent ``extern "C"`` kernel
(``include/tldsl/general.hpp``) — the pipeline's last resort for compute parts that no
specialised recipe matches; recipe ``general_comm`` is the same for communication parts on SMs
(tasks in the communication schedule's order, ``lanes`` CTAs). Matching: :mod:`..match.general`; planning: :mod:`..plan.general`;
every op's C++: :mod:`..rules.tile_ops` (one table), index code :mod:`..rules.scalars`, waits
and notifies :mod:`..rules.primitives`.

* Tasks (program instances) run on task groups: a CTA is one group of ``threads`` threads, or
  — for a part with no dot, wait, notify or data primitive — several (``groups``, see
  :func:`..plan.general.task_groups`), each with its own shared-memory arena and named barrier,
  so an SM keeps several tiles in flight. Group ``g`` of CTA ``b`` runs tasks ``b + g *
  gridDim.x``, then every ``groups * gridDim.x``, in row-major order of the part's grid; every
  thread of a group runs the index code.
* Tiles the plan stores live in the group's shared-memory arena (slots reused by liveness), or —
  those that do not fit in 227 KB (:func:`..plan.general._spills`) — in the group's share of a
  global-memory scratch (``scratch``; CTA ``b``'s group ``g`` at ``(b * groups + g) *
  scratch_bytes``); loaded tiles every reader takes element for element are held in the
  threads' registers (:mod:`..plan.held`, :mod:`..rules.held`); the rest are computed element
  by element where consumed; a one-element value computed from held rows (a row's max, sum,
  ``1 / sum``) is in every thread's registers. Every statement is a loop of the group's
  threads over its output elements, with the group's barrier only before a statement that
  touches memory (a slot, a tensor) the statements since the last barrier touched, one of them
  writing (:mod:`..rules.barriers`): loads and stores move
  16-byte chunks of a tile's rows (vector accesses where inside the tensor and aligned, element
  by element at its edges), row reductions combine 32 lanes of a warp by shuffles; ``dot`` runs
  on tensor cores, fp32 accumulation: on WGMMA where its tile has a multiple of 64 rows and
  f16 / bf16 operands (``include/tldsl/general_wgmma.hpp``: operands staged in shared memory in
  a GMMA layout, each warpgroup on 64-row output tiles), else on ``mma.sync`` (f16 / bf16 exact,
  f32 as TF32). A ``tl.range`` loop that only loads 16-bit tiles and accumulates their dots runs
  as a pipelined mainloop instead (:mod:`..plan.dot_loop`, :mod:`..rules.dot_loop`,
  ``include/tldsl/general_pipeline.hpp``: TMA or cp.async stages ahead of WGMMA, accumulators in
  registers); its TMA descriptors are ``tma:<param>`` parameters (:attr:`LoweredGeneral.tma`).
* Waits: thread 0 spins (acquire at the wait's scope), then a CTA barrier; notifies: a CTA
  barrier, then thread 0 fences and adds (release at the notify's scope).

Kernel parameters (:attr:`LoweredGeneral.params`, in order; ``KernelParam.source`` says what the
runtime passes): ``buf_<name>`` (``buffer:<name>``, const when only read) per tensor the part
loads or stores; ``sig_<name>`` (``signal:<name>``) and ``sig_<name>_peers``
(``peer_signals:<name>``) per signal; ``tbl_<name>`` per ``load_scalar`` table;
``tma_<name>_<rows>x64`` (``tma:<param>``) per tensor and box a pipelined loop copies by TMA; ``scratch`` (``scratch``: where slots are spilled,
:attr:`LoweredGeneral.scratch_bytes_per_cta` for every CTA of the launch); ``rank``;
``launch``. Launch: grid ``(min(tasks, sm_count), 1, 1)``, block ``(groups * threads, 1, 1)``,
``smem_bytes`` (every group's arena) of dynamic shared memory (above 48 KB the launcher raises the kernel's
``cudaFuncAttributeMaxDynamicSharedMemorySize``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...ir import core
from ..abi import KernelParam, LoweredKernel, marker
from ..ir_queries import only_part
from ..match.general import WHAT, match_general, match_general_comm
from ..plan.general import GeneralPlan, plan_general
from ..rules import held as held_rules
from ..rules.tile_ops import TileEmitter
from .recipe import Recipe


@dataclass(frozen=True)
class LoweredGeneral(LoweredKernel):
    """A compute part lowered by the general recipe (see the module docstring)."""
    kernel_name: str
    part: str
    entry: str
    source: str
    params: tuple[KernelParam, ...]
    threads: int
    shared_bytes: int
    grid_shape: tuple[int, ...]
    dots: int
    waits: int
    notifies: int
    signals: tuple[str, ...]
    slots: tuple[str, ...]             # the stored tiles, described
    options: tuple[str, ...] = ()
    lanes: int | None = None           # a communication part: its CTAs (the schedule's lanes)
    groups: int = 1                    # tasks a CTA runs at once, on groups of ``threads`` threads
    scratch_bytes: int = 0             # one group's global-memory scratch (its spilled slots)
    wgmma_dots: int = 0                # of ``dots``, those on WGMMA (the rest on mma.sync)
    tma: tuple = ()                    # TmaDescriptorSpec per "tma" parameter (pipelined loops' copies)
    held: tuple[str, ...] = ()         # the tiles held in registers, described (plan.held)
    replicated: tuple[str, ...] = ()   # the one-element values every thread holds, described

    @property
    def cta_threads(self) -> int:
        return self.threads * self.groups

    @property
    def scratch_bytes_per_cta(self) -> int:
        """The global-memory scratch the runtime allocates per CTA it launches (0: none)."""
        return self.groups * self.scratch_bytes

    @property
    def num_tasks(self) -> int:
        return math.prod(self.grid_shape)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.cta_threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return self.shared_bytes

    def grid(self, sm_count: int) -> tuple[int, int, int]:
        """At most one CTA per SM and per task (a CTA's groups take tasks b, b + gridDim.x, ...:
        every SM busy before any holds two tasks); a communication part: its lanes (as the SM
        communication kernels)."""
        return (max(1, min(self.num_tasks, sm_count if self.lanes is None else self.lanes)), 1, 1)

    def describe(self) -> str:
        return "\n".join([f"{self.entry}: {self.kernel_name}.{self.part}  general lowering",
                          f"  tasks {'x'.join(map(str, self.grid_shape))} = {self.num_tasks}, CTAs of {self.groups} "
                          f"group(s) of {self.threads} threads, {self.shared_bytes} B of shared memory"
                          + (f" and {self.scratch_bytes} B of global scratch a group" if self.scratch_bytes else "")
                          + f"; {self.dots} dot(s) ({self.wgmma_dots} on WGMMA), {self.waits} "
                          f"wait(s), {self.notifies} notify(s) on {list(self.signals)}",
                          *(f"  {s}" for s in self.slots),
                          *(f"  {s}" for s in self.held),
                          *(f"  {s}" for s in self.replicated),
                          *(f"  taken from the {name} recipe, which refused: {why}" for name, why in self.declined),
                          "  params: " + ", ".join(f"{p.ctype} {p.name} <- {p.source}" for p in self.params)])


def render_general(plan: GeneralPlan) -> LoweredGeneral:
    """The kernel's source: the task loop over the part's body (see the module docstring)."""
    kernel, p, m = plan.kernel, plan.part, plan.match
    em = TileEmitter(plan)
    prefetch = held_rules.prefetch_lines(em, _decode_lines(plan), "  ")   # before the body: its own names
    body = em.emit("    ")
    ntasks = math.prod(p.grid)
    order = "row-major" if plan.lanes is None else f"the communication schedule's order, {plan.lanes} lane(s)"
    walk = ntasks
    if plan.order is not None:
        order = "the compute schedule's tile order"
        if plan.order.holes:        # whole cluster rows: the rows past the grid are tasks that skip
            cm = plan.order.cluster_m
            walk = -(-p.grid[0] // cm) * cm * math.prod(p.grid[1:])
    L = [f"// Generated by tldsl.codegen, recipe general — do not edit. Kernel '{kernel.name}', {p.role} part "
         f"'{p.name}' ({p.loc}).",
         f"// tasks: grid {tuple(p.grid)} = {ntasks}, {order}; group g of CTA b runs tasks b + g * gridDim.x, then "
         f"every {plan.groups} * gridDim.x; "
         f"{plan.groups} group(s) of {plan.threads} threads (a task each at a time), {plan.smem_bytes} B of dynamic "
         "shared memory",
         '#include "tldsl/general.hpp"',
         *(['#include "tldsl/tile_order.hpp"'] if plan.order is not None else []),
         *(['#include "tldsl/general_wgmma.hpp"'] if plan.wgmma else []),
         *(['#include "tldsl/general_pipeline.hpp"'] if plan.dot_loops else []),
         "",
         # one CTA an SM (the runtime's launch): ptxas may give each thread its share of the registers
         f'extern "C" __global__ void __launch_bounds__({plan.threads * plan.groups}, 1)',
         f"{plan.entry}(",
         "    " + ",\n    ".join(f"{q.ctype} {q.name}" for q in plan.params) + ") {",
         "  (void)rank; (void)launch;",
         "  TLDSL_DYNAMIC_SMEM(tldsl_smem);",
         "  (void)tldsl_smem;",
         "  // the task group of this thread: its threads, its index among them, its shared memory",
         "#if defined(TLDSL_HOST_EMULATION)",
         "  constexpr int kGroups = 1;",
         "  const int gthreads = (int)blockDim.x;   // the CPU check may run fewer threads than planned",
         "#else",
         f"  constexpr int kGroups = {plan.groups};",
         f"  constexpr int gthreads = {plan.threads};   // the launch's block is kGroups * gthreads threads",
         "#endif",
         "  const int grp = (int)threadIdx.x / gthreads;",
         "  const int tid = (int)threadIdx.x - grp * gthreads;",
         f"  unsigned char* const tldsl_arena = static_cast<unsigned char*>(__builtin_assume_aligned(tldsl_smem + grp * {plan.arena_bytes}, 16));",
         "  (void)tid; (void)tldsl_arena;",
         *_scratch_base(plan),
         *em.slot_declarations("  "),
         *prefetch,
         f"  for (int task = (int)blockIdx.x + grp * (int)gridDim.x; task < {walk}; task += (int)gridDim.x * kGroups) "
         f"{{{marker(p.loc)}"]
    L += _decode_lines(plan)
    if plan.order is not None and plan.order.holes:
        L.append(f"    if (pid0 >= {p.grid[0]}) continue;   // a row past the grid, in the last cluster row")
    L += body
    L += ["  }", "}", ""]
    slots = tuple(f"{'scratch' if s.spilled else 'slot'} {s.offset:>6} +{s.nbytes:<6} {'x'.join(map(str, s.shape))} "
                  f"{s.dtype} ({s.op.name}{', ' + s.op.loc.short() if s.op.loc else ''}), live {s.start}..{s.end}"
                  + (": its warps' results (the value: in every thread)" if s.value.id in plan.replicated else "")
                  for s in sorted(plan.slots.values(), key=lambda s: (s.spilled, s.offset, s.start)))
    slots += tuple(f"staging {s.offset:>6} +{s.nbytes:<6} WGMMA operands of the dot at "
                   f"{s.op.loc.short() if s.op.loc else '?'}, live {s.start}..{s.end}"
                   for s in sorted(plan.stagings.values(), key=lambda s: (s.offset, s.start)))
    slots += tuple(f"ring    {s.offset:>6} +{s.nbytes:<6} {plan.dot_loops[id(s.op)].stages} stages of the pipelined "
                   f"dot loop at {s.op.loc.short() if s.op.loc else '?'}, live {s.start}..{s.end}"
                   for s in sorted(plan.rings.values(), key=lambda s: (s.offset, s.start)))
    held = tuple(f"registers {h.thread_bytes:>3} B a thread: {'x'.join(map(str, h.value.type.shape))} "
                 f"{h.value.type.dtype} ({h.value.owner.name}{', ' + h.value.owner.loc.short() if h.value.owner.loc else ''})"
                 f", chunks of {h.order.V}" for h in plan.held.values())
    every = tuple(f"registers in every thread: 1 {v.type.dtype} ({v.owner.name}"
                  f"{', ' + v.owner.loc.short() if v.owner.loc else ''})"
                  for v in (op.result for op in p.walk() if op.results and op.result.id in plan.replicated))
    return LoweredGeneral(kernel.name, p.name, plan.entry, "\n".join(L), plan.params, plan.threads, plan.smem_bytes,
                          tuple(p.grid), m.dots, m.waits, m.notifies, plan.signals, slots, plan.options, plan.lanes,
                          plan.groups, plan.scratch_bytes,
                          len(plan.wgmma) + sum(len(lp.dots) for lp in plan.dot_loops.values()), plan.tma, held,
                          every)


def _decode_lines(plan: GeneralPlan) -> list[str]:
    """The task's program ids: row-major (``plan.decode``), or in the compute schedule's tile
    order (``plan.order``: :meth:`~tldsl.ir.schedule.ComputeSchedule.tile_order`, which the
    simulator runs the part's tasks in) — cluster rows, groups of them walked column by column,
    rotated to start on a rank's rows; the last axes row-major inside."""
    o = plan.order
    if o is None:
        L = []
        for axis, div, mod in plan.decode:
            e = "task" if div == 1 else f"task / {div}"
            if mod is not None:
                e = f"({e}) % {mod}"
            L.append(f"    const int pid{axis} = {e};")
            L.append(f"    (void)pid{axis};")
        return L
    grid = tuple(plan.part.grid)
    g0, g1, rest = grid[0], (grid[1] if len(grid) > 1 else 1), grid[2:]
    cm, R = o.cluster_m, math.prod(rest)
    gc = -(-g0 // cm)                                   # cluster rows
    kind = "tldsl::kCommAligned" if o.rotated else "tldsl::kSwizzled" if o.group_m else "tldsl::kRowMajor"
    start = (f"tldsl::comm_aligned_start({gc}, rank, {o.world_size}, {o.align_shift})" if o.rotated else "0")
    # task = ((walk index * rest) + rest index) * cm + row in the cluster: tile_order expands each
    # entry of the walk over the rest axes, then over a cluster's rows (tile_order.hpp: the walk)
    what = ("in order" if len(grid) == 1 else "row by row" if not o.group_m else
            f"groups of {o.group_m} {'cluster ' if cm > 1 else ''}rows, each walked column by column")
    L = [f"    // the compute schedule's tile order: {what}" + (f", clusters of {cm} tile rows" if cm > 1 else "")
         + (f", starting on the rows of rank (rank + {o.align_shift}) % {o.world_size}" if o.rotated else ""),
         f"    const int tr_ = task / {cm};" if cm > 1 else "    const int tr_ = task;",
         f"    const tldsl::TileCoord tile_ = tldsl::tile_at({kind}, {f'tr_ / {R}' if R > 1 else 'tr_'}, {gc}, {g1}, "
         f"{o.group_m or 1}, {start});",
         f"    const int pid0 = tile_.m * {cm} + task % {cm};" if cm > 1 else "    const int pid0 = tile_.m;"]
    if len(grid) > 1:
        L.append("    const int pid1 = tile_.n;")
    div = 1
    for axis in reversed(range(2, len(grid))):
        L.append(f"    const int pid{axis} = (tr_ / {div}) % {grid[axis]};" if div > 1 else
                 f"    const int pid{axis} = tr_ % {grid[axis]};")
        div *= grid[axis]
    return L + [f"    (void)pid{a};" for a in range(len(grid))]


def _scratch_base(plan: GeneralPlan) -> list[str]:
    """The group's share of the global-memory scratch, where its spilled slots live (none: no lines)."""
    if not plan.scratch_bytes:
        return []
    return ["  // this group's share of the global-memory scratch (the slots that do not fit in shared memory)",
            f"  unsigned char* const tldsl_scratch = static_cast<unsigned char*>(__builtin_assume_aligned(scratch + "
            f"((long long)blockIdx.x * {plan.groups} + grp) * {plan.scratch_bytes}ll, 128));"]


RECIPE = Recipe("general", "compute", 0, match_general, plan_general, render_general,
                options=frozenset({"threads", "wait_timeout_ns", "entry", "wgmma_inflight", "dot_loop_copies"}),
                summary="any compute part: shared-memory or register tiles, element loops, WGMMA / mma.sync dots")
#: the same lowering for communication parts on SMs that the streamed kernel (sm_comm) does not take
RECIPE_COMM = Recipe("general_comm", "comm", 0, match_general_comm, plan_general, render_general,
                     options=frozenset({"threads", "wait_timeout_ns", "entry"}),
                     summary="any communication part on SMs, as the general lowering")


def lower_general(kernel: core.Kernel, part: str | core.Part | None = None, *, threads: int | None = None,
                  wait_timeout_ns: int | None = None, entry: str | None = None) -> LoweredGeneral:
    """Lower a compute part (the only one, or the one named) with the general recipe, whatever
    recipe the pipeline would choose: its match → plan → render. Options:
    :func:`..plan.general.plan_general`."""
    p = only_part(kernel, part, WHAT, "compute parts", lambda q: q.role == "compute")
    return RECIPE.run(kernel, p, threads=threads, wait_timeout_ns=wait_timeout_ns, entry=entry)
