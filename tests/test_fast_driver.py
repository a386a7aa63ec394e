"""The ctypes fast path of the hot driver calls, against a stand-in libcuda whose entry points
are Python callbacks: every argument must reach the driver as the C signature has it."""
import ctypes
from types import SimpleNamespace

import pytest

pytest.importorskip("cuda.bindings")
from cuda.bindings import driver as cu  # noqa: E402

from tldsl.runtime.gpu.fast_driver import FastDriver  # noqa: E402


def _fake_libcuda(calls, fail=()):
    sigs = {name: ctypes.CFUNCTYPE(ctypes.c_int, *argtypes) for name, argtypes in FastDriver._SIGNATURES.items()}
    keep = {}

    def entry(name):
        def fn(*args):
            calls.append((name,) + tuple(args))
            return 1 if name in fail else 0     # CUDA_ERROR_INVALID_VALUE
        keep[name] = sigs[name](fn)
        return ctypes.cast(keep[name], ctypes.c_void_p).value

    getter_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                ctypes.c_uint64, ctypes.POINTER(ctypes.c_int))

    def get(symbol, pfn, version, flags, status):
        calls.append(("cuGetProcAddress", symbol, version, flags))
        pfn[0] = entry(symbol.decode())
        status[0] = 0
        return 0
    g = getter_t(get)
    return SimpleNamespace(cuGetProcAddress_v2=g, keep=(keep, g))


def test_fast_driver_marshals_every_argument():
    calls = []
    lib = _fake_libcuda(calls)
    drv = FastDriver(cu, lib)
    assert sorted(c[1] for c in calls if c[0] == "cuGetProcAddress") == sorted(s.encode() for s in FastDriver._SIGNATURES)
    assert all(c[2] == 12000 and c[3] == 0 for c in calls if c[0] == "cuGetProcAddress")
    calls.clear()
    big = (1 << 63) + 5                                   # full 64-bit addresses and values
    assert drv.cuStreamWriteValue64(0x1000, big, 7, 0) == (cu.CUresult.CUDA_SUCCESS,)
    assert drv.cuStreamWaitValue64(cu.CUstream(0x2000), 0x7f00_0000_0008, big, 0)[0] == cu.CUresult.CUDA_SUCCESS
    drv.cuMemcpyAsync(0x7f00_0000_1000, 0x7f00_0000_2000, 3 << 30, 0x3000)
    drv.cuLaunchKernel(cu.CUfunction(0xABC), 8, 1, 1, 384, 1, 1, 200_000, 0x4000, 0x5000, 0)
    assert calls[0] == ("cuStreamWriteValue64", 0x1000, big, 7, 0)
    assert calls[1] == ("cuStreamWaitValue64", 0x2000, 0x7f00_0000_0008, big, 0)
    assert calls[2] == ("cuMemcpyAsync", 0x7f00_0000_1000, 0x7f00_0000_2000, 3 << 30, 0x3000)
    assert calls[3] == ("cuLaunchKernel", 0xABC, 8, 1, 1, 384, 1, 1, 200_000, 0x4000, 0x5000, None)
    # everything else is cuda-python's
    assert drv.CUstreamWaitValue_flags is cu.CUstreamWaitValue_flags


def test_fast_driver_returns_the_driver_error():
    calls = []
    lib = _fake_libcuda(calls, fail={"cuMemcpyAsync"})      # holds the callbacks the driver calls
    drv = FastDriver(cu, lib)
    (err,) = drv.cuMemcpyAsync(1, 2, 3, 0)
    assert err == cu.CUresult.CUDA_ERROR_INVALID_VALUE
    from tldsl.runtime.dist.plan_exec import checked
    with pytest.raises(Exception, match="cuMemcpyAsync"):
        checked(drv, drv.cuMemcpyAsync(1, 2, 3, 0), "cuMemcpyAsync(test)")
