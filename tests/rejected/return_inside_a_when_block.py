"""A return inside `with tl.when(...)`: traced once, it would end every task there, where the
condition holds or not (the code after it was silently never traced before this was refused)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "`return` inside `with tl.when(...)`"


@tl.kernel
def early_exit(x, y):
    M, N = x.shape

    @tl.compute_part(grid=(M // 8,))
    def part(pm):
        t = tl.load(x, (pm * 8, 0), (8, N))
        with tl.when(pm == 0):
            tl.store(y, (0, 0), t * 0.0 - 1.0)
            return  # <-- error
        tl.store(y, (pm * 8, 0), t * 2.0)


def trace():
    return early_exit.trace(1, tl.TensorSpec((32, 4), tl.float32), tl.TensorSpec((32, 4), tl.float32))
