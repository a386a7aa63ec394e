"""Every op of the library, by name: each op module registers its
:class:`~tldsl.testing.OpSpec` here when imported (importing :mod:`tldsl.ops` imports them all);
the property tests and the mutation check read :data:`OPS`."""
from __future__ import annotations

from ..testing.opspec import OpSpec

OPS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in OPS:
        raise ValueError(f"op '{spec.name}' registered twice")
    OPS[spec.name] = spec
    return spec
