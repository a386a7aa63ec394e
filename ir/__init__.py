"""The tldsl IR: typed tile programs whose compute and communication parts are separate.

Data flows one way: the frontend (``tldsl``) builds a :class:`Kernel`, :mod:`.verifier`
checks it, and both the simulator (``tldsl.runtime.sim``) and the code generator
(``tldsl.codegen``) consume it unchanged.
"""
from .types import (DType, float16, bfloat16, float32, int32, bool_, dtype_of,
                    ScalarType, TileType, FragmentType, TensorType, SignalType,
                    MemSpace, SignalScope)
from .location import Location
from .core import Value, Op, Block, Part, Kernel, Buffer, Signal
from .opdefs import OPS, OpDef, SYNC_OPS, NOTIFY_OPS, WAIT_OPS
from .printer import format_kernel
from .verifier import verify

__all__ = [n for n in dir() if not n.startswith("_")]
