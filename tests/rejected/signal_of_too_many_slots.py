"""`tl.signal("s", 2**70)`: a signal's slots are named by 32-bit int channels, so it has fewer than
2**31 of them. The count was accepted while tracing, and numpy's ValueError ("Maximum allowed
dimension exceeded") came from inside the simulator; now refused at the declaring line."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "signal 's' of 1180591620717411303424 slots: notifies and waits name a slot with a 32-bit int channel"


@tl.kernel
def counted(x, y):
    s = tl.signal("s", 2 ** 70)  # <-- error

    @tl.compute_part(grid=(1,))
    def p(i):
        tl.store(y, (0,), tl.load(x, (0,), (8,)))
        tl.producer_tile_notify(s, 0)


def trace():
    return counted.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
