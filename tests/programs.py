"""Tile programs several test files run (one definition, imported where needed)."""
from __future__ import annotations

import tldsl as tl


@tl.kernel
def scale_rows(x, y, *, compute: tl.ComputeSchedule = None):
    """``y = 2 x + 1`` tile by tile: elementwise, no loop, tiles that need not divide the tensor."""
    M, N = x.shape
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        t = tl.load(x, (pm * BM, pn * BN), (BM, BN))
        tl.store(y, (pm * BM, pn * BN), t * 2.0 + 1.0)
