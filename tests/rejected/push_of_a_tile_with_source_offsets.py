"""`tile_push_data(dst, offs, tile, src_offsets, shape)`: a tile is pushed whole, so the source
offsets and shape (a tensor source's) were silently ignored — all 8 elements moved where the call
asked for 2. The error is at the push, naming what to pass instead."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tile_push_data pushes a tile whole: src_offsets and shape are for a tensor source"


@tl.kernel
def partial(x, y: tl.Symmetric):
    W = tl.world_size()
    (N,) = x.shape

    @tl.comm_part(grid=(1,))
    def c(i):
        t = tl.load(x, (0,), (N,))
        tl.tile_push_data(y.at((tl.rank() + 1) % W), (0,), t, (4,), (2,))  # <-- error


def trace():
    return partial.trace(2, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
