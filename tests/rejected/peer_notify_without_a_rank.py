"""peer_tile_notify adds to one rank's copy of the signal: it has no default rank (rank_notify has)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "peer_tile_notify needs the rank whose copy of the signal it adds to"


@tl.kernel
def ping(a: tl.Symmetric, c):
    got = tl.signal("got", 1, scope="symmetric")

    @tl.comm_part(grid=(1,), name="send")
    def send(i):
        tl.peer_tile_notify(got, 0, None)  # <-- error

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.peer_tile_wait(got, 0)
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return ping.trace(2, f32, f32)
