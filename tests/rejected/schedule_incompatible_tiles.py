"""Compute tiles of 16 rows, communication tiles of 24 rows: neither divides the other, so no
channel mapping links a compute tile to whole communication tiles."""
import tldsl as tl

ERROR = tl.ScheduleError
MESSAGE = "communication tile_m=24 and compute BM=16: one must divide the other"


@tl.kernel
def row_copy(x, out, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    BM = compute.BM

    @tl.compute_part(grid=(tl.cdiv(x.shape[0], BM),))
    def copy(i):
        tl.store(out, (i * BM, 0), tl.load(x, (i * BM, 0), (BM, x.shape[1])))


SPECS = [tl.TensorSpec((64, 32), tl.float32)] * 2


def trace():
    return row_copy.trace(2, *SPECS, compute=tl.ComputeSchedule(tile=(16, 32, 32)), comm=tl.CommSchedule(tile_m=24))  # <-- error
