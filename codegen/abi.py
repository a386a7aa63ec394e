"""The kernel ABI every recipe produces and the GPU launcher reads: the flat ``extern "C"``
parameter list, the TMA descriptors the host encodes for it, the names generated code gives
kernel tensors and signals, and what every lowered kernel shares (compile, launch shape).

A recipe describes its kernel with these types only; ``tldsl.runtime.gpu`` binds arguments
by :attr:`KernelParam.source` and encodes :class:`TmaDescriptorSpec` s, so a new recipe needs
no launcher code."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..ir import core
from .toolchain.compiler import CompileJob, compile_cuda


# -- names in generated code ----------------------------------------------------------------------

def cident(s: str) -> str:
    """A C identifier made from an IR name."""
    s = re.sub(r"[^0-9A-Za-z_]", "_", s)
    return s if s and not s[0].isdigit() else "_" + s


def marker(loc) -> str:
    """The trailing comment that maps a generated line back to the tile program."""
    return f"  // tldsl: {loc.filename}:{loc.lineno}" if loc is not None else ""


def signal_param(sig: core.Signal) -> str:
    """Kernel parameter holding this rank's copy of a signal."""
    return f"sig_{cident(sig.name)}"


def peer_signal_param(sig: core.Signal) -> str:
    """Kernel parameter holding the table of every rank's copy of a signal."""
    return f"sig_{cident(sig.name)}_peers"


def signal_slot(sig: core.Signal, channel: str, rank: str | None = None) -> str:
    """C++ address of ``channel`` of a signal: this rank's copy, or ``rank`` 's through the
    table of every rank's copies."""
    if rank is None:
        return f"{signal_param(sig)} + {channel}"
    return f"{peer_signal_param(sig)}[{rank}] + {channel}"


def buffer_param(buf: core.Buffer) -> str:
    """Kernel parameter holding this rank's pointer to a tensor."""
    return f"buf_{cident(buf.name)}"


def peer_buffer_param(buf: core.Buffer) -> str:
    """Kernel parameter holding the table of every rank's pointer to a symmetric tensor."""
    return f"buf_{cident(buf.name)}_peers"


def table_param(buf: core.Buffer) -> str:
    """Kernel parameter holding an i32 table that index code reads (``load_scalar``)."""
    return f"tbl_{cident(buf.name)}"


def is_this_rank(v: core.Value | None) -> bool:
    """Whether a primitive's rank operand is absent or ``tl.rank()`` itself (this rank's copy)."""
    return v is None or (isinstance(v.owner, core.Op) and v.owner.name == "rank")


# -- host-side description ----------------------------------------------------------------------

@dataclass(frozen=True)
class TmaDescriptorSpec:
    """Arguments of ``cuTensorMapEncodeTiled`` for one kernel parameter (dims innermost first,
    strides in bytes for dims 1..rank-1, as the driver API takes them)."""
    param: str                      # kernel parameter, e.g. "tma_a"
    buffer: str                     # IR buffer it describes
    role: str                       # "A" | "B" | "C" | ...
    dtype: str                      # IR dtype name
    data_type: str                  # CUtensorMapDataType enumerator name
    global_dims: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dims: tuple[int, ...]
    element_strides: tuple[int, ...]
    swizzle: str
    interleave: str = "CU_TENSOR_MAP_INTERLEAVE_NONE"
    l2_promotion: str = "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"
    oob_fill: str = "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"   # out-of-bounds elements read as zero

    @property
    def rank(self) -> int:
        return len(self.global_dims)

    def encode(self, address: int) -> bytes:
        """The 128-byte ``CUtensorMap`` for a tensor at device ``address`` (needs the CUDA driver)."""
        import ctypes

        from cuda.bindings import driver as cu
        err, tmap = cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, self.data_type), self.rank, address,
            [cu.cuuint64_t(x) for x in self.global_dims], [cu.cuuint64_t(x) for x in self.global_strides],
            [cu.cuuint32_t(x) for x in self.box_dims], [cu.cuuint32_t(x) for x in self.element_strides],
            getattr(cu.CUtensorMapInterleave, self.interleave), getattr(cu.CUtensorMapSwizzle, self.swizzle),
            getattr(cu.CUtensorMapL2promotion, self.l2_promotion), getattr(cu.CUtensorMapFloatOOBfill, self.oob_fill))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled({self.param}) failed: {err}")
        return ctypes.string_at(tmap.getPtr(), 128)


@dataclass(frozen=True)
class KernelParam:
    """One entry of the flat ``extern "C"`` parameter list, in order."""
    name: str
    ctype: str          # C++ spelling
    kind: str           # "tma" | "i32" | "u64" | "ptr"
    source: str         # what the runtime passes: "tma:<param>", "M", "N", "K", "rank", "launch",
                        # "signal:<name>" (this rank's copy), "buffer:<name>" (a table's address)
    value: int | None = None   # the value fixed by the trace (M, N, K), else None


def kernel_entry(entry: str, threads: int, params, body: list[str]) -> list[str]:
    """The ``extern "C"`` entry of a generated kernel: launch bounds (one CTA per SM), the flat
    parameter list in the recipe's order, and ``body`` (already indented)."""
    plist = ",\n    ".join(f"{p.ctype} {p.name}" for p in params)
    return [f'extern "C" __global__ void __launch_bounds__({threads}, 1)', f"{entry}(", f"    {plist}) {{",
            *body, "}", ""]


class LoweredKernel:
    """Mixin for lowered kernels: ``compile()`` plus a persistent kernel's launch shape.

    Expects ``source``, ``entry``, ``options``, and for the defaults below ``num_tiles`` and a
    ``config`` with ``threads`` and ``smem_bytes``."""

    def job(self):
        """This kernel as a :class:`.toolchain.compiler.CompileJob` (for ``compile_many``)."""
        return CompileJob(self.source, self.entry, tuple(self.options))

    def compile(self, **kw):
        """Compile with NVRTC (cached). Keyword arguments go to ``compile_cuda``: ``progress``
        (True, False, or a callable such as ``print`` in notebooks), ``cache``, ``heartbeat``
        (seconds between progress lines of a long compile)."""
        opts = tuple(self.options) + tuple(kw.pop("options", ()))
        return compile_cuda(self.source, self.entry, options=opts, **kw)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.config.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return self.config.smem_bytes

    @property
    def cluster_dims(self) -> tuple[int, int, int]:
        return (1, 1, 1)

    def grid(self, sm_count: int) -> tuple[int, int, int]:
        """Persistent launch: at most one CTA per SM (``sm_count`` may be lowered to leave SMs
        to communication kernels), never more CTAs than tiles."""
        return (max(1, min(self.num_tiles, sm_count)), 1, 1)
