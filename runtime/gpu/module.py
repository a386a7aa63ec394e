"""Load a cubin once per device and keep its function handle ready to launch."""
from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass

from .device import check, current_context

_LOADED: dict[tuple, "LoadedKernel"] = {}


@dataclass
class LoadedKernel:
    name: str
    module: object
    function: object
    smem_bytes: int
    _image: object = None     # keeps the cubin bytes alive while the module exists

    def set_smem(self, nbytes: int):
        from cuda.bindings import driver as cu
        if nbytes > 48 * 1024:
            check(cu.cuFuncSetAttribute(self.function,
                                        cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        nbytes), f"cuFuncSetAttribute(max dynamic smem={nbytes}) for {self.name}")
        self.smem_bytes = nbytes


def load_kernel(cubin: bytes, name: str, smem_bytes: int = 0) -> LoadedKernel:
    """Load ``cubin`` into the current context (cached by content) and get ``name``."""
    import torch
    from cuda.bindings import driver as cu
    ctx = current_context()
    key = (torch.cuda.current_device(), int(ctx) if ctx is not None else 0,
           hashlib.sha256(cubin).hexdigest(), name)
    k = _LOADED.get(key)
    if k is None:
        image = ctypes.create_string_buffer(cubin, len(cubin))
        mod = check(cu.cuModuleLoadData(ctypes.addressof(image)), f"cuModuleLoadData({name})")
        fn = check(cu.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
        k = LoadedKernel(name, mod, fn, 0, image)
        _LOADED[key] = k
    if smem_bytes and smem_bytes != k.smem_bytes:
        k.set_smem(smem_bytes)
    return k
