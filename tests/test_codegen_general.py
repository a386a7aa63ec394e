"""The general lowering (recipe ``general``): compute parts no specialised recipe matches lower
to CUDA C++ for sm_90a, checked three ways without a GPU:

* **the pipeline** picks it only where no other recipe matches, and refuses what it cannot
  lower at the user's line;
* **NVRTC + SASS** (marker ``nvrtc``; skipped only where the CUDA wheels are missing): every
  program compiles; every ``dot`` is tensor-core code (``HGMMA`` for the dots on WGMMA — f16 /
  bf16 tiles of a multiple of 64 rows —, ``HMMA`` for the rest), no spills, no ``BPT.TRAP``;
  the fuzzer's programs too (tensor cores and traps);
* **CPU emulation** (needs ``g++``): the same generated source, built by the host compiler with
  ``TLDSL_HOST_EMULATION`` (one ``std::thread`` per CUDA thread, a ``std::barrier`` per CTA, a
  shared-memory arena per CTA, and — for a kernel whose tiles do not fit in shared memory — its
  global-memory scratch, poisoned with NaN as the runtime poisons it; the dot's host branch
  multiplies the same rounded inputs in fp32), runs every task; its outputs must match
  ``tl.simulate``'s element by element.

Tolerances: the GPU comparison's own (``tldsl.testing.program_tolerance``): per element, a bound
on the legitimate difference carried through the program from the magnitudes that flow into it
(a dot's K and its rows and columns, a sum's N; an f32 ``dot`` as TF32; transcendental functions
within a few ulps, glibc's vs numpy's here); NaN and infinities at the same places.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import LoweringError, lower
from tldsl.codegen import toolchain as tcm
from tldsl.codegen.recipes.general import lower_general
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import compile_many
from tldsl.codegen.toolchain.sass import tensor_core_problems
from tldsl.runtime.gpu.bind import SCRATCH_POISON_WORD
from tldsl.runtime.sim.memory import host_array, to_storage
from tldsl.testing.program_tolerance import assert_agrees, reference_with_tolerances

import host_build
from programs import outer_sums, scale_rows, weighted_scatter, whole_row_softmax

S = tl.TensorSpec
INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"
NP = {"f16": np.float16, "bf16": np.float32, "f32": np.float32, "i32": np.int32, "i1": np.bool_}

_OK, _WHY = tcm.toolchain_available()
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ missing (CPU emulation of generated kernels)")


# =================================================================================================
# Programs no specialised recipe matches
# =================================================================================================

@tl.kernel
def int_math(x, y, *, compute: tl.ComputeSchedule = None):
    """i32 arithmetic: wrapping products, floor division and modulo of negatives, where, min / max."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        t = tl.load(x, (pm * BM, pn * BN), (BM, BN))
        u = (t * 7919 + 13) // 5 % 11 - t // (t % 3)
        v = tl.where(t > 0, tl.maximum(u, t), tl.minimum(u, -t))
        tl.store(y, (pm * BM, pn * BN), v + tl.iota(BN)[None, :] * pn)


@tl.kernel
def row_softmax(x, y, *, compute: tl.ComputeSchedule = None):
    M, N = x.shape
    BM = compute.tile[0]

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        t = tl.load(x, (pm * BM, 0), (BM, N)).to(tl.float32)
        m = tl.max(t, 1)
        e = tl.exp(t - m[:, None])
        tl.store(y, (pm * BM, 0), e / tl.sum(e, 1)[:, None])


@tl.kernel
def rmsnorm(x, w, y, *, compute: tl.ComputeSchedule = None, eps: float = 1e-6):
    M, N = x.shape
    BM = compute.tile[0]

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        t = tl.load(x, (pm * BM, 0), (BM, N)).to(tl.float32)
        r = tl.rsqrt(tl.sum(t * t, 1) / N + eps)
        g = tl.load(w, (0,), (N,)).to(tl.float32)
        tl.store(y, (pm * BM, 0), t * r[:, None] * g[None, :])


@tl.kernel
def gated_gemm(a, b, c, bias, out, *, compute: tl.ComputeSchedule = None, gate: str = "relu"):
    """``relu(A @ B + bias) * (A @ C)`` (or SiLU-gated) as one part: two accumulators, one K loop."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        h = tl.fragment((BM, BN), tl.float32)
        g = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            x = tl.load(a, (pm * BM, k), (BM, BK))
            h += tl.dot(x, tl.load(b, (k, pn * BN), (BK, BN)))
            g += tl.dot(x, tl.load(c, (k, pn * BN), (BK, BN)))
        z = h.read() + tl.load(bias, (pn * BN,), (BN,)).to(tl.float32)[None, :]
        act = tl.maximum(z, 0.0) if gate == "relu" else z * tl.sigmoid(z)
        tl.store(out, (pm * BM, pn * BN), act * g.read())


@tl.kernel
def gated_linear(a, wb, c, bias, out, *, compute: tl.ComputeSchedule = None, gate: str = "relu"):
    """``gated_gemm`` with its first weight stored [N, K], as a torch ``Linear`` keeps it, and read
    as ``tl.trans(tile)``: one right operand staged K-major (as loaded), the other MN-major."""
    M, K = a.shape
    N = wb.shape[0]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        h = tl.fragment((BM, BN), tl.float32)
        g = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            x = tl.load(a, (pm * BM, k), (BM, BK))
            h += tl.dot(x, tl.trans(tl.load(wb, (pn * BN, k), (BN, BK))))
            g += tl.dot(x, tl.load(c, (k, pn * BN), (BK, BN)))
        z = h.read() + tl.load(bias, (pn * BN,), (BN,)).to(tl.float32)[None, :]
        act = tl.maximum(z, 0.0) if gate == "relu" else z * tl.sigmoid(z)
        tl.store(out, (pm * BM, pn * BN), act * g.read())


@tl.kernel
def column_sums(x, y, *, compute: tl.ComputeSchedule = None):
    """A traced loop bound (tl.range over a load_scalar'd length), a fragment updated in place, a
    guard (tl.when), tl.static_range, min over axis 0, expand_dims / broadcast_to / trans."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(N, BN),))
    def part(pn):
        acc = tl.fragment((BN, 1), tl.float32)
        lo = tl.fragment((1, BN), tl.float32, fill=float("inf"))
        for i in tl.range(0, M, BM):
            t = tl.load(x, (i, pn * BN), (BM, BN)).to(tl.float32)
            acc += tl.expand_dims(tl.sum(tl.trans(t), 1), 1)
            with tl.when(i + BM <= M):                     # whole tiles only: zero rows would win the min
                lo.write(tl.minimum(lo.read(), tl.min(t, 0)[None, :]))
        s = tl.trans(acc.read())
        for j in tl.static_range(2):
            s = s + tl.broadcast_to(lo.read(), (1, BN)) * (j + 1)
        tl.store(y, (0, pn * BN), s)


@tl.kernel
def gather_rows(x, idx, lens, y, *, compute: tl.ComputeSchedule = None):
    """load_rows by an i32 tile (negative ids read 0), load_scalar, iota, where, casts."""
    M, N = y.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        rows = tl.load(idx, (pm * BM,), (BM,))
        n = tl.load_scalar(lens, (pm,))
        rows = tl.where(tl.iota(BM) < n, rows, -1)
        g = tl.load_rows(x, rows, pn * BN, BN)
        tl.store(y, (pm * BM, pn * BN), (g.to(tl.float32) * 0.5).to(y.dtype))


@tl.kernel
def attention_like(q, k, v, o, *, compute: tl.ComputeSchedule = None):
    """A dot with a transposed operand, a softmax, and a dot of a cast tile."""
    M, D = q.shape
    N = k.shape[0]
    BM = compute.tile[0]

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        s = tl.dot(tl.load(q, (pm * BM, 0), (BM, D)), tl.trans(tl.load(k, (0, 0), (N, D)))) * 0.125
        p = tl.exp(s - tl.max(s, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        tl.store(o, (pm * BM, 0), tl.dot(p.to(q.dtype), tl.load(v, (0, 0), (N, D))))


@tl.kernel
def flash_attention(q, k, v, o, *, compute: tl.ComputeSchedule = None):
    """Online softmax over key blocks (keys not a multiple of the block): the running max, the
    rescaled accumulator ``acc * alpha + dot`` and masked tails."""
    M, D = q.shape
    N = k.shape[0]
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        qt = tl.load(q, (pm * BM, 0), (BM, D))
        m = tl.fragment((BM,), tl.float32, fill=-1e30)
        l_sum = tl.fragment((BM,), tl.float32)
        acc = tl.fragment((BM, D), tl.float32)
        for kb in tl.range(0, N, BN):
            kt = tl.load(k, (kb, 0), (BN, D))
            vt = tl.load(v, (kb, 0), (BN, D))
            valid = (tl.iota(BN) + kb < N)[None, :]
            sc = tl.where(valid, tl.dot(qt, tl.trans(kt)) * 0.2, -1e30)
            m_new = tl.maximum(m[...], tl.max(sc, 1))
            alpha = tl.exp(m[...] - m_new)
            p = tl.where(valid, tl.exp(sc - m_new[:, None]), 0.0)
            l_sum[...] = l_sum[...] * alpha + tl.sum(p, 1)
            acc[...] = acc[...] * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m[...] = m_new
        tl.store(o, (pm * BM, 0), acc[...] / l_sum[...][:, None])


@tl.kernel
def wide_dot(a, b, y, z, *, compute: tl.ComputeSchedule = None):
    """``tl.dot`` alone over the whole of K (staged for WGMMA in chunks where the operands are
    more than the staging takes), and a dot of computed operands (elementwise tiles, read where
    they are computed)."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        x = tl.load(a, (pm * BM, 0), (BM, K))
        w = tl.load(b, (0, pn * BN), (K, BN))
        tl.store(y, (pm * BM, pn * BN), tl.dot(x, w))
        tl.store(z, (pm * BM, pn * BN), tl.dot(x * 0.5 + 1.0, tl.maximum(w, 0.0)))


@tl.kernel
def signalled_rows(x, y, *, compute: tl.ComputeSchedule = None):
    """A part that publishes each tile with a notify and waits for it before reading it back."""
    M, N = x.shape
    BM, BN, _ = compute.tile
    ready = tl.signal("ready", tl.cdiv(M, BM))

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        tl.store(y, (pm * BM, 0), tl.load(x, (pm * BM, 0), (BM, N)) + 1.0)
        tl.producer_tile_notify(ready, pm)
        tl.consumer_tile_wait(ready, pm, count=1)
        t = tl.load(y, (pm * BM, 0), (BM, N))
        tl.store(y, (pm * BM, 0), t * t)


@tl.kernel
def edge_semantics(sx, sn, o1, o2, o3, o4, o5, o6, o7, q1, q2, q3, *, compute: tl.ComputeSchedule = None):
    """numpy's edge cases, which the simulator runs: NaN and infinities through max / min /
    where / reductions, floor division and modulo of floats (negative, by zero) and of ints (by
    zero, INT_MIN // -1), i32 wrapping, casts of NaN and out-of-range floats to i32, f16
    overflow, & and | (logical on bools, bitwise on ints and on an int with a bool)."""
    M, N = sx.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        t = tl.load(sx, (0, 0), (M, N))
        u = tl.load(sn, (0, 0), (M, N))
        f = tl.where(tl.abs(t) < 1e30, t, 0.0)             # the finite values
        tl.store(o1, (0, 0), tl.maximum(t, 1.0) + tl.minimum(t, -1.0))
        tl.store(o2, (0, 0), (t // 1.5) * 1000.0 + t % -1.5)
        tl.store(o3, (0, 0), t // (t - t))
        tl.store(o4, (0, 0), (-t) % 2.0 + t % -0.75)
        tl.store(o5, (0, 0), tl.where(t > 0.0, t, -t) + tl.cast(tl.cast(t * 1e5, tl.float16), tl.float32))
        tl.store(o6, (0, 0), tl.max(f, 1)[:, None] - tl.min(f, 1)[:, None] + tl.sum(f, 1)[:, None] + f)
        tl.store(o7, (0, 0), tl.max(t, 1)[:, None] + tl.min(t, 0)[None, :] + t % (t - t))
        tl.store(q1, (0, 0), u // (u % 5 - 2) + u % (u % 3 - 1) + u // -1 + (u & 6) - ((u | -8) & (u > 0)))
        tl.store(q2, (0, 0), u * 65537 - u * u + tl.cast(t * 1e10, tl.int32) // 7)
        flags = tl.where((u > 0) & (t > 0.0) | (u == 0), u * 0 + 1, tl.where(t != t, u * 0 + 2, u * 0))
        tl.store(q3, (0, 0), flags + tl.cast(t, tl.int32))


def _specs(shapes_dtypes):
    return [S(s, d) for s, d in shapes_dtypes]


def case(name, fn, shapes, tile, **kw):
    return pytest.param(fn, shapes, tile, kw, id=name)


F16, BF16, F32, I32 = tl.float16, tl.bfloat16, tl.float32, tl.int32
CASES = [
    case("scale_rows-f16", scale_rows, [((100, 70), F16)] * 2, (64, 64, 32)),
    case("scale_rows-bf16", scale_rows, [((37, 130), BF16)] * 2, (16, 64, 32)),
    case("scale_rows-f32", scale_rows, [((9, 33), F32)] * 2, (8, 16, 16)),
    case("int_math-i32", int_math, [((30, 50), I32)] * 2, (16, 32, 16)),
    case("row_softmax-f32", row_softmax, [((50, 72), F32)] * 2, (16, 16, 16)),
    case("row_softmax-bf16", row_softmax, [((21, 100), BF16)] * 2, (8, 16, 16)),
    case("rmsnorm-f16", rmsnorm, [((40, 96), F16), ((96,), F16), ((40, 96), F16)], (16, 16, 16)),
    case("rmsnorm-bf16", rmsnorm, [((33, 64), BF16), ((64,), BF16), ((33, 64), BF16)], (32, 16, 16)),
    case("gated_gemm-f16", gated_gemm, [((100, 88), F16), ((88, 72), F16), ((88, 72), F16), ((72,), F16),
                                        ((100, 72), F16)], (64, 32, 32)),
    case("gated_gemm-bf16-silu", gated_gemm, [((70, 40), BF16), ((40, 50), BF16), ((40, 50), BF16), ((50,), BF16),
                                             ((70, 50), F32)], (32, 32, 16), gate="silu"),
    case("gated_gemm-f32-tf32", gated_gemm, [((40, 24), F32), ((24, 20), F32), ((24, 20), F32), ((20,), F32),
                                            ((40, 20), F32)], (16, 16, 8)),
    case("column_sums-f16", column_sums, [((45, 40), F16), ((1, 40), F32)], (16, 16, 16)),
    case("gather_rows-bf16", gather_rows, [((20, 48), BF16), ((24,), I32), ((3,), I32), ((24, 48), BF16)],
         (8, 32, 16)),
    case("gather_rows-i32", gather_rows, [((20, 48), I32), ((24,), I32), ((3,), I32), ((24, 48), I32)],
         (8, 32, 16)),
    case("scatter_add_rows-bf16", weighted_scatter, [((40, 48), BF16), ((40,), I32), ((40,), F32), ((20, 48), BF16)],
         (16, 32, 16)),
    case("scatter_add_rows-f16", weighted_scatter, [((37, 40), F16), ((37,), I32), ((37,), F32), ((20, 40), F16)],
         (8, 16, 16)),
    case("scatter_add_rows-f32", weighted_scatter, [((30, 24), F32), ((30,), I32), ((30,), F32), ((20, 24), F32)],
         (8, 16, 8)),
    case("attention_like-f16", attention_like, [((40, 32), F16), ((24, 32), F16), ((24, 32), F16), ((40, 32), F16)],
         (16, 16, 16)),
    case("flash_attention-bf16", flash_attention, [((40, 32), BF16), ((50, 32), BF16), ((50, 32), BF16),
                                                   ((40, 32), F32)], (16, 16, 16)),
    # over a CTA's shared memory: fragments in the global-memory scratch (SPILLED below)
    case("gated_gemm-f32-256-spilled", gated_gemm, [((300, 70), F32), ((70, 270), F32), ((70, 270), F32),
                                                    ((270,), F32), ((300, 270), F32)], (256, 256, 32)),
    case("outer_sums-f16-256-spilled", outer_sums, [((5, 300), F16), ((5, 270), F16), ((300, 270), F32)],
         (256, 256, 16)),
    case("edge_semantics-f32", edge_semantics, [((8, 24), F32), ((8, 24), I32)] + [((8, 24), F32)] * 7
         + [((8, 24), I32)] * 3, (8, 8, 8)),
    case("signalled_rows-f32", signalled_rows, [((24, 20), F32)] * 2, (8, 16, 16)),
    # dots on WGMMA (64-row multiples, f16 / bf16): two accumulators, a transposed operand, a chain
    # of two dots through a softmax (a computed operand), an online softmax, K past the staging
    # (chunks) and N past 128 columns (several warpgroup tiles), K and N not multiples of 16
    case("gated_gemm-f16-wgmma", gated_gemm, [((130, 72), F16), ((72, 100), F16), ((72, 100), F16), ((100,), F16),
                                              ((130, 100), F16)], (128, 64, 32)),
    case("attention_like-f16-wgmma", attention_like, [((130, 32), F16), ((72, 32), F16), ((72, 32), F16),
                                                      ((130, 32), F16)], (64, 16, 16)),
    case("flash_attention-bf16-wgmma", flash_attention, [((100, 32), BF16), ((150, 32), BF16), ((150, 32), BF16),
                                                         ((100, 32), F32)], (64, 32, 16)),
    case("wide_dot-f16-chunks", wide_dot, [((150, 200), F16), ((200, 300), F16), ((150, 300), F32),
                                           ((150, 300), F32)], (128, 128, 16)),
    case("wide_dot-bf16-wide", wide_dot, [((70, 40), BF16), ((40, 200), BF16), ((70, 200), F32),
                                          ((70, 200), F32)], (64, 256, 16)),
    # pipelined dot loops (plan.dot_loop): loads by cp.async into a ring of swizzled stages, the
    # accumulators in registers — K and N past the tiles' edges (zeros staged), and tensors whose
    # rows are not 16-byte multiples (staged element by element)
    case("gated_gemm-f16-pipelined", gated_gemm, [((200, 200), F16), ((200, 136), F16), ((200, 136), F16),
                                                  ((136,), F16), ((200, 136), F16)], (128, 128, 64)),
    case("gated_gemm-bf16-silu-pipelined-unaligned", gated_gemm, [((130, 100), BF16), ((100, 66), BF16),
                                                                  ((100, 66), BF16), ((66,), BF16), ((130, 66), F32)],
         (64, 64, 64), gate="silu"),
    # a right operand stored [N, K] and transposed in the dot (a torch Linear's weight): staged as
    # loaded, K-major, beside an MN-major one
    case("gated_linear-f16-pipelined", gated_linear, [((200, 200), F16), ((136, 200), F16), ((200, 136), F16),
                                                      ((136,), F16), ((200, 136), F16)], (128, 128, 64)),
    case("gated_linear-bf16-silu-pipelined-unaligned", gated_linear, [((130, 100), BF16), ((66, 100), BF16),
                                                                      ((100, 66), BF16), ((66,), BF16),
                                                                      ((130, 66), F32)], (64, 64, 64), gate="silu"),
    case("gated_linear-f16-pipelined-two-chunks", gated_linear, [((130, 300), F16), ((100, 300), F16),
                                                                 ((300, 100), F16), ((100,), F16), ((130, 100), F16)],
         (64, 64, 128)),
    # WGMMA dots whose accumulators do not fit beside their operands: the accumulators go to the
    # scratch, the staging of the operands never does
    case("gated_gemm-f16-256-wgmma-spilled", gated_gemm, [((300, 70), F16), ((70, 270), F16), ((70, 270), F16),
                                                          ((270,), F16), ((300, 270), F16)], (256, 256, 64)),
    # one task holding the whole tensor (its load and exponentials: 2 x 250 KB)
    case("whole_row_softmax-f32-spilled", whole_row_softmax, [((50, 1250), F32)] * 2, (8, 8, 8)),
]


#: the cases whose tiles do not all fit in a CTA's shared memory
SPILLED = [i for i, c in enumerate(CASES) if c.id.endswith("-spilled")]


def trace(fn, shapes, tile, kw):
    return fn.trace(1, *_specs(shapes), compute=tl.ComputeSchedule(tile=tile), **kw)


def inputs_for(k, rng):
    """Random inputs by dtype; index tensors hold valid rows (and some negative ones)."""
    out = {}
    for b in k.args:
        shape, dt = b.type.shape, b.type.dtype.name
        if b.name == "sx":         # specials among ordinary values
            v = rng.standard_normal(shape) * 4
            flat = v.reshape(-1)
            flat[::7] = np.nan
            flat[1::11] = np.inf
            flat[2::13] = -np.inf
            flat[3::5] = 0.0
            flat[4::17] = -0.0
            flat[5::19] = 3e38
            out[b.name] = v.astype(np.float32)
        elif b.name == "sn":
            v = rng.integers(-50, 50, shape).astype(np.int32)
            flat = v.reshape(-1)
            flat[::9] = np.iinfo(np.int32).min
            flat[1::10] = np.iinfo(np.int32).max
            out[b.name] = v
        elif b.name == "idx":
            out[b.name] = rng.integers(-2, 20, shape).astype(np.int32)
        elif b.name == "lens":
            out[b.name] = rng.integers(0, 9, shape).astype(np.int32)
        elif dt == "i32":
            out[b.name] = rng.integers(-1000, 1000, shape).astype(np.int32)
        else:
            out[b.name] = rng.standard_normal(shape).astype(NP[dt])
    return out


# =================================================================================================
# The pipeline
# =================================================================================================

@pytest.mark.parametrize("fn,shapes,tile,kw", CASES)
def test_the_pipeline_lowers_what_no_recipe_matches(fn, shapes, tile, kw):
    k = trace(fn, shapes, tile, kw)
    lk = lower(k, "part")
    assert type(lk).__name__ == "LoweredGeneral"
    assert '#include "tldsl/general.hpp"' in lk.source
    assert lk.smem_bytes <= 227 * 1024
    dots = sum(1 for op in k.parts[0].walk() if op.name == "dot")
    staged = lk.source.count("tldsl::gen::wgmma_staged<")      # the dots of pipelined loops
    assert lk.dots == dots and lk.source.count("tldsl::gen::wgmma_dot<") + staged == lk.wgmma_dots
    assert lk.source.count("tldsl::gen::mma_dot<") == dots - lk.wgmma_dots
    assert ('#include "tldsl/general_wgmma.hpp"' in lk.source) == (lk.wgmma_dots > staged)
    assert ('#include "tldsl/general_pipeline.hpp"' in lk.source) == (staged > 0)
    assert "tldsl: " + fn.fn.__code__.co_filename in lk.source     # generated lines point at the tile program


def test_existing_recipes_keep_their_programs():
    """general is the lowest priority: a GEMM the warp-specialised recipe matches stays there."""
    from test_codegen_host import trace_plain
    from tldsl.codegen import RECIPES
    assert min(r.priority for r in RECIPES if r.role == "compute") == \
        next(r.priority for r in RECIPES if r.name == "general")
    assert type(lower(trace_plain(), "mm")).__name__ == "LoweredGemm"
    assert type(lower_general(trace_plain(), "mm")).__name__ == "LoweredGeneral"


def _spilled(lk) -> list[str]:
    """The slots ``lk`` keeps in the global-memory scratch, as (op, line of the tile program)."""
    return [s.split("(")[1].split(")")[0] for s in lk.slots if s.startswith("scratch")]


def test_tiles_over_the_shared_memory_limit_spill_to_the_global_scratch():
    """Two 256 x 256 f32 accumulators (512 KB) and the K loop's loads: the accumulators go to the
    scratch, the dots' operands (touched more, and read by the tensor cores) stay in shared
    memory, which fits; the kernel takes the scratch, a share per task group of each CTA."""
    lk = lower(trace(*CASES[SPILLED[0]].values), "part")
    spilled = _spilled(lk)
    assert len(set(spilled)) == 2 and all(s.startswith("frag_alloc, test_codegen_general.py:") for s in spilled), \
        lk.describe()
    assert all("(load," in s for s in lk.slots if s.startswith("slot "))
    assert lk.smem_bytes <= 227 * 1024 and lk.scratch_bytes == 2 * 256 * 256 * 4 and lk.groups == 1
    assert [p.name for p in lk.params][-3:] == ["scratch", "rank", "launch"]
    assert lk.source.count("tldsl_scratch + ") == 2 and "blockIdx.x * 1 + grp" in lk.source
    # element-wise accumulation: the fragment alone over the limit; small arenas run several tasks a CTA
    lk = lower(trace(*CASES[SPILLED[1]].values), "part")
    assert _spilled(lk) == ["frag_alloc, programs.py:30"] and lk.groups == 4, lk.describe()
    assert lk.scratch_bytes_per_cta == 4 * 256 * 256 * 4 and lk.smem_bytes <= 4 * 1024


def test_plan_spills_the_least_touched_tiles_and_keeps_dot_operands_in_shared_memory():
    """The plan itself: every tile has one slot, in shared memory or the scratch; the arena fits;
    each space's slots never overlap while live; what is spilled is a tile that is live where
    shared memory overflows, and no dot operand where another choice was left."""
    from tldsl.codegen.match.general import match_general
    from tldsl.codegen.plan.general import SMEM_LIMIT, plan_general
    k = trace(*CASES[SPILLED[0]].values)
    plan = plan_general(k, k.parts[0], match_general(k, k.parts[0]))
    spilled = [s for s in plan.slots.values() if s.spilled]
    shared = [s for s in plan.slots.values() if not s.spilled]
    assert {s.op.name for s in spilled} == {"frag_alloc"} and len(spilled) == 2
    assert {s.op.name for s in shared} == {"load"} and plan.arena_bytes <= SMEM_LIMIT
    assert plan.scratch_bytes >= max(s.offset + s.nbytes for s in spilled)
    for space in (spilled, shared):
        for a in space:
            for b in space:
                if a is not b and not (a.end < b.start or b.end < a.start):
                    assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset, (a, b)
    dot_reads = {v.id for op in k.parts[0].walk() if op.name == "dot" for v in op.operands}
    assert not any(s.value.id in dot_reads for s in spilled)
    # a plan that fits keeps everything in shared memory, and the kernel takes no scratch
    small = trace(gated_gemm, [((128, 128), F16)] * 3 + [((128,), F16), ((128, 128), F16)], (64, 64, 32), {})
    plan = plan_general(small, small.parts[0], match_general(small, small.parts[0]))
    assert not any(s.spilled for s in plan.slots.values()) and plan.scratch_bytes == 0
    assert "scratch" not in [p.name for p in plan.params]


def test_a_whole_tensor_tile_lowers_with_its_tiles_in_the_global_scratch():
    """A 1024 x 5000 f32 softmax in one task (a 20 MB tile the simulator runs): the general
    lowering keeps its load and its exponentials in the task group's global scratch, the row
    maxima and sums in shared memory."""
    f32 = S((1024, 5000), tl.float32)
    lk = lower(whole_row_softmax.trace(1, f32, f32), "part")
    assert lk.scratch_bytes_per_cta == 2 * 1024 * 5000 * 4 and lk.smem_bytes <= 16 * 1024, lk.describe()
    assert [s.split()[0] for s in lk.slots].count("scratch") == 2


def test_the_scratch_has_no_bound_of_its_own():
    """A 1024 x 600000 f32 softmax in one task (two 2.5 GB tiles live at once) lowers: the scratch
    is bounded by the GPU's free memory at run time (runtime/gpu/scratch_fit.py), a tile by its
    elements at trace."""
    f32 = S((1024, 600_000), tl.float32)
    lk = lower(whole_row_softmax.trace(1, f32, f32), "part")
    assert lk.scratch_bytes_per_cta == 2 * 1024 * 600_000 * 4
    assert "tldsl_scratch + 2457600000, 16)" in lk.source     # a byte offset past 2**31 needs no suffix: a
    # decimal literal too big for an int is a long in C++


def test_a_dot_whose_wgmma_staging_cannot_fit_runs_on_mma_sync():
    """A 4096 x 16 by 16 x 4096 f16 dot: WGMMA would stage A's rows and B's columns, 16 deep in K
    at least, 256 KB, over a CTA's shared memory; it runs on mma.sync from where its operands are
    (it was an internal error of the planner)."""
    from programs import one_task_outer_product
    f16 = tl.float16
    k = one_task_outer_product.trace(1, S((4096, 16), f16), S((16, 4096), f16), S((4096, 4096), tl.float32))
    lk = lower(k, "part")
    assert lk.dots == 1 and lk.wgmma_dots == 0 and lk.scratch_bytes > 4096 * 4096 * 4
    small = one_task_outer_product.trace(1, S((128, 16), f16), S((16, 128), f16), S((128, 128), tl.float32))
    assert lower(small, "part").wgmma_dots == 1


def test_slots_are_reused_by_liveness():
    """Loads of the K loop and the dots' results share slots with the epilogue's temporaries:
    the arena is smaller than the sum of the stored tiles."""
    k = trace(gated_gemm, [((128, 128), F16)] * 3 + [((128,), F16), ((128, 128), F16)], (64, 64, 32), {})
    lk = lower(k, "part")
    total = sum(int(s.split("+")[1].split()[0]) for s in lk.slots)
    assert lk.smem_bytes < total, lk.describe()


def test_options_are_checked():
    k = trace(scale_rows, [((64, 64), F16)] * 2, (64, 64, 32), {})
    assert lower(k, "part", threads=256).threads == 256
    with pytest.raises(LoweringError, match="multiple of 32"):
        lower(k, "part", threads=100)


# =================================================================================================
# NVRTC + SASS
# =================================================================================================

@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
def test_generated_programs_compile_for_sm90a_with_tensor_core_dots(tmp_path):
    """Every program above, the ring exchange (data primitives), the GEMM with a gated epilogue at 8192^3 and 8191 x 8200 x 4104 with
    128 x 128 x 64 tiles, and the library's compute parts (each lowered by the general recipe
    instead of its own, at their default tiles)."""
    if tcm.find_toolchain().cuobjdump is None:
        pytest.skip("cuobjdump missing: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    lks = {c.id: lower(trace(*c.values), "part") for c in CASES}
    for M, N, K in ((8192, 8192, 8192), (8191, 8200, 4104)):
        lks[f"gated_gemm-{M}x{N}x{K}"] = lower(trace(gated_gemm, [((M, K), F16), ((K, N), F16), ((K, N), F16),
                                                                    ((N,), F16), ((M, N), F16)], (128, 128, 64), {}),
                                                "part")
    lks["split_k_dots"] = lower(split_k_dots.trace(1, *_specs([((130, 200), F16), ((200, 136), F16), ((2,), I32),
                                                                 ((130, 136), F32)]),
                                                   compute=tl.ComputeSchedule(tile=(64, 128, 64))), "part")
    multi = dict(_multi_cases())
    lks["ring_exchange"] = lower(multi["ring_exchange"], "part")                      # data primitives on SMs
    lks["normed_gather.gather"] = lower(multi["normed_gather"], "gather")             # a communication part
    for name, k in _library_kernels():
        for p in k.parts:
            if p.role == "compute":
                lks[f"{name}.{p.name}"] = lower_general(k, p.name)
    cks = compile_many([lk.job() for lk in lks.values()], cache=KernelCache(tmp_path), progress=False)
    for (name, lk), ck in zip(lks.items(), cks):
        info = ck.ptxas_info()[ck.name]
        assert info["spill_store_bytes"] == 0 and info["spill_load_bytes"] == 0 and info["stack_bytes"] == 0, \
            (name, info)
        sass = ck.sass()[ck.name]
        assert sass.count("BPT.TRAP") == 0 and sass.spill_instructions == 0, (name, sass.summary())
        # every dot on tensor cores: HGMMA for those on WGMMA, HMMA for the rest
        assert not tensor_core_problems(sass, lk.wgmma_dots, lk.dots - lk.wgmma_dots), (name, sass.mnemonics)
        assert lk.smem_bytes <= 227 * 1024, name
    # the dots of at least 64 rows of f16 / bf16 tiles: WGMMA
    assert lks["gated_gemm-8192x8192x8192"].wgmma_dots == 2 and lks["attention_like-f16-wgmma"].wgmma_dots == 2


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@pytest.mark.parametrize("dtype,tile,pair", [(BF16, (16, 32, 16), "REDG.E.ADD.BF16x2"),
                                             (F16, (8, 16, 16), "REDG.E.ADD.F16x2"), (F32, (8, 16, 8), None)])
def test_sixteen_bit_rows_are_added_two_columns_at_a_time(tmp_path, dtype, tile, pair):
    """sm_90 runs a single 16-bit reduction as a compare-and-swap loop (SASS ATOMG.E.CAS): the general
    lowering adds a 16-bit tile (of an even column count: every tile of a compute schedule) two columns
    a thread, one packed REDG where the pair lies inside the tensor, 4-byte aligned (the loop stays
    for a pair at an edge or misaligned); f32 elements each take one REDG."""
    k = trace(weighted_scatter, [((37, 40), dtype), ((37,), I32), ((37,), F32), ((20, 40), dtype)], tile, {})
    lk = lower(k, "part")
    assert ("tldsl::gen::add_pair(" in lk.source) == (pair is not None)
    ck = compile_many([lk.job()], cache=KernelCache(tmp_path), progress=False)[0]
    ops = ck.sass()[ck.name].opcodes
    reds = {op for op in ops if op.startswith("REDG.E.ADD")}
    cas = any(op.startswith("ATOMG.E.CAS") for op in ops)
    if pair is not None:
        assert any(op.startswith(pair) for op in reds) and cas, sorted(ops)
    else:
        assert reds and not cas, sorted(ops)


def _library_kernels():
    from test_codegen_attention import trace_sp
    from test_codegen_comm import rs_kernel
    from test_codegen_host import trace_ag as ag_gemm
    from test_codegen_host import trace_plain
    from test_codegen_moe import trace_ag, trace_rs
    yield "plain_gemm", trace_plain()
    yield "allgather_gemm", ag_gemm()
    yield "moe_ag", trace_ag()
    yield "moe_rs", trace_rs()
    yield "sp_attention", trace_sp()
    yield "gemm_reduce_scatter", rs_kernel(W=4, comm=tl.CommSchedule(tile_m=64, order="ring", mode="push"), Ms=256,
                                           tile=(128, 128, 64), stages=3)


# =================================================================================================
# CPU emulation against the simulator
# =================================================================================================

_HARNESS = """\
#define TLDSL_HOST_EMULATION 1
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include "tldsl/general.hpp"

{source}

static void* load_file(const char* path, size_t n) {{
  void* p = std::aligned_alloc(64, (n + 63) / 64 * 64);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(p, 1, n, f) != n) {{ std::fprintf(stderr, "cannot read %s\\n", path); std::exit(2); }}
  std::fclose(f);
  return p;
}}
static void save_file(const char* path, const void* p, size_t n) {{
  FILE* f = std::fopen(path, "wb");
  std::fwrite(p, 1, n, f);
  std::fclose(f);
}}
// a kernel's global-memory scratch as the runtime gives it: poisoned (NaN as f32 / f16 / bf16)
static unsigned char* poisoned_scratch(size_t n) {{
  const size_t words = (n + 7) / 8 + 1;
  auto* p = static_cast<unsigned long long*>(std::aligned_alloc(256, (words * 8 + 255) / 256 * 256));
  for (size_t i = 0; i < words; ++i) p[i] = {poison}ull;
  return reinterpret_cast<unsigned char*>(p);
}}

int main(int argc, char** argv) {{
  const int threads = std::atoi(argv[1]);
  const int grid = std::atoi(argv[2]);
  unsigned char* m_scratch = poisoned_scratch((size_t)grid * {scratch});
  (void)m_scratch;
  static unsigned long long run_check_word = 0;     // as tl.run maps it (runtime/gpu/run_checks.py)
  tldsl_run_checks = &run_check_word;
{loads}
  std::vector<std::thread> pool;
  for (int b = 0; b < grid; ++b) {{
    auto* bar = new std::barrier<>(threads);
    auto* smem = static_cast<unsigned char*>(std::aligned_alloc(128, {smem}));
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([=] {{
        tldsl_emu::thread_idx.x = t;
        tldsl_emu::block_idx.x = b;
        tldsl_emu::block_dim.x = threads;
        tldsl_emu::grid_dim.x = grid;
        tldsl_emu::cta_barrier = bar;
        tldsl_emu::dynamic_smem = smem;
        {entry}({args});
      }});
  }}
  for (auto& th : pool) th.join();
{saves}
  if (run_check_word) {{
    std::fprintf(stderr, "run check failed: site %llu, count %d\\n", (run_check_word >> 32) - 1,
                 (int)(unsigned)(run_check_word & 0xffffffffull));
    return 3;
  }}
  return 0;
}}
"""


def device_layout(arr, dt):
    if dt == "bf16":
        return (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.ascontiguousarray(arr)


def from_device(raw: bytes, dt, shape):
    if dt == "bf16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(raw, NP[dt]).reshape(shape)


#: ThreadSanitizer's options for the emulated kernels it checks: every race reported, then a
#: failing exit status
TSAN_OPTIONS = "halt_on_error=0 exitcode=66 report_signal_unsafe=0 history_size=4"


def _host_program(src: str, sanitize: bool) -> tuple[Path, dict | None]:
    """The emulation harness built by g++ (with ThreadSanitizer where ``sanitize``), and the
    environment to run it in."""
    tsan = ["-fsanitize=thread", "-g"] if sanitize else []
    exe = host_build.build(src, ["-std=c++20", "-O1", "-pthread", "-ffp-contract=off", "-w", *tsan, f"-I{INCLUDE}"])
    return exe, ({**os.environ, "TSAN_OPTIONS": TSAN_OPTIONS} if sanitize else None)


def emulate(k, lk, arrays: dict, tmp_path: Path, threads=64, grid=3, sanitize=False) -> dict:
    """Run ``lk`` on CPU threads (``grid`` CTAs of ``threads``); ``arrays``: the simulator's
    inputs by tensor name. Returns every tensor after the run. ``sanitize``: built with
    ThreadSanitizer, so a missing barrier is a reported race (a failure), not a chance wrong value."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    loads, saves, args, files = [], [], [], {}
    dts = {b.name: b.type.dtype.name for b in k.args}
    for name, arr in arrays.items():
        dev = device_layout(arr, dts[name])
        f = tmp_path / f"m_{name}.bin"
        f.write_bytes(dev.tobytes())
        loads.append(f'  void* m_{name} = load_file("{f.name}", {dev.nbytes});')
        saves.append(f'  save_file("{f.name}", m_{name}, {dev.nbytes});')
        files[name] = f
    for sig in k.signals:
        loads.append(f"  static unsigned long long s_{sig.name}[{sig.type.slots}] = {{}};")
    for p in lk.params:
        kind, _, name = p.source.partition(":")
        ct = p.ctype.replace("__restrict__", "").strip()
        args.append({"buffer": f"({ct})m_{name}", "signal": f"({ct})s_{name}", "rank": "0", "launch": "1ull",
                     "scratch": "m_scratch", "tma": "tldsl::gen::TmaDesc{}"}[kind])
    src = _HARNESS.format(source=lk.source, loads="\n".join(loads), saves="\n".join(saves), entry=lk.entry,
                          args=", ".join(args), smem=max(128, (lk.smem_bytes + 127) // 128 * 128),
                          scratch=lk.scratch_bytes_per_cta, poison=hex(SCRATCH_POISON_WORD))
    (tmp_path / "harness.cpp").write_text(src)
    exe, env = _host_program(src, sanitize)
    if "tldsl/general_pipeline.hpp" in lk.source or getattr(lk, "held", ()):
        threads = lk.threads        # a pipelined dot loop's warpgroups each own rows of the tile; held
                                    # tiles' chunks are spread over the planned threads
    r = subprocess.run([str(exe), str(threads), str(grid)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return {n: from_device(files[n].read_bytes(), dts[n], arrays[n].shape) for n in arrays}


@needs_gxx
@pytest.mark.parametrize("fn,shapes,tile,kw", CASES)
def test_emulated_kernel_matches_the_simulator(tmp_path, fn, shapes, tile, kw):
    k = trace(fn, shapes, tile, kw)
    lk = lower(k, "part")
    arrays = inputs_for(k, np.random.default_rng(7))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    got = emulate(k, lk, {n: want_in for n, want_in in _stored_inputs(k, arrays).items()}, tmp_path)
    assert_agrees([got], want, tolerances)


@needs_gxx
def test_emulated_max_and_min_order_negative_zero_below_positive_zero(tmp_path):
    """The generated code's max / min (PTX max.NaN / min.NaN on the GPU, their host twins here)
    and the simulator agree on the sign of a zero result: 1 / max(+0, -0) is +inf either way round,
    and a row's max or min of mixed zeros does not depend on the order it is reduced in."""
    from test_tile_operators import SIGNED_ZEROS_X, signed_zeros, signed_zeros_want
    k = signed_zeros.trace(1, S((4, 4), F32), S((24, 4), F32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    got = emulate(k, lower(k, "part"), {"x": SIGNED_ZEROS_X, "y": np.full((24, 4), np.nan, np.float32)}, tmp_path)
    np.testing.assert_array_equal(got["y"], signed_zeros_want())


@tl.kernel
def index_arithmetic_at_int_bounds(tab, y, *, compute: tl.ComputeSchedule = None):
    """Index arithmetic on table entries at i32's edges: INT_MIN // -1 and % -1, and a loop whose
    last step would carry its index past INT_MAX."""
    @tl.compute_part(grid=(1,))
    def part(p):
        a, b = tl.load_scalar(tab, (0,)), tl.load_scalar(tab, (1,))
        n = tl.fragment((1,), tl.int32)
        for i in tl.range(tl.load_scalar(tab, (2,)), tl.load_scalar(tab, (3,)), tl.load_scalar(tab, (4,))):
            n += 1
        tl.store(y, (0,), tl.where(tl.iota(3) == 0, a // b, tl.where(tl.iota(3) == 1, a % b, n.read())))


@needs_gxx
def test_emulated_index_arithmetic_at_int_bounds_matches_the_simulator(tmp_path):
    """numpy's (the simulator's) INT_MIN // -1 wraps to INT_MIN and INT_MIN % -1 is 0, where C's
    division traps; a tl.range from INT_MAX - 9 below INT_MAX by 4 runs 3 iterations, where
    ``i += 4`` wrapped below the bound and ran 2**30 more (found by a helper's programs)."""
    tab = np.array([-2**31, -1, 2**31 - 10, 2**31 - 1, 4], np.int32)
    y = np.full(3, 7, np.int32)
    k = index_arithmetic_at_int_bounds.trace(1, S((5,), tl.int32), S((3,), tl.int32),
                                             compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    want = tl.simulate(index_arithmetic_at_int_bounds, 1, [{"tab": tab, "y": y}],
                       compute=tl.ComputeSchedule(tile=(8, 8, 8)))[0]["y"]
    np.testing.assert_array_equal(want, [-2**31, 0, 3])
    got = emulate(k, lower(k, "part"), {"tab": tab, "y": y}, tmp_path)
    np.testing.assert_array_equal(got["y"], want)


@tl.kernel
def long_update_chain(x, y, *, compute: tl.ComputeSchedule = None):
    """300 unrolled updates of one tile: 600 element ops in one chain."""
    @tl.compute_part(grid=(1,))
    def part(p):
        t = tl.load(x, (0, 0), (8, 8))
        for _ in tl.static_range(300):
            t = t * 1.0001 + 0.5
        tl.store(y, (0, 0), t)


@needs_gxx
def test_a_chain_of_600_element_ops_lowers_and_computes_as_the_simulator(tmp_path):
    """Fused into one expression it was rendered by recursion 600 deep (a RecursionError from
    lowering, found by a helper); every MAX_FUSED_DEPTH ops a value is now stored."""
    from tldsl.codegen.plan.general import MAX_FUSED_DEPTH
    x = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    y = np.full((8, 8), np.nan, np.float32)
    want = tl.simulate(long_update_chain, 1, [{"x": x, "y": y}], compute=tl.ComputeSchedule(tile=(8, 8, 8)))[0]["y"]
    k = long_update_chain.trace(1, S((8, 8), F32), S((8, 8), F32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    lk = lower(k, "part")
    assert lk.source.count("(") < 600 * 12 and MAX_FUSED_DEPTH < 600
    got = emulate(k, lk, {"x": x, "y": y}, tmp_path)
    np.testing.assert_array_equal(got["y"], want)


def _stored_inputs(k, arrays):
    """The inputs as the simulator stores them (numpy; bf16 rounded to nearest even)."""
    return {b.name: to_storage(host_array(arrays[b.name]), b.type.dtype) for b in k.args}


def test_the_plan_puts_f16_and_bf16_dots_of_64_row_multiples_on_wgmma_with_their_operands_staged():
    """f16 / bf16 dots whose tile has a multiple of 64 rows run on WGMMA in CTAs of whole
    warpgroups; the rest (fewer rows, f32 operands as TF32, a CTA of 96 threads) on mma.sync. A
    WGMMA dot stages its operands in shared memory live at the dot only: apart from every slot
    live there, never in the scratch, sized for its chunks of K."""
    from tldsl.codegen.match.general import match_general
    from tldsl.codegen.plan.general import STAGING_LIMIT, plan_general
    by_id = {c.id: c.values for c in CASES}

    def plan(name, **kw):
        k = trace(*by_id[name])
        return plan_general(k, k.parts[0], match_general(k, k.parts[0]), **kw)
    for name, on_wgmma in (("gated_gemm-f16", 2), ("gated_gemm-bf16-silu", 0), ("gated_gemm-f32-tf32", 0),
                           ("attention_like-f16", 0), ("attention_like-f16-wgmma", 2),
                           ("flash_attention-bf16-wgmma", 2), ("wide_dot-f16-chunks", 2),
                           ("gated_gemm-f16-256-wgmma-spilled", 2)):
        p = plan(name)
        assert len(p.wgmma) == len(p.stagings) == on_wgmma, name
        for vid, st in p.stagings.items():
            assert not st.spilled and st.start == st.end and st.nbytes == p.wgmma[vid].nbytes <= STAGING_LIMIT, name
            assert st.offset % 16 == 0 and st.offset + st.nbytes <= p.arena_bytes, name
            for s in list(p.slots.values()) + [x for x in p.stagings.values() if x is not st]:
                if not s.spilled and s.start <= st.start <= s.end:
                    assert s.offset + s.nbytes <= st.offset or st.offset + st.nbytes <= s.offset, (name, s, st)
    assert any(s.spilled for s in plan("gated_gemm-f16-256-wgmma-spilled").slots.values())
    assert not plan("gated_gemm-f16", threads=96).wgmma                  # not whole warpgroups
    assert len(plan("gated_gemm-f16", threads=256).wgmma) == 2
    # K = 200 past what the staging takes at once: two chunks of 112; N = 256 in two tiles of 128
    assert {(w.nt, w.kc) for w in plan("wide_dot-f16-chunks").wgmma.values()} == {(128, 112)}
    assert {(w.nt, w.kc) for w in plan("wide_dot-bf16-wide").wgmma.values()} == {(128, 48)}


PIPELINED = [c for c in CASES if "pipelined" in c.id]


@pytest.mark.parametrize("fn,shapes,tile,kw", PIPELINED)
def test_a_loop_that_only_loads_and_accumulates_dots_runs_as_a_pipelined_mainloop(fn, shapes, tile, kw):
    from tldsl.codegen.plan.general import plan_general
    from tldsl.codegen.match.general import match_general
    k = trace(fn, shapes, tile, kw)
    part = k.parts[0]
    plan = plan_general(k, part, match_general(k, part))
    (lp,) = plan.dot_loops.values()
    assert len(lp.dots) == 2 and len(lp.loads) == 3 and lp.stages >= 3
    assert plan.threads == 128 * lp.warpgroups and lp.mb * lp.warpgroups * 64 == tile[0]
    transposed = fn is gated_linear            # its first weight [N, K]: a right operand staged K-major
    assert {ld.role for ld in lp.loads} == ({"a", "b", "bt"} if transposed else {"a", "b"})
    assert [d.b_k_major for d in lp.dots] == [transposed, False] and not plan.wgmma and not plan.stagings
    assert all(d.fill == 0.0 for d in lp.dots)       # registers start from the fill: no slot read
    ring = plan.rings[id(lp.loop)]
    assert ring.nbytes == lp.ring_bytes == lp.stages * lp.stage_bytes + 1024 + (8 * lp.stages if lp.tma else 0)
    assert lp.tma == all(s[-1] % 8 == 0 for s, _ in shapes[:3])      # TMA where every loaded row is 16-byte
    assert lp.inflight == (1 if lp.stages >= 4 else 0) and lp.lookahead == 2      # two iterations of copies ahead
    for d in lp.dots:                                # the fragments' slots live only after the loop
        assert plan.slots[d.frag.id].start > ring.end
    lk = lower(k, "part")
    assert lk.wgmma_dots == 2 and lk.source.count("tldsl::gen::wgmma_staged<") == 2
    assert lk.source.count(", true>(") == int(transposed)           # the K-major right operand's WGMMA
    if lp.tma:                                       # one thread's TMA copies, an mbarrier a stage
        assert "tma_stage_tile<" in lk.source and "stage_bar_wait(" in lk.source and len(lk.tma) == 3
        assert [p.source for p in lk.params if p.kind == "tma"] == [f"tma:{t.param}" for t in lk.tma]
        assert all(t.box_dims[0] == 64 and t.swizzle == "CU_TENSOR_MAP_SWIZZLE_128B" for t in lk.tma)
    else:                                            # every thread's cp.async copies
        assert "cp_async_wait<" in lk.source and "stage_tile_sw128<" in lk.source and not lk.tma
    cp = lower(k, "part", dot_loop_copies="cp.async")
    assert "tma_stage_tile<" not in cp.source and "cp_async_wait<" in cp.source and not cp.tma


@needs_gxx
def test_a_pipelined_loop_without_wgmma_groups_across_iterations_matches_the_simulator(tmp_path):
    """``wgmma_inflight=0`` at four stages: every iteration's WGMMAs done at its end, copies one
    stage further ahead."""
    fn, shapes, tile, kw = next(c.values for c in PIPELINED if c.id == "gated_gemm-f16-pipelined")
    k = trace(fn, shapes, tile, kw)
    k = fn.trace(1, *_specs(shapes), compute=tl.ComputeSchedule(tile=tile, stages=4), **kw)
    lk = lower(k, "part", wgmma_inflight=0, dot_loop_copies="cp.async")
    assert lk.source.count("tldsl::gen::wgmma_wait<0>();") == 2 and "wgmma_wait<1>" not in lk.source
    assert "cp_async_wait<2>" in lk.source and "into the stage of 1 iteration(s) ago" in lk.source   # 4 stages: 3 ahead
    assert "wgmma_wait<1>" in lower(k, "part").source                                                # the default at 4
    arrays = inputs_for(k, np.random.default_rng(4))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    assert_agrees([emulate(k, lk, _stored_inputs(k, arrays), tmp_path)], want, tolerances)
    with pytest.raises(LoweringError, match="wgmma_inflight=2"):
        lower(k, "part", wgmma_inflight=2)


@needs_gxx
def test_the_swizzled_order_walks_every_task_once(tmp_path):
    """The compute schedule's "swizzled" order (groups of ``group_m`` rows, the last one short)
    on the general path: every output tile written once, as the simulator writes it."""
    shapes = [((300, 64), F16), ((64, 192), F16), ((64, 192), F16), ((192,), F16), ((300, 192), F16)]
    k = gated_gemm.trace(1, *_specs(shapes), compute=tl.ComputeSchedule(tile=(64, 64, 64), order="swizzled",
                                                                        group_m=2))
    lk = lower(k, "part")
    assert "groups of 2 rows" in lk.source and "tldsl/general_pipeline.hpp" in lk.source
    arrays = inputs_for(k, np.random.default_rng(3))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    assert_agrees([emulate(k, lk, _stored_inputs(k, arrays), tmp_path)], want, tolerances)


def test_loops_the_mainloop_does_not_take_stay_on_the_statement_path():
    """K tiles that are not 64-column multiples, a loop that also computes (an online softmax),
    and accumulators over a thread's share of registers run statement by statement."""
    from tldsl.codegen.plan.general import plan_general
    from tldsl.codegen.match.general import match_general
    for c in CASES:
        if c.id in ("gated_gemm-f16-wgmma", "flash_attention-bf16-wgmma", "gated_gemm-f16-256-wgmma-spilled"):
            k = trace(*c.values[:3], c.values[3])
            part = k.parts[0]
            assert not plan_general(k, part, match_general(k, part)).dot_loops, c.id
    # a warpgroup per 64-row block, two at most: 128 rows on 128 threads, or 256 rows, stay put
    shapes = [((300, 200), F16), ((200, 136), F16), ((2,), I32), ((300, 136), F32)]
    for tile, threads, pipelined in (((128, 128, 64), 128, False), ((128, 128, 64), 256, True),
                                     ((256, 128, 64), None, False)):
        k = split_k_dots.trace(1, *_specs(shapes), compute=tl.ComputeSchedule(tile=tile))
        part = k.parts[0]
        opts = {"threads": threads} if threads else {}
        assert bool(plan_general(k, part, match_general(k, part), **opts).dot_loops) == pipelined, (tile, threads)


def test_dot_results_go_straight_into_the_statement_after_them():
    """``acc += dot``, ``acc * alpha + dot`` and a stored ``where(mask, dot * scale, ...)``: the
    dot computes them as its results come out, so no dot result takes shared memory."""
    by_id = {c.id: c.values for c in CASES}
    for name in ("gated_gemm-f16", "flash_attention-bf16", "gated_gemm-f16-wgmma", "flash_attention-bf16-wgmma"):
        fn, shapes, tile, kw = by_id[name]
        lk = lower(trace(fn, shapes, tile, kw), "part")
        assert not any("(dot," in s for s in lk.slots), lk.describe()


# =================================================================================================
# Every part of a multi-rank kernel at once: communication kernels (their recipe) beside compute
# parts lowered by the general recipe, all ranks' CTAs on CPU threads, against the simulator
# =================================================================================================

_MULTI = """\
#define TLDSL_HOST_EMULATION 1
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include "tldsl/general.hpp"

{sources}

static void* load_file(const char* path, size_t n) {{
  void* p = std::aligned_alloc(64, (n + 63) / 64 * 64);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(p, 1, n, f) != n) {{ std::fprintf(stderr, "cannot read %s\\n", path); std::exit(2); }}
  std::fclose(f);
  return p;
}}
static void save_file(const char* path, const void* p, size_t n) {{
  FILE* f = std::fopen(path, "wb");
  std::fwrite(p, 1, n, f);
  std::fclose(f);
}}
// a kernel's global-memory scratch as the runtime gives it: poisoned (NaN as f32 / f16 / bf16)
static unsigned char* poisoned_scratch(size_t n) {{
  const size_t words = (n + 7) / 8 + 1;
  auto* p = static_cast<unsigned long long*>(std::aligned_alloc(256, (words * 8 + 255) / 256 * 256));
  for (size_t i = 0; i < words; ++i) p[i] = {poison}ull;
  return reinterpret_cast<unsigned char*>(p);
}}
static void launch(std::vector<std::thread>& pool, int threads, int grid, size_t smem, std::function<void()> body) {{
  for (int b = 0; b < grid; ++b) {{
    auto* bar = new std::barrier<>(threads);
    auto* arena = static_cast<unsigned char*>(std::aligned_alloc(128, smem));
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([=] {{
        tldsl_emu::thread_idx.x = t;
        tldsl_emu::block_idx.x = b;
        tldsl_emu::block_dim.x = threads;
        tldsl_emu::grid_dim.x = grid;
        tldsl_emu::cta_barrier = bar;
        tldsl_emu::dynamic_smem = arena;
        body();
      }});
  }}
}}

int main() {{
  static unsigned long long run_check_word = 0;     // as tl.run maps it (runtime/gpu/run_checks.py)
  tldsl_run_checks = &run_check_word;
{loads}
  std::vector<std::thread> pool;
{launches}
  for (auto& th : pool) th.join();
{saves}
  if (run_check_word) {{
    std::fprintf(stderr, "run check failed: site %llu, count %d\\n", (run_check_word >> 32) - 1,
                 (int)(unsigned)(run_check_word & 0xffffffffull));
    return 3;
  }}
  return 0;
}}
"""


def emulate_kernel(k, lowered: list, arrays: list[dict], tmp_path: Path, threads=32, grid=2,
                   sanitize=False, returncode: int = 0):
    """Run every lowered part of ``k`` for every rank at once on CPU threads. ``arrays[r]``: rank
    r's tensors (workspaces too) as the simulator stores them. Returns every rank's tensors.
    ``sanitize``: built with ThreadSanitizer (as :func:`emulate`). ``returncode`` 3: a run-time
    check is expected to fail (what the harness printed is returned)."""
    W = k.world_size
    dts = {b.name: b.type.dtype.name for b in k.buffers}
    tmp_path.mkdir(parents=True, exist_ok=True)
    loads, saves, launches, files = [], [], [], []
    for r in range(W):
        for b in k.buffers:
            dev = device_layout(arrays[r][b.name], dts[b.name])
            f = tmp_path / f"m_{r}_{b.name}.bin"
            f.write_bytes(dev.tobytes())
            loads.append(f'  void* m_{r}_{b.name} = load_file("{f.name}", {dev.nbytes});')
            saves.append(f'  save_file("{f.name}", m_{r}_{b.name}, {dev.nbytes});')
            files.append((r, b.name, f))
        for sig in k.signals:
            loads.append(f"  auto* s_{r}_{sig.name} = new unsigned long long[{sig.type.slots}]();")
    for b in k.buffers:
        loads.append(f"  void* t_{b.name}[{W}] = {{{', '.join(f'm_{r}_{b.name}' for r in range(W))}}};")
    for sig in k.signals:
        loads.append(f"  unsigned long long* ts_{sig.name}[{W}] = {{{', '.join(f's_{r}_{sig.name}' for r in range(W))}}};")
    for lk in lowered:
        g = min(grid, lk.num_tasks)
        smem = max(128, (lk.smem_bytes + 127) // 128 * 128)
        for r in range(W):
            args = []
            scratch = f"x_{r}_{lk.entry}"         # each rank's kernel its own scratch, as the runtime gives it
            if any(p.source == "scratch" for p in lk.params):
                loads.append(f"  unsigned char* {scratch} = poisoned_scratch({g * lk.scratch_bytes_per_cta});")
            for p in lk.params:
                kind, _, name = p.source.partition(":")
                ct = p.ctype.replace("__restrict__", "").strip()
                args.append({"buffer": f"({ct})m_{r}_{name}", "peers": f"({ct})t_{name}",
                             "signal": f"({ct})s_{r}_{name}", "peer_signals": f"({ct})ts_{name}",
                             "rank": str(r), "launch": "1ull", "scratch": scratch,
                             "tma": "tldsl::gen::TmaDesc{}"}[kind])
            # held chunks spread over the planned threads; a pipelined dot loop's warpgroups each own rows (as emulate)
            t = lk.threads if (getattr(lk, "held", ()) or "tldsl/general_pipeline.hpp" in lk.source) else threads
            launches.append(f"  launch(pool, {t}, {g}, {smem}, [=] {{ {lk.entry}({', '.join(args)}); }});")
    src = _MULTI.format(sources="\n".join(lk.source for lk in lowered), loads="\n".join(loads),
                        saves="\n".join(saves), launches="\n".join(launches), poison=hex(SCRATCH_POISON_WORD)).replace(
        "#include <thread>", "#include <functional>\n#include <thread>")
    (tmp_path / "multi.cpp").write_text(src)
    exe, env = _host_program(src, sanitize)
    r = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == returncode, r.stderr[-4000:]
    if returncode:
        return r.stderr
    out = [dict() for _ in range(W)]
    for rank, name, f in files:
        out[rank][name] = from_device(f.read_bytes(), dts[name], arrays[rank][name].shape)
    return out


@tl.kernel
def ring_exchange(x: tl.Symmetric, y: tl.Symmetric, w: tl.Symmetric, z, *, compute: tl.ComputeSchedule = None):
    """A compute part moving data itself: it pushes a tile into the next rank (and copies its x
    there), notifies it, waits for the previous rank's push, pulls the previous rank's x."""
    M, N = x.shape
    BM = compute.tile[0]
    W = tl.world_size()
    arrived = tl.signal("arrived", tl.cdiv(M, BM), scope="symmetric")

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        nxt, prv = (tl.rank() + 1) % W, (tl.rank() + W - 1) % W
        t = tl.load(x, (pm * BM, 0), (BM, N))
        tl.tile_push_data(y.at(nxt), (pm * BM, 0), t * 2.0)
        tl.tile_push_data(w.at(nxt), (pm * BM, 0), x, (pm * BM, 0), (BM, N))
        tl.peer_tile_notify(arrived, pm, nxt)
        tl.peer_tile_wait(arrived, pm, count=1)
        u = tl.tile_pull_data(x.at(prv), (pm * BM, 0), (BM, N))
        tl.store(z, (pm * BM, 0), tl.load(y, (pm * BM, 0), (BM, N)) - tl.load(w, (pm * BM, 0), (BM, N)) + u)


# A communication part on SMs that the streamed kernel does not take (a reduction: it
# RMS-normalises each peer's rows as it gathers them) notifies a compute part that waits — the
# program the distributed runtime's GPU check runs too.
from tldsl.runtime.dist.program_check import rmsnorm_gather as normed_gather  # noqa: E402


def _multi_cases():
    from tldsl.ops.allgather_gemm import allgather_gemm
    from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
    from tldsl.ops.sp_attention import sp_attention
    c16 = tl.ComputeSchedule(tile=(16, 16, 16))
    yield "allgather_gemm", allgather_gemm.trace(
        2, S((24, 32), F16), S((32, 40), F16), S((48, 40), F16), compute=c16,
        comm=tl.CommSchedule(tile_m=8, mode="pull", sms=2))
    yield "gemm_reduce_scatter", gemm_reduce_scatter.trace(
        2, S((32, 24), BF16), S((24, 40), BF16), S((16, 40), BF16), compute=c16,
        comm=tl.CommSchedule(tile_m=8, order="ring", mode="push", sms=2))
    yield "ring_exchange", ring_exchange.trace(3, *[S((20, 24), F32)] * 4, compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    yield "normed_gather", normed_gather.trace(2, S((12, 40), BF16), S((24, 40), F32), S((24, 40), F32),
                                               compute=tl.ComputeSchedule(tile=(16, 16, 16)),
                                               comm=tl.CommSchedule(sms=2))
    yield "sp_attention", sp_attention.trace(
        2, *[S((24, 32), F16)] * 4, heads=2, causal=True, compute=tl.ComputeSchedule(tile=(16, 16, 16)),
        comm=tl.CommSchedule(tile_m=8, mode="pull", sms=2))


@needs_gxx
@pytest.mark.parametrize("name", ["allgather_gemm", "gemm_reduce_scatter", "sp_attention", "ring_exchange",
                                  "normed_gather"])
def test_emulated_multi_rank_kernel_with_generally_lowered_compute_matches_the_simulator(tmp_path, name):
    """The library's fused ops with their compute parts lowered by the general recipe (instead
    of their own): the waits on the communication kernels' notifies, and the notifies they wait
    for, work across ranks; every rank's outputs match the simulator's."""
    k = dict(_multi_cases())[name]
    lowered = [lower_general(k, p.name) if p.role == "compute" else lower(k, p.name) for p in k.parts]
    assert any(type(x).__name__ == "LoweredGeneral" for x in lowered)
    if name == "normed_gather":     # its communication part: the general lowering too (recipe general_comm)
        assert all(type(x).__name__ == "LoweredGeneral" for x in lowered) and lowered[0].lanes == 2
    rng = np.random.default_rng(11)
    inputs = [inputs_for(k, rng) for _ in range(k.world_size)]
    res, tolerances = reference_with_tolerances(k, k.world_size, [dict(x) for x in inputs])
    stored = []
    for r in range(k.world_size):
        arrays = _stored_inputs(k, inputs[r])
        for b in k.workspaces:
            arrays[b.name] = np.full(b.type.shape, np.nan if b.type.dtype.is_float else -1, NP[b.type.dtype.name])
        stored.append(arrays)
    got = emulate_kernel(k, lowered, stored, tmp_path)
    for r in range(k.world_size):
        out = np.asarray(res[r][k.args[-1].name], np.float64)
        assert np.isfinite(out).all() and np.abs(out).max() > 0         # the product / attention, every row
    assert_agrees(got, res, tolerances, names=[b.name for b in k.args])


@tl.kernel
def counted_wait(x, cnt, y, *, compute: tl.ComputeSchedule = None, per_launch: int = None):
    """A wait whose count is a table entry: the simulator refuses one that is not positive (or
    past ``per_launch``) when it meets it."""
    M, N = x.shape
    s = tl.signal("s", 1)
    ws = tl.local_buffer((M, N), x.dtype, "ws")

    @tl.compute_part(grid=(1,))
    def produce(i):
        tl.store(ws, (0, 0), tl.load(x, (0, 0), (M, N)) * 2.0)
        tl.producer_tile_notify(s, 0)

    @tl.compute_part(grid=(1,))
    def consume(i):
        tl.consumer_tile_wait(s, 0, count=tl.load_scalar(cnt, (0,)), per_launch=per_launch)
        tl.store(y, (0, 0), tl.load(ws, (0, 0), (M, N)) + 1.0)


@needs_gxx
@pytest.mark.parametrize("count, per_launch", [(1, None), (0, None), (-3, None), (2, 1), (1, 1)])
def test_emulated_wait_checks_a_run_time_count_as_the_simulator_does(tmp_path, count, per_launch):
    """A wait's count read from a table: where the simulator refuses it (not positive, or past
    the slot's notifies per launch) the generated wait records the failure for the host at the
    wait's site (tl.run raises RunCheckError there) and passes; the GPU's wait used to pass
    silently at 0 and hang at a negative count."""
    from tldsl.codegen.ir_queries import wait_at_site, wait_site
    from tldsl.runtime.gpu.run_checks import CHECK_CALL
    x = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)
    cnt = np.array([count], np.int32)
    y = np.full((8, 8), np.nan, np.float32)
    sched = dict(compute=tl.ComputeSchedule(tile=(8, 8, 8)), per_launch=per_launch)
    refused = count <= 0 or (per_launch is not None and count > per_launch)
    args = [{"x": x, "cnt": cnt, "y": y}]
    if refused:
        with pytest.raises(tl.SimulationError, match="wait count"):
            tl.simulate(counted_wait, 1, args, **sched)
    else:
        want = tl.simulate(counted_wait, 1, args, **sched)[0]["y"]
    k = counted_wait.trace(1, S((8, 8), F32), S((1,), tl.int32), S((8, 8), F32), **sched)
    lowered = [lower(k, p.name) for p in k.parts]
    assert CHECK_CALL in lowered[1].source and CHECK_CALL not in lowered[0].source
    wait = next(op for _, op in k.walk() if op.name == "consumer_tile_wait")
    arrays = [{"x": x, "cnt": cnt, "y": y, "ws": np.full((8, 8), np.nan, np.float32)}]
    if refused:
        err = emulate_kernel(k, lowered, arrays, tmp_path, returncode=3)
        assert f"run check failed: site {wait_site(wait)}, count {count}" in err
        assert wait_at_site(k, wait_site(wait)) is wait
    else:
        np.testing.assert_array_equal(emulate_kernel(k, lowered, arrays, tmp_path)[0]["y"], want)


def test_a_part_the_gemm_planner_refuses_falls_back_to_the_general_recipe():
    """The warp-specialised GEMM matches a K loop whose tiles differ from the schedule's, but its
    planner refuses them: lower() hands the part to the general lowering; lower_gemm still says why."""
    from test_codegen_pipeline import _fixed_tile_gemm
    from tldsl.codegen import lower_gemm, pipeline
    spec = S((256, 256), F16)
    k = _fixed_tile_gemm.trace(1, spec, spec, spec, compute=tl.ComputeSchedule(tile=(128, 128, 32)))
    with pytest.raises(LoweringError, match="do not match the compute schedule's tile"):
        lower_gemm(k)
    assert pipeline.match(k, k.parts[0]).recipe.name == "gemm"
    with pytest.warns(tl.FallbackWarning, match="part 'mm' .* general recipe: the gemm recipe refused: .*do not match") as w:
        lk = lower(k, "mm")
    assert type(lk).__name__ == "LoweredGeneral" and lk.dots == 1
    assert w[0].filename == k.parts[0].loc.filename and w[0].lineno == k.parts[0].loc.lineno     # the part's line
    assert [name for name, _ in lk.declined] == ["gemm"] and "do not match" in lk.describe()
    assert "gemm recipe refused" in lk._repr_html_()
    plain = lower(_fixed_tile_gemm.trace(1, spec, spec, spec, compute=tl.ComputeSchedule(tile=(128, 128, 64))), "mm")
    assert plain.declined == ()                                 # the recipe made for it took it: nothing to say
    with pytest.raises(LoweringError, match="do not match the compute schedule's tile"):
        lower(k, "mm", cluster=(2, 1))          # an option only the GEMM takes: its planner's error


@tl.kernel
def gemm_any_k(a, b, c, *, compute: tl.ComputeSchedule = None):
    M, K = a.shape
    _, N = b.shape
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(c, (pm * BM, pn * BN), acc.read())


@needs_gxx
def test_a_gemm_with_k_0_falls_back_to_the_general_recipe_and_stores_zeros(tmp_path):
    """TMA takes no zero extent (cuTensorMapEncodeTiled refuses a 0 dimension): the GEMM recipe
    refuses K = 0 at plan time, the general lowering takes the part without TMA descriptors (its
    pipelined K loop by cp.async), and stores C = 0 as the simulator does, over a poisoned C."""
    from tldsl.codegen import lower_gemm, pipeline
    from tldsl.codegen.abi import TmaDescriptorSpec
    sch = tl.ComputeSchedule(tile=(128, 128, 64))
    a, b, c = np.zeros((128, 0), np.float16), np.zeros((0, 128), np.float16), np.full((128, 128), np.nan, np.float32)
    k = gemm_any_k.trace(1, S(a.shape, F16), S(b.shape, F16), S(c.shape, F32), compute=sch)
    assert pipeline.match(k, k.parts[0]).recipe.name == "gemm"
    with pytest.raises(LoweringError, match="TMA cannot describe tensor 'a' .*zero extent, shape \\[128, 0\\]"):
        lower_gemm(k)
    with pytest.warns(tl.FallbackWarning, match="general recipe: the gemm recipe refused: TMA cannot describe"):
        lk = lower(k, "part")
    assert type(lk).__name__ == "LoweredGeneral" and lk.tma == () and [n for n, _ in lk.declined] == ["gemm"]
    assert not any(p.kind == "tma" for p in lk.params)
    with pytest.raises(LoweringError, match="zero extent"):
        TmaDescriptorSpec("tma_x", "x", "A", "f16", "F16", (0, 4), (0,), (8, 4), (1, 1), "NONE")
    want = tl.simulate(gemm_any_k, 1, [{"a": a, "b": b, "c": c}], compute=sch)[0]["c"]
    np.testing.assert_array_equal(want, 0)
    got = emulate(k, lk, {"a": a, "b": b, "c": c}, tmp_path)
    np.testing.assert_array_equal(got["c"], want)


def test_a_tma_descriptor_the_driver_refuses_is_an_input_error_naming_the_tensor(monkeypatch):
    """cuTensorMapEncodeTiled's refusal (faked here: no driver on the CPU) is a typed tldsl error
    naming the descriptor, the tensor and what was asked, not a bare RuntimeError."""
    from types import SimpleNamespace
    driver = pytest.importorskip("cuda.bindings.driver")
    import cuda.bindings
    from tldsl.codegen.abi import TmaDescriptorSpec

    class _Refused:
        name = "CUDA_ERROR_INVALID_VALUE"

    class _Fake:
        cuuint64_t = cuuint32_t = int

        def __getattr__(self, name):      # the enums and their members
            return SimpleNamespace(CUDA_SUCCESS="ok") if name == "CUresult" else self

        @staticmethod
        def cuTensorMapEncodeTiled(*args):
            return _Refused(), None

    assert driver is not None
    monkeypatch.setattr(cuda.bindings, "driver", _Fake())
    spec = TmaDescriptorSpec("tma_x", "x", "A", "f16", "F16", (64, 4), (128,), (64, 4), (1, 1), "NONE")
    with pytest.raises(tl.InputError, match="TMA descriptor tma_x of tensor 'x' cannot be built: "
                                            "cuTensorMapEncodeTiled refused it \\(CUDA_ERROR_INVALID_VALUE\\): "
                                            "shape \\[4, 64\\] \\(f16\\).*not 16-byte aligned"):
        spec.encode(0x1008)


def test_a_compute_part_with_fused_communication_parts_is_refused():
    """own_rows='compute' fuses the all-gather's own-rows parts into the GEMM's kernel; the
    general lowering does not run them, so it refuses rather than drop their work."""
    from tldsl.ops.allgather_gemm import allgather_gemm
    from tldsl.codegen import pipeline
    k = allgather_gemm.trace(2, S((256, 256), F16), S((256, 256), F16), S((512, 256), F16),
                             compute=tl.ComputeSchedule(tile=(128, 128, 64)),
                             comm=tl.CommSchedule(tile_m=None, mode="pull", engine="copy_engine", own_rows="compute"))
    assert any(p.fused for p in k.parts)
    with pytest.raises(LoweringError, match="does not run fused parts yet"):
        lower_general(k, "gemm")
    assert pipeline.match(k, k.part("gemm")).recipe.name == "gemm"


# =================================================================================================
# Generated programs (tldsl.testing's fuzzer families): every part on CPU threads against the simulator
# =================================================================================================

FUZZ_SEED, FUZZ_PROGRAMS = 1806, 8


def _fuzz_cases():
    from tldsl.testing.program_case import FuzzCase
    from tldsl.testing.program_families import generate_distinct
    return [FuzzCase(p, f"fuzz seed {FUZZ_SEED} program {i}") for i, p in generate_distinct(FUZZ_PROGRAMS, FUZZ_SEED)]


@needs_gxx
@pytest.mark.parametrize("index", range(FUZZ_PROGRAMS))
def test_emulated_generated_program_matches_the_simulator(tmp_path, index):
    """Random well-formed programs (single parts, pipelines linked by signals, communication over
    several ranks): compute parts by the general recipe, communication parts by the pipeline's
    choice, all ranks at once on CPU threads; outputs within the fuzzer's tolerances."""
    from tldsl.codegen.abi import LoweredKernel
    case = _fuzz_cases()[index]
    k = case.trace()
    lowered = [lower_general(k, p.name) if p.role == "compute" else lower(k, p.name) for p in k.parts]
    if not all(isinstance(x, LoweredKernel) for x in lowered):
        pytest.skip("a copy-engine part: a host plan, not a kernel (checked by test_codegen_comm)")
    ref, _ = case.reference()
    stored = []
    for r in range(k.world_size):
        arrays = _stored_inputs(k, case.inputs[r])
        for b in k.workspaces:
            arrays[b.name] = np.full(b.type.shape, np.nan if b.type.dtype.is_float else -0x5A5A5A5A,
                                     NP[b.type.dtype.name])
        stored.append(arrays)
    got = emulate_kernel(k, lowered, stored, tmp_path)
    bad = case.mismatches(ref.outputs, got)
    assert not bad, f"{bad}\n{case.source}"


def _scatter_cases():
    """The fuzzer's ``scatter`` family (``tl.add_rows``) without dots: the general lowering's programs."""
    from tldsl.testing.program_case import FuzzCase
    from tldsl.testing.program_families import generate_distinct
    got = [FuzzCase(p, f"scatter seed 3 program {i}") for i, p in generate_distinct(16, 3, families=["scatter"])]
    return [c for c in got if "tl.dot" not in c.program.source()][:6]


@needs_gxx
@pytest.mark.parametrize("index", range(6))
def test_emulated_scatter_adds_match_the_simulator(tmp_path, index):
    """Random programs adding rows into rows chosen at run time (repeated ids, negative ids skipped,
    on one rank or two): the general lowering's atomic adds on CPU threads against the simulator,
    within the fuzzer's tolerances (the adds land in another order)."""
    case = _scatter_cases()[index]
    k = case.trace()
    assert "add_rows" in str(k)
    lowered = [lower_general(k, p.name) for p in k.parts]
    ref, _ = case.reference()
    got = emulate_kernel(k, lowered, [_stored_inputs(k, case.inputs[r]) for r in range(k.world_size)], tmp_path)
    bad = case.mismatches(ref.outputs, got)
    assert not bad, f"{bad}\n{case.source}"


@tl.kernel
def split_k_dots(a, b, ks, out, *, compute: tl.ComputeSchedule = None):
    """Two pipelined K loops into one fragment (the second starts from what the first left in
    the fragment's slot), their bounds read from a table at run time (the second may run 0
    iterations)."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32, fill=0.5)
        k1 = tl.load_scalar(ks, (0,))
        k2 = tl.load_scalar(ks, (1,))
        for k in tl.range(0, k1, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        for k in tl.range(k1, k2, BK):
            acc += tl.dot(tl.load(a, (pm * BM, k), (BM, BK)), tl.load(b, (k, pn * BN), (BK, BN)))
        tl.store(out, (pm * BM, pn * BN), acc.read())


@needs_gxx
@pytest.mark.parametrize("bounds", [(128, 200), (192, 192)], ids=["both-loops", "second-empty"])
def test_two_pipelined_loops_share_a_fragment_through_its_slot(tmp_path, bounds):
    from tldsl.codegen.plan.general import plan_general
    from tldsl.codegen.match.general import match_general
    shapes = [((130, 200), F16), ((200, 136), F16), ((2,), I32), ((130, 136), F32)]
    k = split_k_dots.trace(1, *_specs(shapes), compute=tl.ComputeSchedule(tile=(64, 128, 64)))
    part = k.parts[0]
    plan = plan_general(k, part, match_general(k, part))
    first, second = sorted(plan.dot_loops.values(), key=lambda lp: plan.rings[id(lp.loop)].start)
    assert first.dots[0].fill == 0.5 and second.dots[0].fill is None   # the second reads the slot
    lk = lower(k, "part")
    assert lk.source.count("{  // pipelined dot loop:") == 2 and lk.source.count("v = 0.5f;") == 1
    arrays = inputs_for(k, np.random.default_rng(9))
    arrays["ks"] = np.array(bounds, np.int32)
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    assert_agrees([emulate(k, lk, _stored_inputs(k, arrays), tmp_path)], want, tolerances)


def test_a_tensor_read_by_tma_that_is_not_16_byte_aligned_is_refused_before_launch():
    """The pipelined loop's TMA descriptors need 16-byte aligned tensors: binding one at an odd
    address is an InputError naming the tensor, not a failure inside the driver."""
    from tldsl.runtime.gpu.bind import DeviceArray, bind, nominal_memory
    from tldsl.runtime.gpu.run_errors import UnboundParameterError
    fn, shapes, tile, kw = next(c.values for c in PIPELINED if c.id == "gated_gemm-f16-pipelined")
    k = trace(fn, shapes, tile, kw)
    lk = lower(k, "part")
    assert lk.tma
    mem = nominal_memory(k)
    bind(lk, 0, mem)                                 # aligned: binds
    b = mem.buffers[0]["b"]
    mem.buffers[0]["b"] = DeviceArray(b.ptr + 2, b.shape, b.dtype)
    with pytest.raises(UnboundParameterError, match="'b' starts at .* not 16-byte aligned"):
        bind(lk, 0, mem)


@tl.kernel
def dead_accumulator(a, b, c, y, *, compute: tl.ComputeSchedule = None):
    """A fragment the pipelined loop reads from its slot and nobody reads after it, beside one
    filled right before the loop: both are written back at the loop's end (a review's case)."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        g = tl.fragment((BM, BN), tl.float32)
        g.write(g.read() + 1.0)
        h = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            x = tl.load(a, (pm * BM, k), (BM, BK))
            h += tl.dot(x, tl.load(b, (k, pn * BN), (BK, BN)))
            g += tl.dot(x, tl.load(c, (k, pn * BN), (BK, BN)))
        tl.store(y, (pm * BM, pn * BN), h.read())


@needs_gxx
def test_fragments_written_back_together_never_share_a_slot(tmp_path):
    shapes = [((200, 256), F16), ((256, 136), F16), ((256, 136), F16), ((200, 136), F32)]
    k = dead_accumulator.trace(1, *_specs(shapes), compute=tl.ComputeSchedule(tile=(128, 128, 64), stages=4))
    from tldsl.codegen.plan.general import plan_general
    from tldsl.codegen.match.general import match_general
    part = k.parts[0]
    plan = plan_general(k, part, match_general(k, part))
    (lp,) = plan.dot_loops.values()
    a, b = (plan.slots[d.frag.id] for d in lp.dots)
    wb = plan.rings[id(lp.loop)].end + 1                 # where the loop writes its registers back
    assert a.start <= wb <= a.end and b.start <= wb <= b.end
    assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
    lk = lower(k, "part")
    assert "fence_proxy_async_all();" in lk.source
    arrays = inputs_for(k, np.random.default_rng(2))
    want, tolerances = reference_with_tolerances(k, 1, [dict(arrays)])
    assert_agrees([emulate(k, lk, _stored_inputs(k, arrays), tmp_path)], want, tolerances)
