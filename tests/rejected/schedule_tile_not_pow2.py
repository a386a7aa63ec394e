"""A compute tile of 24 rows: tile sizes are powers of two between 8 and 256."""
import tldsl as tl

ERROR = tl.ScheduleError
MESSAGE = "compute tile (24, 32, 32): need three powers of two between 8 and 256"


@tl.kernel
def row_copy(x, out, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    BM = compute.BM

    @tl.compute_part(grid=(tl.cdiv(x.shape[0], BM),))
    def copy(i):
        tl.store(out, (i * BM, 0), tl.load(x, (i * BM, 0), (BM, x.shape[1])))


SPECS = [tl.TensorSpec((64, 32), tl.float32)] * 2


def trace():
    return row_copy.trace(2, *SPECS, compute=tl.ComputeSchedule(tile=(24, 32, 32)))  # <-- error
