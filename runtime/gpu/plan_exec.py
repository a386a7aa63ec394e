"""Execute a copy-engine plan (:class:`tldsl.codegen.plan.copy_engine.CopyEnginePlan`) on CUDA streams.

A plan lists, per rank, what that rank enqueues on one communication stream per launch:
copies (:class:`CeCopy`), signal writes (:class:`CeSignalWrite`) and stream waits
(:class:`CeWait`). :class:`PlanExecutor` turns rank ``r``'s list into driver calls:

* a copy becomes ``cuMemcpyAsync`` when its rows are contiguous on both sides (or it is one
  row), else ``cuMemcpy2DAsync`` with the plan's pitches — the same bytes, offsets and pitches
  :meth:`CopyEnginePlan.run_numpy` moves;
* a signal write becomes ``cuStreamWriteValue64(stream, addr, value(launch),
  CU_STREAM_WRITE_VALUE_DEFAULT)`` (the default flags order it after the stream's earlier
  copies) — or, for a slot with other writers (``add``), a one-thread kernel adding 1
  (:mod:`.signal_add`; a driver that executes the calls itself provides ``tldsl_signal_add``);
* a wait becomes ``cuStreamWaitValue64(stream, addr, target(launch), CU_STREAM_WAIT_VALUE_GEQ)``.

Every driver call is checked (:class:`CudaDriverError` naming the call, the action and its
tile program line). Addresses come from a :class:`PointerTable`: for each buffer / signal of
the plan, every rank's copy *as mapped in this process* (torch symmetric memory's
``buffer_ptrs`` plus the region's offset; see :func:`symmetric_addresses`), or only this rank's
own address for a local tensor. Every access of the plan is bounds-checked against the tables
once, when the executor is built, so a wrong table fails before anything is enqueued.

Same-GPU copies: the driver runs a device-to-device copy within one GPU as an SM kernel, so
on a communication stream beside a persistent kernel that holds every SM and waits for it, it
can never start (measured: BENCHMARKS.md, 2-GPU AllGather+GEMM). ``enqueue(...,
local_stream=s)`` moves each *local segment* of the plan (a run of same-GPU copies and the
signal writes that follow them, no waits) to stream ``s`` — the compute stream, before the
persistent kernel is enqueued. That keeps the plan's meaning when every signal write
publishes only the copies of its own segment (true of ``all_gather``: one flag per shard);
:attr:`PlanExecutor.segments` shows the split. The fused-op runtime goes further where it can:
the leading local segments (:func:`hoistable`: an all-gather's own shard) are enqueued
before any part is forked (``enqueue(..., only="hoisted")``, the rest with ``only="rest"``), so
no persistent kernel is resident while they run and none has to leave SMs free for them.

The driver module is ``cuda.bindings.driver`` unless one is passed (the host tests pass a
fake that executes the calls on numpy memory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from ...errors import InputError
from .device import CudaDriverError

ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "i32": 4, "u64": 8, "i64": 8, "u8": 1}


def load_driver():
    """``cuda.bindings.driver`` (cuda-python)."""
    from cuda.bindings import driver
    return driver


class DriverConstants(NamedTuple):
    drv: object
    write_default: object     # CU_STREAM_WRITE_VALUE_DEFAULT
    wait_geq: object          # CU_STREAM_WAIT_VALUE_GEQ
    success: object           # CUDA_SUCCESS


_CONSTANTS: dict = {}


def driver_constants(drv) -> DriverConstants:
    """The enum values a launch passes or compares, looked up once per driver module:
    cuda-python builds a new enum object at every attribute access, and a launch makes a
    dozen of them on the host's critical path."""
    c = _CONSTANTS.get(id(drv))
    if c is None or c.drv is not drv:
        c = _CONSTANTS[id(drv)] = DriverConstants(drv, drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
                                                  drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
                                                  drv.CUresult.CUDA_SUCCESS)
    return c


def stream_handshake(drv, stream: int, arrive: Sequence[int], rank: int, launch: int) -> None:
    """A group barrier as stream memory operations on ``stream``, no kernel and no SM: write
    ``launch`` into slot ``rank`` of every peer's symmetric arrival array (``arrive[q]``: rank
    ``q``'s array as mapped here; each write is ordered after the stream's earlier work and
    preceded by a memory barrier), then wait until every peer's slot here holds ``launch`` or
    more. Counters only grow, so an earlier launch's value never satisfies the wait."""
    stream_arrive(drv, stream, arrive, rank, launch)
    stream_await(drv, stream, arrive, rank, launch)


def stream_arrive(drv, stream: int, arrive: Sequence[int], rank: int, launch: int) -> None:
    """The first half of :func:`stream_handshake`: ``launch`` into slot ``rank`` of every peer's
    arrival array (a host may enqueue it early, the wait later)."""
    W = len(arrive)
    wr = driver_constants(drv).write_default
    for p in ((rank + s) % W for s in range(1, W)):
        checked(drv, drv.cuStreamWriteValue64(stream, arrive[p] + 8 * rank, launch, wr),
                f"cuStreamWriteValue64(arrival of rank {rank} on rank {p})")


def stream_await(drv, stream: int, arrive: Sequence[int], rank: int, launch: int) -> None:
    """The second half of :func:`stream_handshake`: wait until every peer's slot here holds
    ``launch`` or more."""
    W = len(arrive)
    geq = driver_constants(drv).wait_geq
    for p in ((rank + s) % W for s in range(1, W)):
        checked(drv, drv.cuStreamWaitValue64(stream, arrive[rank] + 8 * p, launch, geq),
                f"cuStreamWaitValue64(arrival of rank {p})")


def segments_of(actions, rank: int, kinds) -> tuple[tuple[bool, tuple], ...]:
    """``actions`` cut into segments (a run of copies, then the writes / waits that follow them);
    each flagged local when all its copies stay on ``rank``'s GPU and it has no wait. ``kinds``:
    the (CeCopy, CeSignalWrite, CeWait) classes."""
    CeCopy, _, CeWait = kinds
    segs: list[list] = []
    for a in actions:
        if isinstance(a, CeCopy) and (not segs or not isinstance(segs[-1][-1], CeCopy)):
            segs.append([a])
        elif not segs:
            segs.append([a])
        else:
            segs[-1].append(a)
    out = []
    for s in segs:
        copies = [a for a in s if isinstance(a, CeCopy)]
        local = bool(copies) and all(c.src_rank == rank and c.dst_rank == rank for c in copies) and \
            not any(isinstance(a, CeWait) for a in s)
        out.append((local, tuple(s)))
    return tuple(out)


def hoistable(segments) -> tuple[bool, ...]:
    """Per segment of :func:`segments_of`: whether it may run before the launch's parts are forked
    — the leading run of local segments only. A local segment has no wait, and none precedes it;
    nor does any cross-GPU copy or signal write, so moved ahead it keeps the plan's order of writes
    (most signal writes are absolute values: a later segment's write run first could publish copies
    not yet made, and then be overwritten; an add run early would count copies not yet made)."""
    out, leading = [], True
    for local, _ in segments:
        leading = leading and local
        out.append(leading)
    return tuple(out)


def local_copies_left(plan, rank: int) -> bool:
    """Whether rank ``rank``'s actions of ``plan`` keep work that runs on SMs once the hoistable
    segments are taken out — a same-GPU copy (within this rank's GPU or within a peer's: a copy
    from a peer's buffer into the same peer's), or a notify adding from a kernel
    (:mod:`.signal_add`) — : only then must SMs stay free beside the persistent kernels."""
    from ...codegen.plan.copy_engine import CeCopy, CeSignalWrite, CeWait
    kinds = (CeCopy, CeSignalWrite, CeWait)
    segs = segments_of(plan.actions[rank], rank, kinds)
    return any(not early and any((isinstance(a, CeCopy) and a.src_rank == a.dst_rank) or
                                 (isinstance(a, CeSignalWrite) and a.add) for a in seg)
               for (_, seg), early in zip(segs, hoistable(segs)))


def checked(drv, result, what: str):
    """Unwrap a cuda-python ``(CUresult, *values)`` result of ``drv``; raise on any error."""
    err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != driver_constants(drv).success:
        try:
            name = drv.cuGetErrorName(err)[1]
            desc = drv.cuGetErrorString(err)[1]
        except Exception:   # noqa: BLE001 - the error itself is what matters
            name = desc = None
        name = name.decode() if isinstance(name, bytes) else (name or str(err))
        desc = desc.decode() if isinstance(desc, bytes) else (desc or "")
        raise CudaDriverError(f"{what} failed: {name} ({desc})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def raw_stream_getter(torch):
    """``f(device_index) -> int``: the current stream's raw handle, by torch's accessor for it
    where this build has one (no Stream object built: a fused op's launch is host-bound)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)


def driver_event(drv, owner):
    """A driver event without timing, destroyed when ``owner`` is collected."""
    import weakref
    ev = checked(drv, drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    weakref.finalize(owner, drv.cuEventDestroy, ev)
    return ev


# =================================================================================================
# device memory descriptors and pointer tables
# =================================================================================================

@dataclass(frozen=True)
class DeviceArray:
    """A contiguous array in device memory: address, shape, element type (IR dtype name or
    ``u64`` / ``i64`` / ``u8``). ``owner`` keeps the memory alive (a torch tensor)."""
    ptr: int
    shape: tuple[int, ...]
    dtype: str
    owner: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "ptr", int(self.ptr))
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        if self.dtype not in ELEM_BYTES:
            raise InputError(f"unknown device array element type {self.dtype!r}")

    @property
    def numel(self) -> int:
        n = 1
        for x in self.shape:
            n *= x
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * ELEM_BYTES[self.dtype]


_TORCH_TO_IR = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32", "torch.int32": "i32",
                "torch.int64": "i64", "torch.uint8": "u8", "torch.uint64": "u64"}


def as_device_array(x, what: str = "tensor") -> DeviceArray:
    """A :class:`DeviceArray` for a contiguous CUDA torch tensor (or a DeviceArray, unchanged)."""
    if isinstance(x, DeviceArray):
        return x
    is_cuda = getattr(x, "is_cuda", None)
    if is_cuda is None or not hasattr(x, "data_ptr"):
        raise InputError(f"{what} must be a CUDA torch tensor, got {type(x).__name__}")
    if not is_cuda:
        raise InputError(f"{what} must be a CUDA tensor (it is on {x.device})")
    if not x.is_contiguous():
        raise InputError(f"{what} must be contiguous (row-major)")
    dt = _TORCH_TO_IR.get(str(x.dtype))
    if dt is None:
        raise InputError(f"{what} has an unsupported dtype {x.dtype}")
    return DeviceArray(x.data_ptr(), tuple(x.shape), dt, owner=x)


def symmetric_addresses(buffer_ptrs: Sequence[int], rank: int, local_ptr: int, nbytes: int, *,
                        handle_offset: int | None = None, buffer_size: int | None = None,
                        region_offset: int = 0) -> tuple[int, ...]:
    """Every rank's address, as mapped in this process, of a region of a symmetric allocation.

    ``buffer_ptrs`` is the symmetric-memory handle's per-rank base address (torch's
    ``handle.buffer_ptrs``: the base of each rank's block); ``local_ptr`` is this rank's tensor
    (``data_ptr()``), which may lie ``offset`` bytes into its block (torch's ``handle.offset``
    where the backend reports one). The region starts ``region_offset`` bytes into the tensor
    and spans ``nbytes``. Every rank's copy lies at the same offset of its block."""
    ptrs = [int(p) for p in buffer_ptrs]
    W = len(ptrs)
    if not 0 <= rank < W:
        raise InputError(f"rank {rank} is outside the symmetric handle's {W} buffer pointers")
    if any(p == 0 for p in ptrs):
        raise InputError(f"a symmetric handle's buffer pointer is null: {[hex(p) for p in ptrs]} (a peer is not "
                         "reachable by load/store)")
    off = int(local_ptr) - ptrs[rank]
    if off < 0:
        raise InputError(f"the symmetric tensor at {int(local_ptr):#x} lies before its block at {ptrs[rank]:#x}")
    if handle_offset is not None and int(handle_offset) != off:
        raise InputError(f"the symmetric tensor lies {off} bytes into its block but the handle says "
                         f"{int(handle_offset)}")
    if buffer_size is not None and off + region_offset + nbytes > int(buffer_size):
        raise InputError(f"region [{off + region_offset}, {off + region_offset + nbytes}) runs past the symmetric "
                         f"block of {int(buffer_size)} bytes")
    return tuple(p + off + int(region_offset) for p in ptrs)


@dataclass
class PointerTable:
    """Addresses of named tensors as this process sees them: ``entries[name][q]`` = rank ``q``'s
    copy (None where this process cannot address it, e.g. a local tensor's peers) and the
    bytes each copy holds."""
    world_size: int
    rank: int
    entries: dict[str, tuple[int | None, ...]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def add_symmetric(self, name: str, addresses: Sequence[int], nbytes: int) -> "PointerTable":
        if len(addresses) != self.world_size:
            raise InputError(f"'{name}': {len(addresses)} addresses for a world of {self.world_size}")
        self.entries[name] = tuple(int(a) for a in addresses)
        self.sizes[name] = int(nbytes)
        return self

    def add_local(self, name: str, address: int, nbytes: int) -> "PointerTable":
        ent = [None] * self.world_size
        ent[self.rank] = int(address)
        self.entries[name] = tuple(ent)
        self.sizes[name] = int(nbytes)
        return self

    def address(self, name: str, rank: int, what: str = "") -> int:
        ent = self.entries.get(name)
        if ent is None:
            raise InputError(f"{what}no address for '{name}' (known: {sorted(self.entries)})")
        if not 0 <= rank < self.world_size:
            raise InputError(f"{what}rank {rank} is outside the world of {self.world_size}")
        a = ent[rank]
        if a is None:
            raise InputError(f"{what}'{name}' on rank {rank} is not addressable from rank {self.rank}: it must be "
                             "symmetric (allocated with symmetric memory) for the plan to reach it")
        return a


# =================================================================================================
# resolved actions
# =================================================================================================

@dataclass(frozen=True)
class ResolvedCopy:
    action: object            # CeCopy
    src: int
    dst: int
    width: int
    height: int
    src_pitch: int
    dst_pitch: int
    local: bool               # both ends on this GPU: the driver runs it on SMs

    @property
    def contiguous(self) -> bool:
        return self.height == 1 or (self.src_pitch == self.width and self.dst_pitch == self.width)


@dataclass(frozen=True)
class ResolvedWrite:
    action: object            # CeSignalWrite
    addr: int


@dataclass(frozen=True)
class ResolvedWait:
    action: object            # CeWait
    addr: int


def _where(a) -> str:
    loc = getattr(a, "loc", "")
    return f" ({loc})" if loc else ""


def _span(name, off, width, height, pitch, size, a, what):
    end = off + (height - 1) * pitch + width if height > 0 else off
    if off < 0 or end > size:
        raise InputError(f"{what}: bytes [{off}, {end}) of '{name}' lie outside its {size} bytes{_where(a)}")


class PlanExecutor:
    """Rank ``rank``'s part of a copy-engine plan, resolved to addresses once, enqueued per launch.

    ``pointers``: a :class:`PointerTable` with every buffer and signal the plan touches.
    Names listed in ``per_call`` are this rank's tensors that change from call to call (e.g. a
    freshly allocated output): their addresses are given to :meth:`enqueue`, checked against
    the size recorded in the table for them. ``checks_only``: built for its checks alone (no GPU:
    nothing is loaded, nothing can be enqueued)."""

    def __init__(self, plan, rank: int, pointers: PointerTable, *, per_call: Sequence[str] = (), driver=None,
                 checks_only: bool = False):
        from ...codegen.plan.copy_engine import CeCopy, CeSignalWrite, CeWait
        self._kinds = (CeCopy, CeSignalWrite, CeWait)
        if pointers.world_size != plan.world_size or pointers.rank != rank:
            raise InputError(f"pointer table is for rank {pointers.rank} of {pointers.world_size}; the plan needs "
                             f"rank {rank} of {plan.world_size}")
        self.plan, self.rank, self.pointers = plan, int(rank), pointers
        self.per_call = tuple(per_call)
        self._drv = driver
        self.actions = tuple(plan.actions[rank])
        for name in self.per_call:
            if name not in pointers.sizes:
                raise InputError(f"per-call tensor '{name}' needs its size in the pointer table")
        # validate (and for fixed tensors, resolve) every action now
        self._check_all()
        # a notify adding from a kernel: the kernel compiled and loaded now, not mid-launch (a driver
        # that executes the calls itself provides the add)
        self._add = getattr(driver, "tldsl_signal_add", None)
        if self._add is None and not checks_only and any(isinstance(a, CeSignalWrite) and a.add for a in self.actions):
            from .signal_add import SignalAdder
            self._add = SignalAdder()
        self.segments = self._segments()
        self.hoisted = hoistable(self.segments)

    # -- validation --------------------------------------------------------------------------
    def _need_bytes(self, name: str) -> int | None:
        meta = self.plan.buffers.get(name)
        if meta is None:
            return None
        shape, _dt, eb = meta
        n = 1
        for x in shape:
            n *= x
        return n * eb

    def _check_all(self):
        CeCopy, CeSignalWrite, CeWait = self._kinds
        W, r = self.plan.world_size, self.rank
        for name, need in ((n, self._need_bytes(n)) for n in self.plan.buffers):
            if name in self.pointers.sizes and need is not None and self.pointers.sizes[name] < need:
                raise InputError(f"'{name}' holds {self.pointers.sizes[name]} bytes; the plan's tensor needs {need}")
        for a in self.actions:
            if isinstance(a, CeCopy):
                what = f"rank {r}: copy {a.src}@{a.src_rank} -> {a.dst}@{a.dst_rank}"
                if a.width_bytes <= 0 or a.height <= 0:
                    raise InputError(f"{what}: empty copy{_where(a)}")
                if a.height > 1 and (a.width_bytes > a.src_pitch or a.width_bytes > a.dst_pitch):
                    raise InputError(f"{what}: rows of {a.width_bytes} bytes overlap with pitches "
                                     f"{a.src_pitch} / {a.dst_pitch}{_where(a)}")
                for name, rk, off, pitch in ((a.src, a.src_rank, a.src_byte_offset, a.src_pitch),
                                             (a.dst, a.dst_rank, a.dst_byte_offset, a.dst_pitch)):
                    if name in self.per_call and rk != r:
                        raise InputError(f"{what}: '{name}' is given per call (this rank's tensor) but the plan "
                                         f"addresses rank {rk}'s copy{_where(a)}")
                    if name not in self.per_call:
                        self.pointers.address(name, rk, f"{what}: ")
                    _span(name, off, a.width_bytes, a.height, pitch, self.pointers.sizes.get(name, 0), a, what)
            elif isinstance(a, (CeSignalWrite, CeWait)):
                rk = a.rank if isinstance(a, CeSignalWrite) else r
                kind = "write" if isinstance(a, CeSignalWrite) else "wait"
                what = f"rank {r}: {kind} {a.signal}[{a.slot}]@{rk}"
                self.pointers.address(a.signal, rk, f"{what}: ")
                slots = self.plan.signals.get(a.signal)
                if slots is not None and not 0 <= a.slot < slots:
                    raise InputError(f"{what}: slot outside the signal's {slots} slots{_where(a)}")
                _span(a.signal, 8 * a.slot, 8, 1, 8, self.pointers.sizes.get(a.signal, 0), a, what)
            else:
                raise InputError(f"rank {r}: unknown plan action {a!r}")
        if not 0 <= self.rank < W:
            raise InputError(f"rank {self.rank} outside the plan's world of {W}")

    def _segments(self) -> tuple[tuple[bool, tuple], ...]:
        """The action list cut into segments (:func:`segments_of`)."""
        return segments_of(self.actions, self.rank, self._kinds)

    # -- resolution ----------------------------------------------------------------------------
    def _addr(self, name: str, rank: int, per_call: Mapping[str, int]) -> int:
        if name in self.per_call:
            if name not in per_call:
                raise InputError(f"enqueue: the address of '{name}' (given per call) is missing")
            v = per_call[name]
            if isinstance(v, DeviceArray):
                if v.nbytes < self.pointers.sizes[name]:
                    raise InputError(f"enqueue: '{name}' holds {v.nbytes} bytes; the plan needs "
                                     f"{self.pointers.sizes[name]}")
                return v.ptr
            return int(v)
        return self.pointers.address(name, rank)

    def resolve(self, per_call: Mapping[str, int | DeviceArray] | None = None) -> list:
        """Every action with its addresses (for this call's per-call tensors: an address, or a
        :class:`DeviceArray` whose size is checked)."""
        CeCopy, CeSignalWrite, CeWait = self._kinds
        per_call = dict(per_call or {})
        extra = set(per_call) - set(self.per_call)
        if extra:
            raise InputError(f"enqueue: {sorted(extra)} are not per-call tensors of this executor ({self.per_call})")
        out = []
        for a in self.actions:
            if isinstance(a, CeCopy):
                src = self._addr(a.src, a.src_rank, per_call) + a.src_byte_offset
                dst = self._addr(a.dst, a.dst_rank, per_call) + a.dst_byte_offset
                out.append(ResolvedCopy(a, src, dst, a.width_bytes, a.height, a.src_pitch, a.dst_pitch,
                                        a.src_rank == self.rank and a.dst_rank == self.rank))
            elif isinstance(a, CeSignalWrite):
                out.append(ResolvedWrite(a, self.pointers.address(a.signal, a.rank) + a.byte_offset))
            else:
                out.append(ResolvedWait(a, self.pointers.address(a.signal, self.rank) + 8 * a.slot))
        return out

    # -- enqueue ---------------------------------------------------------------------------------
    @property
    def driver(self):
        if self._drv is None:
            self._drv = load_driver()
        return self._drv

    def enqueue(self, stream: int, launch: int, *, local_stream: int | None = None,
                per_call: Mapping[str, int | DeviceArray] | None = None, only: str = "all") -> list[tuple]:
        """Enqueue this rank's actions for launch ``launch`` (1-based) on ``stream`` (a CUstream
        handle, e.g. ``torch.cuda.Stream().cuda_stream``); local segments on ``local_stream``
        when given. ``only``: ``"all"`` the segments, ``"hoisted"`` just the :attr:`hoisted` ones,
        ``"rest"`` all but those. Returns the calls issued, ``(function, stream, arguments...)``,
        in order."""
        if not isinstance(launch, int) or launch < 1:
            raise InputError(f"launch index {launch!r}: launches count from 1")
        if only not in ("all", "hoisted", "rest"):
            raise InputError(f"only={only!r}: 'all', 'hoisted' or 'rest'")
        resolved = self.resolve(per_call)
        by_action = {id(x.action): x for x in resolved}
        issued = []
        for (local, seg), early in zip(self.segments, self.hoisted):
            if (only == "hoisted" and not early) or (only == "rest" and early):
                continue
            s = local_stream if (local and local_stream is not None) else stream
            for a in seg:
                issued.append(self._issue(by_action[id(a)], s, launch))
        return issued

    def _issue(self, x, stream, launch):
        drv = self.driver
        a = x.action
        if isinstance(x, ResolvedCopy):
            what = (f"rank {self.rank}: copy {a.src}@{a.src_rank} -> {a.dst}@{a.dst_rank} "
                    f"({x.height} x {x.width} B){_where(a)}")
            if x.contiguous:
                n = x.width * x.height
                checked(drv, drv.cuMemcpyAsync(x.dst, x.src, n, stream), f"cuMemcpyAsync: {what}")
                return ("cuMemcpyAsync", stream, x.dst, x.src, n)
            p = drv.CUDA_MEMCPY2D()
            p.srcMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcDevice = x.src
            p.srcXInBytes = 0
            p.srcY = 0
            p.srcPitch = x.src_pitch
            p.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.dstDevice = x.dst
            p.dstXInBytes = 0
            p.dstY = 0
            p.dstPitch = x.dst_pitch
            p.WidthInBytes = x.width
            p.Height = x.height
            checked(drv, drv.cuMemcpy2DAsync(p, stream), f"cuMemcpy2DAsync: {what}")
            return ("cuMemcpy2DAsync", stream, x.dst, x.dst_pitch, x.src, x.src_pitch, x.width, x.height)
        if isinstance(x, ResolvedWrite) and a.add:
            try:
                self._add(stream, x.addr)
            except CudaDriverError as e:
                raise CudaDriverError(f"tldsl_signal_add: rank {self.rank}: {a.signal}[{a.slot}]@{a.rank} += 1"
                                      f"{_where(a)}: {e}") from e
            return ("tldsl_signal_add", stream, x.addr)
        if isinstance(x, ResolvedWrite):
            v = a.value(launch)
            checked(drv, drv.cuStreamWriteValue64(stream, x.addr, v,
                                                  drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
                    f"cuStreamWriteValue64: rank {self.rank}: {a.signal}[{a.slot}]@{a.rank} = {v}{_where(a)}")
            return ("cuStreamWriteValue64", stream, x.addr, v)
        t = a.target(launch)
        checked(drv, drv.cuStreamWaitValue64(stream, x.addr, t, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                f"cuStreamWaitValue64: rank {self.rank}: {a.signal}[{a.slot}] >= {t}{_where(a)}")
        return ("cuStreamWaitValue64", stream, x.addr, t)

    def describe(self) -> str:
        lines = [f"rank {self.rank} of {self.plan.kernel_name}.{self.plan.part}: {len(self.actions)} action(s) in "
                 f"{len(self.segments)} segment(s)"]
        for local, seg in self.segments:
            lines.append(f"  {'local (same-GPU copies: may go on the compute stream)' if local else 'communication stream'}:")
            for a in seg:
                lines.append(f"    {type(a).__name__} {a}")
        return "\n".join(lines)


def plan_symmetric_names(plan) -> tuple[set[str], set[str]]:
    """(buffers, signals) that some rank of ``plan`` addresses on another rank: they must live in
    symmetric memory; every other name of the plan can be a plain local tensor."""
    from ...codegen.plan.copy_engine import CeCopy, CeSignalWrite
    bufs, sigs = set(), set()
    for r, acts in enumerate(plan.actions):
        for a in acts:
            if isinstance(a, CeCopy):
                if a.src_rank != r:
                    bufs.add(a.src)
                if a.dst_rank != r:
                    bufs.add(a.dst)
            elif isinstance(a, CeSignalWrite) and a.rank != r:
                sigs.add(a.signal)
    return bufs, sigs


def torch_uploader(values: Sequence[int]) -> DeviceArray:
    """Upload a table of u64 values to the current CUDA device (kept alive by the result)."""
    import torch
    t = torch.tensor([int(v) for v in values], dtype=torch.int64,
                     device=torch.device("cuda", torch.cuda.current_device()))
    return DeviceArray(t.data_ptr(), (len(values),), "u64", owner=t)
