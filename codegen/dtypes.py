"""The one table from IR dtypes to what generated code and the host need of them.

Every recipe, rule and host-side description reads C types, element sizes, WGMMA operand tags
and TMA data types from here (they used to be five tables, one per lowering)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import LoweringError


@dataclass(frozen=True)
class CType:
    """What one IR dtype is in generated C++ and to the TMA unit."""
    name: str               # IR spelling
    c: str                  # C++ element type in global / shared memory
    bytes: int
    compute: str            # C++ type tile math runs in (16-bit floats compute in float)
    comm: str               # element type of the communication kernels' vector copies
    gmma: str | None = None            # WGMMA operand tag (f32 accumulate), None: not a WGMMA operand
    tma: str | None = None             # CUtensorMapDataType enumerator, None: no TMA


TABLE: dict[str, CType] = {t.name: t for t in (
    CType("f16", "__half", 2, "float", "tldsl::comm::f16", "F32F16F16", "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"),
    CType("bf16", "__nv_bfloat16", 2, "float", "tldsl::comm::bf16", "F32BF16BF16", "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"),
    CType("f32", "float", 4, "float", "float", None, "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"),
    CType("i32", "int", 4, "int", "int", None, "CU_TENSOR_MAP_DATA_TYPE_INT32"),
    CType("i1", "bool", 1, "bool", "bool", None, None),
)}

#: the 16-bit floats WGMMA multiplies (f32 accumulate)
MMA_INPUTS = tuple(n for n, t in TABLE.items() if t.gmma is not None)

#: the dtypes of scalar (index code) values, and of the per-row values the MoE hooks compute
SCALARS = ("i1", "i32", "f32")

#: TMA swizzle mode by swizzle width in bytes
SWIZZLE = {32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}


def ctype(dtype) -> CType:
    """The table entry of an IR dtype (or its name)."""
    name = getattr(dtype, "name", dtype)
    try:
        return TABLE[name]
    except KeyError:
        raise LoweringError(f"internal: no C type for dtype {name!r}") from None


def c_type(dtype) -> str:
    return ctype(dtype).c


def elem_bytes(dtype) -> int:
    return ctype(dtype).bytes


def scalar_ctype(dtype) -> str:
    """The C++ type of a scalar (index code) value: bool, int or float."""
    name = getattr(dtype, "name", dtype)
    if name not in SCALARS:
        raise LoweringError(f"internal: no scalar C type for {name}")
    return TABLE[name].c
