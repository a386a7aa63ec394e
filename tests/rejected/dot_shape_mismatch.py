"""tl.dot of a [16, 16] tile by an [8, 16] tile: the inner dimensions differ."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.dot: inner dimensions differ: (16, 16) @ (8, 16)"


@tl.kernel
def bad_dot(a, b, c):
    @tl.compute_part(grid=(1,))
    def gemm(i):
        x = tl.load(a, (0, 0), (16, 16))
        y = tl.load(b, (0, 0), (8, 16))
        tl.store(c, (0, 0), tl.dot(x, y))  # <-- error


def trace():
    f32 = tl.TensorSpec((16, 16), tl.float32)
    return bad_dot.trace(2, f32, f32, f32)
