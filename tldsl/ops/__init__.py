"""The op library, written in the tile language. Each module holds the kernel, a numpy
reference and an :class:`~tldsl.testing.OpSpec` registering it for the tests."""
from __future__ import annotations

from ..testing.opspec import OpSpec

OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in OPS:
        raise ValueError(f"op '{spec.name}' registered twice")
    OPS[spec.name] = spec
    return spec


def _load_all():
    from . import allgather_gemm  # noqa: F401
    for mod in ("gemm_reduce_scatter", "moe", "sp_attention"):
        try:
            __import__(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise


_load_all()
