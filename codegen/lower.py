"""One entry point from a part of a kernel's IR to generated CUDA: each lowering module says
which parts it recognises; the first that matches lowers the part.

Lowerings (one module each): ``lower_gemm`` (GEMM-shaped compute parts). Others register
here as they are written; a part no lowering recognises gets a LoweringError naming it.
"""
from __future__ import annotations

import importlib

from ..ir import core
from .lower_gemm import LoweringError

#: module names under tldsl.codegen, tried in order; each has ``matches(kernel, part) -> bool``
#: and ``lower(kernel, part, **options)``.
LOWERINGS: list[str] = ["lower_gemm", "lower_grouped_gemm", "lower_attention", "lower_comm"]


def _module(name):
    return importlib.import_module(f"{__package__}.{name}")


def lower(kernel: core.Kernel, part: str | core.Part, **options):
    """Lower one part of ``kernel`` with the first lowering that recognises it."""
    if not isinstance(kernel, core.Kernel):
        raise LoweringError(f"lower() takes a traced kernel (a tldsl IR Kernel), got {type(kernel).__name__}: "
                            f"trace it first — kernel_fn.trace(world_size, *tensor_specs, compute=..., comm=...) "
                            f"— or take result.kernel from tl.simulate(...)")
    if isinstance(part, str) and part not in [q.name for q in kernel.parts]:
        raise LoweringError(f"kernel '{kernel.name}' has no part {part!r}; its parts: "
                            + ", ".join(f"'{q.name}' ({q.role})" for q in kernel.parts))
    p = kernel.part(part) if isinstance(part, str) else part
    tried = []
    for name in LOWERINGS:
        mod = _module(name)
        if mod.matches(kernel, p):
            return mod.lower(kernel, p, **options)
        tried.append(name)
    reasons = []
    for name in tried:   # say why each lowering declined, at the line it objected to
        try:
            _module(name).lower(kernel, p)
        except LoweringError as e:
            where = f" ({e.loc.short()})" if getattr(e, "loc", None) is not None else ""
            reasons.append(f"  {name}: {getattr(e, 'raw_message', str(e))}{where}")
        except Exception as e:  # noqa: BLE001 - a lowering that does not apply may fail differently
            reasons.append(f"  {name}: {type(e).__name__}: {e}")
    raise LoweringError(f"no lowering recognises {p.role} part '{p.name}' of kernel '{kernel.name}':\n"
                        + "\n".join(reasons), p.loc)


def lower_all(kernel: core.Kernel, **options) -> dict:
    """Every part of ``kernel`` lowered: {part name: lowered kernel}."""
    return {p.name: lower(kernel, p, **options) for p in kernel.parts}
