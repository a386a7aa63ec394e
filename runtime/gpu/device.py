"""Is there a GPU we can use, and the checked way to call the driver."""
from __future__ import annotations

import functools

from ...errors import TldslError


class GPUUnavailableError(TldslError):
    """No usable NVIDIA GPU (or torch / cuda-python is missing): nothing was launched."""


class CudaDriverError(TldslError):
    """A CUDA driver call failed."""


@functools.lru_cache(maxsize=None)
def _probe() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed (pip install 'tldsl[gpu]')"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False, "cuda-python (cuda-bindings) is not installed (pip install 'tldsl[gpu]')"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return False, f"the generated kernels need sm_90a (Hopper); this GPU is sm_{major}{minor}"
    return True, torch.cuda.get_device_name()


def gpu_available() -> bool:
    return _probe()[0]


def require_gpu() -> str:
    """The device name, or GPUUnavailableError saying why there is none."""
    ok, why = _probe()
    if not ok:
        raise GPUUnavailableError(f"no GPU to run on: {why}")
    return why


def check(result, what: str):
    """Unwrap a cuda-python ``(CUresult, *values)`` tuple, raising on any error."""
    from cuda.bindings import driver as cu
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, desc = cu.cuGetErrorString(err)
        raise CudaDriverError(f"{what} failed: {name.decode() if name else err} "
                              f"({desc.decode() if desc else ''})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def current_context():
    """Make sure torch created the device's primary context, and return it."""
    import torch
    from cuda.bindings import driver as cu
    require_gpu()
    torch.cuda.init()
    torch.empty(1, device="cuda")   # forces context creation on the current device
    return check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")


def sm_count() -> int:
    import torch
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def cuda_context_exists(driver=None) -> bool:
    """Whether CUDA has a context in this process already: torch's, another library's primary
    context (CuPy, Numba) or one of its own made current. CUDA reads CUDA_DEVICE_MAX_CONNECTIONS
    when it makes a context, so a later setting would not count. Where that cannot be told, True
    (the caller then leaves the environment as it is). ``driver``: ``cuda.bindings.driver`` (a
    stand-in in tests)."""
    try:
        import torch
        if torch.cuda.is_initialized():
            return True
        cu = driver
        if cu is None:
            from cuda.bindings import driver as cu
        ok = cu.CUresult.CUDA_SUCCESS
        err, count = cu.cuDeviceGetCount()
        if err == cu.CUresult.CUDA_ERROR_NOT_INITIALIZED:
            return False                    # cuInit not called yet: no context can exist
        if err != ok:
            return True
        for i in range(count):
            err, dev = cu.cuDeviceGet(i)
            if err != ok:
                return True
            err, _flags, active = cu.cuDevicePrimaryCtxGetState(dev)
            if err != ok or active:
                return True
        err, ctx = cu.cuCtxGetCurrent()
        return err != ok or bool(int(ctx))
    except Exception:                       # no driver library to ask, or an unexpected answer
        return True

