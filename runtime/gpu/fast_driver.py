"""The four driver calls on a fused launch's critical path, called through ctypes.

A fused op's launch is a handful of driver calls (kernel launches, stream memory operations,
peer copies), and with an idle device every microsecond the host spends on them is a
microsecond of the op's time (``tldsl.bench_host`` shows the device waiting for the host).
cuda-python wraps every argument in Python objects, several microseconds per call; these four
go straight to the driver's entry points (found with ``cuGetProcAddress``, so the versioned
symbol is the driver's own). Everything else falls through to ``cuda.bindings.driver``, and
results keep its convention: a tuple whose first item is a ``CUresult``.
"""
from __future__ import annotations

import ctypes

_FAST = None


class FastDriver:
    """``cuda.bindings.driver`` with ``cuLaunchKernel``, ``cuMemcpyAsync``,
    ``cuStreamWriteValue64`` and ``cuStreamWaitValue64`` taking plain ints (handles,
    addresses) and called through ctypes."""

    _SIGNATURES = {
        "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3,
        "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        "cuStreamWriteValue64": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint],
        "cuStreamWaitValue64": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint],
    }

    def __init__(self, driver, libcuda: ctypes.CDLL, cuda_version: int = 12000):
        self._driver = driver
        get = libcuda.cuGetProcAddress_v2
        get.restype = ctypes.c_int
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                        ctypes.POINTER(ctypes.c_int)]
        self._fns = {}
        for name, argtypes in self._SIGNATURES.items():
            pfn, status = ctypes.c_void_p(), ctypes.c_int()
            err = get(name.encode(), ctypes.byref(pfn), cuda_version, 0, ctypes.byref(status))
            if err != 0 or not pfn.value:
                raise OSError(f"cuGetProcAddress({name}) failed: error {err}, status {status.value}")
            self._fns[name] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(pfn.value)
        self._ok = driver.CUresult.CUDA_SUCCESS

    def __getattr__(self, name):
        return getattr(self._driver, name)

    def _result(self, err: int):
        return (self._ok,) if err == 0 else (self._driver.CUresult(err),)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        return self._result(self._fns["cuLaunchKernel"](int(f), gx, gy, gz, bx, by, bz, smem, int(stream or 0),
                                                        int(params or 0), int(extra or 0) or None))

    def cuMemcpyAsync(self, dst, src, nbytes, stream):
        return self._result(self._fns["cuMemcpyAsync"](int(dst), int(src), int(nbytes), int(stream or 0)))

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        return self._result(self._fns["cuStreamWriteValue64"](int(stream or 0), int(addr), int(value), int(flags)))

    def cuStreamWaitValue64(self, stream, addr, value, flags):
        return self._result(self._fns["cuStreamWaitValue64"](int(stream or 0), int(addr), int(value), int(flags)))


def fast_driver():
    """The :class:`FastDriver` (made once), or ``cuda.bindings.driver`` itself where libcuda
    cannot be opened or lacks an entry point (then the calls are only slower)."""
    global _FAST
    if _FAST is None:
        from cuda.bindings import driver
        try:
            _FAST = FastDriver(driver, ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            _FAST = driver
    return _FAST
