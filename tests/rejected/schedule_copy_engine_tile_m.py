"""The copy-engine all-gather copies whole shards: a communication tile size makes no sense for it."""
import tldsl as tl
from tldsl.collectives import all_gather

ERROR = tl.ScheduleError
MESSAGE = "the copy-engine all-gather copies whole shards (in column slices with col_tile): set tile_m=None"


@tl.kernel
def gather_rows(x: tl.Symmetric, out, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    ag = all_gather(x, out, comm)  # <-- error
    BM = compute.BM

    @tl.compute_part(grid=(tl.cdiv(out.shape[0], BM),))
    def copy(i):
        ag.wait_rows(i * BM, (i + 1) * BM)
        tl.store(out, (i * BM, 0), tl.load(out, (i * BM, 0), (BM, out.shape[1])))


def trace():
    return gather_rows.trace(2, tl.TensorSpec((64, 32), tl.float32), tl.TensorSpec((128, 32), tl.float32),
                             comm=tl.CommSchedule(engine="copy_engine", tile_m=16))
