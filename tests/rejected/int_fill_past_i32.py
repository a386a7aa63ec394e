"""An i32 tile filled with a constant past i32's range: it would wrap around (2**40 + 5 -> 5)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.full: 1099511627781 does not fit in i32"


@tl.kernel
def filled(out):
    @tl.compute_part(grid=(1,))
    def fill(p):
        tl.store(out, (0,), tl.full((8,), 2**40 + 5, tl.int32))  # <-- error


def trace():
    return filled.trace(1, tl.TensorSpec((8,), tl.int32))
