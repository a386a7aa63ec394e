"""A copy-engine part is a stream of DMA copies: it cannot load tiles or do math."""
import tldsl as tl

ERROR = tl.VerificationError
MESSAGE = "'load' cannot run on the copy engine"


@tl.kernel
def math_on_dma(a: tl.Symmetric, c):
    @tl.comm_part(grid=(1,), name="dma", engine="copy_engine")
    def dma(i):
        x = tl.load(a, (0,), (4,))  # <-- error
        tl.store(c, (0,), x)

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.store(c, (0,), tl.load(a, (0,), (4,)))


def trace():
    f32 = tl.TensorSpec((4,), tl.float32)
    return math_on_dma.trace(2, f32, f32)
