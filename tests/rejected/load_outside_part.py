"""A tile load in the kernel body: tile operations run in tasks, i.e. inside a part."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "can only be used inside a compute or comm part"


@tl.kernel
def eager_load(a, c):
    x = tl.load(a, (0,), (4,))  # <-- error

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.store(c, (0,), x)


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return eager_load.trace(2, f32, f32)
