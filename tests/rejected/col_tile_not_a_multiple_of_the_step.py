"""A column-sliced all-gather whose slices do not start at the K loop's steps: a step would read
columns of a slice it has not waited for, so the program is refused at its wait."""
import tldsl as tl
from tldsl.collectives import all_gather

ERROR = tl.CompilationError
MESSAGE = "all_gather: the compute loop's step (64) must divide the communication's col_tile (96)"


@tl.kernel
def gather_gemm(a: tl.Symmetric, b, c, *, compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    W = tl.world_size()
    Ms, K = a.shape
    BM, BN, BK = compute.tile
    full = tl.symmetric_buffer((W * Ms, K), a.dtype, "a_gathered")
    ag = all_gather(a, full, comm)

    @tl.compute_part(grid=(tl.cdiv(W * Ms, BM), tl.cdiv(b.shape[1], BN)))
    def gemm(pm, pn):
        r0 = pm * BM
        ag.wait_rows(r0, r0 + BM, then_cols=True)
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            ag.wait_cols(r0, r0 + BM, k, BK)  # <-- error
            acc += tl.dot(tl.load(full, (r0, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(c, (r0, pn * BN), acc)


def trace():
    return gather_gemm.trace(2, tl.TensorSpec((64, 256), tl.float16), tl.TensorSpec((256, 64), tl.float16),
                             tl.TensorSpec((128, 64), tl.float16),
                             compute=tl.ComputeSchedule(tile=(64, 64, 64)),
                             comm=tl.CommSchedule(engine="copy_engine", mode="push", col_tile=96))
