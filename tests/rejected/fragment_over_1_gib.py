"""An accumulator the size of a whole output (32768 x 16384 f32, 2 GiB) instead of one tile: no
kernel can hold it (the general lowering spills at most 1 GiB a task group to global memory, where
its 32-bit indices reach), and the simulator would have allocated it per task. The error is at the
allocation and names the limit."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "a 32768x16384 f32 fragment is 2,147,483,648 bytes: no kernel holds one over 1 GiB"


@tl.kernel
def whole(a, c):
    @tl.compute_part(grid=(1,))
    def acc_all(i):
        acc = tl.fragment((32768, 16384), tl.float32)  # <-- error
        tl.store(c, (0, 0), acc)


def trace():
    return whole.trace(1, tl.TensorSpec((32768, 16384), tl.float16), tl.TensorSpec((32768, 16384), tl.float32))
