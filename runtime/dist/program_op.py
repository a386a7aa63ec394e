"""One fused-op runtime for any traced kernel: :class:`FusedProgram` runs a ``@tl.kernel``'s
compute and communication parts across the GPUs of a torch.distributed group, one rank per
process, the way ``tl.run`` runs all of them on one GPU.

**Building** (every rank of the group, at the same point — it is collective):

1. trace the kernel for the group's size and the argument specs (shapes, dtypes) and the
   keyword values (``compute=``, ``comm=``, ...), then lower every part through the one pipeline
   ``tl.run`` uses (:func:`~..gpu.run_plan.lower_for_run`), check that every kernel parameter
   can be bound (:func:`~..gpu.bind.check_bindings`), compile and load the kernels, and plan this
   rank's streams and grids (:func:`~..gpu.run_plan.plan_run` for the W ranks on W GPUs' SMs and
   queues — every kernel of this rank resident at once on its GPU — this rank's items kept);
2. **one agreement check**: the ranks exchange a hash of the traced IR (and the lowered
   kernels' names) — or the error that stopped them. A rank that failed raises its own error,
   its peers an :class:`~tldsl.errors.InputError` naming it; ranks that traced different
   programs all raise the same InputError. No rank reaches the allocation alone, so nothing
   hangs;
3. allocate what the IR declares peer-visible — every symmetric tensor, and every signal's
   counters plus a handshake array of one slot per rank, in one int64 block — through a
   :class:`~.symmetric.Lease` (freed only by the collective ``close()``); workspaces that are
   not symmetric are plain device tensors. Counters start at zero; a host barrier follows so no
   peer writes a counter before it is zeroed.

**A launch** (``op(*tensors)``; every rank calls it the same number of times, in the same order;
``L`` counts launches from 1). Everything is enqueued on the caller's stream or forked from it,
nothing waits on the host:

1. the caller's tensors of symmetric arguments are copied into the symmetric buffers (other
   arguments are bound in place: their kernels' arguments are packed once per set of addresses)
   — unless the caller passes the buffer itself (:meth:`FusedProgram.symmetric_buffer`);
2. **entry handshake** (stream memory operations, :func:`~..gpu.plan_exec.stream_handshake`):
   value ``2L - 1`` into this rank's slot of every peer's handshake array, then wait until every
   peer's slot here holds it. After it, every peer has finished launch ``L - 1`` (including its
   read-back) and copied launch ``L``'s inputs in — as the simulator, where each launch starts
   with every rank's inputs in place;
3. every part of this rank (:func:`~..gpu.run_program.enqueue_launch`): first, on the caller's
   stream, each copy-engine plan's leading same-GPU copies and their flags
   (:func:`~..gpu.plan_exec.hoistable`: an all-gather's own shard) — so the persistent kernels
   need no SMs left free for them, and the ``before_comm`` hooks and the timeline's part marks
   come after them — then each kernel or copy-engine plan (the rest of it) on a stream of its own
   forked from the caller's, with the **epoch** ``L`` —
   the kernels' ``launch`` parameter and the copy-engine waits' targets. Signal counters are
   never reset and only grow, so a wait of launch ``L`` needs ``per_launch * (L - 1) + count``
   (:func:`tldsl.ir.semantics.wait_target`): notifies from launch ``L - 1`` never satisfy it;
4. **exit handshake**: value ``2L``, the same way — every peer's parts of launch ``L`` are done
   (a peer's push into this rank's tensors included);
5. the symmetric buffers some op writes are copied back into the caller's tensors (not into a
   buffer passed as itself).

Hooks and timelines (what the fused GEMM ops always offered, for any program): ``op.hooks``
``{'before_compute' | 'before_comm': hook(op, launch, stream)}`` runs on the host just before a
part of that role is enqueued (the distributed checks inject stragglers there), and with
``op.timeline = PhaseTimeline()`` each launch marks its start on the caller's stream and
``<part> done`` on each part's stream.

A call made on another stream than the previous one first waits for the previous launch (the
counters and handshakes assume launches run in call order). So a call is stream-ordered like any
torch op; :meth:`FusedProgram.synchronize` waits for the last launch with ``tl.run`` 's timeout
and its :class:`~..gpu.run_errors.GpuHangError`.

The epoch is one number per launch, from one method (:meth:`FusedProgram._launch_epoch`): the
kernels' ``launch`` argument (their ABI takes it by value, as the GEMM and communication kernels
do), the copy-engine targets and the two handshake values all derive from it. Eagerly it is the
host's count of launches. A CUDA graph bakes that number into its replays, so where the fused-op
base numbers launches itself (``FusedOp._next_launch``: a captured op zeroes its counters on the
device behind a group barrier at the start of every launch and runs it as launch 1) the program
takes the base's number, and the counters it resets are this program's one int64 block
(:meth:`FusedProgram._graph_counters`: signals and handshake slots).

Tested without a GPU in tests/test_program_op.py (every rank's real FusedProgram on a fake GPU
that runs each launched kernel's tile program); on GPUs, ``torchrun --standalone
--nproc_per_node=2 -m tldsl.runtime.dist.program_check``.
"""
from __future__ import annotations

import numbers

import dataclasses
import gc
import hashlib

import numpy as np

from ...errors import InputError
from ...run import check_run_options, register_group_runner
from ...ir import core
from ...ir.display import one_line
from ...ir.opdefs import written_arguments, written_buffers
from ..gpu.bind import DeviceMemory, array_dtype, bind, check_bindings, is_kernel, pack
from ..gpu.plan_exec import DeviceArray, PlanExecutor, PointerTable, checked, load_driver, stream_handshake
from ..gpu.run_plan import (RESERVED_FOR_COPIES, RunPlan, check_chain, hardware_queues, lower_for_run, needs_free_sms,
                            plan_run, stream_ordered)
from ..gpu.sm_split import check_split
from ..gpu.run_program import (_TORCH, enqueue_launch, read_back, scratch_allocator, scratch_budget, to_device,
                               wait_for)
from ..gpu.run_checks import failure as run_check_failure
from ..gpu.run_result import RunResult
from ..sim.memory import poison_value
from .fused_op import FusedOp
from .group import agreement_entry, check_agreement, dist_context, enable_symmetric_memory
from .operands import check_no_grad, check_progress, overlaps
from .symmetric import Lease

#: sets of argument addresses whose packed kernel arguments are kept (a training loop passes a few)
PACKED_SETS = 8
#: the symmetric block of every signal's counters and the handshake slots
COUNTERS = "signal counters"


def exchange(ctx, obj) -> list:
    """Every rank's ``obj`` (``all_gather_object`` over ``ctx.group``; alone: ``[obj]``) — the
    one host collective a program's building makes."""
    if ctx.world_size == 1:
        return [obj]
    import torch.distributed as dist
    every = [None] * ctx.world_size
    dist.all_gather_object(every, obj, group=ctx.group)
    return every


def program_hash(ir: core.Kernel) -> str:
    """A digest of the traced program (its printed IR: parts, schedules, buffers, signals)."""
    return hashlib.sha256(str(ir).encode()).hexdigest()[:16]


class FusedProgram(FusedOp):
    """A traced kernel's parts run across a process group, this process being one rank.

    ``kernel``: a ``@tl.kernel`` function; ``group``: a torch.distributed process group (default
    WORLD), its size the traced world size; ``specs``: the arguments' shapes and dtypes (tensors,
    arrays or ``tl.TensorSpec`` s, in argument order, or a dict by name); keyword values
    (``compute=``, ``comm=``, ...) as for ``tl.simulate``. ``timeout_s``: a wait in a kernel
    that lasts longer traps, and :meth:`synchronize` raises ``GpuHangError`` (None: never).
    ``lowering``: ``lower_all`` options. ``device``: the GPU interface of ``tl.run``
    (:class:`~..gpu.cuda_device.CudaDevice` by default). ``sm_split``: how the compute kernels
    share this rank's SMs — ``"work"`` (in proportion to each part's estimated work, the
    default) or ``"even"`` (:func:`~..gpu.run_plan.plan_run`). ``chain``: where a compute part
    that waits only on another compute part of the rank runs (an MoE combine behind its grouped
    GEMM, a grouped GEMM behind the row gather staging its rows) — ``"after"`` it, with the SMs
    it leaves (the default), ``"beside"`` it, resident at once with a share
    (:func:`~..gpu.chains.chained_parts`), or ``"folded"`` with it into the grouped GEMM's kernel
    where the recipe can host the other (:mod:`~..gpu.fold`; else after it).

    Calling it (``op(*tensors)`` or ``op(**tensors)``, the caller's device tensors of the
    traced shapes and dtypes, contiguous) enqueues one launch on the caller's stream; the
    arguments are updated in place as the program writes them, and returned by name."""

    def __init__(self, kernel, group=None, specs=None, *, timeout_s: float | None = 60.0,
                 lowering: dict | None = None, static_checks: bool = True, device=None, progress=None,
                 sm_split: str = "work", chain: str = "after", **kwargs):
        self.ctx = dist_context(group)
        self.launches = 0
        self._engine = None
        self._nvshmem = None                    # the NVSHMEM transport's workspace (symmetric memory, counters)
        self._last = None                       # (start, end, done) events of the last launch
        self._last_captured = False             # ... recorded while capturing a CUDA graph
        self.launch_ms: list[float] = []
        self.hooks: dict = {}                   # 'before_compute' / 'before_comm': (op, launch, stream) -> None
        self.timeline = None                    # a PhaseTimeline: the next calls mark their parts' ends on it
        self.hook_owner = None                  # what hooks get as their op (an op built on this program)
        error, built = None, None
        try:
            check_split(sm_split)
            check_chain(chain)
            self.sm_split, self.chain = sm_split, chain
            built = self._build(kernel, specs, kwargs, timeout_s, lowering, static_checks, device, progress)
        except Exception as e:                  # noqa: BLE001 - exchanged first, then re-raised
            error = e
        every = exchange(self.ctx, agreement_entry(built, error))
        if error is not None:
            raise error
        check_agreement(f"FusedProgram({_name(kernel)})", every, None, differ="traced different programs")
        self._allocate()

    # -- building ---------------------------------------------------------------------------------
    def _build(self, kernel, specs, kwargs, timeout_s, lowering, static_checks, device, progress) -> dict:
        """Everything that can refuse, before any collective allocation: the trace, the lowering,
        the bindings, the compile and the plan. Returns what the ranks must agree on."""
        from ...kernel import KernelFunction
        if not isinstance(kernel, KernelFunction):
            raise InputError(f"FusedProgram needs a @tl.kernel function, got {type(kernel).__name__}")
        self.kernel_fn = kernel
        check_run_options(timeout_s, lowering, "FusedProgram")
        if not isinstance(static_checks, bool):          # ('no' is truthy: it would check)
            raise InputError(f"static_checks must be True or False, got {static_checks!r}")
        check_progress("FusedProgram", progress)
        self.timeout_s = timeout_s
        specs = _specs_in_order(kernel.arg_names, specs)
        ir = kernel.trace_checked(self.ctx.world_size, specs, kwargs, channels=static_checks)
        self.kernel = ir
        self.compute, self.comm = ir.compute_schedule, ir.comm_schedule
        lowered = lower_for_run(ir, wait_timeout_ns=None if timeout_s is None else int(timeout_s * 1e9),
                                transports=("ptr", "nvshmem"), chain=self.chain, **dict(lowering or {}))
        self._transport = getattr(ir.comm_schedule, "transport", None) or "ptr"
        check_bindings(ir, lowered)
        if device is None:
            from ..gpu.cuda_device import CudaDevice
            device = CudaDevice()
        self.device = device
        self._drv = device.ce_driver if device.ce_driver is not None else load_driver()
        self._loaded = device.load({lk.entry: lk for lk in lowered.values() if is_kernel(lk)}, progress)
        if getattr(device, "run_checks", None) is not None:
            device.run_checks.clear()                   # (what an earlier program left is not this one's)
        # planned as every rank on one GPU of W GPUs' SMs and queues (each rank's share: one GPU's, less the SMs
        # left to same-GPU copies where copy-engine parts keep some past those hoisted ahead of the parts, as
        # tl.run leaves them, and less the hardware queue of the caller's stream, whose handshakes wait too)
        W = ir.world_size
        kept = [lk for p, lk in lowered.items() if not ir.part(p).fused]
        reserve = needs_free_sms(kept, W, hoist_local_copies=True)
        pooled = device.sm_count * W - (RESERVED_FOR_COPIES * (W - 1) if reserve else 0)
        mine = scratch_budget(ir, device, ranks=1)            # (each GPU holds one rank's scratch and tensors)
        full = plan_run(ir, lowered, sm_count=pooled, queues=max(1, hardware_queues() - 1) * W,
                        occupancy=lambda lk: device.occupancy(self._loaded[lk.entry], lk), split=self.sm_split,
                        chain=self.chain, hoist_local_copies=True, scratch_budget=None if mine is None else W * mine)
        self.plan = _rank_plan(full, self.ctx.rank)
        self.lowered = lowered
        # (the waits the kernels keep: chained "after", a combine's data-dependent wait is dropped)
        self._reset_each_launch = bool(data_dependent_waits(stream_ordered(ir) if self.chain == "after" else ir))
        self._written = written_buffers(ir)
        return {"arguments": ", ".join(f"{b.name} {list(b.type.shape)} {b.type.dtype.name}" for b in ir.args),
                "schedules": f"{ir.compute_schedule}, {ir.comm_schedule}", "program": program_hash(ir),
                "world size": ir.world_size,
                "kernels": tuple(sorted(lk.entry for lk in lowered.values() if is_kernel(lk)))}

    def _allocate(self) -> None:
        """The symmetric tensors, the counters and handshake slots (one int64 block), the local
        workspaces — then a host barrier, so no peer's write can precede the zeroing here."""
        import torch
        ir, W, rank = self.kernel, self.ctx.world_size, self.ctx.rank
        workspaces = {b.name for b in ir.workspaces}
        enable_symmetric_memory(self.ctx.group_name)      # (older torch needs it; newer: nothing)
        self._lease = Lease(self.ctx, f"FusedProgram({ir.name}) on rank {rank}", self)
        self._closed = False
        at = self.device.torch_device
        self._symmetric: dict[str, object] = {}          # name -> this rank's symmetric tensor
        self._workspaces: dict[str, object] = {}
        peers: dict[str, list[int]] = {}
        slots = [int(s.type.slots) for s in ir.signals]
        blocks = self._symmetric_memory([(b.name, tuple(b.type.shape), b.type.dtype.name) for b in ir.buffers
                                         if b.symmetric] + [(COUNTERS, (sum(slots) + W,), "u64")])
        for b in ir.buffers:
            dtype = getattr(torch, _TORCH[b.type.dtype.name])
            if b.symmetric:
                t, peers[b.name] = blocks[b.name]
                self._symmetric[b.name] = t
                if b.name in workspaces:
                    t.fill_(poison_value(b.type.dtype))
            elif b.name in workspaces:
                self._workspaces[b.name] = torch.full(tuple(b.type.shape), poison_value(b.type.dtype), dtype=dtype,
                                                      device=at)
        block, base = blocks[COUNTERS]
        block.zero_()
        self._counter_block = block
        self._signals, sig_peers, off = {}, {}, 0
        for s, n in zip(ir.signals, slots):
            self._signals[s.name] = block[off:off + n]
            sig_peers[s.name] = [a + 8 * off for a in base]
            off += n
        self._handshake = [a + 8 * off for a in base]     # every rank's W arrival slots, as mapped here
        self._fixed = [{} for _ in range(W)]               # rank -> {name: DeviceArray} of tensors bound once
        for name, addrs in peers.items():
            b = ir.buffer(name)
            for q in range(W):
                self._fixed[q][name] = DeviceArray(addrs[q], tuple(b.type.shape), array_dtype(b.type.dtype),
                                                   owner=self._symmetric[name] if q == rank else None)
        for name, t in self._workspaces.items():
            b = ir.buffer(name)
            self._fixed[rank][name] = DeviceArray(t.data_ptr(), tuple(b.type.shape), array_dtype(b.type.dtype),
                                                  owner=t)
        self._sig_arrays = [{s.name: DeviceArray(sig_peers[s.name][q], (int(s.type.slots),), "i64")
                             for s in ir.signals} for q in range(W)]
        self._tables: dict = {}                            # peer tables, uploaded once
        self._packed: dict[tuple, tuple] = {}              # argument addresses -> (kernel args, copy executors)
        self._streams = self.device.streams(self.plan.streams) if self.plan.streams > 1 else None
        if self._nvshmem is not None:       # each NVSHMEM kernel's module gets NVSHMEM's device state
            for lk in self.lowered.values():
                if getattr(lk, "transport", "ptr") == "nvshmem":
                    self._nvshmem.nv.init_module(self._loaded[lk.entry].module)
        if getattr(block, "is_cuda", False):
            torch.cuda.synchronize(block.device)
        exchange(self.ctx, None)                           # every rank's counters are zero from here on

    def _symmetric_memory(self, specs) -> dict:
        """``{name: (this rank's tensor, every rank's address as mapped here)}`` for ``specs``
        ``(name, shape, tldsl dtype name)`` — torch symmetric memory, or with the NVSHMEM transport
        one block of NVSHMEM's heap (``nvshmem_ptr`` on the device finds only addresses inside
        it); either held by this program's lease (collective)."""
        import torch
        W, rank = self.ctx.world_size, self.ctx.rank
        if self._transport == "nvshmem":
            from .nvshmem import NvshmemWorkspace
            self._nvshmem = ws = NvshmemWorkspace(
                self.ctx, [(n, "signal" if n == COUNTERS else "buffer", shape, dt) for n, shape, dt in specs],
                lease=self._lease)
            return {n: (ws.tensors[n], list(ws.addresses[n])) for n, _, _ in specs}
        out = {}
        for n, shape, dt in specs:
            t, h = self._lease.empty(shape, torch.int64 if dt == "u64" else getattr(torch, _TORCH[dt]))
            out[n] = (t, _peer_addresses(h, t, W, rank))
        return out

    def symmetric_buffer(self, name: str):
        """This rank's symmetric buffer of the symmetric argument ``name``. A call given this
        tensor for ``name`` binds it in place: no copy into the buffer before the launch, nor
        back out after it (what torch's symmetric-memory ops offer with their buffers). Write a
        call's input into it on the stream of that call, after the previous call was enqueued
        there: the peers read it until the previous launch's exit handshake, which that stream
        follows. Valid until :meth:`close`. Given for any other argument, a call refuses it
        (:meth:`_check_apart_from_program_memory`): ``name`` is copied into it, and the kernels and
        the peers read and write ``name`` there."""
        self._check_open()
        b = next((b for b in self.kernel.args if b.name == name), None)
        if b is None or not b.symmetric:
            symmetric = [b.name for b in self.kernel.args if b.symmetric]
            raise InputError(f"'{name}' is not a symmetric argument of {self.kernel.name} (those are: "
                             f"{', '.join(symmetric) or 'none'})")
        return self._symmetric[name]

    # -- a launch -----------------------------------------------------------------------------------
    def __call__(self, *tensors, **named):
        """Enqueue one launch on the caller's stream (see the module's docstring); returns the
        argument tensors by name (the same objects, updated in place once the launch has run)."""
        self._check_open()
        args = self._arguments(tensors, named)
        kernels, copies, mem = self._packs(args)
        self._mem = mem
        self._enqueue(args, kernels, copies)
        return dict(zip([b.name for b in self.kernel.args], args))

    def _arguments(self, tensors, named) -> list:
        """The caller's tensors in argument order, each checked (before anything is enqueued)."""
        names = [b.name for b in self.kernel.args]
        if tensors and named:
            raise InputError(f"{self.kernel.name}: pass the arguments in order or by name, not both")
        if named:
            missing = [n for n in names if n not in named]
            extra = [n for n in named if n not in names]
            if missing or extra:
                raise InputError(f"{self.kernel.name} takes {names}; missing {missing}, unknown {extra}")
            tensors = tuple(named[n] for n in names)
        if len(tensors) != len(names):
            raise InputError(f"{self.kernel.name} takes {len(names)} tensors ({', '.join(names)}), got {len(tensors)}")
        self.check_arguments(dict(zip(names, tensors)))
        return list(tensors)

    def check_arguments(self, named: dict) -> None:
        """The caller's tensors of some of the arguments, by name, each as the traced program
        takes it, none it writes sharing memory with another, and none sharing memory the program
        stages another argument through (:meth:`_check_apart_from_program_memory`) — what a call
        checks before anything is enqueued (the MoE ops check theirs before the routing too)."""
        import torch
        at = self.device.torch_device
        buffers = [self.kernel.buffer(n) for n in named]
        for b, t in zip(buffers, named.values()):
            want = getattr(torch, _TORCH[b.type.dtype.name])
            if not isinstance(t, torch.Tensor):
                raise InputError(f"argument '{b.name}': a torch tensor on {at}, got {type(t).__name__}")
            if tuple(t.shape) != tuple(b.type.shape) or t.dtype != want:
                raise InputError(f"argument '{b.name}': {tuple(t.shape)} {t.dtype}, the program was traced for "
                                 f"{tuple(b.type.shape)} {want}")
            if t.device != at:
                raise InputError(f"argument '{b.name}' is on {t.device}; this rank's program runs on {at}")
            if not t.is_contiguous():
                raise InputError(f"argument '{b.name}' is not contiguous (pass .contiguous())")
            if b.symmetric and _overlaps_other(t, self._symmetric[b.name]):
                raise InputError(f"argument '{b.name}' overlaps its symmetric buffer without being it: pass "
                                 f"symmetric_buffer('{b.name}') itself, or a tensor of its own")
        staged = [self._staged(b, t) for b, t in zip(buffers, named.values())]
        self._check_apart_from_program_memory(named)
        _check_written_apart(buffers, list(named.values()), self._written, staged)
        check_no_grad(type(self).__name__, [(f"argument '{n}'", t) for n, t in named.items()])

    def _check_apart_from_program_memory(self, named: dict) -> None:
        """No argument's tensor shares a byte with memory this program stages another argument
        through or keeps for itself. The kernels (and the peers) touch a symmetric argument in its
        symmetric buffer, not in the caller's tensor: a staged one (:meth:`_staged`) is copied into
        the buffer before the kernels and, written, back after them. Another argument's tensor
        within that buffer would be overwritten by the copy-in (a local input read as the other
        argument's values), written by the kernels while the peers read it (an output stored where
        they pull the other argument), or copied in and back in an order the call does not say —
        a wrong answer, not an error; so is any overlap with a workspace or the signal counters.
        A buffer passed as its own argument (bound in place) is that argument's tensor, which
        :func:`_check_written_apart` compares as any other. An argument not in ``named`` (a
        partial check: the MoE ops' before the routing) is left to the call's own check."""
        ir = self.kernel
        staged = [b.name for b in ir.args if b.symmetric and b.name in named and self._staged(b, named[b.name])]
        own = [(f"workspace '{n}'", w) for n, w in {**self._symmetric, **self._workspaces}.items()
               if n not in {b.name for b in ir.args}] + [("signal counters", self._counter_block)]
        for name, t in named.items():
            for other in staged:    # (its own buffer: checked with its tensor; an argument not given: checked later)
                if other != name and overlaps(t, self._symmetric[other]):
                    raise InputError(
                        f"argument '{name}' overlaps the symmetric buffer of argument '{other}' "
                        f"(symmetric_buffer('{other}')): the program copies '{other}' into it, and its kernels and "
                        f"peers read and write '{other}' there; pass a separate tensor for '{name}', or "
                        f"symmetric_buffer('{other}') as '{other}' itself")
            for what, w in own:
                if overlaps(t, w):
                    raise InputError(f"argument '{name}' overlaps the program's {what}, which its kernels write: "
                                     f"pass a separate tensor for '{name}'")

    def _staged(self, b, t) -> bool:
        """Whether argument ``b``'s tensor ``t`` is copied into its symmetric buffer before the
        kernels (and, written, back after them): a symmetric argument that is not the buffer itself
        (:meth:`symmetric_buffer`, bound in place)."""
        return b.symmetric and t.data_ptr() != self._symmetric[b.name].data_ptr()

    def _packs(self, args):
        """The kernels' packed arguments and the copy-engine executors for these argument
        addresses (built once per set of addresses, at most :data:`PACKED_SETS` kept)."""
        local = [(b, t) for b, t in zip(self.kernel.args, args) if not b.symmetric]
        key = tuple(t.data_ptr() for _, t in local)
        hit = self._packed.get(key)
        if hit is not None:
            return hit
        W, rank = self.ctx.world_size, self.ctx.rank
        buffers = [dict(d) for d in self._fixed]
        for b, t in local:
            # (keyed by address, checked per call: the caller's tensor itself is not kept alive here)
            buffers[rank][b.name] = DeviceArray(t.data_ptr(), tuple(b.type.shape), array_dtype(b.type.dtype))
        mem = DeviceMemory(W, buffers, self._sig_arrays, self.device.upload, self.device.encode_tma,
                           tables=self._tables, allocate=scratch_allocator(self.device.torch_device))
        kernels = {(k.rank, k.part): pack(bind(k.lowered, rank, mem, ctas=k.ctas)) for k in self.plan.kernels}
        copies = {(c.rank, c.part): PlanExecutor(c.plan, rank, _pointers(mem, rank, c.plan), driver=self._drv)
                  for c in self.plan.copies}
        if len(self._packed) >= PACKED_SETS:
            self._packed.pop(next(iter(self._packed)))
        self._packed[key] = (kernels, copies, mem)
        return kernels, copies, mem

    def _enqueue(self, args, kernels, copies) -> None:
        """Launch ``L``: copy-in, entry handshake ``2L - 1``, the parts with epoch ``L``, exit
        handshake ``2L``, copy-out — all stream-ordered after the caller's stream."""
        W, rank = self.ctx.world_size, self.ctx.rank
        L = self._launch_epoch()
        dev, drv = self.device, self._drv
        origin = dev.origin()
        captured = _capturing()
        if self._last is not None and not captured and not self._last_captured:
            dev.wait_event(origin, self._last[2])   # after the previous call, whatever stream it was made on
        sym = [(b.name, t) for b, t in zip(self.kernel.args, args) if self._staged(b, t)]
        for name, t in sym:
            n = t.numel() * t.element_size()
            checked(drv, drv.cuMemcpyAsync(self._symmetric[name].data_ptr(), t.data_ptr(), n, origin),
                    f"cuMemcpyAsync(argument '{name}' into its symmetric buffer)")
        epoch = L
        if self._reset_each_launch:     # (data_dependent_waits) zeroed before this rank's entry handshake:
            epoch = 1                   # every peer's notifies of launch L come after it, of L - 1 before it
            n = sum(int(t.numel()) for t in self._signals.values()) * 8
            if n:
                checked(drv, drv.cuMemsetD8Async(self._counter_block.data_ptr(), 0, n, origin),
                        "cuMemsetD8Async(the signal counters)")
        if self.timeline is not None:       # before the entry handshake: its wait for the peers shows
            self.timeline.mark("start", torch_stream(origin, dev), "caller")
        if W > 1:
            stream_handshake(drv, origin, self._handshake, rank, 2 * L - 1)
        streams = self._streams or [origin]
        watch = self._watch(origin) if (self.hooks or self.timeline is not None) else None
        # between the first part that may spin and the last part it waits for, the host must not
        # wait for the device: no garbage collection (freeing symmetric memory synchronises)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            start, end = enqueue_launch(dev, list(self.plan.items), epoch, self._loaded, kernels, copies, origin,
                                        streams, watch=watch, hoist=True)
        finally:
            if gc_was_on:
                gc.enable()
        if W > 1:
            stream_handshake(drv, origin, self._handshake, rank, 2 * L)
        for name, t in sym:
            if name not in self._written:
                continue                            # nothing writes it: the caller's tensor holds it already
            n = t.numel() * t.element_size()
            checked(drv, drv.cuMemcpyAsync(t.data_ptr(), self._symmetric[name].data_ptr(), n, origin),
                    f"cuMemcpyAsync(symmetric buffer '{name}' back into the argument)")
        done = dev.event()
        dev.record(done, origin)
        if self._last is not None:
            dev.destroy(self._last)
        self._last, self._last_captured = (start, end, done), captured

    def _watch(self, origin):
        """What runs on the host around each part's enqueue: the caller's hooks before it
        (``hooks['before_compute']`` / ``hooks['before_comm']`` by the part's role, called as
        ``hook(op, launch, stream)`` with the part's stream and ``op`` the op the caller holds —
        :attr:`hook_owner`, this program by default; the distributed checks inject stragglers
        there) and timeline marks ``<part> start`` / ``<part> done`` on that stream around it
        (the timeline's ``start`` mark precedes the entry handshake: :meth:`_enqueue`)."""
        def watch(item, stream: int, when: str) -> None:
            role = self.kernel.part(item.part).role
            if when == "before":
                hook = self.hooks.get(f"before_{role}")
                if hook is not None:
                    hook(self.hook_owner or self, self.launches, torch_stream(stream, self.device))
            if self.timeline is not None:
                label = f"{item.part} {'start' if when == 'before' else 'done'}"
                self.timeline.mark(label, torch_stream(stream, self.device), role)
        return watch

    def _launch_epoch(self) -> int:
        """Count this call as a launch and return its epoch: the host's count — or, where the
        fused-op base numbers launches itself (``FusedOp._next_launch``: a captured op starts
        every launch from counters reset on the device, its epoch then 1), the base's number.
        Everything a launch enqueues that depends on it (the kernels' ``launch``, the copy-engine
        targets, the handshake values) is derived from this one number."""
        base = getattr(super(), "_next_launch", None)
        if base is not None:
            return base()
        self.launches += 1
        return self.launches

    def synchronize(self) -> None:
        """Wait for the last launch, its copy-back included; past ``timeout_s`` a
        ``GpuHangError`` with the plan and this rank's counters."""
        if self._last is None or self._last_captured:     # (a graph's replays: torch.cuda.synchronize)
            return
        start, end, done = self._last
        wait_for(self.device, done, self.launches, self.plan, self._mem, self.timeout_s)
        if len(self.launch_ms) < self.launches:
            self.launch_ms.append(self.device.elapsed_ms(start, end))
        self._raise_failed_checks()

    def _raise_failed_checks(self) -> None:
        """A wait count the kernels checked at run time and found wrong since the last synchronize
        (:mod:`tldsl.runtime.gpu.run_checks`): a ``RunCheckError`` at the wait's line."""
        checks = getattr(self.device, "run_checks", None)   # (the host tests' fake device has none)
        if checks is None:
            return
        failed = run_check_failure(self.kernel, checks.read(), self.launches)
        if failed is not None:
            checks.clear()
            raise failed

    # -- what FusedOp asks ----------------------------------------------------------------------------
    def signal_tensors(self) -> dict:
        self._check_open()                              # (its views went with close())
        return dict(self._signals)

    def signal_map(self) -> list[tuple[str, int, int, str]]:
        """``(signal, address, slots, note)`` of this rank's counters and handshake slots (decodes a
        device ``wait timed out: slot 0x...`` line: :func:`~.comm_kernel.explain_address`)."""
        self._check_open()
        rank, out = self.ctx.rank, []
        for s in self.kernel.signals:
            t = self._signals[s.name]
            who = "symmetric: peers notify" if s.type.scope.value == "symmetric" else "local"
            out.append((s.name, t.data_ptr(), t.numel(), f"rank {rank}, {who}; {s.type.slots} slot(s)"))
        W = self.ctx.world_size
        out.append(("handshake", self._handshake[rank], W, f"rank {rank}: slot q = rank q's last handshake value "
                    "(2L - 1 on entering launch L, 2L on leaving it)"))
        return out

    def _graph_counters(self) -> list:
        """Every counter a launch waits on or writes: the one int64 block holding the signals
        and the handshake slots (what a device-side reset of the epoch zeroes)."""
        return [self._counter_block]

    def workspace_tensors(self) -> dict:
        workspaces = {b.name for b in self.kernel.workspaces}
        return {**{n: t for n, t in self._symmetric.items() if n in workspaces},
                **self._workspaces}

    def _release(self) -> None:
        if self._last is not None:
            try:
                if not self._last_captured:         # (a captured launch: Lease.release synchronises)
                    wait_for(self.device, self._last[2], self.launches, self.plan, self._mem, self.timeout_s)
            finally:
                self.device.destroy(self._last)
                self._last = None
        if self._nvshmem is not None:
            self._nvshmem.close()               # (its views of the heap; the lease frees the heap)
            self._nvshmem = None
        self._packed.clear()
        self._tables.clear()
        self._fixed = self._sig_arrays = self._mem = None
        self._signals, self._symmetric, self._counter_block = {}, {}, None

    def _problem(self) -> str:
        args = ", ".join(f"{b.name} {list(b.type.shape)} {b.type.dtype.name}" for b in self.kernel.args)
        return f"{self.kernel.name}({args})"

    def _facts(self) -> list[tuple[str, object]]:
        return [("program", self._problem()), ("parts", ", ".join(p.name for p in self.kernel.parts)),
                ("symmetric", ", ".join(b.name for b in self.kernel.buffers if b.symmetric) or "-")]

    def _describe_body(self) -> list[str]:
        p = self.plan
        lines = [f"rank {self.ctx.rank}'s launch: {p.streams} stream(s), {p.resident_ctas} CTAs of "
                 f"{p.sm_count} SMs, SMs shared by {p.split}, handshakes on the caller's stream"] + [f"  {x.describe()}" for x in p.items]
        for item in self.plan.items:
            lk = item.lowered if hasattr(item, "lowered") else item.plan
            lines.append(f"part {item.part}: " + (lk.describe() if hasattr(lk, "describe") else type(lk).__name__))
        return lines


# -- helpers ----------------------------------------------------------------------------------------

def torch_stream(handle: int, device):
    """A torch stream object for a raw CUDA stream of ``device`` (what hooks and timelines record
    on); a device without torch streams (a test's fake) passes the handle itself."""
    make = getattr(device, "torch_stream", None)
    return make(handle) if make is not None else handle


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA): an event
    recorded outside a capture cannot be waited for inside it."""
    try:
        import torch
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError, AttributeError, ImportError):
        return False


WAITS = ("consumer_tile_wait", "peer_tile_wait", "rank_wait")


def data_dependent_waits(ir: core.Kernel) -> list[str]:
    """The parts whose waits count notifies with a number read from memory (an MoE combine
    waits for as many GEMM tiles as a routing table says). Counters never reset need the
    notifies of every earlier launch (``per_launch * (L - 1) + count``), which is unknown when
    the count changes with the data between launches: such a program runs every launch from
    counters zeroed on the device behind a group barrier (``FusedOp._fresh_epoch``), as a
    captured launch does, its epoch then always 1."""
    parts = []
    for p in ir.parts:
        for op in p.walk():
            if op.name in WAITS and "per_launch" not in op.attrs:
                owner = op.operands[2].owner
                if not (isinstance(owner, core.Op) and owner.name == "const"):
                    parts.append(p.name)
                    break
    return parts


def _name(kernel) -> str:
    return getattr(kernel, "name", type(kernel).__name__)


def _overlaps_other(t, buf) -> bool:
    """Whether ``t``'s bytes overlap ``buf``'s without being exactly them (a copy between the two
    would overlap)."""
    a, n = t.data_ptr(), t.numel() * t.element_size()
    b, m = buf.data_ptr(), buf.numel() * buf.element_size()
    return a < b + m and b < a + n and (a, n) != (b, m)


def _check_written_apart(args, tensors, written: frozenset[str], staged: list[bool]) -> None:
    """No argument the program writes shares a
    byte with another argument its kernels read or write in place: they would write it while they
    still read the other — a wrong answer, not an error. ``staged`` arguments (symmetric ones not
    passed as their buffer) are copied into it before the kernels and, written, back after them:
    one that is only read may share the bytes of an output (an in-place all-reduce, ``op(x=t,
    out=t)``), two that are written may not. The same tensor for one read-write argument is fine."""
    def writes(b):
        return b.name in written

    for i, (b, t) in enumerate(zip(args, tensors)):
        if not writes(b):
            continue
        for j, (other, u) in enumerate(zip(args, tensors)):
            in_place = not staged[i] and not staged[j]             # both touched by the kernels themselves
            if j != i and (in_place or writes(other)) and overlaps(t, u):
                raise InputError(f"argument '{b.name}' overlaps argument '{other.name}' in memory, and the program "
                                 f"writes '{b.name}' while it may still read '{other.name}': pass a separate tensor")


def _specs_in_order(names: list[str], specs) -> tuple:
    if specs is None:
        raise InputError(f"FusedProgram needs the arguments' specs ({', '.join(names)}): tensors, arrays or "
                         "tl.TensorSpec s, in order or by name")
    if isinstance(specs, dict):
        missing = [n for n in names if n not in specs]
        extra = [n for n in specs if n not in names]
        if missing or extra:
            raise InputError(f"specs: the kernel takes {names}; missing {missing}, unknown {extra}")
        return tuple(specs[n] for n in names)
    if not isinstance(specs, (list, tuple)):
        raise InputError(f"specs: the arguments' specs ({', '.join(names)}) in order (a list or tuple) or by name "
                         f"(a dict), got {type(specs).__name__}")
    return tuple(specs)


def _peer_addresses(handle, t, W: int, rank: int) -> list[int]:
    """Every rank's address of symmetric tensor ``t`` as mapped in this process."""
    ptrs = [int(p) for p in getattr(handle, "buffer_ptrs", ())]
    if len(ptrs) != W:
        raise InputError(f"the symmetric-memory handle maps {len(ptrs)} ranks' buffers, the group has {W}")
    off = t.data_ptr() - ptrs[rank]
    return [p + off for p in ptrs]


def _pointers(mem: DeviceMemory, rank: int, ce_plan) -> PointerTable:
    """A copy-engine plan's view of this rank's memory: symmetric tensors and every signal at
    every rank's address, a local tensor at this rank's only."""
    table = PointerTable(mem.world_size, rank)
    for names, get in ((ce_plan.buffers, mem.buffers), (ce_plan.signals, mem.signals)):
        for name in names:
            mine = get[rank].get(name)
            if mine is None:
                raise InputError(f"the copy-engine plan of part '{ce_plan.part}' touches '{name}', which this "
                                 "rank does not hold")
            if all(name in get[q] for q in range(mem.world_size)):
                table.add_symmetric(name, [get[q][name].ptr for q in range(mem.world_size)], mine.nbytes)
            else:
                table.add_local(name, mine.ptr, mine.nbytes)
    return table


def _rank_plan(full: RunPlan, rank: int) -> RunPlan:
    """This rank's items of a plan made for every rank, on streams numbered from 0 (a chained
    part's still its producer's)."""
    mine = [x for x in full.items if x.rank == rank]
    renumber = {s: i for i, s in enumerate(dict.fromkeys(x.stream for x in mine))}
    items = tuple(dataclasses.replace(x, stream=renumber[x.stream]) for x in mine)
    W = max(full.kernel.world_size, 1)
    return RunPlan(full.kernel, items, (full.sm_count + full.reserved_sms * (W - 1)) // W, full.reserved_sms,
                   full.split)


# -- tl.run across the GPUs of a group ----------------------------------------------------------------

@dataclasses.dataclass(repr=False)
class DistRunResult(RunResult):
    """``tl.run(..., group=...)`` 's result on one rank: ``RunResult`` 's interface, with only this
    rank's arrays (``result[rank]``; another rank's index is an InputError)."""
    rank: int = 0

    def __getitem__(self, rank: int):
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool):
            raise InputError(f"a result is indexed by rank first: result[rank][{rank!r}], not result[{rank!r}]")
        W = self.kernel.world_size
        if not -W <= rank < W:
            raise InputError(f"rank {rank}: this result has ranks 0..{W - 1}")
        rank %= W                           # (result[-1] is the last rank, as on a one-process result)
        if rank != self.rank:
            raise InputError(f"this process is rank {self.rank} of {self.kernel.world_size}: it holds only its own "
                             f"arrays (result[{self.rank}]), not rank {rank}'s")
        return self.outputs[rank]

    def __repr__(self) -> str:
        k = self.kernel
        times = ", ".join(f"{t:.3f}" for t in self.launch_ms)
        return one_line(f"<RunResult {k.name}: rank {self.rank} of {k.world_size} on {self.device or 'a GPU'}, "
                        f"{self.launches} launch(es) [{times}] ms; outputs {', '.join(self.outputs[self.rank])}>")


def run_across(kernel, world_size, inputs, seed, options, kwargs: dict, *, group, timeout_s, lowering, progress,
               device=None) -> DistRunResult:
    """``tl.run`` with ``group=``: this process is one rank of ``group`` and ``inputs`` its own
    arguments (a dict by name, or the arrays in argument order); the program runs through
    :class:`FusedProgram` (building it is collective: every rank calls ``tl.run`` alike).
    ``world_size``: None or the group's size. The arguments are checked and traced as
    ``tl.simulate`` checks them."""
    from ..sim.simulate import checked_call
    ctx = dist_context(group)
    if world_size is not None and world_size != ctx.world_size:
        raise InputError(f"world_size={world_size!r}, but the process group has {ctx.world_size} ranks")
    if inputs is None or not isinstance(inputs, (dict, list, tuple)):
        raise InputError("tl.run(..., group=...) takes this rank's inputs: one dict by argument name, or the arrays "
                         f"in argument order (got {type(inputs).__name__})")
    ir, per_rank, opts = checked_call(kernel, ctx.world_size, [inputs] * ctx.world_size, seed, options, kwargs,
                                      "run", "it is unused across GPUs (each rank enqueues its own parts)")
    op = FusedProgram(kernel, group, per_rank[0], timeout_s=timeout_s, lowering=lowering,
                      static_checks=opts.static_checks, device=device, progress=progress, **kwargs)
    at = op.device.torch_device
    tensors = [to_device(arr, b.type.dtype, at) for b, arr in zip(op.kernel.args, per_rank[0])]
    written = written_arguments(op.kernel)
    saved = [(t, t.clone()) for b, t in zip(op.kernel.args, tensors) if b in written]
    for launch in range(opts.launches):
        for t, original in saved if launch else ():
            t.copy_(original)          # every launch on the caller's arguments, as tl.simulate's (on the op's stream)
        op(*tensors)
        op.synchronize()
    W, rank = ctx.world_size, ctx.rank
    outputs, workspaces = [{} for _ in range(W)], [{} for _ in range(W)]
    mine = {b.name: t for b, t in zip(op.kernel.args, tensors)}
    mine.update(op.workspace_tensors())
    outs, wss = read_back(op.kernel, [mine])
    del mine                            # (copies: nothing outside the op may view its symmetric memory at close())
    outputs[rank] = {k: np.array(v, copy=True) for k, v in outs[0].items()}
    workspaces[rank] = {k: np.array(v, copy=True) for k, v in wss[0].items()}
    del outs, wss
    result = DistRunResult(op.kernel, outputs, workspaces, [], 0, opts.launches, seed, 0, device=op.device.name,
                           plan=op.plan, launch_ms=list(op.launch_ms), tensors=[{} for _ in range(W)], rank=rank)
    result.tensors[rank] = {b.name: t for b, t in zip(op.kernel.args, tensors)}
    op.close()
    return result


register_group_runner(run_across)
