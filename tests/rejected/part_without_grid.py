"""``@tl.comm_part`` written without its ``(grid=...)``: the part would be dropped silently."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "@tl.comm_part needs its grid: write @tl.comm_part(grid=(...)) above def stage"


@tl.kernel
def forgot_the_grid(a, c):
    @tl.comm_part  # <-- error
    def stage(i):
        pass

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return forgot_the_grid.trace(2, f32, f32)
