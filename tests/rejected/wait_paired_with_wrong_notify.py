"""peer_tile_wait is satisfied by peer_tile_notify; this signal is only written by rank_notify."""
import tldsl as tl

ERROR = tl.VerificationError
MESSAGE = "peer_tile_wait on signal 'arrived', which only rank_notify writes; a peer_tile_wait is satisfied by peer_tile_notify"


@tl.kernel
def mismatched_pair(a: tl.Symmetric, c):
    W = tl.world_size()
    arrived = tl.signal("arrived", 1, scope="symmetric")

    @tl.comm_part(grid=(1,), name="announce", engine="copy_engine")
    def announce(i):
        tl.rank_notify(arrived, 0, (tl.rank() + 1) % W)

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.peer_tile_wait(arrived, 0)  # <-- error
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return mismatched_pair.trace(2, f32, f32)
