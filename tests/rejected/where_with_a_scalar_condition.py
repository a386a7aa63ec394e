"""`tl.where(tl.rank() == 0, a, b)`: tl.where selects element by element on a bool tile; a traced
scalar condition is a choice between two values (tl.select) or a guarded region (tl.when). The
error names both."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.where takes a boolean tile as its condition, got a traced scalar: for a choice between two values write tl.select(cond, a, b)"


@tl.kernel
def chosen(x, y):
    (N,) = x.shape

    @tl.compute_part(grid=(1,))
    def p(i):
        t = tl.load(x, (0,), (N,))
        tl.store(y, (0,), tl.where(tl.rank() == 0, t, -t))  # <-- error


def trace():
    return chosen.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
