"""The layer benchmark's fused-op column (tldsl/bench/fused_layers.py) compares the fused MoE ops
with the sequential layer: its mapping of the sequential layer's expert-sorted rows to the fused
ops' padded layout is the routing tables' own (each routed row lands where the routing kernels
put it), and its check refuses a wrong output."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tldsl.bench import baselines, fused_layers  # noqa: E402
from tldsl.ops.moe import moe_num_tiles  # noqa: E402
from tldsl.runtime.gpu.moe_routing import model_tables  # noqa: E402


@pytest.mark.parametrize("routing", baselines.ROUTINGS)
@pytest.mark.parametrize("E,topk,BM", [(5, 2, 8), (16, 4, 16), (3, 1, 64)])
def test_padded_rows_put_each_routed_row_where_the_routing_tables_do(routing, E, topk, BM):
    W, Ms = 2, 37
    T = W * Ms
    ids, _ = baselines.random_topk(T, E, topk, routing, device="cpu", seed=5)
    rows = torch.arange(T * topk, dtype=torch.float32)[:, None].repeat(1, 3)
    order, _ = baselines.route(ids, E)
    NT = moe_num_tiles(T * topk, E, BM)
    padded, dest = fused_layers.padded_rows(rows[order], ids, E, BM, NT)
    tables = model_tables(ids.numpy(), E, W, Ms, BM)
    flat = order.numpy()
    t, k = flat // topk, flat % topk
    assert np.array_equal(dest.numpy(), tables["token_pos"][k * T + t])      # where the kernels put them
    assert np.array_equal(tables["sorted_token_ids"][dest.numpy()], t)
    assert torch.equal(padded[dest], rows[order])
    unused = torch.ones(NT * BM, dtype=torch.bool)
    unused[dest] = False
    assert not padded[unused].any()                                           # padding rows are zero


def test_the_check_refuses_a_wrong_output():
    want = torch.randn(64, 32)
    assert fused_layers.check("op", want + 1e-3 * torch.randn(64, 32), want) < fused_layers.REL_TOL
    spike = want.clone()
    spike[3, 4] += 0.5 * float(want.pow(2).mean().sqrt())        # one element far off: L2 small, max not
    with pytest.raises(RuntimeError, match="largest"):
        fused_layers.check("op", spike, want)
    with pytest.raises(RuntimeError, match="differs from the sequential layer"):
        fused_layers.check("op", want.flip(0), want)
    with pytest.raises(RuntimeError):
        fused_layers.check("op", torch.full_like(want, float("nan")), want)


@pytest.mark.parametrize("routing", baselines.ROUTINGS)
def test_padded_rows_match_the_host_routing_the_kernel_benchmark_uses(routing):
    """``python -m tldsl.bench moe`` checks the grouped GEMM's padded rows against _grouped_mm's
    through :func:`fused_layers.padded_rows`: the host routing (``tldsl.ops.moe.moe_routing``) puts
    each expert-sorted row at the same place."""
    from tldsl.ops.moe import moe_routing
    T, E, topk, BM = 300, 8, 2, 64
    ids, _ = baselines.random_topk(T, E, topk, routing, device="cpu", seed=7)
    rt = moe_routing(ids.numpy(), E, 1, T, BM)
    order, _ = baselines.route(ids, E)
    _, dest = fused_layers.padded_rows(torch.zeros(T * topk, 1), ids, E, BM, rt.num_rows // BM)
    assert np.array_equal(rt.sorted_token_ids[dest.numpy()], (order // topk).numpy())
