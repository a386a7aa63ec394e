"""tl.static_assert reports the user's own message at the user's line."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "square_copy needs a square matrix, got (8, 4)"


@tl.kernel
def square_copy(a, c):
    M, N = a.shape
    tl.static_assert(M == N, f"square_copy needs a square matrix, got {(M, N)}")  # <-- error

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.store(c, (0, 0), tl.load(a, (0, 0), (M, N)))


def trace():
    f32 = tl.TensorSpec((8, 4), tl.float32)
    return square_copy.trace(2, f32, f32)
