"""An accumulator the size of a whole output (65536 x 32768 f32, 2**31 elements) instead of one
tile: no kernel can index it (a tile's element indices are 32-bit ints, so a tile or fragment holds
at most 2**30 elements), and the simulator would have allocated it per task. The error is at the
allocation and names the bound."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "a 65536x32768 f32 fragment has 2,147,483,648 elements: no kernel indexes one past 2**30"


@tl.kernel
def whole(a, c):
    @tl.compute_part(grid=(1,))
    def acc_all(i):
        acc = tl.fragment((65536, 32768), tl.float32)  # <-- error
        tl.store(c, (0, 0), acc)


def trace():
    return whole.trace(1, tl.TensorSpec((65536, 32768), tl.float16), tl.TensorSpec((65536, 32768), tl.float32))
