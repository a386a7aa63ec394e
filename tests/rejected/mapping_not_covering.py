"""A StaticMapping of 2 shards x 4 rows over a 10-row tensor leaves rows 8..9 unmapped."""
import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "mapping 'rows' does not cover 'gathered': 2 shards of 4 rows give 8 rows, the tensor has 10"


@tl.kernel
def partial_mapping(a: tl.Symmetric, c):
    gathered = tl.symmetric_buffer((10, 4), tl.float32, "gathered")
    rows = tl.StaticMapping("rows", gathered, rows_per_rank=4)  # <-- error

    @tl.compute_part(grid=(1,))
    def use(i):
        tl.store(c, (0, 0), tl.load(a, (0, 0), (4, 4)))


def trace():
    f32 = tl.TensorSpec((4, 4), tl.float32)
    return partial_mapping.trace(2, f32, f32)
