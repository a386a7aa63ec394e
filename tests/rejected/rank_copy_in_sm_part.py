"""rank_copy_data is a copy-engine transfer: it cannot run in a part on SMs."""
import tldsl as tl

ERROR = tl.VerificationError
MESSAGE = "rank_copy_data runs on the copy engine: put it in a comm part with engine='copy_engine'"


@tl.kernel
def copy_on_sms(a: tl.Symmetric, c):
    W = tl.world_size()
    gathered = tl.symmetric_buffer((2 * 4,), tl.float32, "gathered")

    @tl.comm_part(grid=(W,), name="gather", engine="sm")
    def gather(step):
        peer = (tl.rank() + step) % W
        tl.rank_copy_data(gathered, (peer * 4,), a.at(peer), (0,), (4,))  # <-- error

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return copy_on_sms.trace(2, f32, f32)
