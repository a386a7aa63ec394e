"""tl.dot of an f16 tile by an f32 tile: operand types must match (cast one first)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.dot: operand types differ (f16 vs f32)"


@tl.kernel
def mixed_dot(a, b, c):
    @tl.compute_part(grid=(1,))
    def gemm(i):
        x = tl.load(a, (0, 0), (16, 16))
        y = tl.load(b, (0, 0), (16, 16))
        acc = tl.dot(x, y)  # <-- error
        tl.store(c, (0, 0), acc)


def trace():
    return mixed_dot.trace(2, tl.TensorSpec((16, 16), tl.float16), tl.TensorSpec((16, 16), tl.float32),
                           tl.TensorSpec((16, 16), tl.float32))
