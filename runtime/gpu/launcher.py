"""What every launcher of a generated kernel shares: the call, and the checks on signals."""
from __future__ import annotations

from ...codegen.abi import SOURCES
from ...errors import InputError
from .launch import ArgPack, PreparedLaunch

_TORCH_DTYPE = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "i32": "int32"}


def signal_pointer(entry: str, name: str, signals, slots: int | None = None) -> int:
    """Device address of this rank's counters of signal ``name`` (an int64 CUDA tensor)."""
    import torch
    sig = (signals or {}).get(name)
    if sig is None or not isinstance(sig, torch.Tensor) or sig.dtype != torch.int64 or not sig.is_cuda \
            or not sig.is_contiguous() or (slots is not None and sig.numel() < slots):
        need = f"at least {slots} counters" if slots is not None else "counters"
        raise InputError(f"{entry} waits on or notifies signal '{name}': pass signals={{'{name}': a contiguous "
                         f"int64 CUDA tensor of {need}}}")
    return sig.data_ptr()


class Launcher:
    """Base of the kernel launchers: the call, and the packing of the lowered kernel's flat
    parameter list. Subclasses provide ``kernel``, ``grid``, ``lowered`` and
    ``tma_tensor(buffers, spec)`` (the validated tensor behind a TMA descriptor); they may
    refine ``check_call``, ``table_pointer``, ``signal_slots`` and ``scalar``."""

    def __call__(self, buffers: dict | None = None, *, signals=None, launch_index: int = 1, rank: int = 0,
                 stream=None, **named):
        """Launch on ``stream`` (default: torch's current stream); buffers by IR name, signals
        by name, ``launch_index`` the 1-based epoch the waits count in."""
        import torch
        buffers = dict(buffers or {}, **named)
        self.check_call(rank, launch_index)
        s = stream if stream is not None else torch.cuda.current_stream()
        self.prepare(buffers, signals, rank).launch(s.cuda_stream, launch_index)

    def prepare(self, buffers: dict, signals: dict | None = None, rank: int = 0, hold: bool = True) -> PreparedLaunch:
        """Validate and pack every argument now; the result launches with only an epoch. It holds
        the tensors it was given (their memory stays theirs while it lives); ``hold=False`` for a
        cache keyed by their addresses, whose owner keeps them (an entry is only hit again for
        tensors at those addresses, so holding would only pin memory and defeat the cache)."""
        pack = self.args(buffers, signals, 1, rank)
        if not hold:
            pack.refs.clear()
        slot = next((i for i, p in enumerate(self.lowered.params) if p.source == "launch"), None)
        return PreparedLaunch(self.kernel, self.grid, self.lowered.block, pack, slot, self.lowered.cluster_dims)

    def args(self, buffers: dict, signals: dict | None = None, launch_index: int = 1, rank: int = 0) -> ArgPack:
        """The kernel's arguments, in the lowering's order, after validating every input."""
        self.check_call(rank, launch_index)
        lw = self.lowered
        specs = {s.param: s for s in lw.tma}
        pack = ArgPack()
        for p in lw.params:
            kind, name = p.origin
            if kind == "tma":
                spec = specs[name]
                t = self.tma_tensor(buffers, spec)
                pack.hold(t)
                key = (spec.param, t.data_ptr())
                desc = self._tma_cache.get(key)
                if desc is None:
                    desc = self._tma_cache[key] = spec.encode(t.data_ptr())
                pack.add("tma", desc)
            elif kind == "rank":
                pack.add("i32", rank)
            elif kind == "launch":
                pack.add("u64", launch_index)
            elif kind == "signal":
                pack.add("ptr", signal_pointer(lw.entry, name, signals, self.signal_slots(name)))
                pack.hold(signals[name])
            elif kind == "buffer":
                pack.add("ptr", self.table_pointer(buffers, name))
                pack.hold(buffers[name])
            elif kind == "data":
                pack.add("ptr", self.data_pointer(buffers, name))
                pack.hold(buffers[name])
            elif kind == "scalar":      # a launch argument the caller gives by name
                value = buffers.get(name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise InputError(f"{lw.entry} takes the int '{name}': pass it with the tensors")
                pack.add("i32", value)
            else:
                value = self.scalar(p)
                if value is None:
                    raise InputError(f"{lw.entry}: this launcher cannot pass parameter {p.name} "
                                     f"({p.source!r}: {SOURCES.get(kind, 'unknown source')})")
                pack.add("i32", value)
        return pack

    @property
    def _tma_cache(self) -> dict:
        """Encoded TMA descriptors by (parameter, base address): the encode is paid once."""
        cache = self.__dict__.get("_tma_descriptors")
        if cache is None:
            cache = self.__dict__["_tma_descriptors"] = {}
        return cache

    def checked_tensor(self, buffers: dict, name: str, shape, dtype: str, *, tma: bool = False):
        """``buffers[name]``, checked against the traced shape and IR dtype: a contiguous,
        16-byte aligned CUDA tensor (what TMA and the vector accesses need)."""
        import torch
        t = buffers.get(name)
        if t is None:
            raise InputError(f"{self.lowered.entry}: missing tensor '{name}'")
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise InputError(f"'{name}' must be a CUDA torch tensor")
        if tuple(t.shape) != tuple(shape):
            raise InputError(f"'{name}' has shape {tuple(t.shape)}; the kernel was built for {tuple(shape)}")
        want = getattr(torch, _TORCH_DTYPE[dtype])
        if t.dtype != want:
            raise InputError(f"'{name}' is {t.dtype}; the kernel was built for {want}")
        if not t.is_contiguous():
            raise InputError(f"'{name}' must be contiguous (row-major)")
        if t.data_ptr() % 16:
            raise InputError(f"'{name}' must be 16-byte aligned" + (" for TMA" if tma else " (vector access)"))
        return t

    def check_call(self, rank: int, launch_index: int) -> None:
        if launch_index < 1:
            raise InputError("launch_index counts launches from 1")

    def signal_slots(self, name: str) -> int | None:
        """The fewest counters signal ``name`` needs (None: not checked)."""
        return None

    def data_pointer(self, buffers: dict, name: str) -> int:
        """Address of a tensor the kernel reads element by element (``data:<name>``), checked
        against its traced shape and dtype."""
        spec = {n: (shape, dt) for n, shape, dt in getattr(self.lowered, "data_buffers", ())}
        if name not in spec:
            raise InputError(f"{self.lowered.entry}: unknown data parameter '{name}'")
        shape, dt = spec[name]
        return self.checked_tensor(buffers, name, shape, dt).data_ptr()

    def table_pointer(self, buffers: dict, name: str) -> int:
        """Address of an i32 table the kernel reads (``buffer:<name>`` parameters)."""
        import torch
        t = buffers.get(name)
        if t is None or not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or not t.is_cuda:
            raise InputError(f"{self.lowered.entry} reads table '{name}': pass it as an int32 CUDA tensor")
        return t.data_ptr()

    def scalar(self, param) -> int | None:
        """The value of a compile-time scalar parameter (None: not one)."""
        return None
