"""`tl.signal(3, 1)`: the first argument is the signal's name, not its slots (which come second);
a number was taken as the name without a word. The error says which argument is which."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.signal's first argument is its name (a non-empty string, e.g. tl.signal(\"ready\", 1)), got 3"


@tl.kernel
def counted(x, y):
    s = tl.signal(3, 1)  # <-- error

    @tl.compute_part(grid=(1,))
    def p(i):
        tl.store(y, (0,), tl.load(x, (0,), (8,)))
        tl.producer_tile_notify(s, 0)


def trace():
    return counted.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
