"""The fused GPU ops are notebook-native too (tests/test_reprs.py: the other types): built on
test_dist_host's simulated driver with torch symmetric memory faked, no GPU needed (the schedules
on the fused-op runtime: tests/test_program_engine.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the fused ops' host-side build needs torch (make install: a CPU build)")
from test_dist_host import fake_ag, proto  # noqa: E402,F401 - fixtures: torch symmetric memory on a simulated driver
from test_reprs import assert_notebook_native  # noqa: E402


def test_fused_ops_on_the_host(proto, fake_ag):
    """The GPU ops, built on test_dist_host's simulated driver: their schedules are compacted to
    what differs from the defaults so the line keeps its start and end."""
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    AllGatherMatmul, torch = fake_ag
    ag = AllGatherMatmul(4091, 1032, 3000, torch.bfloat16, handshake="kernel")
    html = assert_notebook_native(ag, "<AllGatherMatmul rank 1/2: A shard [4091, 1032]", "mode='pull'", "0 launches>")
    assert "describe()" in html and "engine" in html
    rs = MatmulReduceScatter(4096 * 2, 1032, 3000, "bfloat16")
    assert_notebook_native(rs, "<MatmulReduceScatter rank 1/2: A [8192, 1032]", "engine='copy_engine'", "0 launches>")
    for op in (ag, rs):
        op.close()
        assert repr(op).endswith("closed>") and "freed" in op._repr_html_()
