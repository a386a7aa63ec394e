"""A signal kept from an earlier trace (a module-level dict) and used in another trace: each trace
declares its own signals, so the kept handle names nothing in the new one. The error is at the use
and says where the signal was declared."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "this uses the signal 'ready' (declared at signal_of_another_trace.py:17) of another trace or kernel"

KEPT = {}
F32 = tl.TensorSpec((32,), tl.float32)


@tl.kernel
def copied(x, y):
    first = "ready" not in KEPT
    if first:
        KEPT["ready"] = tl.signal("ready", 4)

    @tl.compute_part(grid=(4,))
    def copy(t):
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)))
        tl.producer_tile_notify(KEPT["ready"], t)  # <-- error


def trace():
    KEPT.clear()
    copied.trace(1, F32, F32)       # declares the signal and keeps it
    return copied.trace(2, F32, F32)
