"""A whole-row softmax loaded as one 1024 x 5000 f32 tile (20 MB): the simulator used to run it while
no lowering can hold it (the general one spills at most 16 MiB a task group). Refused at the load."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "a 1024x5000 f32 tile is 20,480,000 bytes: no kernel holds one over 16 MiB"


@tl.kernel
def whole_softmax(x, y):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        t = tl.load(x, (0, 0), (M, N))  # <-- error
        e = tl.exp(t - tl.expand_dims(tl.max(t, 1), 1))
        tl.store(y, (0, 0), e / tl.expand_dims(tl.sum(e, 1), 1))


def trace():
    f32 = tl.TensorSpec((1024, 5000), tl.float32)
    return whole_softmax.trace(1, f32, f32)
