"""A consumer waits on a signal that no part ever notifies: it would hang."""
import tldsl as tl

ERROR = tl.VerificationError
MESSAGE = "consumer_tile_wait on signal 'ready', but nothing notifies it: this wait would hang"


@tl.kernel
def orphan_wait(a, c):
    ready = tl.signal("ready", 4)

    @tl.compute_part(grid=(4,))
    def use(t):
        tl.consumer_tile_wait(ready, t)  # <-- error
        tl.store(c, (t * 4,), tl.load(a, (t * 4,), (4,)))


def trace():
    f32 = tl.TensorSpec((16,), tl.float32)
    return orphan_wait.trace(2, f32, f32)
