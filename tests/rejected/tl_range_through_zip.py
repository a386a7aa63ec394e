"""A tl.range iterated through zip: its body is traced once, so zip saw one element of its other
arguments, and `zip(range(1), tl.range(4))` ran the IR loop four times (silently, before this was
refused); enumerate would count 0 for every iteration."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.range iterated through zip(...)"


@tl.kernel
def first_block_sum(x, y):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        acc = tl.fragment((M,), tl.float32)
        for _, c in zip(range(1), tl.range(0, N, 8)):  # <-- error
            acc += tl.sum(tl.load(x, (0, c), (M, 8)), 1)
        tl.store(y, (0,), acc.read())


def trace():
    return first_block_sum.trace(1, tl.TensorSpec((2, 32), tl.float32), tl.TensorSpec((2,), tl.float32))
