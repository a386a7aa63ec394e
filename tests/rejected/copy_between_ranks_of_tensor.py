"""A memory-to-memory push from a 2-d tensor into a 3-d one (the simulator used to crash on it)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "tile_push_data: a copy moves a box between tensors of the same rank, but 'x' is 2-d and 'inbox' is 3-d"


@tl.kernel
def mixed_ranks(x, inbox: tl.Symmetric):
    W = tl.world_size()
    M, N = x.shape

    @tl.comm_part(grid=(W,))
    def push(step):
        peer = (tl.rank() + step) % W
        tl.tile_push_data(inbox.at(peer), (tl.rank(), 0, 0), x, (0, 0), (M, N))  # <-- error


def trace():
    return mixed_ranks.trace(2, tl.TensorSpec((4, 8), tl.float32), tl.TensorSpec((2, 4, 8), tl.float32))
