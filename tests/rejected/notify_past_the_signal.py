"""A notify whose computed channel runs past the signal (static channel analysis, at the notify)."""
import tldsl as tl

ERROR = tl.VerificationError
MESSAGE = "producer_tile_notify on rank 0, task (1,): channel 4 is outside signal 'ready' (4 slots)"


@tl.kernel
def shifted(a, c):
    ready = tl.signal("ready", 4)

    @tl.comm_part(grid=(4,), name="stage")
    def stage(t):
        tl.store(c, (t,), tl.load(a, (t,), (1,)))
        tl.producer_tile_notify(ready, t + 3)  # <-- error

    @tl.compute_part(grid=(4,))
    def use(t):
        tl.consumer_tile_wait(ready, t)


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return shifted.trace(2, f32, f32)
