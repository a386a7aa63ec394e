"""A fragment written with a tile that does not broadcast to its shape."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "cannot write a (8, 8) tile into a (16, 16) fragment"


@tl.kernel
def written(x, out):
    @tl.compute_part(grid=(1,))
    def acc(p):
        a = tl.fragment((16, 16), tl.float32)
        a.write(tl.load(x, (0, 0), (8, 8)))  # <-- error
        tl.store(out, (0, 0), a)


def trace():
    return written.trace(1, tl.TensorSpec((8, 8), tl.float32), tl.TensorSpec((16, 16), tl.float32))
