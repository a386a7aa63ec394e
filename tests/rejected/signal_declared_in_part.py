"""Signals (and buffers) belong to the kernel: they cannot be declared inside a part."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "signals must be declared in the kernel body, outside compute/comm parts"


@tl.kernel
def local_signal(a, c):
    @tl.compute_part(grid=(1,))
    def use(i):
        ready = tl.signal("ready", 1)  # <-- error
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return local_signal.trace(2, f32, f32)
