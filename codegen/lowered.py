"""What every lowered kernel shares: how it is compiled and how it is launched.

Each lowering returns a dataclass holding ``source``, ``entry`` and ``options``; mixing in
:class:`LoweredKernel` gives it ``compile()``, and the launch shape of a persistent kernel
(one CTA per SM at most, never more CTAs than tiles) unless it says otherwise.
"""
from __future__ import annotations

from ..ir import core
from .scalars import LoweringError


class LoweredKernel:
    """Mixin for lowered kernels: ``compile()`` plus a persistent kernel's launch shape.

    Expects ``source``, ``entry``, ``options``, and for the defaults below ``num_tiles`` and a
    ``config`` with ``threads`` and ``smem_bytes``."""

    def job(self):
        """This kernel as a :class:`.compiler.CompileJob` (for ``compile_many``)."""
        from .compiler import CompileJob
        return CompileJob(self.source, self.entry, tuple(self.options))

    def compile(self, **kw):
        """Compile with NVRTC (cached). Keyword arguments go to :func:`.compiler.compile_cuda`:
        ``progress`` (True, False, or a callable such as ``print`` in notebooks), ``cache``,
        ``heartbeat`` (seconds between progress lines of a long compile)."""
        from .compiler import compile_cuda
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


def kernel_entry(entry: str, threads: int, params, body: list[str]) -> list[str]:
    """The ``extern "C"`` entry of a generated kernel: launch bounds (one CTA per SM), the flat
    parameter list in the lowering's order, and ``body`` (already indented)."""
    plist = ",\n    ".join(f"{p.ctype} {p.name}" for p in params)
    return [f'extern "C" __global__ void __launch_bounds__({threads}, 1)', f"{entry}(", f"    {plist}) {{",
            *body, "}", ""]


def recognises(match, kernel: core.Kernel, part: core.Part, role: str = "compute") -> bool:
    """Whether ``match(kernel, part)`` accepts ``part`` (it raises LoweringError otherwise)."""
    if part.role != role:
        return False
    try:
        match(kernel, part)
    except LoweringError:
        return False
    return True
