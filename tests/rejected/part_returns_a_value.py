"""A part that returns its result instead of storing it: the value would be dropped and the
output left as it was."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "part 'doubled' returned a Tile: a part's results are what it stores"


@tl.kernel
def twice(x, out):
    @tl.compute_part(grid=(1,))  # <-- error
    def doubled(p):
        return tl.load(x, (0,), (8,)) * 2.0


def trace():
    return twice.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
