"""A traced scalar used as a Python int (here a tile shape): shapes are static."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tile shape must be 1 positive Python ints"


@tl.kernel
def dynamic_shape(a, c):
    @tl.compute_part(grid=(4,))
    def use(t):
        x = tl.load(a, (0,), (t + 1,))  # <-- error
        tl.store(c, (0,), x)


def trace():
    f32 = tl.TensorSpec((16,), tl.float32)
    return dynamic_shape.trace(2, f32, f32)
