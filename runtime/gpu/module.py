"""Load a cubin once per device and keep its function handle ready to launch.

Loading goes through cuda.core (``ObjectCode.from_cubin`` / ``get_kernel``: the library is
loaded, kept alive and found by name there); launching does not. A launch stays the prepared
``cuLaunchKernel`` of :mod:`.launch` (cuda.bindings, arguments packed once) on the
``CUfunction`` of the loaded kernel in torch's context. Measured with ``python -m tldsl.bench
launch --rounds 200`` (BENCHMARKS.md, "2026-12-01 (thirteenth session) — launch overhead:
cuda.core vs cuda.bindings"; 1× H200, an empty kernel of N pointer arguments on a torch stream,
host µs per launch, medians of 200 batches of 100)::

    N   prepared cuLaunchKernel     prepared, kernel     cuda.core.launch     the same, Stream     ArgPack built
        (cuModuleLoadData)          loaded by cuda.core  (Stream, config      .from_handle per     per launch
                                                         built once)          launch
    1   7.03                        6.99                 6.22                 16.57                8.80
    8   6.26                        6.19                 5.97                 16.34                12.36
    24  6.42                        6.33                 6.66                 17.87                21.46

    cold load + first launch: cuModuleLoadData 66 µs, cuda.core ObjectCode 87 µs (median of 20)

* Loading through cuda.core costs nothing per launch (the same ``CUfunction``; 6.99 vs 7.03,
  6.19 vs 6.26, 6.33 vs 6.42 µs) and about 20 µs once per kernel, beside a compile or a cache
  read of milliseconds: moved.
* ``cuda.core.launch`` is not better everywhere (0.3-0.8 µs faster at 1-8 arguments, 0.2-0.5
  µs slower at 24; the fused ops' kernels take 10-30), needs a ``cuda.core.Stream`` per torch
  stream (17 µs a launch when made per launch), and packs arguments only of its own types: the
  128-byte TMA descriptors our kernels take by value (``ArgPack.add("tma", ...)``) are refused
  (ctypes arrays and bytes are "of unsupported type"; only its own ``TensorMapDescriptor``
  passes). Not moved: launching stays the prepacked ``cuLaunchKernel``.

The ``CUfunction`` and ``CUmodule`` handed out here are the driver's own, so everything that
takes them (the copy-engine staging and communication kernels' ``cuLaunchKernel``,
``nvshmemx_cumodule_init`` on the module of an NVSHMEM kernel — run on an H200 by
``tldsl.checks.nvshmem_library`` —, occupancy queries) is unchanged.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .device import check, current_context

_LOADED: dict[tuple, "LoadedKernel"] = {}


@dataclass
class LoadedKernel:
    name: str
    module: object            # the CUmodule of the kernel's library in the current context
    function: object          # its CUfunction there: what cuLaunchKernel takes
    smem_bytes: int
    _image: object = None     # the cuda.core ObjectCode: keeps the library loaded while the kernel exists

    def set_smem(self, nbytes: int):
        from cuda.bindings import driver as cu
        if nbytes > 48 * 1024:
            check(cu.cuFuncSetAttribute(self.function,
                                        cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        nbytes), f"cuFuncSetAttribute(max dynamic smem={nbytes}) for {self.name}")
        self.smem_bytes = nbytes


def object_code_type():
    """cuda.core's ``ObjectCode`` (``cuda.core`` from 0.5 on; ``cuda.core.experimental`` before)."""
    try:
        from cuda.core import ObjectCode
    except ImportError:
        from cuda.core.experimental import ObjectCode
    return ObjectCode


def load_cubin(cubin: bytes, name: str) -> LoadedKernel:
    """Load ``cubin`` through cuda.core and get kernel ``name``'s function and module in the
    current context (no caching: :func:`load_kernel` caches)."""
    from cuda.bindings import driver as cu
    code = object_code_type().from_cubin(bytes(cubin), name=name)
    try:
        kernel = code.get_kernel(name)
    except Exception as e:      # noqa: BLE001 - cuda.core's errors carry the driver's; say which kernel
        from .device import CudaDriverError
        raise CudaDriverError(f"loading {name} with cuda.core failed: {type(e).__name__}: {e}") from e
    fn = check(cu.cuKernelGetFunction(kernel.handle), f"cuKernelGetFunction({name})")
    mod = check(cu.cuFuncGetModule(fn), f"cuFuncGetModule({name})")
    return LoadedKernel(name, mod, fn, 0, code)


def load_kernel(cubin: bytes, name: str, smem_bytes: int = 0) -> LoadedKernel:
    """Load ``cubin`` into the current context (cached by content) and get ``name``."""
    import torch
    ctx = current_context()
    key = (torch.cuda.current_device(), int(ctx) if ctx is not None else 0,
           hashlib.sha256(cubin).hexdigest(), name)
    k = _LOADED.get(key)
    if k is None:
        k = _LOADED[key] = load_cubin(cubin, name)
    if smem_bytes and smem_bytes != k.smem_bytes:
        k.set_smem(smem_bytes)
    return k
