"""consumer_tile_wait links parts of one rank: it needs a local signal, not a symmetric one."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "consumer_tile_wait works on local signals, but 'arrived' is symmetric"


@tl.kernel
def wrong_scope(a: tl.Symmetric, c):
    W = tl.world_size()
    arrived = tl.signal("arrived", 1, scope="symmetric")

    @tl.comm_part(grid=(1,), name="send")
    def send(i):
        tl.peer_tile_notify(arrived, 0, (tl.rank() + 1) % W)

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.consumer_tile_wait(arrived, 0)  # <-- error
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return wrong_scope.trace(2, f32, f32)
