"""tensor.at(rank) addresses a peer's copy: only symmetric tensors have one."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "'a' is not symmetric: only symmetric tensors"


@tl.kernel
def peek_at_peer(a, c):
    W = tl.world_size()

    @tl.compute_part(grid=(1,))
    def use(i):
        peer = (tl.rank() + 1) % W
        x = tl.load(a.at(peer), (0,), (4,))  # <-- error
        tl.store(c, (0,), x)


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return peek_at_peer.trace(2, f32, f32)
