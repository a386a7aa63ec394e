"""One BLAS thread while a simulation runs.

numpy's OpenBLAS splits a product among threads from 64x64x64 up. The simulator's products
are tiles, each well under a millisecond on one core, and on a busy machine (a laptop, a
shared CI box) every threaded call waits for a second core to be free: 128-wide tiles ran
15 times slower than on one thread. A threaded product splits its output among threads,
never a sum, so the thread count changes no bit of any result. ``threadpoolctl`` finds every
BLAS the process has loaded and sets and restores their thread counts.
"""
from __future__ import annotations

import contextlib

from threadpoolctl import ThreadpoolController

_controller: ThreadpoolController | None = None


@contextlib.contextmanager
def one_blas_thread():
    """Run the body with every loaded BLAS on one thread, restoring each one's count after."""
    global _controller
    if _controller is None:             # inspecting the loaded libraries once is enough
        _controller = ThreadpoolController()
    with _controller.limit(limits=1, user_api="blas"):
        yield
