"""A part whose grid is None (a size left unset): a grid is a tuple of Python ints."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "a part's grid must be a tuple of Python ints (static), got None"

GRID = None


@tl.kernel
def copied(out):
    @tl.compute_part(grid=GRID)  # <-- error
    def v(p):
        tl.store(out, (0,), tl.zeros((8,)))


def trace():
    return copied.trace(1, tl.TensorSpec((8,), tl.float32))
