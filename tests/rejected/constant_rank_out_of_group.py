"""A constant rank 2 in a group of 2 ranks (ranks are 0 and 1)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "rank 2 is outside the group of 2 ranks"


@tl.kernel
def third_rank(a: tl.Symmetric, c):
    @tl.compute_part(grid=(1,))
    def use(i):
        x = tl.load(a.at(2), (0,), (4,))  # <-- error
        tl.store(c, (0,), x)


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return third_rank.trace(2, f32, f32)
