"""A symmetric allocation carved into named regions: the layout (pure, host-tested) and what
every workspace built on one offers — torch symmetric memory's
(:class:`~.comm_kernel.SymmetricWorkspace`) and NVSHMEM's heap's
(:class:`~.nvshmem.NvshmemWorkspace`) alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import InputError
from ..gpu.plan_exec import ELEM_BYTES

SIGNAL_DTYPES = ("u64", "i64")


@dataclass(frozen=True)
class Region:
    """A named region of a symmetric allocation: a buffer (IR dtype) or a signal (u64 slots)."""
    name: str
    kind: str                   # "buffer" | "signal"
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def layout_regions(specs: Sequence[tuple[str, str, Sequence[int], str]], align: int = 512
                   ) -> tuple[tuple[Region, ...], int]:
    """Place ``(name, kind, shape, dtype)`` regions one after another, each ``align``-byte
    aligned; returns the regions and the total bytes (at least ``align``)."""
    if align < 16 or align & (align - 1):
        raise InputError(f"region alignment {align} must be a power of two >= 16")
    out, off, seen = [], 0, set()
    for name, kind, shape, dtype in specs:
        if name in seen:
            raise InputError(f"region '{name}' is declared twice")
        seen.add(name)
        if kind not in ("buffer", "signal"):
            raise InputError(f"region '{name}': kind {kind!r} must be 'buffer' or 'signal'")
        if kind == "signal" and dtype not in SIGNAL_DTYPES:
            raise InputError(f"signal region '{name}' must hold u64 counters, not {dtype}")
        if dtype not in ELEM_BYTES:
            raise InputError(f"region '{name}': unknown dtype {dtype!r}")
        shape = tuple(int(x) for x in shape)
        if any(x <= 0 for x in shape):
            raise InputError(f"region '{name}' has an empty shape {shape}")
        n = ELEM_BYTES[dtype]
        for x in shape:
            n *= x
        out.append(Region(name, kind, shape, dtype, off, n))
        off += -(-n // align) * align
    return tuple(out), max(off, align)


class RegionWorkspace:
    """What every symmetric workspace offers: named regions (:func:`layout_regions`) with a
    torch view and every rank's address of each. Subclasses fill ``ctx``, ``regions``,
    ``total_bytes``, ``tensors`` and ``addresses`` and provide ``barrier`` / ``close``."""

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def tensor(self, name: str):
        return self.tensors[name]

    def peers(self, name: str) -> tuple[int, ...]:
        return self.addresses[name]

    def _title(self) -> str:
        return f"symmetric workspace: {self.total_bytes} bytes"

    def describe(self) -> str:
        lines = [f"{self._title()} on rank {self.ctx.rank} of {self.ctx.world_size}"]
        for r in self.regions:
            lines.append(f"  {r.kind} {r.name} {list(r.shape)} {r.dtype} at +{r.offset}: "
                         + ", ".join(f"rank {q} {a:#x}" for q, a in enumerate(self.addresses[r.name])))
        return "\n".join(lines)
