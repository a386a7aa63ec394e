"""The generated sm_90a flash-attention kernel (the compute part of ``sp_attention``) on a GPU,
against torch's scaled_dot_product_attention on the gathered K/V (skipped where there is no GPU).

One GPU plays one rank ``r`` of ``W``: the gathered ``k_gathered`` / ``v_gathered`` [W*Sl, H*D]
are filled directly and every signal the kernel waits on is pre-set for launch 1, so the kernel
runs exactly as it would once communication has delivered everything. Outputs are poisoned with
NaN first. Run on a GPU host with: ``python -m pytest -m gpu tests/test_gpu_attention.py``.
"""
from __future__ import annotations

import math

import pytest

from tldsl.runtime.gpu import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]

PULL = dict(tile_m=128, mode="pull")


def _lower(W, Sl, H, D, tile, causal, dtype, comm=None, stages=3, overlap=None, Hkv=None, layout="contiguous",
           softmax=None):
    import tldsl as tl
    from tldsl.codegen import lower_attention
    from tldsl.ops.sp_attention import sp_attention
    dt = tl.ir.dtype_of(dtype)
    q, kv = tl.TensorSpec((Sl, H * D), dt), tl.TensorSpec((Sl, (Hkv or H) * D), dt)
    k = sp_attention.trace(W, q, kv, kv, q, heads=H, kv_heads=Hkv, causal=causal, layout=layout,
                           compute=tl.ComputeSchedule(tile=tile, stages=stages),
                           comm=tl.CommSchedule(**(comm or PULL)))
    return k, lower_attention(k, overlap=overlap, softmax=softmax)


def _inputs(W, Sl, H, D, dtype, seed, Hkv=None):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = getattr(torch, dtype)
    q = torch.randn(Sl, H * D, device="cuda", dtype=t, generator=g)
    k_all = torch.randn(W * Sl, (Hkv or H) * D, device="cuda", dtype=t, generator=g)
    v_all = torch.randn(W * Sl, (Hkv or H) * D, device="cuda", dtype=t, generator=g)
    return q, k_all, v_all


def _signals(kernel, lowered, value):
    import torch
    return {s.name: torch.full((s.type.slots,), value, device="cuda", dtype=torch.int64)
            for s in kernel.signals if s.name in lowered.signals}


def _reference(q, k_all, v_all, H, D, rank, causal, layout="contiguous"):
    """fp32 softmax attention per head over the gathered K/V (key/value heads repeated for GQA),
    causal on the global positions of ``layout``."""
    import torch
    import torch.nn.functional as F
    from tldsl.ops.sp_attention import positions
    Sl, N = q.shape[0], k_all.shape[0]
    Hkv = k_all.shape[1] // D
    qh = q.float().view(Sl, H, D).transpose(0, 1)
    kh = k_all.float().view(N, Hkv, D).transpose(0, 1).repeat_interleave(H // Hkv, dim=0)
    vh = v_all.float().view(N, Hkv, D).transpose(0, 1).repeat_interleave(H // Hkv, dim=0)
    mask = None
    if causal:
        pos = torch.from_numpy(positions(N // Sl, Sl, layout)).to("cuda")
        mask = pos.reshape(-1)[None, :] <= pos[rank][:, None]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=1.0 / math.sqrt(D))
    return out.transpose(0, 1).reshape(Sl, H * D)


def _check(o, ref, dtype, what):
    import torch
    assert not torch.isnan(o).any(), f"{what}: some output rows were never written (or NaN)"
    err = (o.float() - ref).abs()
    tol = (2e-2 if dtype == "float16" else 4e-2) + 2e-2 * ref.abs()
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max |err| "
                           f"{err.max().item():.3g} at {tuple(int(i) for i in (bad.nonzero()[0]))}")


def _run(W, rank, Sl, H, D, tile, causal, dtype="float16", comm=None, stages=3, overlap=None, max_ctas=None,
         seed=0, Hkv=None, layout="contiguous", softmax=None):
    import torch
    from tldsl.runtime.gpu.attention import AttentionKernel
    k, la = _lower(W, Sl, H, D, tile, causal, dtype, comm, stages, overlap, Hkv, layout, softmax)
    kern = AttentionKernel(la, max_ctas=max_ctas)
    q, k_all, v_all = _inputs(W, Sl, H, D, dtype, seed + 17 * rank, Hkv)
    o = torch.full_like(q, float("nan"))
    kern({"q": q, "k_gathered": k_all, "v_gathered": v_all, "o": o}, signals=_signals(k, la, 1), rank=rank,
         launch_index=1)
    torch.cuda.synchronize()
    _check(o, _reference(q, k_all, v_all, H, D, rank, causal, layout), dtype,
           f"W={W} rank={rank} Sl={Sl} H={H} H_kv={Hkv or H} D={D} tile={tile} causal={causal} layout={layout} "
           f"{dtype} stages={stages} overlap={la.config.overlap} softmax={la.config.softmax} grid={kern.grid}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rank", [0, 3])
def test_d128_matches_sdpa(rank, causal):
    _run(4, rank, 1024, 2, 128, (128, 128, 64), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tile", [(128, 128, 64), (64, 128, 64), (128, 64, 64)])
def test_d64_partial_shards_bf16(tile, causal):
    # Sl = 1000: the last key block of every shard is partial (rows past the shard read 0)
    _run(2, 1, 1000, 4, 64, tile, causal, dtype="bfloat16")


@pytest.mark.parametrize("stages,overlap", [(1, False), (2, False), (2, True), (3, False)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pipeline_variants(stages, overlap, causal):
    _run(3, 2, 640, 2, 128, (128, 128, 64), causal, stages=stages, overlap=overlap)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_persistent_ctas_reuse_the_q_buffer(causal):
    # 7 CTAs for 3 x 8 = 24 tiles: each CTA runs several tiles through the same Q / O buffer
    _run(2, 1, 1000, 3, 64, (128, 64, 64), causal, max_ctas=7)
    _run(2, 0, 700, 3, 128, (64, 128, 64), causal, max_ctas=5)


@pytest.mark.parametrize("softmax", ["plain", "fold"])
def test_softmax_variants(softmax):
    """The kernel of before (plain) and the folded scale alone (fold) beside the default (split,
    whose mask-free bodies every other test here runs):
    causal blocks on and off the diagonal, partial shards, GQA, a zig-zag split, one warpgroup."""
    _run(4, 3, 1024, 2, 128, (128, 128, 64), True, softmax=softmax)
    _run(3, 2, 1000, 4, 128, (128, 128, 64), False, Hkv=2, dtype="bfloat16", softmax=softmax)
    _run(2, 1, 1000, 4, 64, (64, 128, 64), True, dtype="bfloat16", softmax=softmax)
    _run(4, 1, 1002, 4, 64, (128, 128, 64), True, dtype="bfloat16", Hkv=2, layout="zigzag", softmax=softmax)
    _run(3, 2, 640, 2, 128, (128, 128, 64), True, stages=2, overlap=False, softmax=softmax)


@pytest.mark.parametrize("D,tile", [(32, (64, 64, 64)), (16, (64, 16, 16)), (32, (128, 32, 32))])
def test_small_head_dims(D, tile):
    _run(3, 1, 200, 2, D, tile, True, stages=2)
    _run(3, 0, 77, 1, D, tile, False, stages=2)


@pytest.mark.parametrize("comm", [dict(tile_m=64, mode="push", order="full_mesh"), dict(engine="copy_engine")])
def test_other_communication_schedules(comm):
    # peer_tile_wait / rank_wait (system-scope acquires) instead of consumer_tile_wait
    _run(4, 2, 512, 2, 128, (128, 128, 64), True, comm=comm)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Hkv", [1, 2])
def test_gqa_matches_sdpa(Hkv, causal):
    # 4 query heads on 1 or 2 key/value heads; Sl = 1000: partial key blocks at every shard end
    _run(3, 2, 1000, 4, 128, (128, 128, 64), causal, Hkv=Hkv)


@pytest.mark.parametrize("tile", [(128, 128, 64), (64, 64, 64)])
@pytest.mark.parametrize("rank", [0, 3])
def test_zigzag_causal_matches_sdpa(rank, tile):
    # chunks of 501 rows: query blocks straddle the rank's two chunks, key blocks end partial
    _run(4, rank, 1002, 4, 64, tile, True, dtype="bfloat16", Hkv=2, layout="zigzag")


def test_zigzag_short_chunks_persistent():
    # chunks of 37 rows (shorter than a tile), MHA, 3 CTAs for all tiles
    _run(2, 1, 74, 2, 128, (128, 128, 64), True, layout="zigzag", max_ctas=3)


def test_short_sequence_smaller_than_a_tile():
    _run(2, 1, 40, 2, 64, (128, 128, 64), True)


def test_waits_block_until_flags_are_set():
    """The producer spins on the flags of each key block: with the flags at 0 nothing is stored;
    once they are raised the same launch completes and is correct."""
    import torch
    from tldsl.runtime.gpu.attention import AttentionKernel
    W, rank, Sl, H, D = 2, 1, 512, 2, 128
    k, la = _lower(W, Sl, H, D, (128, 128, 64), True, "float16")
    kern = AttentionKernel(la)
    q, k_all, v_all = _inputs(W, Sl, H, D, "float16", 5)
    o = torch.full_like(q, float("nan"))
    sig = _signals(k, la, 0)
    # Everything that runs while the kernel spins must already be loaded: with CUDA's lazy
    # module loading, loading a kernel waits for the spinning one, which waits for it.
    torch.cuda._sleep(1000)
    torch.isnan(o).all().item()           # loads the kernels of the check made while the kernel spins
    for s in sig.values():
        s.fill_(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kern({"q": q, "k_gathered": k_all, "v_gathered": v_all, "o": o}, signals=sig, rank=rank)
    torch.cuda._sleep(50_000_000)            # the kernel spins meanwhile
    assert torch.isnan(o).all().item(), "output was stored before its key blocks were signalled"
    for s in sig.values():
        s.fill_(1)                           # launch 1, count 1: every wait is satisfied
    torch.cuda.synchronize()
    _check(o, _reference(q, k_all, v_all, H, D, rank, True), "float16", "after the flags were set")


def test_inputs_are_validated():
    import torch
    from tldsl.errors import InputError
    from tldsl.runtime.gpu.attention import AttentionKernel
    k, la = _lower(2, 256, 2, 64, (128, 64, 64), False, "float16")
    kern = AttentionKernel(la)
    q, k_all, v_all = _inputs(2, 256, 2, 64, "float16", 1)
    o = torch.empty_like(q)
    with pytest.raises(InputError, match="k_gathered' has shape"):
        kern({"q": q, "k_gathered": k_all[:100], "v_gathered": v_all, "o": o}, signals=_signals(k, la, 1))
    with pytest.raises(InputError, match="waits on or notifies signal"):
        kern({"q": q, "k_gathered": k_all, "v_gathered": v_all, "o": o})
    with pytest.raises(InputError, match="rank 2 is outside"):
        kern({"q": q, "k_gathered": k_all, "v_gathered": v_all, "o": o}, signals=_signals(k, la, 1), rank=2)


@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")],
                         ids=["full", "causal", "causal-zigzag"])
def test_speed_report(causal, layout):
    """Not a benchmark gate: prints the generated kernel's TFLOP/s next to torch's SDPA (flash)
    on the same gathered K/V (W=2, Sl=4096 per rank, 16 heads of 128), after checking it."""
    import torch
    import torch.nn.functional as F
    from tldsl.bench.timing import interleaved_ms
    from tldsl.ops.sp_attention import positions
    from tldsl.runtime.gpu.attention import AttentionKernel
    W, rank, Sl, H, D = 2, 1, 4096, 16, 128
    k, la = _lower(W, Sl, H, D, (128, 128, 64), causal, "bfloat16", layout=layout)
    kern = AttentionKernel(la)
    q, k_all, v_all = _inputs(W, Sl, H, D, "bfloat16", 3)
    o = torch.full_like(q, float("nan"))
    sig = _signals(k, la, 1)
    bufs = {"q": q, "k_gathered": k_all, "v_gathered": v_all, "o": o}
    kern(bufs, signals=sig, rank=rank)
    torch.cuda.synchronize()
    _check(o, _reference(q, k_all, v_all, H, D, rank, causal, layout), "bfloat16", "speed shape")
    qh = q.view(Sl, H, D).transpose(0, 1).unsqueeze(0)
    kh = k_all.view(W * Sl, H, D).transpose(0, 1).unsqueeze(0).contiguous()
    vh = v_all.view(W * Sl, H, D).transpose(0, 1).unsqueeze(0).contiguous()
    qh = qh.contiguous()
    mask = None
    pos = positions(W, Sl, layout)
    if causal:   # global positions: e.g. contiguous rank 1 sees shard 0 whole and its own shard causally
        p = torch.from_numpy(pos).to("cuda")
        mask = p.reshape(-1)[None, :] <= p[rank][:, None]
    ms_ours, ms_torch = interleaved_ms(
        [lambda: kern(bufs, signals=sig, rank=rank),
         lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)], iters=20)
    pairs = int((pos[rank] + 1).sum()) if causal else Sl * W * Sl
    flops = 4 * pairs * D * H
    print(f"\nattention {'causal' if causal else 'full'} {layout} Sl={Sl} N={W * Sl} H={H} D={D} bf16: tldsl "
          f"{ms_ours:.3f} ms ({flops / ms_ours / 1e9:.0f} TFLOP/s), torch SDPA{' (masked)' if causal else ''} "
          f"{ms_torch:.3f} ms ({flops / ms_torch / 1e9:.0f} TFLOP/s)")
