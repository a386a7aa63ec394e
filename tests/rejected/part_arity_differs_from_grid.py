"""A part over a 2-d grid written with one program id: it is called with one per axis."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "part 'tiles' must take 2 argument(s), one program id per axis of its 2-d grid: def tiles(p0, p1)"


@tl.kernel
def copied(x, out):
    @tl.compute_part(grid=(2, 2))  # <-- error
    def tiles(pm):
        tl.store(out, (pm * 8, 0), tl.load(x, (pm * 8, 0), (8, 8)))


def trace():
    return copied.trace(1, tl.TensorSpec((16, 16), tl.float32), tl.TensorSpec((16, 16), tl.float32))
