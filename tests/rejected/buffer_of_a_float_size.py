"""A workspace sized by true division: 17 / 2 is 8.5, which would have been truncated to 8 rows."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "buffer 'half' needs a shape of positive Python ints, got (8.5, 4) (use // for a whole number)"


@tl.kernel
def halves(x, out):
    M, N = x.shape
    half = tl.local_buffer((M / 2, N), tl.float32, "half")  # <-- error

    @tl.compute_part(grid=(1,))
    def copy(p):
        tl.store(out, (0, 0), tl.load(x, (0, 0), (8, 4)))


def trace():
    return halves.trace(1, tl.TensorSpec((17, 4), tl.float32), tl.TensorSpec((17, 4), tl.float32))
