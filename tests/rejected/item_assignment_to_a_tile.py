"""`t[0, 0] = 1.0` on a loaded tile: tiles are immutable values, and Python's TypeError ("'Tile'
object does not support item assignment") said nothing of what to write instead. The error is at
the assignment and names tl.where and fragments, as `t[0]` (a read) already did."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tiles are immutable: t[...] = value cannot change one. Make a new tile, tl.where(mask, value, t)"


@tl.kernel
def first_set(x, y):
    @tl.compute_part(grid=(1,))
    def p(i):
        t = tl.load(x, (0, 0), (4, 8))
        t[0, 0] = 1.0  # <-- error
        tl.store(y, (0, 0), t)


def trace():
    return first_set.trace(1, tl.TensorSpec((4, 8), tl.float32), tl.TensorSpec((4, 8), tl.float32))
