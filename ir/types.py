"""IR types: every value has a static shape, an element type and a memory space.

Memory spaces are explicit because the code generator must know where a tile lives
(global / symmetric HBM, shared memory, registers) and which movement op brings it there.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    """An element type of tensors and tiles: ``tl.float16``, ``tl.bfloat16``, ``tl.float32``,
    ``tl.int32``, ``tl.bool_`` (its ``repr`` is the IR's spelling: ``f16``, ``bf16`` ...)."""
    name: str          # IR spelling, e.g. "bf16"
    bits: int
    kind: str          # "float" | "int" | "bool"
    storage: str       # numpy dtype the simulator stores it in

    def __repr__(self) -> str:
        return self.name

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.storage)


float16 = DType("f16", 16, "float", "float16")
# numpy has no bfloat16: the simulator stores it in float32 and rounds on every store.
bfloat16 = DType("bf16", 16, "float", "float32")
float32 = DType("f32", 32, "float", "float32")
int32 = DType("i32", 32, "int", "int32")
bool_ = DType("i1", 1, "bool", "bool")

ALL_DTYPES = (float16, bfloat16, float32, int32, bool_)
_BY_NAME = {d.name: d for d in ALL_DTYPES}
_NP_ALIASES = {"float16": float16, "float32": float32, "int32": int32, "bool": bool_,
               "bfloat16": bfloat16}


def dtype_of(x) -> DType:
    """The tldsl dtype of a DType, a numpy dtype/array, a name, or a torch dtype."""
    if isinstance(x, DType):
        return x
    if x is None:           # (np.dtype(None) is float64, which the caller never wrote)
        raise TypeError("a dtype is required, got None: tldsl supports f16, bf16, f32, i32, i1")
    if isinstance(x, str):
        if x in _BY_NAME:
            return _BY_NAME[x]
        if x in _NP_ALIASES:
            return _NP_ALIASES[x]
        raise TypeError(f"unknown dtype {x!r}: tldsl supports f16, bf16, f32, i32, i1 (float16, bfloat16, float32, "
                        "int32, bool)")
    if hasattr(x, "dtype") and not isinstance(x, (np.dtype, type)):     # an array or tensor (not np.float64)
        return dtype_of(x.dtype)
    name = str(x).replace("torch.", "")
    try:
        name = np.dtype(x).name
    except TypeError:
        pass
    if name in _NP_ALIASES:
        return _NP_ALIASES[name]
    raise TypeError(f"unsupported dtype {name}: tldsl supports f16, bf16, f32, i32, i1")


class MemSpace(str, enum.Enum):
    GLOBAL = "global"        # this rank's HBM, not addressable by peers
    SYMMETRIC = "symmetric"  # same-shaped allocation on every rank, addressable by peers
    SHARED = "shared"        # per-CTA shared memory (TMA destination)
    REG = "reg"              # registers

    def __str__(self) -> str:
        return self.value


class SignalScope(str, enum.Enum):
    LOCAL = "local"          # producer/consumer signals inside one rank
    SYMMETRIC = "symmetric"  # one copy per rank, writable by peers

    def __str__(self) -> str:
        return self.value


def _shape(shape) -> str:
    return "x".join(str(s) for s in shape)


@dataclass(frozen=True)
class ScalarType:
    dtype: DType

    def __str__(self) -> str:
        return self.dtype.name


@dataclass(frozen=True)
class TileType:
    """An immutable tile value (SSA). Loads produce shared-memory tiles, math produces registers."""
    shape: tuple[int, ...]
    dtype: DType
    space: MemSpace = MemSpace.REG

    def __str__(self) -> str:
        return f"tile<{_shape(self.shape)}x{self.dtype.name}, {self.space}>"


@dataclass(frozen=True)
class FragmentType:
    """A mutable register tile (an accumulator); read and written by explicit ops."""
    shape: tuple[int, ...]
    dtype: DType

    def __str__(self) -> str:
        return f"frag<{_shape(self.shape)}x{self.dtype.name}>"


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: DType
    space: MemSpace

    def __str__(self) -> str:
        return f"tensor<{_shape(self.shape)}x{self.dtype.name}, {self.space}>"


@dataclass(frozen=True)
class SignalType:
    slots: int
    scope: SignalScope

    def __str__(self) -> str:
        return f"signal<{self.slots}, {self.scope}>"


i32 = ScalarType(int32)
f32 = ScalarType(float32)
i1 = ScalarType(bool_)
