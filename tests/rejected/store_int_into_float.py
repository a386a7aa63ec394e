"""Storing an i32 tile into an f32 tensor: only float -> float stores convert implicitly."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tl.store: cannot store an i32 tile into 'out' of f32 (floats convert on a store, integers and bools do not: convert it first, t.to(tl.float32))"


@tl.kernel
def store_ints(x, out):
    @tl.compute_part(grid=(1,))
    def fill(i):
        idx = tl.iota(16)
        tl.store(out, (0,), idx)  # <-- error


def trace():
    f32 = tl.TensorSpec((16,), tl.float32)
    return store_ints.trace(2, f32, f32)
