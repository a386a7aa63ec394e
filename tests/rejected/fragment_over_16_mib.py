"""An accumulator the size of a whole output (8192 x 8192 f32, 256 MiB) instead of one tile: no
kernel can hold it (the general lowering spills at most 16 MiB a task group), and the simulator
would have allocated it per task. The error is at the allocation and names the limit."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "a 8192x8192 f32 fragment is 268,435,456 bytes: no kernel holds one over 16 MiB"


@tl.kernel
def whole(a, c):
    @tl.compute_part(grid=(1,))
    def acc_all(i):
        acc = tl.fragment((8192, 8192), tl.float32)  # <-- error
        tl.store(c, (0, 0), acc)


def trace():
    return whole.trace(1, tl.TensorSpec((8192, 8192), tl.float16), tl.TensorSpec((8192, 8192), tl.float32))
