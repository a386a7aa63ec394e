"""The benchmarks' timing helpers on the GPU: a repeat's fresh placement (``bench moe --repeat``)."""
from __future__ import annotations

import pytest

from tldsl.runtime.gpu import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]


def test_a_fresh_placement_empties_the_cache_and_holds_its_ballast():
    """Entering: the blocks the allocator cached are handed back to the driver (the run's tensors
    come from it anew); inside: the run's ballast held; leaving: it is freed."""
    import torch
    from tldsl.bench.timing import fresh_placement
    base = torch.cuda.memory_allocated()
    for run in range(3):
        left = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")    # the last run's tensors ...
        del left                                                          # ... cached, not returned
        reserved = torch.cuda.memory_reserved()
        with fresh_placement(run, step_mib=3):
            assert torch.cuda.memory_reserved() <= reserved - (40 << 20) + (20 << 20)   # + the ballast's segment
            assert torch.cuda.memory_allocated() - base == (run * 3 + 1) << 20
        assert torch.cuda.memory_allocated() == base
