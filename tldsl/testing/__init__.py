"""Testing support: the op registry, hypothesis strategies and the mutation check.

Users property-test their own kernels with the same strategies (``tldsl.testing.strategies``).
"""
from .opspec import OpCase, OpSpec, check_case, describe

__all__ = ["OpCase", "OpSpec", "check_case", "describe", "registry"]


def registry() -> dict[str, OpSpec]:
    """Every op of the library, by name."""
    from ..ops import OPS
    return dict(OPS)
