"""A copy-engine plan's notify of a slot with other writers: add 1 from a one-thread kernel.

The copy engine's stream signals by writing values (``cuStreamWriteValue64``), which is exact
only where one stream owns the slot; where several ranks' copy engines (a gather to one rank,
counting arrivals) or a kernel's atomic adds share it, each notify must add. Stream memory ops
have no add on Hopper's drivers, so the notify is this kernel, enqueued on the stream after the
copies it publishes: it starts once they are complete, fences them system-wide and adds 1 to the
counter (system scope: the counter may be a peer's). It needs an SM, so the run plan leaves SMs
free beside persistent kernels where a plan has such notifies (``needs_free_sms``).
"""
from __future__ import annotations

ENTRY = "tldsl_signal_add"

SOURCE = r"""
extern "C" __global__ void tldsl_signal_add(unsigned long long* counter) {
  __threadfence_system();                 // the stream's earlier copies, visible before the count
  atomicAdd_system(counter, 1ull);
}
"""


class SignalAdder:
    """The kernel compiled (NVRTC, cached on disk) and loaded into the current context once, when
    an executor whose plan adds is built; calling it enqueues one add."""

    def __init__(self, progress=None):
        from ...codegen.toolchain import compiler
        from .module import load_kernel
        self.kernel = load_kernel(compiler.compile_cuda(SOURCE, ENTRY, progress=progress).cubin, ENTRY)

    def __call__(self, stream: int, address: int) -> None:
        """Add 1 to the u64 counter at ``address`` once ``stream``'s earlier work is done."""
        from .launch import ArgPack, launch
        args = ArgPack()
        args.add("ptr", address)
        launch(self.kernel, (1, 1, 1), (1, 1, 1), args, stream)
