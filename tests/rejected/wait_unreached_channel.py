"""The producer notifies channels 0..2; the consumer waits on channel 3, which nothing reaches
(static channel analysis)."""
import tldsl as tl

ERROR = tl.VerificationError
MESSAGE = "waits for 1 notify on channel 3 of signal 'ready', but only 0 can arrive in a launch (notifies reach channels 0..2"


@tl.kernel
def off_by_one(a, c):
    ready = tl.signal("ready", 4)
    staged = tl.local_buffer((16,), tl.float32, "staged")

    @tl.comm_part(grid=(3,), name="stage")
    def stage(t):
        tl.store(staged, (t * 4,), tl.load(a, (t * 4,), (4,)))
        tl.producer_tile_notify(ready, t)

    @tl.compute_part(grid=(4,))
    def use(t):
        tl.consumer_tile_wait(ready, 3)  # <-- error
        tl.store(c, (t * 4,), tl.load(staged, (t * 4,), (4,)))


def trace():
    f32 = tl.TensorSpec((16,), tl.float32)
    return off_by_one.trace(2, f32, f32)
