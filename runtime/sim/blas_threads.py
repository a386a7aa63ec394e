"""One BLAS thread while a simulation runs.

numpy's OpenBLAS splits a product among threads from 64x64x64 up. The simulator's products
are tiles, each well under a millisecond on one core, and on a busy machine (a laptop, a
shared CI box) every threaded call waits for a second core to be free: 128-wide tiles ran
15 times slower than on one thread. A threaded product splits its output among threads,
never a sum, so the thread count changes no bit of any result. Only OpenBLAS (numpy's
wheels, or a system one) is found and set; with any other BLAS nothing changes.
"""
from __future__ import annotations

import contextlib
import ctypes

#: (get, set) function names: numpy's scipy-openblas wheels, then plain OpenBLAS builds
_NAMES = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
          ("openblas_get_num_threads", "openblas_set_num_threads"))
_controls: list | None = None


def _find_controls() -> list:
    """(get, set) of every OpenBLAS this process has loaded (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower()})
    except OSError:
        return []
    found = []
    for path in paths:
        if not path.startswith("/"):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _NAMES:
            get, set_ = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and set_ is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                set_.restype, set_.argtypes = None, [ctypes.c_int]
                found.append((get, set_))
                break
    return found


@contextlib.contextmanager
def one_blas_thread():
    """Run the body with OpenBLAS on one thread, restoring each library's count after."""
    global _controls
    if _controls is None:
        _controls = _find_controls()
    before = [(set_, get()) for get, set_ in _controls]
    for set_, _ in before:
        set_(1)
    try:
        yield
    finally:
        for set_, n in before:
            set_(n)
