"""A part defined inside another part: parts are siblings in the kernel body."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "parts cannot be nested: define every part in the kernel body"


@tl.kernel
def nested(a, c):
    @tl.compute_part(grid=(1,))
    def outer(i):
        @tl.comm_part(grid=(1,), name="inner")  # <-- error
        def inner(j):
            pass

        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return nested.trace(2, f32, f32)
