"""A continue inside `with tl.when(...)` in an unrolled loop: it would skip the rest of every
iteration, not only those where the condition holds."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "`continue` inside `with tl.when(...)`"


@tl.kernel
def masked_blocks(x, y):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        for c in tl.static_range(0, N, 8):
            t = tl.load(x, (0, c), (M, 8))
            with tl.when(tl.load_scalar(y, (0, 0)) > c):
                if c > 0:
                    continue  # <-- error
            tl.store(y, (0, c), t)


def trace():
    return masked_blocks.trace(1, tl.TensorSpec((2, 32), tl.int32), tl.TensorSpec((2, 32), tl.int32))
