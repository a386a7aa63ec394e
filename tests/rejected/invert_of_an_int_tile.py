"""'~' is taken on bool masks only (numpy's logical not there); an integer tile's bitwise not is -x - 1."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "'~' of a i32 tile: tiles take '~' on bool masks only"


@tl.kernel
def invert_ints(a, c):
    @tl.compute_part(grid=(1,))
    def use(i):
        x = tl.load(a, (0,), (4,))
        tl.store(c, (0,), ~x)  # <-- error


def trace():
    i32 = tl.TensorSpec((4,), tl.int32)
    return invert_ints.trace(1, i32, i32)
