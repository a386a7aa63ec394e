"""A constant channel 4 on a signal of 4 slots (channels 0..3)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "producer_tile_notify: channel 4 is outside signal 'ready' (4 slots)"


@tl.kernel
def past_the_end(a, c):
    ready = tl.signal("ready", 4)

    @tl.comm_part(grid=(1,), name="stage")
    def stage(i):
        tl.producer_tile_notify(ready, 4)  # <-- error

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.consumer_tile_wait(ready, 0)
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return past_the_end.trace(2, f32, f32)
