"""The fused ops registered as torch custom ops: schemas, fake (meta) shapes for torch.compile,
and input errors raised before anything runs (no GPU needed)."""
import pytest

torch = pytest.importorskip("torch")

import tldsl  # noqa: E402
import tldsl.torch_ops  # noqa: E402,F401  (registers torch.ops.tldsl.*)
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def test_ops_are_registered_with_async_tp_signatures():
    ag = torch.ops.tldsl.fused_all_gather_matmul.default._schema
    rs = torch.ops.tldsl.fused_matmul_reduce_scatter.default._schema
    assert [a.name for a in ag.arguments] == ["a_shard", "bs", "gather_dim", "group_name"]
    assert [a.name for a in rs.arguments] == ["a", "b", "reduce_op", "scatter_dim", "group_name"]


def test_fake_shapes_for_torch_compile():
    with FakeTensorMode():
        a = torch.empty(96, 64, dtype=torch.bfloat16)
        b1, b2 = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(64, 48, dtype=torch.bfloat16)
        a_full, (c1, c2) = torch.ops.tldsl.fused_all_gather_matmul(a, [b1, b2], 0, "0")
        assert a_full.shape == (96, 64) and c1.shape == (96, 32) and c2.shape == (96, 48)
        out = torch.ops.tldsl.fused_matmul_reduce_scatter(a, b1, "sum", 0, "0")
        assert out.shape == (96, 32)


@pytest.mark.parametrize("call,fragment", [
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a, [b], 1, "0"), "gather_dim=1"),
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a, [b.t()], 0, "0"), "must be [K=64, N]"),
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a.float(), [b.float()], 0, "0"), "bf16 or fp16"),
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a, [b.half()], 0, "0"), "but A is"),
    (lambda a, b: torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "max", 0, "0"), "'sum' or 'avg'"),
    (lambda a, b: torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "sum", 1, "0"), "scatter_dim=1"),
    (lambda a, b: torch.ops.tldsl.fused_matmul_reduce_scatter(a, b.t(), "sum", 0, "0"), "matching K"),
])
def test_bad_input_is_rejected_before_anything_runs(call, fragment):
    a = torch.randn(96, 64).to(torch.bfloat16)
    b = torch.randn(64, 32).to(torch.bfloat16)
    with pytest.raises(tldsl.InputError, match=fragment.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        call(a, b)


def test_without_a_process_group_the_error_says_so():
    a = torch.randn(96, 64).to(torch.bfloat16)
    b = torch.randn(64, 32).to(torch.bfloat16)
    with pytest.raises(tldsl.InputError, match="torch.distributed is not initialised"):
        torch.ops.tldsl.fused_all_gather_matmul(a, [b], 0, "0")


def test_close_all_releases_every_built_op_once(monkeypatch):
    from tldsl import torch_ops
    closed = []

    class Op:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)
    monkeypatch.setattr(torch_ops, "_OPS", {("ag", 1): Op("ag"), ("rs", 2): Op("rs")})
    assert [o.name for o in torch_ops.built_ops()] == ["ag", "rs"]
    torch_ops.close_all()
    assert closed == ["ag", "rs"] and torch_ops.built_ops() == []
    torch_ops.close_all()                                # nothing left: nothing closed twice
    assert closed == ["ag", "rs"]


def test_close_all_closes_the_rest_when_one_fails(monkeypatch):
    from tldsl import torch_ops
    closed = []

    class Op:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} failed")
    monkeypatch.setattr(torch_ops, "_OPS", {1: Op("a"), 2: Op("b", fails=True), 3: Op("c")})
    with pytest.raises(RuntimeError, match="b failed"):
        torch_ops.close_all()
    assert closed == ["a", "b", "c"] and torch_ops.built_ops() == []
