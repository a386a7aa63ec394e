"""A count written as the sum of a comparison: summing a bool tile would OR its elements (bool
arithmetic), not count them. The error says to cast to int32 first."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.sum of a bool tile: cast it first"


@tl.kernel
def positives(x, out):
    @tl.compute_part(grid=(1,))
    def count(p):
        t = tl.load(x, (0, 0), (4, 8))
        tl.store(out, (0,), tl.sum(t > 0, 1))  # <-- error


def trace():
    return positives.trace(1, tl.TensorSpec((4, 8), tl.float32), tl.TensorSpec((4,), tl.int32))
