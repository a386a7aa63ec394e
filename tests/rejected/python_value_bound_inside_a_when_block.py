"""A Python value bound inside a tl.when body and read after it: the body is traced once for every
task, so every task scaled by 2.0, not only task 0 (silently, before this was refused)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "`scale` is bound inside this tl.when body (line 17) and read after it"


@tl.kernel
def scaled_first_block(x, y):
    (N,) = x.shape

    @tl.compute_part(grid=(N // 8,))
    def part(p):
        scale = 1.0
        with tl.when(p == 0):
            scale = 2.0  # <-- error
        tl.store(y, (p * 8,), tl.load(x, (p * 8,), (8,)) * scale)


def trace():
    return scaled_first_block.trace(1, tl.TensorSpec((32,), tl.float32), tl.TensorSpec((32,), tl.float32))
