"""Two tl.range loops stepped together (a zip made before the for statement): each body is traced
once, so the second loop opened inside the first and the body ran 16 times where the program meant 4
(silently, before this was refused)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "two tl.range loops were advanced together"


@tl.kernel
def diagonal_blocks(x, y):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        acc = tl.fragment((8,), tl.float32)
        pairs = zip(tl.range(0, M, 8), tl.range(0, N, 8))
        for r, c in pairs:  # <-- error
            acc += tl.sum(tl.load(x, (r, c), (8, 8)), 1)
        tl.store(y, (0,), acc.read())


def trace():
    return diagonal_blocks.trace(1, tl.TensorSpec((32, 32), tl.float32), tl.TensorSpec((8,), tl.float32))
