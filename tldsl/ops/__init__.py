"""The op library, written in the tile language. Each module holds the kernel, a numpy
reference and an :class:`~tldsl.testing.OpSpec` registering it for the tests (:mod:`.registry`);
importing this package imports them all, so :data:`OPS` lists every op."""
from __future__ import annotations

from .registry import OPS, register
from . import allgather_gemm, gemm_reduce_scatter, moe, sp_attention  # noqa: F401 - each registers its op

__all__ = ["OPS", "register"]
