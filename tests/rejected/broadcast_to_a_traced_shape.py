"""A tile broadcast to a shape computed from the program id: tile shapes are static."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.broadcast_to: tile shape must be 1 positive Python ints, got (Scalar(i32),) (tile shapes are static"


@tl.kernel
def spread(out):
    @tl.compute_part(grid=(2,))
    def v(p):
        tl.store(out, (0,), tl.broadcast_to(tl.zeros((1,)), (p + 1,)))  # <-- error


def trace():
    return spread.trace(1, tl.TensorSpec((8,), tl.float32))
