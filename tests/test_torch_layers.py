"""The MoE layers and sequence-parallel attention as torch custom ops (tldsl/torch_layers.py): their fake (meta) shapes for
torch.compile, and bad operands refused with InputError before an op is built (no GPU)."""
import pytest

torch = pytest.importorskip("torch")

import tldsl.torch_layers as tmo  # noqa: E402  (registers torch.ops.tldsl.all_gather_moe / moe_reduce_scatter)
from tldsl.errors import InputError  # noqa: E402
from tldsl.ops.moe import moe_num_tiles  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def test_fake_shapes_for_torch_compile():
    T, K, Nr, E, topk = 100, 64, 48, 6, 2
    with FakeTensorMode():
        x = torch.empty(T, K, dtype=torch.bfloat16)
        ids = torch.empty(T, topk, dtype=torch.int64)
        h = torch.ops.tldsl.all_gather_moe(x, ids, torch.empty(E, K, Nr, dtype=torch.bfloat16), "0")
        R = moe_num_tiles(T * topk, E, 128) * 128
        assert h.shape == (R, Nr) and h.dtype == torch.bfloat16
        h64 = torch.ops.tldsl.all_gather_moe(x, ids, torch.empty(E, K, Nr, dtype=torch.bfloat16), "0", block_m=64)
        assert h64.shape == (moe_num_tiles(T * topk, E, 64) * 64, Nr)
        out = torch.ops.tldsl.moe_reduce_scatter(h, ids, torch.empty(T, topk), torch.empty(E, Nr, K, dtype=torch.bfloat16),
                                                 "0")
        assert out.shape == (T, K) and out.dtype == torch.bfloat16
        q, kv = torch.empty(64, 8, 128, dtype=torch.float16), torch.empty(64, 2, 128, dtype=torch.float16)
        o = torch.ops.tldsl.sp_attention(q, kv, kv, "0", is_causal=True, layout="zigzag")
        assert o.shape == q.shape and o.dtype == q.dtype


def test_the_fake_kernel_refuses_what_the_op_refuses():
    """Found by an explorer's round: the fake (meta) kernel torch.compile traces with accepted
    layout='zigzag' with an odd S, which the op refuses only when the compiled graph runs. Both
    now run the op's one argument check."""
    from tldsl.runtime.dist.attention_op import SequenceParallelAttention
    import tldsl as tl
    with pytest.raises(InputError, match="Sl=7 must be even"):
        SequenceParallelAttention(tl.TensorSpec((7, 2, 16), tl.bfloat16), tl.TensorSpec((7, 32), tl.bfloat16), 2,
                                  causal=True, layout="zigzag")
    with FakeTensorMode():
        q = torch.empty(7, 2, 16, dtype=torch.bfloat16)
        with pytest.raises(InputError, match="sp_attention: the zigzag layout .* Sl=7 must be even"):
            torch.ops.tldsl.sp_attention(q, q, q, "0", is_causal=True, layout="zigzag")
        even = torch.empty(8, 2, 16, dtype=torch.bfloat16)
        assert torch.ops.tldsl.sp_attention(even, even, even, "0", is_causal=True, layout="zigzag").shape == (8, 2, 16)


@pytest.mark.parametrize("call, match", [
    (lambda x, ids, w: torch.ops.tldsl.all_gather_moe(x.float(), ids, w.float(), "0"), "bf16 or fp16"),
    (lambda x, ids, w: torch.ops.tldsl.all_gather_moe(x, ids.float(), w, "0"), "int32 or int64"),
    (lambda x, ids, w: torch.ops.tldsl.all_gather_moe(x, ids[:-1], w, "0"), "topk_ids has 7 tokens"),
    (lambda x, ids, w: torch.ops.tldsl.all_gather_moe(x, ids, w[:, :-1], "0"), "w1 must be"),
    (lambda x, ids, w: torch.ops.tldsl.all_gather_moe(x, ids, w, "0", block_m=100), "block_m must be"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(x, x, x, "0"), "must be a 3-d tensor"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w[:, :5], w[:, :5], "0"), "kv_heads=5 must divide heads=16"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w, w.float(), "0"), "bf16 or fp16"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w, w, "0", layout="ring"), "layout must be one of"),
    (lambda x, ids, w: torch.ops.tldsl.moe_reduce_scatter(x, ids, ids.float(), w.transpose(1, 2), "0"),
     r"h must be \[384, 32\]"),
    (lambda x, ids, w: torch.ops.tldsl.moe_reduce_scatter(torch.zeros(384, 32, dtype=torch.float16), ids, ids.double(),
                                                          w.transpose(1, 2), "0"),
     "topk_weights must be float32, bfloat16 or float16 .* got torch.float64"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w[:, :0], w[:, :0], "0"), "no dimension 0"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w[..., :0], w[..., :0], w[..., :0], "0"), "no dimension 0"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w, w, "0", scale=float("nan")), "scale must be a finite"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w, w, "0", scale=float("-inf")), "scale must be a finite"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w, w, "0", is_causal=True, layout="zigzag"),
     "zigzag layout holds two chunks of Sl/2 rows per rank: Sl=3 must be even"),
    # every operand valid but on the CPU: refused before the build (which compiles for the GPU)
    (lambda x, ids, w: torch.ops.tldsl.all_gather_moe(x, ids, w, "0"), "all_gather_moe: x must be a CUDA tensor"),
    (lambda x, ids, w: torch.ops.tldsl.moe_reduce_scatter(torch.zeros(384, 32, dtype=torch.float16), ids, ids.float(),
                                                          w.transpose(1, 2), "0"),
     "moe_reduce_scatter: h must be a CUDA tensor"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w, w, "0"), "sp_attention: q must be a CUDA tensor"),
    # no backward: an operand that requires grad is refused while autograd records
    (lambda x, ids, w: torch.ops.tldsl.all_gather_moe(x.clone().requires_grad_(), ids, w, "0"), "x requires grad"),
    (lambda x, ids, w: torch.ops.tldsl.moe_reduce_scatter(torch.zeros(384, 32, dtype=torch.float16), ids,
                                                          ids.float().requires_grad_(), w.transpose(1, 2), "0"),
     "topk_weights requires grad"),
    (lambda x, ids, w: torch.ops.tldsl.sp_attention(w, w, w.clone().requires_grad_(), "0"), "v requires grad"),
])
def test_bad_operands_are_refused_before_an_op_is_built(monkeypatch, call, match):
    built = []
    monkeypatch.setattr(tmo, "_build", lambda key, make: built.append(key))
    x, ids, w = torch.zeros(8, 16, dtype=torch.float16), torch.zeros(8, 2, dtype=torch.int32), \
        torch.zeros(3, 16, 32, dtype=torch.float16)
    with pytest.raises(InputError, match=match):
        call(x, ids, w)
    assert built == []


@pytest.mark.parametrize("call, match", [
    (lambda T: torch.ops.tldsl.all_gather_moe(T(8, 16), T(8, 0, dt=torch.int32), T(4, 16, 32), "0"),
     "all_gather_moe: topk must be a positive int, got 0"),
    (lambda T: torch.ops.tldsl.all_gather_moe(T(8, 16), T(8, 2, dt=torch.int32), T(0, 16, 32), "0"),
     "all_gather_moe: num_experts must be a positive int"),
    (lambda T: torch.ops.tldsl.all_gather_moe(T(0, 16), T(0, 2, dt=torch.int32), T(4, 16, 32), "0"),
     "all_gather_moe: rows_per_rank must be a positive int"),
    (lambda T: torch.ops.tldsl.moe_reduce_scatter(T(64, 32), T(8, 0, dt=torch.int32), T(8, 0, dt=torch.float32),
                                                  T(4, 32, 16), "0", 64),
     "moe_reduce_scatter: topk must be a positive int, got 0"),
    (lambda T: torch.ops.tldsl.moe_reduce_scatter(T(0, 32), T(0, 2, dt=torch.int32), T(0, 2, dt=torch.float32),
                                                  T(4, 32, 16), "0", 64),
     "moe_reduce_scatter: rows_per_rank must be a positive int"),
])
def test_the_fake_moe_kernels_refuse_the_sizes_the_ops_refuse(call, match):
    """Found by an explorer's round: the fake (meta) kernels of all_gather_moe / moe_reduce_scatter
    took topk = 0, no experts and no tokens, which the ops refuse: a graph traced and failed only
    when run. The fake kernels now run the ops' own check of those sizes."""
    def T(*shape, dt=torch.float16):
        return torch.empty(*shape, dtype=dt, device="meta")
    with pytest.raises(InputError, match=match):
        call(T)
    from tldsl.runtime.dist.moe_ops import check_moe_sizes          # the ops' check, shared
    with pytest.raises(InputError, match="topk must be a positive int, got 0"):
        check_moe_sizes(8, 0, 4)
