"""The fused ops registered as torch custom ops: torch's own schemas, fake (meta) shapes for
torch.compile, N-d operands and any gather / scatter dim laid out as torch lays them out, and
input errors raised before anything runs (no GPU needed: the 2-d ops and the collectives are
stood in for by their results, computed from every simulated rank's operands)."""
import pytest

torch = pytest.importorskip("torch")

import tldsl  # noqa: E402
import tldsl.torch_ops  # noqa: E402,F401  (registers torch.ops.tldsl.*)
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def test_ops_have_torchs_own_schemas():
    """Argument names, types, defaults, keyword-only markers and returns as torch.ops.symm_mem's:
    a call written for theirs (keywords included) runs on ours."""
    import torch.distributed._symmetric_memory  # noqa: F401  (defines torch.ops.symm_mem.*)

    def shape(schema):
        return ([(a.name, str(a.type), a.kwarg_only, a.default_value) for a in schema.arguments],
                [str(r.type) for r in schema.returns])
    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        ours = getattr(torch.ops.tldsl, name).default._schema
        theirs = getattr(torch.ops.symm_mem, name).default._schema
        assert shape(ours) == shape(theirs), name


def test_fake_shapes_for_torch_compile():
    with FakeTensorMode():
        a = torch.empty(96, 64, dtype=torch.bfloat16)
        b1, b2 = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(64, 48, dtype=torch.bfloat16)
        a_full, (c1, c2) = torch.ops.tldsl.fused_all_gather_matmul(a, [b1, b2], 0, "0")
        assert a_full.shape == (96, 64) and c1.shape == (96, 32) and c2.shape == (96, 48)
        out = torch.ops.tldsl.fused_matmul_reduce_scatter(a, b1, "sum", 0, "0")
        assert out.shape == (96, 32)
        x = torch.empty(2, 48, 64, dtype=torch.bfloat16)                        # [batch, seq, hidden]
        a_full, (c,) = torch.ops.tldsl.fused_all_gather_matmul(x, [b1], 1, "0", return_A=False)
        assert a_full is None and c.shape == (2, 48, 32)
        assert torch.ops.tldsl.fused_matmul_reduce_scatter(x, b1, "avg", -2, "0").shape == (2, 48, 32)


# -- N-d operands, any dim: torch's layouts -----------------------------------------------------------

def _torch_all_gather_matmul(shards, bs, g):
    """torch.ops.symm_mem.fused_all_gather_matmul's result: its values as its fallback computes
    them from the all-gathered (rank-major) shards, laid out as its CUDA path returns them (2-d
    contiguous results of the shards moved and flattened, viewed back: ``unflatten``)."""
    W, shard = len(shards), shards[0]
    flat = torch.cat([s.contiguous() for s in shards])
    if g == shard.dim() - 1:
        a_mm = torch.cat(flat.flatten(0, -2).chunk(W), dim=-1)
        lead = tuple(shard.shape[:-1])
        return a_mm.view(*lead, -1), [torch.mm(a_mm, b).view(*lead, -1) for b in bs]
    a = flat.view(W, *shard.shape).movedim(g + 1, 1).flatten(0, 1)
    values = [a.movedim(0, g)] + [torch.matmul(a, b).movedim(0, g) for b in bs]
    lead = [W] + list(shard.movedim(g, 0).shape[:-1])

    def unflatten(t):
        return t.contiguous().view(*lead, -1).flatten(0, 1).movedim(0, g)
    a2d = a.flatten(0, -2)
    laid = [unflatten(a2d)] + [unflatten(a2d @ b) for b in bs]
    for v, x in zip(values, laid):
        assert torch.equal(v, x)
    return laid[0], laid[1:]


def _torch_matmul_reduce_scatter(As, b, reduce_op, d, rank):
    """torch's reduce_scatter_single(A @ B, reduce_op, scatter_dim) on ``rank``: the sum (or mean)
    over ranks of A @ B, this rank's chunk along ``d``, contiguous."""
    total = sum(torch.matmul(a, b) for a in As)
    if reduce_op == "avg":
        total = total / len(As)
    return total.chunk(len(As), dim=d)[rank].contiguous()


@pytest.fixture
def ranks(monkeypatch):
    """Run the torch ops as rank ``me`` of ``W`` simulated ranks: the 2-d fused ops and the
    collectives of the last-dim paths are stood in for by their results over every rank's
    operands (``ranks.operands``), so everything the torch ops do around them runs for real."""
    from tldsl import torch_ops
    import tldsl.runtime.dist as rd
    import torch.distributed as dist
    state = type("Ranks", (), {})()
    state.W, state.me, state.operands, state.asked = 2, 0, None, []
    monkeypatch.setattr(torch_ops, "_OPS", {})
    monkeypatch.setattr(torch_ops, "_world_size", lambda name: state.W)
    monkeypatch.setattr(torch_ops, "_group", lambda name: "group")
    monkeypatch.setattr(torch_ops, "_check_devices", lambda what, tensors: None)
    monkeypatch.setattr(torch_ops, "dense", lambda t: t.contiguous())

    def each_rank_2d(fn):
        return [fn(x) for x in state.operands]

    class AllGatherMatmul:
        def __init__(self, Ms, K, N, dtype, group=None):
            self.shape = (Ms, K, N)

        def __call__(self, a2d, b, return_gathered=True):
            g = state.dim
            blocks = [torch_ops.as_row_blocks(x, g)[0] for x in state.operands]
            assert torch.equal(blocks[state.me], a2d) and a2d.shape == self.shape[:2]
            full = torch.cat(blocks)
            state.asked.append(return_gathered)
            return (full if return_gathered else None), full @ b

    class MatmulReduceScatter:
        def __init__(self, M, K, N, dtype, group=None):
            self.shape = (M, K, N)

        def __call__(self, a2d, b):
            blocks = [torch_ops.as_row_blocks(x, state.dim)[0] for x in state.operands]
            assert torch.equal(blocks[state.me], a2d) and a2d.shape == self.shape[:2]
            total = sum(x @ b for x in blocks)
            return total.chunk(state.W)[state.me]

    def all_gather_into_tensor(out, flat, group=None):
        out.copy_(torch.cat([x.flatten(0, -2) for x in state.operands]))

    def reduce_scatter_tensor(out, blocks, group=None):
        P = out.shape[0]
        full = sum(x.flatten(0, -2) @ state.b for x in state.operands)
        out.copy_(full.view(P, state.W, -1)[:, state.me])
        assert torch.equal(blocks.view(state.W, P, -1)[state.me],
                           (state.operands[state.me].flatten(0, -2) @ state.b).view(P, state.W, -1)[:, state.me])
    monkeypatch.setattr(rd, "AllGatherMatmul", AllGatherMatmul)
    monkeypatch.setattr(rd, "MatmulReduceScatter", MatmulReduceScatter)
    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter_tensor)
    return state


SHAPES = [(8, 16), (3, 8, 16), (2, 4, 6, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("W", [1, 2, 3])
def test_all_gather_matmul_takes_torchs_operands_and_returns_its_layout(ranks, shape, W):
    """Every gather dim of 2-, 3- and 4-d shards (negative too; the last one gathers K, unfused),
    several Bs, return_A: values equal torch's, and so do the shapes and strides."""
    gen = torch.Generator().manual_seed(W)
    for g in list(range(len(shape))) + [-1, -2]:
        gd = g % len(shape)
        ranks.W, ranks.dim, ranks.me = W, gd, W - 1
        ranks.operands = [torch.randint(-2, 3, shape, generator=gen).to(torch.bfloat16) for _ in range(W)]
        K = shape[-1] * (W if gd == len(shape) - 1 else 1)
        bs = [torch.randint(-2, 3, (K, n), generator=gen).to(torch.bfloat16) for n in (5, 3)]
        want_a, want_cs = _torch_all_gather_matmul(ranks.operands, bs, gd)
        got_a, got_cs = torch.ops.tldsl.fused_all_gather_matmul(ranks.operands[ranks.me], bs, g, "tp")
        for want, got in zip([want_a] + want_cs, [got_a] + list(got_cs)):
            assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want), (shape, g)
        none, cs = torch.ops.tldsl.fused_all_gather_matmul(ranks.operands[ranks.me], bs, g, "tp", return_A=False)
        assert none is None and all(torch.equal(c, w) for c, w in zip(cs, want_cs))
        # one B and no A asked for: the gathered rows never leave the fused op
        ranks.asked.clear()
        none, (c,) = torch.ops.tldsl.fused_all_gather_matmul(ranks.operands[ranks.me], bs[:1], g, "tp",
                                                             return_A=False)
        assert none is None and torch.equal(c, want_cs[0])
        assert ranks.asked == ([] if gd == len(shape) - 1 else [False]), (shape, g)


@pytest.mark.parametrize("shape", [(6, 16), (3, 6, 16), (2, 6, 4, 16)])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter_takes_torchs_operands_and_returns_its_layout(ranks, shape, reduce_op):
    """Every scatter dim (negative too; the last one scatters N, unfused), sum and avg: values,
    shapes and strides (contiguous) equal torch's reduce-scatter of A @ B."""
    gen = torch.Generator().manual_seed(7)
    for W in (1, 2):
        for d in list(range(len(shape))) + [-1]:
            dd = d % len(shape)
            if shape[dd] % W:
                continue
            ranks.W, ranks.dim, ranks.me = W, dd, W - 1
            ranks.operands = [torch.randint(-2, 3, shape, generator=gen).to(torch.bfloat16) for _ in range(W)]
            ranks.b = b = torch.randint(-2, 3, (shape[-1], 6), generator=gen).to(torch.bfloat16)
            want = _torch_matmul_reduce_scatter(ranks.operands, b, reduce_op, dd, ranks.me)
            got = torch.ops.tldsl.fused_matmul_reduce_scatter(ranks.operands[ranks.me], b, reduce_op, d, "tp")
            assert got.shape == want.shape and got.stride() == want.stride(), (shape, d)
            assert torch.allclose(got, want), (shape, d)


def test_building_an_op_is_never_captured(ranks, monkeypatch):
    """A CUDA graph capture whose call would build the op is refused (building allocates symmetric
    memory, rendezvouses and synchronises); once built by an eager call, the same call captures."""
    from tldsl.runtime.dist import call_order
    ranks.W, ranks.dim, ranks.me = 2, 0, 1
    ranks.operands = [torch.ones(8, 16, dtype=torch.bfloat16) for _ in range(2)]
    b = torch.ones(16, 4, dtype=torch.bfloat16)
    monkeypatch.setattr(call_order, "capturing", lambda: True)
    with pytest.raises(tldsl.InputError, match="call it once before capturing"):
        torch.ops.tldsl.fused_all_gather_matmul(ranks.operands[1], [b], 0, "tp")
    monkeypatch.setattr(call_order, "capturing", lambda: False)
    torch.ops.tldsl.fused_all_gather_matmul(ranks.operands[1], [b], 0, "tp")          # eager: builds it
    monkeypatch.setattr(call_order, "capturing", lambda: True)
    _, [c] = torch.ops.tldsl.fused_all_gather_matmul(ranks.operands[1], [b], 0, "tp")
    assert torch.equal(c, torch.full((16, 4), 16.0, dtype=torch.bfloat16))


def test_operands_that_require_grad_are_refused_before_anything_runs(ranks):
    """The ops have no backward: while autograd records, an operand that requires grad is refused
    before an op is built or run (torch's generated autograd would run it and fail in backward());
    under torch.no_grad() the same call runs."""
    a = torch.randn(2, 8, 16).to(torch.bfloat16)
    b = torch.randn(16, 8).to(torch.bfloat16)
    ranks.operands, ranks.dim, ranks.b = [a, a], 0, b
    for call, name in ((lambda x, y: torch.ops.tldsl.fused_all_gather_matmul(x, [b, y], 0, "tp"), "Bs\\[1\\]"),
                       (lambda x, y: torch.ops.tldsl.fused_matmul_reduce_scatter(a, y, "sum", 0, "tp"), "B")):
        with pytest.raises(tldsl.InputError, match=f": {name} requires grad, but the op has no backward"):
            call(a, b.clone().requires_grad_())
    with pytest.raises(tldsl.InputError, match="fused_all_gather_matmul: A requires grad"):
        torch.ops.tldsl.fused_all_gather_matmul(a.clone().requires_grad_(), [b], 0, "tp")
    assert ranks.asked == [] and torch_ops_built() == []
    with torch.no_grad():
        _, [c] = torch.ops.tldsl.fused_all_gather_matmul(a.clone().requires_grad_(), [b], 0, "tp")
    assert not c.requires_grad and ranks.asked == [True]


def torch_ops_built():
    from tldsl import torch_ops
    return torch_ops.built_ops()


def test_dims_that_do_not_split_are_refused_before_anything_runs(ranks):
    ranks.W = 4
    a = torch.randn(2, 6, 16).to(torch.bfloat16)
    b = torch.randn(16, 6).to(torch.bfloat16)
    with pytest.raises(tldsl.InputError, match="dim 1 of A has 6 entries, not divisible by the 4 ranks"):
        torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "sum", 1, "tp")
    with pytest.raises(tldsl.InputError, match=r"the last dim \(N = 6\) is scattered over 4 ranks"):
        torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "sum", -1, "tp")
    with pytest.raises(tldsl.InputError, match=r"must be \[K=64, N\]"):           # gathering K: B has every rank's
        torch.ops.tldsl.fused_all_gather_matmul(a, [b], 2, "tp")
    with pytest.raises(tldsl.InputError, match=r"gather_dim=3: a dim of the 3-d A, in \[-3, 2\]"):
        torch.ops.tldsl.fused_all_gather_matmul(a, [b], 3, "tp")


@pytest.mark.parametrize("call,fragment", [
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a, [b.t()], 0, "0"), "must be [K=64, N]"),
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a.float(), [b.float()], 0, "0"), "bf16 or fp16"),
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a, [b.half()], 0, "0"), "but A is"),
    (lambda a, b: torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "max", 0, "0"), "'sum' or 'avg'"),
    (lambda a, b: torch.ops.tldsl.fused_matmul_reduce_scatter(a, b, "sum", 2, "0"), "scatter_dim=2"),
    (lambda a, b: torch.ops.tldsl.fused_all_gather_matmul(a[0], [b], 0, "0"), "at least 2 dims"),
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
