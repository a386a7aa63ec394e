"""A schedule built with a field it does not have (``tiles`` for ``tile``): its fields are listed."""
import tldsl as tl

ERROR = tl.ScheduleError
MESSAGE = "ComputeSchedule has no field 'tiles'; its fields: tile, order, stages, group_m, cluster"


@tl.kernel
def copied(x, out, *, compute: tl.ComputeSchedule = None):
    @tl.compute_part(grid=(1,))
    def tiles(p):
        tl.store(out, (0, 0), tl.load(x, (0, 0), (8, 8)))


def trace():
    return copied.trace(1, tl.TensorSpec((8, 8), tl.float32), tl.TensorSpec((8, 8), tl.float32),
                        compute=tl.ComputeSchedule(tiles=(64, 64, 32)))  # <-- error
