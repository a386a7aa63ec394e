"""SequenceParallelAttention (runtime/dist/attention_op.py) — the library's sequence-parallel
attention on the one fused-op runtime — on W fake GPUs (tests/test_program_op.py's harness):
MHA and GQA, causal zig-zag and contiguous, ragged lengths, two launches with fresh inputs,
against numpy; bad arguments refused with InputError before anything is built or enqueued."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl

torch = pytest.importorskip("torch")

from test_program_op import Group, host  # noqa: E402

from tldsl.errors import InputError  # noqa: E402
from tldsl.ops.sp_attention import reference  # noqa: E402
from tldsl.runtime.dist.attention_op import DEFAULT_COMM, SequenceParallelAttention  # noqa: E402

COMPUTE = tl.ComputeSchedule(tile=(32, 32, 16))


@pytest.mark.parametrize("W, S, heads, kv_heads, causal, layout, comm", [
    (2, 38, 2, 1, True, "zigzag", tl.CommSchedule(tile_m=16, mode="pull")),
    (3, 40, 2, 2, True, "contiguous", tl.CommSchedule(tile_m=16, mode="push", order="full_mesh")),
    (2, 24, 4, 2, False, "contiguous", tl.CommSchedule(engine="copy_engine")),
    (2, 20, 2, 2, True, "contiguous", None),              # the op's default: the copy engines push
])
def test_attention_on_the_fused_op_runtime_agrees_with_numpy(monkeypatch, W, S, heads, kv_heads, causal, layout,
                                                             comm):
    D = 16
    g = Group(monkeypatch, W, seed=W)
    q = tl.TensorSpec((S, heads, D), tl.float16)
    k = tl.TensorSpec((S, kv_heads * D), tl.float16)
    ops = g.build(lambda r, dev: SequenceParallelAttention(q, k, heads, kv_heads=kv_heads, causal=causal,
                                                           layout=layout, compute=COMPUTE, comm=comm, device=dev,
                                                           timeout_s=2.0))
    assert ops[0].kernel.comm_schedule == (DEFAULT_COMM if comm is None else comm)
    # the copy engines' own-shard copies run before attention is forked: no SM left free for them
    assert ops[0].plan.reserved_sms == 0
    rng = np.random.default_rng(S)
    launches = []
    for _ in range(2):                                    # fresh inputs every launch
        qs = [rng.standard_normal((S, heads, D)).astype(np.float16) for _ in range(W)]
        ks = [rng.standard_normal((S, kv_heads * D)).astype(np.float16) for _ in range(W)]
        vs = [rng.standard_normal((S, kv_heads * D)).astype(np.float16) for _ in range(W)]
        outs = {}
        for r in g.fake.rng.sample(range(W), W):
            outs[r] = ops[r](*(torch.from_numpy(a[r]) for a in (qs, ks, vs)))
        launches.append((qs, ks, vs, outs))
    for op in ops:
        op.synchronize()
    for qs, ks, vs, outs in launches:
        want = reference([x.reshape(S, -1) for x in qs], ks, vs, heads, causal, kv_heads=kv_heads, layout=layout)
        for r in range(W):
            assert outs[r].shape == (S, heads, D)
            np.testing.assert_allclose(host(outs[r]).reshape(S, -1), want[r], rtol=2e-2, atol=2e-2)
    for op in ops:
        op.close()


def test_bad_arguments_are_refused_before_anything_is_built():
    S, D = 32, 16
    q, k = tl.TensorSpec((S, 4, D), tl.float16), tl.TensorSpec((S, 2 * D), tl.float16)
    cases = [
        (dict(q=q, k=k, heads=3), "3 heads do not divide"),
        (dict(q=q, k=k, heads=4, kv_heads=3), "kv_heads=3 must divide heads=4"),
        (dict(q=q, k=k, heads=4, kv_heads=1), r"k must be \[32, 1\*16\]"),
        (dict(q=q, k=tl.TensorSpec((S, 2 * D), tl.bfloat16), heads=4, kv_heads=2), "k must be"),
        (dict(q=tl.TensorSpec((S, 4, D), tl.float32), k=k, heads=4), "fp16 or bf16"),
        (dict(q=tl.TensorSpec((S,), tl.float16), k=k, heads=4), r"\[S, heads\*D\]"),
        (dict(q=q, k=k, heads=4, kv_heads=2, layout="diagonal"), "layout must be one of"),
        (dict(q=tl.TensorSpec((31, 4, D), tl.float16), k=tl.TensorSpec((31, 2 * D), tl.float16), heads=4,
              kv_heads=2, causal=True, layout="zigzag"), "Sl=31 must be even"),
        (dict(q=q, k=k, heads=0), "heads must be a positive int"),
        (dict(q="q", k=k, heads=4), "a torch tensor, numpy array or tl.TensorSpec"),
        (dict(q=np.zeros((S, 4 * D)), k=k, heads=4), "q: unsupported dtype float64"),
        (dict(q=q, k=k, heads=4, kv_heads=2, causal="yes"), "causal must be a bool"),
        (dict(q=tl.TensorSpec((S, 0), tl.float16), k=k, heads=4), r"no dimension 0\), got \[32, 0\]"),
        (dict(q=q, k=tl.TensorSpec((S, 0, D), tl.float16), heads=4), r"k must be .*no dimension 0"),
    ] + [(dict(q=q, k=k, heads=4, kv_heads=2, scale=bad), "scale must be a finite number")
         for bad in (float("nan"), float("inf"), -float("inf"), "big", True)]
    for kw, match in cases:
        with pytest.raises(InputError, match=match):
            SequenceParallelAttention(**kw)


def test_the_tile_program_refuses_an_empty_head_dim_and_a_scale_that_is_not_finite():
    from tldsl.errors import CompilationError
    from tldsl.ops.sp_attention import sp_attention
    S = 32
    specs = [tl.TensorSpec((S, 32), tl.float16)] * 4
    compute, comm = tl.ComputeSchedule(tile=(32, 32, 16)), tl.CommSchedule(tile_m=16)
    with pytest.raises(CompilationError, match="scale must be a finite number"):
        sp_attention.trace(2, *specs, heads=2, scale=float("nan"), compute=compute, comm=comm)
    with pytest.raises(CompilationError, match="the head dim must be positive"):
        sp_attention.trace(2, *[tl.TensorSpec((S, 0), tl.float16)] * 4, heads=2, compute=compute, comm=comm)


def test_a_call_with_a_strided_operand_says_so(monkeypatch):
    S, D = 32, 16
    g = Group(monkeypatch, 1)
    (op,) = g.build(lambda r, dev: SequenceParallelAttention(tl.TensorSpec((S, 4, D), tl.float16),
                                                             tl.TensorSpec((S, 2, D), tl.float16), 4, kv_heads=2,
                                                             compute=COMPUTE, device=dev, timeout_s=2.0))
    q, kv = torch.zeros(S, 4, D, dtype=torch.float16), torch.zeros(S, 2, D, dtype=torch.float16)
    strided = torch.zeros(S, D, 2, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(InputError, match="argument 'k' is not contiguous"):
        op(q, strided, kv)
    with pytest.raises(InputError, match=r"argument 'v' must be \[S, heads\*D\] or \[S, heads, D\], got \[\]"):
        op(q, kv, torch.tensor(1.0))
    assert op.launches == 0 and not any(g.fake.queues.values())
    op.close()
