"""A tile made under tl.when exists only inside that block (the IR `if` region)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "(made at tile_from_a_when_block.py:14) from inside the tl.when block at tile_from_a_when_block.py:13, after the block"


@tl.kernel
def guarded(x, y):
    @tl.compute_part(grid=(2,))
    def p(i):
        t = tl.load(x, (0,), (8,))
        with tl.when(i == 0):
            u = t * 2.0
        tl.store(y, (0,), u)  # <-- error


def trace():
    return guarded.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
