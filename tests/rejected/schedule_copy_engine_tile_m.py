"""The copy engine moves whole rank chunks: a communication tile size makes no sense with it."""
import tldsl as tl

ERROR = tl.ScheduleError
MESSAGE = "the copy engine moves whole rank chunks: set tile_m=None with engine='copy_engine'"


@tl.kernel
def row_copy(x, out, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    BM = compute.BM

    @tl.compute_part(grid=(tl.cdiv(x.shape[0], BM),))
    def copy(i):
        tl.store(out, (i * BM, 0), tl.load(x, (i * BM, 0), (BM, x.shape[1])))


SPECS = [tl.TensorSpec((64, 32), tl.float32)] * 2


def trace():
    return row_copy.trace(2, *SPECS, comm=tl.CommSchedule(engine="copy_engine", tile_m=16))  # <-- error
