"""Every parameter of every lowered kernel, bound through one table keyed by its source kind.

A recipe describes its kernel's flat parameter list with :class:`tldsl.codegen.abi.KernelParam`
(``source``: ``"<kind>:<name>"`` or ``"<kind>"``, the kinds of :data:`~tldsl.codegen.abi.SOURCES`).
:data:`BINDERS` has one function per kind, so a GEMM, a communication kernel and a kernel of the
general recipe are launched the same way, and a new recipe needs no launcher code — the
"one runtime drives any traced kernel" rule. A parameter no binder can give a value raises
:class:`~.run_errors.UnboundParameterError` before anything is launched.

Addresses come from a :class:`DeviceMemory`: every rank's tensors and signal counters as
:class:`~tldsl.runtime.gpu.plan_exec.DeviceArray` s (all ranks in one address space: the
ranks ``tl.run`` runs on one GPU, or fake addresses where a plan is only checked), the tables
of every rank's addresses uploaded once each, the global-memory scratch of a kernel whose tiles
do not all fit in shared memory (allocated once per kernel and rank, for the CTAs the launch
runs, poisoned), and the TMA encoder.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...codegen.abi import SOURCES, KernelParam, TmaDescriptorSpec
from ...codegen.dtypes import elem_bytes
from .plan_exec import DeviceArray, PlanExecutor, PointerTable
from .launch import ArgPack
from .run_errors import UnboundParameterError

#: what a kernel's scratch holds before the kernel writes it: per 4 bytes 0x7FF87FF8, a NaN as
#: f32, f16 or bf16 and a large i32 (a tile read before it is written shows)
SCRATCH_POISON_WORD = 0x7FF8_7FF8_7FF8_7FF8
#: more CTAs than any launch runs: a kernel's largest grid
_ANY_SMS = 1 << 30


@dataclass
class DeviceMemory:
    """Every rank's tensors (``buffers[r][name]``) and signal counters (``signals[r][name]``, u64
    or i64), how to upload a table of u64 values, and how to encode a TMA descriptor for an
    address. Tables of every rank's addresses of one tensor or signal are uploaded once."""
    world_size: int
    buffers: list[dict[str, DeviceArray]]
    signals: list[dict[str, DeviceArray]]
    upload: Callable[[Sequence[int]], DeviceArray]
    encode_tma: Callable[[TmaDescriptorSpec, int], bytes]
    tables: dict[tuple[str, str], DeviceArray] = field(default_factory=dict)
    #: ``n`` bytes of device memory filled with :data:`SCRATCH_POISON_WORD` (None: through ``upload``)
    allocate: Callable[[int], DeviceArray] | None = None

    def buffer(self, rank: int, name: str, lowered) -> DeviceArray:
        arr = self.buffers[rank].get(name)
        if arr is None:
            raise UnboundParameterError(f"{_entry(lowered)} takes tensor '{name}', which is no tensor of the traced "
                                        f"program (its tensors: {sorted(self.buffers[rank])})")
        return arr

    def signal(self, rank: int, name: str, lowered) -> DeviceArray:
        arr = self.signals[rank].get(name)
        if arr is None:
            raise UnboundParameterError(f"{_entry(lowered)} takes signal '{name}', which is no signal of the traced "
                                        f"program (its signals: {sorted(self.signals[rank]) or 'none'})")
        return arr

    def table(self, kind: str, name: str, lowered) -> DeviceArray:
        """The device table of every rank's address of tensor (``kind='buffer'``) or signal
        ``name``, uploaded the first time it is asked for."""
        key = (kind, name)
        if key not in self.tables:
            get = self.buffer if kind == "buffer" else self.signal
            self.tables[key] = self.upload([get(q, name, lowered).ptr for q in range(self.world_size)])
        return self.tables[key]

    def scratch(self, rank: int, nbytes: int, lowered) -> DeviceArray:
        """At least ``nbytes`` of poisoned device memory private to kernel ``lowered`` on ``rank``
        (kept with the tables: a kernel's launches run one after another and share it)."""
        key = ("scratch", f"{_entry(lowered)}@{rank}")
        arr = self.tables.get(key)
        if arr is None or arr.nbytes < nbytes:
            arr = self.allocate(nbytes) if self.allocate is not None else \
                self.upload([SCRATCH_POISON_WORD] * -(-nbytes // 8))
            self.tables[key] = arr
        return arr


@dataclass(frozen=True)
class Binding:
    """One parameter and the value passed for it (an int, or a TMA descriptor's 128 bytes)."""
    param: KernelParam
    value: int | bytes

    def describe(self) -> str:
        v = "<TMA descriptor>" if isinstance(self.value, bytes) else \
            (f"{self.value:#x}" if self.param.kind == "ptr" else str(self.value))
        return f"{self.param.name} <- {self.param.source} = {v}"


def is_kernel(lowered) -> bool:
    """A lowered part that is a CUDA kernel (else a host-side copy-engine plan)."""
    return hasattr(lowered, "source") and hasattr(lowered, "entry")


def array_dtype(dtype) -> str:
    """The element type a :class:`DeviceArray` of an IR dtype has (booleans are bytes)."""
    name = getattr(dtype, "name", dtype)
    return "u8" if name == "i1" else name


def _entry(lowered) -> str:
    return getattr(lowered, "entry", type(lowered).__name__)


# -- one binder per source kind --------------------------------------------------------------------

def _tma(p: KernelParam, name: str, lowered, rank: int, launch: int, mem: DeviceMemory):
    spec = next((t for t in getattr(lowered, "tma", ()) or () if t.param == name), None)
    if spec is None:
        raise UnboundParameterError(f"{_entry(lowered)}: parameter {p.name} is TMA descriptor '{name}', which the "
                                    "lowered kernel does not describe (no TmaDescriptorSpec of that name)")
    arr = mem.buffer(rank, spec.buffer, lowered)
    if arr.dtype != spec.dtype:
        raise UnboundParameterError(f"{_entry(lowered)}: TMA descriptor {spec.param} reads '{spec.buffer}' as "
                                    f"{spec.dtype}, but the tensor is {arr.dtype}")
    need = math.prod(spec.global_dims) * elem_bytes(spec.dtype)
    if need > arr.nbytes:
        raise UnboundParameterError(f"{_entry(lowered)}: TMA descriptor {spec.param} spans {need} bytes of "
                                    f"'{spec.buffer}', which holds {arr.nbytes}")
    if arr.ptr % 16:
        raise UnboundParameterError(f"{_entry(lowered)}: '{spec.buffer}' starts at {hex(arr.ptr)}, which is not "
                                    "16-byte aligned, and the kernel reads it with TMA (descriptor "
                                    f"{spec.param}); pass a tensor whose storage starts on a 16-byte boundary "
                                    "(a .contiguous() copy, or a view at an offset of a multiple of 16 bytes)")
    return mem.encode_tma(spec, arr.ptr)


def _signal(p, name, lowered, rank, launch, mem):
    return mem.signal(rank, name, lowered).ptr


def _peer_signals(p, name, lowered, rank, launch, mem):
    return mem.table("signal", name, lowered).ptr


def _peers(p, name, lowered, rank, launch, mem):
    return mem.table("buffer", name, lowered).ptr


def _tensor(p, name, lowered, rank, launch, mem):
    return mem.buffer(rank, name, lowered).ptr


def _scalar(p, name, lowered, rank, launch, mem):
    raise UnboundParameterError(
        f"{_entry(lowered)} takes the int '{name}' ({SOURCES['scalar']}), which only the fused ops' own launchers "
        "choose (a schedule that fuses communication into the GEMM: own_rows='compute' or engine='compute'); "
        "tl.run runs the schedule's parts as separate kernels: use own_rows='comm'")


def _rank(p, name, lowered, rank, launch, mem):
    return rank


def _launch(p, name, lowered, rank, launch, mem):
    return launch


def _scratch(p, name, lowered, rank, launch, mem, ctas=None):
    """The kernel's global-memory scratch: its share per CTA for every CTA the launch runs
    (``ctas``; None: the most the kernel ever runs)."""
    per_cta = int(getattr(lowered, "scratch_bytes_per_cta", 0))
    if per_cta <= 0:
        raise UnboundParameterError(f"{_entry(lowered)}: parameter {p.name} is the kernel's scratch, but the lowered "
                                    "kernel gives no scratch_bytes_per_cta")
    if ctas is None:
        ctas = lowered.grid(_ANY_SMS)[0]
    return mem.scratch(rank, int(ctas) * per_cta, lowered).ptr


def _traced_size(p, name, lowered, rank, launch, mem):
    if p.value is None:
        raise UnboundParameterError(f"{_entry(lowered)}: size parameter {p.name} ({p.source}) carries no value "
                                    "fixed by the trace")
    return p.value


#: what is passed for each kind of :data:`~tldsl.codegen.abi.SOURCES`
BINDERS: dict[str, Callable] = {
    "tma": _tma, "signal": _signal, "peer_signals": _peer_signals, "peers": _peers,
    "buffer": _tensor, "data": _tensor, "scalar": _scalar, "rank": _rank, "launch": _launch,
    "scratch": _scratch, "M": _traced_size, "N": _traced_size, "K": _traced_size,
}


def bind(lowered, rank: int, mem: DeviceMemory, launch: int = 1, ctas: int | None = None) -> list[Binding]:
    """Every parameter of ``lowered`` for ``rank`` and launch ``launch``, in the kernel's order.
    ``ctas``: the CTAs the launch runs (a kernel's scratch is sized by them; None: its largest
    grid)."""
    out = []
    for p in lowered.params:
        kind, name = p.origin
        binder = BINDERS.get(kind)
        if binder is None:
            raise UnboundParameterError(f"{_entry(lowered)}: parameter {p.name} has source {p.source!r}, a kind no "
                                        f"binder knows (known: {sorted(BINDERS)})")
        extra = {"ctas": ctas} if kind == "scratch" else {}
        out.append(Binding(p, binder(p, name, lowered, rank, launch, mem, **extra)))
    return out


def pack(bindings: Sequence[Binding]) -> tuple[ArgPack, int | None]:
    """The driver's ``void*[]`` of ``bindings`` and the index of the launch epoch in it (None:
    the kernel takes none), which :meth:`ArgPack.set` changes per launch."""
    args = ArgPack()
    slot = None
    for i, b in enumerate(bindings):
        args.add(b.param.kind, b.value)
        if b.param.source == "launch":
            slot = i
    return args, slot


def nominal_memory(kernel_ir) -> DeviceMemory:
    """A :class:`DeviceMemory` of made-up, aligned addresses for a traced kernel: binding against
    it checks that every parameter can be bound, and shows where each value comes from, with no
    GPU. The TMA encoder returns 128 zero bytes; uploads and scratch get addresses of their own."""
    counter = iter(range(1, 1 << 40))

    def addr(nbytes: int) -> int:
        return 0x10_0000_0000 + next(counter) * 0x100_0000

    W = kernel_ir.world_size
    buffers = [{b.name: DeviceArray(addr(0), tuple(b.type.shape), array_dtype(b.type.dtype)) for b in kernel_ir.buffers}
               for _ in range(W)]
    signals = [{s.name: DeviceArray(addr(0), (int(s.type.slots),), "u64") for s in kernel_ir.signals} for _ in range(W)]
    return DeviceMemory(W, buffers, signals, lambda values: DeviceArray(addr(0), (len(values),), "u64",
                                                                         owner=tuple(values)),
                        lambda spec, address: bytes(128), allocate=lambda nbytes: DeviceArray(addr(0), (nbytes,), "u8"))


def pointer_table(mem: DeviceMemory, rank: int, ce_plan) -> PointerTable:
    """Rank ``rank``'s view of every tensor and signal of a copy-engine plan (the addresses
    :class:`~tldsl.runtime.gpu.plan_exec.PlanExecutor` resolves its actions with): on one GPU
    every rank's copy is addressable."""
    table = PointerTable(mem.world_size, rank)
    for names, get in ((ce_plan.buffers, mem.buffer), (ce_plan.signals, mem.signal)):
        for name in names:
            arrs = [get(q, name, ce_plan) for q in range(mem.world_size)]
            table.add_symmetric(name, [a.ptr for a in arrs], arrs[rank].nbytes)
    return table


def check_bindings(kernel_ir, lowered: dict) -> None:
    """Bind every lowered part of ``kernel_ir`` for every rank against :func:`nominal_memory` —
    kernels through :data:`BINDERS`, copy-engine plans through the executor's own checks — so a
    parameter or an access nothing can serve is an error before any GPU work (and without one)."""
    from .fold import is_folded
    mem = nominal_memory(kernel_ir)
    for part, lk in lowered.items():
        if is_folded(lk):           # bound with the kernel it runs in
            continue
        for r in range(kernel_ir.world_size):
            if is_kernel(lk):
                bind(lk, r, mem)
            else:
                PlanExecutor(lk, r, pointer_table(mem, r, lk), checks_only=True)
