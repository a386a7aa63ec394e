"""A row sum written with numpy's np.sum: numpy would sum a 0-d object array holding the tile and
hand the tile back unchanged (a program that stores its input). The error is at the call and names
the tile language's sum."""
import numpy as np

import tldsl as tl

ERROR = tl.CompilationError
MESSAGE = "numpy's np.sum on a traced value: write tl.sum(x, axis)"


@tl.kernel
def row_sums(x, out):
    @tl.compute_part(grid=(1,))
    def total(p):
        t = tl.load(x, (0, 0), (4, 8))
        tl.store(out, (0,), np.sum(t, axis=1))  # <-- error


def trace():
    return row_sums.trace(1, tl.TensorSpec((4, 8), tl.float32), tl.TensorSpec((4,), tl.float32))
