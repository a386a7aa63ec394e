"""A Python `if` on a traced scalar: the value is only known when the kernel runs."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "a traced scalar has no Python truth value while tracing: use tl.when(cond)"


@tl.kernel
def python_branch(a, c):
    @tl.compute_part(grid=(4,))
    def use(t):
        if t == 0:  # <-- error
            tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((16,), tl.float32)
    return python_branch.trace(2, f32, f32)
