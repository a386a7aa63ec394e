"""A Python int advanced in a tl.range body: the body is traced once, so every iteration read the
offset the loop started with and summed the first block four times (silently, before this was
refused). Compute the offset from the loop index."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "`off += ...` at line 20 binds `off` to a new int (only a fragment is updated in place)"


@tl.kernel
def row_sum(x, y):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        acc = tl.fragment((M,), tl.float32)
        off = 0
        for c in tl.range(0, N, 8):
            acc += tl.sum(tl.load(x, (0, off), (M, 8)), 1)
            off += 8  # <-- error
        tl.store(y, (0,), acc.read())


def trace():
    return row_sum.trace(1, tl.TensorSpec((2, 32), tl.float32), tl.TensorSpec((2,), tl.float32))
