"""An accumulator kept in a tile: `acc += ...` inside a tl.range binds the Python name to a value
of the loop's body, which does not exist after the loop. The error is at the use, naming the
loop and how to write an accumulator (a fragment)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "(made at accumulator_in_a_tile_across_a_loop.py:18) from inside the tl.range loop at accumulator_in_a_tile_across_a_loop.py:17, after the loop"


@tl.kernel
def summed(a, b, c):
    K = a.shape[1]

    @tl.compute_part(grid=(1,))
    def mm(i):
        acc = tl.zeros((16, 16))
        for k in tl.range(0, K, 16):
            acc += tl.dot(tl.load(a, (0, k), (16, 16)), tl.load(b, (k, 0), (16, 16)))
        tl.store(c, (0, 0), acc)  # <-- error


def trace():
    return summed.trace(1, tl.TensorSpec((16, 64), tl.float16), tl.TensorSpec((64, 16), tl.float16),
                        tl.TensorSpec((16, 16), tl.float32))
