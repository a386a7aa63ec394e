"""``tl.cdiv`` of a schedule field left at its default None (CommSchedule.tile_m)."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "cdiv(16, None): a size is None — a schedule field left unset?"


@tl.kernel
def unset(a, c, *, comm: tl.CommSchedule = None):
    M, = a.shape
    tiles = tl.cdiv(M, comm.tile_m)  # <-- error

    @tl.compute_part(grid=(tiles,))
    def use(t):
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((16,), tl.float32)
    return unset.trace(2, f32, f32, comm=tl.CommSchedule())
