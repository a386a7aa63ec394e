"""`y.at(0).at(1)`: the copy of a symmetric tensor on one rank has no copies of its own. It was
an AttributeError from inside the tracer; the error is at the second `.at`, saying to call it once."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "y.at(...) is already the copy on one rank: call .at(rank) once, on the tensor itself (y.at(rank))"


@tl.kernel
def twice(x, y: tl.Symmetric):
    (N,) = x.shape

    @tl.comm_part(grid=(1,))
    def c(i):
        tl.tile_push_data(y.at(0).at(1), (0,), x, (0,), (N,))  # <-- error


def trace():
    return twice.trace(2, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
