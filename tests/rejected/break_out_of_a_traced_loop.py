"""A break in a tl.range loop: the body is traced once and the IR loop runs every iteration, so the
jump would be taken for all of them (the loop ran whole, silently, before this was refused)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "this tl.range loop was left early by the break at line 18"


@tl.kernel
def first_block_sum(x, y):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        acc = tl.fragment((M,), tl.float32)
        for c in tl.range(0, N, 8):  # <-- error
            acc += tl.sum(tl.load(x, (0, c), (M, 8)), 1)
            break
        tl.store(y, (0,), acc.read())


def trace():
    return first_block_sum.trace(1, tl.TensorSpec((2, 32), tl.float32), tl.TensorSpec((2,), tl.float32))
