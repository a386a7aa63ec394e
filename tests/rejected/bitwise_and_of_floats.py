"""'&' and '|' are numpy's: logical on bool tiles, bitwise on integer ones; float tiles have neither."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "'&' of f32, f32: '&' and '|' take bool or integer tiles"


@tl.kernel
def float_mask(a, c):
    @tl.compute_part(grid=(1,))
    def use(i):
        x = tl.load(a, (0,), (4,))
        both = x & x  # <-- error
        tl.store(c, (0,), tl.where(both, x, 0.0))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return float_mask.trace(1, f32, f32)
