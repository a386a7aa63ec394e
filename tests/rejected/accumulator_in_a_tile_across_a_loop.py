"""An accumulator kept in a tile: `acc += ...` inside a tl.range binds the Python name to a new tile
made in the loop's body, so every iteration would read the tile made before the loop (and the new
one does not exist after the loop). The error is at the update, saying how to write an accumulator
(a fragment)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "`acc += ...` at line 19 binds `acc` to a new Tile (only a fragment is updated in place): the body is traced once"


@tl.kernel
def summed(a, b, c):
    K = a.shape[1]

    @tl.compute_part(grid=(1,))
    def mm(i):
        acc = tl.zeros((16, 16))
        for k in tl.range(0, K, 16):
            acc += tl.dot(tl.load(a, (0, k), (16, 16)), tl.load(b, (k, 0), (16, 16)))  # <-- error
        tl.store(c, (0, 0), acc)


def trace():
    return summed.trace(1, tl.TensorSpec((16, 64), tl.float16), tl.TensorSpec((64, 16), tl.float16),
                        tl.TensorSpec((16, 16), tl.float32))
