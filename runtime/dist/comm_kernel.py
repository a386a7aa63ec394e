"""Launch a lowered SM communication kernel (:class:`tldsl.codegen.recipes.sm_comm.LoweredComm`), and
the symmetric workspace its pointer tables point into.

**Parameter contract** (``LoweredComm.params``, in order; the launcher passes exactly these):

* ``buffer:<name>`` — this rank's tensor: shape and dtype as traced, contiguous, 16-byte aligned;
* ``peers:<name>`` — a device array of ``world_size`` pointers, entry ``q`` = rank ``q``'s copy
  of the symmetric buffer as mapped in this process; entry ``rank`` must be the pointer passed
  for ``buffer:<name>`` when the kernel takes both;
* ``signal:<name>`` — this rank's u64 counters (at least the signal's slots);
* ``peer_signals:<name>`` — the same table for a symmetric signal;
* ``rank`` (i32) and ``launch`` (u64, the 1-based epoch the waits count in).

The pointer tables are built and uploaded **once per op object** (:class:`CommKernel` takes
every rank's addresses at construction, checks them, uploads each table once); a call only
packs this call's tensors, the rank and the launch index. Grid: ``lanes`` CTAs
(``LoweredComm.grid()``), block ``(threads, 1, 1)``, no dynamic shared memory.

**Symmetric workspace** (:class:`SymmetricWorkspace`): one symmetric allocation per op object
(torch symmetric memory, collective: every rank of the group builds it at the same point),
carved into named regions — the symmetric buffers and signals of a tile program — with every
rank's address of each region (:func:`~..gpu.plan_exec.symmetric_addresses`). Signals are zeroed
and the group synchronised before anyone can notify them. Region layout is pure
(:func:`~.regions.layout_regions`) and host-tested; :func:`make_workspace` picks this
workspace or NVSHMEM's (:mod:`.nvshmem`) by the kernel's transport.

The driver (``cuda.bindings.driver``), the kernel loader and the table uploader can be passed
in; the host tests pass fakes that record what would reach the GPU.
"""
from __future__ import annotations

import ctypes
from typing import Mapping, Sequence

from ...codegen.abi import SOURCES
from ...errors import InputError
from ..gpu.launch import ArgPack
from .nvshmem import NvshmemWorkspace
from ..gpu.plan_exec import DeviceArray, as_device_array, checked, load_driver, symmetric_addresses, torch_uploader
from .regions import SIGNAL_DTYPES, RegionWorkspace, layout_regions


def kernel_specs(kernel_ir) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, int]]:
    """``({buffer: (shape, dtype)}, {signal: slots})`` of a traced kernel (every buffer, argument or
    workspace, and every signal)."""
    bufs = {b.name: (tuple(b.type.shape), b.type.dtype.name) for b in kernel_ir.buffers}
    sigs = {s.name: int(s.type.slots) for s in kernel_ir.signals}
    return bufs, sigs


def _check_u64_table(name: str, values, world_size: int, align: int) -> tuple[int, ...]:
    vals = tuple(int(v) for v in values)
    if len(vals) != world_size:
        raise InputError(f"table '{name}' has {len(vals)} entries for a world of {world_size}")
    for q, v in enumerate(vals):
        if v <= 0 or v >= 1 << 63:
            raise InputError(f"table '{name}': rank {q}'s address {v:#x} is not a device pointer")
        if v % align:
            raise InputError(f"table '{name}': rank {q}'s address {v:#x} is not {align}-byte aligned")
    return vals


def make_workspace(ctx, specs, transport: str, lease=None):
    """The symmetric workspace a transport needs (collective): torch symmetric memory for ``ptr``
    kernels (peer-pointer tables), NVSHMEM's heap for ``nvshmem`` kernels (``nvshmem_ptr`` on the
    device only finds addresses inside it). ``lease``: the owning op's
    :class:`~.symmetric.Lease`, which frees it when the op is closed (default: its own)."""
    if transport == "nvshmem":
        return NvshmemWorkspace(ctx, specs, lease=lease)
    if transport != "ptr":
        raise InputError(f"transport={transport!r}: choose 'ptr' or 'nvshmem'")
    return SymmetricWorkspace(ctx, specs, lease=lease)


class CommKernel:
    """A lowered communication part, loaded, with its pointer tables on the device.

    ``buffers`` / ``signal_slots``: the traced shapes (:func:`kernel_specs`); ``peers`` /
    ``peer_signals``: every rank's address (as mapped here) of each symmetric buffer / signal the
    kernel reaches on other ranks. ``kernel``: an already loaded kernel (``.function``,
    ``.smem_bytes``, ``.name``); else ``compiled`` (or the lowered source, compiled now) is
    loaded into the current context."""

    def __init__(self, lowered, *, rank: int, world_size: int, buffers: Mapping[str, tuple],
                 signal_slots: Mapping[str, int], peers: Mapping[str, Sequence[int]] | None = None,
                 peer_signals: Mapping[str, Sequence[int]] | None = None, kernel=None, compiled=None,
                 progress=None, driver=None, uploader=None, nvshmem=None):
        self.lowered = lowered
        self.transport = getattr(lowered, "transport", "ptr")
        if self.transport == "nvshmem" and nvshmem is None:
            raise InputError(f"{lowered.entry} was compiled for transport='nvshmem': pass nvshmem= (the initialised "
                             "library, e.g. NvshmemWorkspace(...).nv) so its module gets nvshmemx_cumodule_init")
        self.rank, self.world_size = int(rank), int(world_size)
        if lowered.world_size != self.world_size:
            raise InputError(f"{lowered.entry} was traced for {lowered.world_size} ranks, not {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"rank {rank} is outside the world of {world_size}")
        self.buffers = {k: (tuple(v[0]), v[1]) for k, v in buffers.items()}
        self.signal_slots = dict(signal_slots)
        peers, peer_signals = dict(peers or {}), dict(peer_signals or {})
        self._drv = driver
        upload = uploader or torch_uploader
        self.tables: dict[str, DeviceArray] = {}        # param source -> device array of W pointers
        self.table_values: dict[str, tuple[int, ...]] = {}
        for p in lowered.params:
            kind, name = p.origin
            if kind == "buffer":
                if name not in self.buffers:
                    raise InputError(f"{lowered.entry} reads '{name}' but no shape was given for it")
            elif kind == "signal":
                if name not in self.signal_slots:
                    raise InputError(f"{lowered.entry} uses signal '{name}' but no slot count was given for it")
            elif kind == "peers":
                if name not in peers:
                    raise InputError(f"{lowered.entry} reaches '{name}' on other ranks: pass every rank's address "
                                     f"of it (peers={{'{name}': [...]}})")
                shape, dt = self.buffers.get(name, (None, None))
                if shape is None:
                    raise InputError(f"{lowered.entry} reaches '{name}' but no shape was given for it")
                vals = _check_u64_table(p.source, peers[name], self.world_size, 16)
                self.table_values[p.source] = vals
            elif kind == "peer_signals":
                if name not in peer_signals:
                    raise InputError(f"{lowered.entry} notifies signal '{name}' on other ranks: pass every rank's "
                                     f"address of it (peer_signals={{'{name}': [...]}})")
                if name not in self.signal_slots:
                    raise InputError(f"{lowered.entry} uses signal '{name}' but no slot count was given for it")
                vals = _check_u64_table(p.source, peer_signals[name], self.world_size, 8)
                self.table_values[p.source] = vals
            elif p.source not in ("rank", "launch"):
                raise InputError(f"{lowered.entry}: unknown kernel parameter source {p.source!r}")
        for src, vals in self.table_values.items():       # once per op object
            arr = upload(vals)
            if not isinstance(arr, DeviceArray) or arr.numel != self.world_size or arr.dtype not in SIGNAL_DTYPES:
                raise InputError(f"the uploader returned {arr!r} for table '{src}'; need {self.world_size} u64 values")
            self.tables[src] = arr
        self.grid = tuple(lowered.grid())
        self.block = tuple(lowered.block)
        if kernel is None:
            from ..gpu.module import load_kernel
            comp = compiled if compiled is not None else lowered.compile(progress=progress)
            kernel = load_kernel(comp.cubin, lowered.entry, 0)
        self.kernel = kernel
        if self.transport == "nvshmem":
            nvshmem.init_module(kernel.module)      # the module's copy of NVSHMEM's device state, before any launch

    @property
    def driver(self):
        if self._drv is None:
            self._drv = load_driver()
        return self._drv

    # -- arguments -------------------------------------------------------------------------------
    def _buffer(self, name: str, given) -> DeviceArray:
        if given is None:
            raise InputError(f"{self.lowered.entry}: missing tensor '{name}'")
        arr = as_device_array(given, f"'{name}'")
        shape, dt = self.buffers[name]
        if arr.shape != shape:
            raise InputError(f"'{name}' has shape {arr.shape}; the kernel was built for {shape}")
        if arr.dtype != dt:
            raise InputError(f"'{name}' is {arr.dtype}; the kernel was built for {dt}")
        if arr.ptr % 16:
            raise InputError(f"'{name}' at {arr.ptr:#x} must be 16-byte aligned (vector access)")
        return arr

    def _signal(self, name: str, given) -> DeviceArray:
        slots = self.signal_slots[name]
        if given is None:
            raise InputError(f"{self.lowered.entry} uses signal '{name}': pass signals={{'{name}': a contiguous int64 "
                             f"CUDA tensor of at least {slots} counters}}")
        arr = as_device_array(given, f"signal '{name}'")
        if arr.dtype not in SIGNAL_DTYPES or arr.numel < slots:
            raise InputError(f"signal '{name}' must be {slots} or more 64-bit counters, got {arr.numel} x {arr.dtype}")
        if arr.ptr % 8:
            raise InputError(f"signal '{name}' at {arr.ptr:#x} must be 8-byte aligned")
        return arr

    def args(self, buffers: Mapping[str, object], signals: Mapping[str, object], launch_index: int):
        """The packed parameters and ``[(param name, value)]`` as the kernel receives them."""
        if not isinstance(launch_index, int) or launch_index < 1:
            raise InputError(f"launch index {launch_index!r}: launches count from 1")
        pack = ArgPack()
        values = []
        local = {}
        for p in self.lowered.params:
            kind, name = p.origin
            if kind == "buffer":
                v = self._buffer(name, buffers.get(name)).ptr
                local[("peers", name)] = v
            elif kind == "signal":
                v = self._signal(name, signals.get(name)).ptr
                local[("peer_signals", name)] = v
            elif kind in ("peers", "peer_signals"):
                v = self.tables[p.source].ptr
            elif kind == "rank":
                v = self.rank
            elif kind == "launch":
                v = launch_index
            else:
                raise InputError(f"{self.lowered.entry}: a communication kernel cannot be passed parameter {p.name} "
                                 f"({p.source!r}: {SOURCES[kind]})")
            pack.add(p.kind, v)
            values.append((p.name, v))
        for (kind, name), ptr in local.items():        # this rank's table entry must be the tensor passed
            src = f"{kind}:{name}"
            if src in self.table_values and self.table_values[src][self.rank] != ptr:
                raise InputError(f"'{name}' was passed at {ptr:#x}, but the pointer table gives rank {self.rank}'s copy "
                                 f"at {self.table_values[src][self.rank]:#x}: pass the symmetric workspace's tensor")
        return pack, values

    def prepare(self, buffers: Mapping[str, object], signals: Mapping[str, object]):
        """Validate and pack the arguments once (:class:`~..gpu.launch.PreparedLaunch`): the ops
        cache these per set of tensor addresses and launch with only the epoch."""
        from ..gpu.launch import PreparedLaunch
        pack, _ = self.args(buffers, signals, 1)
        slot = next(i for i, p in enumerate(self.lowered.params) if p.source == "launch")
        return PreparedLaunch(self.kernel, self.grid, self.block, pack, slot, enqueue=self._enqueue)

    def __call__(self, stream: int, buffers: Mapping[str, object], signals: Mapping[str, object],
                 launch_index: int) -> list[tuple[str, object]]:
        """Launch on ``stream`` (a CUstream handle). Returns the parameter values passed."""
        pack, values = self.args(buffers, signals, launch_index)
        self._enqueue(stream, pack, launch_index)
        return values

    def _enqueue(self, stream: int, pack, launch_index: int) -> None:
        k = self.kernel
        checked(self.driver, self.driver.cuLaunchKernel(k.function, *self.grid, *self.block, k.smem_bytes, stream,
                                                        pack.address(), 0),
                f"cuLaunchKernel({self.lowered.entry}, grid {self.grid}, block {self.block}, launch {launch_index})")


def decode_args(address: int, kinds: Sequence[str]) -> list[int]:
    """Read back a packed ``void*[]`` parameter array (what ``cuLaunchKernel`` receives) as ints,
    one per parameter kind (``ptr``, ``i32``, ``u64``). For tests and debugging."""
    arr = (ctypes.c_void_p * len(kinds)).from_address(address)
    out = []
    for slot, kind in zip(arr, kinds):
        ctype = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "u64": ctypes.c_uint64}[kind]
        out.append(int(ctype.from_address(slot).value))
    return out


# =================================================================================================
# the symmetric workspace
# =================================================================================================

_TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32", "u64": "int64",
                 "i64": "int64", "u8": "uint8"}


class SymmetricWorkspace(RegionWorkspace):
    """One symmetric allocation carved into named regions, with every rank's address of each.

    Building it is **collective** (``symm_mem.rendezvous``): every rank of ``ctx.group`` must
    build the same layout at the same point. Signal regions are zeroed, then the group
    synchronises (a barrier on the handle, which also loads torch's barrier kernel before any
    persistent kernel can be spinning), so no rank notifies a counter before its owner zeroed it.
    Its memory is held by ``lease`` (:mod:`.symmetric`): freed when that lease is released —
    by :meth:`close` if the workspace has its own — never by garbage collection.
    """

    def __init__(self, ctx, specs: Sequence[tuple[str, str, Sequence[int], str]], *, align: int = 512,
                 lease=None):
        import torch
        from .group import enable_symmetric_memory
        from .symmetric import Lease
        self.ctx = ctx
        self.regions, self.total_bytes = layout_regions(specs, align)
        enable_symmetric_memory(ctx.group_name)
        self._own_lease = lease is None
        self.lease = lease or Lease(ctx, f"symmetric workspace of {self.total_bytes} bytes", self)
        self.raw, self.handle = self.lease.empty(self.total_bytes, torch.uint8)
        ptrs = [int(p) for p in self.handle.buffer_ptrs]
        off = getattr(self.handle, "offset", None)
        size = getattr(self.handle, "buffer_size", None)
        self.addresses: dict[str, tuple[int, ...]] = {}
        self.tensors: dict[str, object] = {}
        for r in self.regions:
            self.addresses[r.name] = symmetric_addresses(ptrs, ctx.rank, self.raw.data_ptr(), r.nbytes,
                                                         handle_offset=off, buffer_size=size, region_offset=r.offset)
            t = self.raw[r.offset:r.offset + r.nbytes].view(getattr(torch, _TORCH_DTYPES[r.dtype])).view(r.shape)
            self.tensors[r.name] = t
            if r.kind == "signal":
                t.zero_()
        self.handle.barrier(channel=0)
        torch.cuda.synchronize()

    def barrier(self, stream=None, channel: int = 0, timeout_ms: int | None = None):
        """A stream-ordered barrier of the group (torch's barrier kernel on ``stream``, default
        the current stream): work after it on every rank starts after work before it on all."""
        import torch
        kw = {"timeout_ms": timeout_ms} if timeout_ms else {}
        if stream is None:
            self.handle.barrier(channel=channel, **kw)
        else:
            with torch.cuda.stream(stream):
                self.handle.barrier(channel=channel, **kw)

    def close(self) -> None:
        """Drop this workspace's views of its memory; with its own lease, free it now
        (collective: every rank, same point), else its op's ``close()`` does."""
        self.lease.forget(self)
        if self._own_lease:
            self.lease.release()


def signal_map(entries: Sequence[tuple[str, int, int, str]]) -> list[tuple[str, int, int, str]]:
    """Normalise ``(signal name, base address, slots, note)`` entries (one per signal array this
    rank's kernels wait on or notify) for :func:`explain_address`."""
    return [(str(n), int(a), int(s), str(note)) for n, a, s, note in entries]


def explain_address(addr: int, entries: Sequence[tuple[str, int, int, str]]) -> str | None:
    """Which signal slot ``addr`` is (a device ``wait timed out: slot 0x...`` line), or None."""
    for name, base, slots, note in entries:
        if base <= addr < base + 8 * slots and (addr - base) % 8 == 0:
            return f"{name}[{(addr - base) // 8}]" + (f" ({note})" if note else "")
    return None
