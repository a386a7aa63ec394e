// tldsl: device side of the general lowering (codegen/recipes/general.py): any compute part.
//
// One task (program instance) runs on one task group: the whole CTA, or (a part without dots,
// waits, notifies or data primitives) one of kGroups groups of the CTA, each with its own arena
// and named barrier. Every thread of a group evaluates the part's index code. A tile the plan
// materialises lives in the group's shared memory (offsets chosen by the planner), or, where the
// tiles do not fit there, in the group's share of a global-memory scratch the runtime allocates
// (the kernel's `scratch` parameter; the same code reads and writes either through a pointer);
// every other tile value is an expression computed element by element where a statement
// consumes it. A statement (load, store, reduction, dot, fragment write, ...) is a loop of the
// group's threads over its output elements (16-byte chunks of rows for loads and stores,
// warp-shuffle lanes for reductions), followed by the group's barrier (which orders the group's
// global-memory accesses as it orders its shared-memory ones).
//
// The element math reproduces the simulator's numpy rules: 16-bit floats compute in float and
// round at every op, float arithmetic is explicitly rounded (never contracted into an FMA),
// i32 wraps, integer division by zero gives 0, maximum / minimum propagate NaN, floor division
// and modulo of floats follow numpy's divmod, and values that mix i32 and float compute in
// double (numpy promotes them to float64).
//
// `dot` runs on tensor cores: on WGMMA where the plan puts it there (f16 / bf16 tiles of a
// multiple of 64 rows: general_wgmma.hpp, which a kernel with such a dot includes), else here on
// CuTe's SM80 mma.sync atoms, m16n8k16 for f16 / bf16 operands and m16n8k8 TF32 for f32
// operands (inputs rounded to TF32, round-to-nearest-away), fp32 accumulation. Under
// TLDSL_HOST_EMULATION (the test suite's CPU check) the same product is computed element by
// element with the same input rounding and fp32 accumulation (both paths).
#pragma once

#include "tldsl/comm.hpp"

#if defined(TLDSL_HOST_EMULATION)
#include <math.h>
#include <stdint.h>
namespace tldsl_emu {
inline thread_local unsigned char* dynamic_smem = nullptr;   // the harness gives every CTA its own
}
#define TLDSL_DYNAMIC_SMEM(name) unsigned char* name = tldsl_emu::dynamic_smem
#else
#include <cute/arch/mma_sm80.hpp>
#define TLDSL_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#include "tldsl/element_math.hpp"

namespace tldsl {
namespace gen {

// -- task groups and cooperative reductions ----------------------------------------------------

// The barrier of one task group: the whole CTA when it runs one group, else named barrier
// 1 + group over the group's threads (a multiple of 32). Under TLDSL_HOST_EMULATION a kernel
// always runs one group (kGroups is 1 there).
template <int Groups>
TLDSL_DEV void group_sync(int group, int threads) {
  if constexpr (Groups == 1) {
    (void)group;
    (void)threads;
    __syncthreads();
  } else {
#if !defined(TLDSL_HOST_EMULATION)
    asm volatile("bar.sync %0, %1;" : : "r"(group + 1), "r"(threads) : "memory");
#endif
  }
}

// Lanes that reduce one output together (a power of two up to 32, consecutive lanes of a warp);
// one under TLDSL_HOST_EMULATION, where threads are not warps.
#if defined(TLDSL_HOST_EMULATION)
#define TLDSL_REDUCE_LANES(n) 1
#else
#define TLDSL_REDUCE_LANES(n) (n)
#endif

// The value of lane (this lane ^ offset) of the warp (every lane of the warp calls it).
TLDSL_DEV float shfl_xor(float v, int offset) {
#if defined(TLDSL_HOST_EMULATION)
  (void)offset;
  return v;
#else
  return __shfl_xor_sync(0xffffffffu, v, offset);
#endif
}
TLDSL_DEV int shfl_xor(int v, int offset) {
#if defined(TLDSL_HOST_EMULATION)
  (void)offset;
  return v;
#else
  return __shfl_xor_sync(0xffffffffu, v, offset);
#endif
}
TLDSL_DEV bool shfl_xor(bool v, int offset) { return shfl_xor(int(v), offset) != 0; }

// -- dot on tensor cores ----------------------------------------------------------------------

// The operand type an atom multiplies: f16 and bf16 values are exact in their 16 bits, f32
// values are rounded to TF32 (round to nearest, ties away: cvt.rna.tf32.f32).
enum class MmaKind { kF16, kBF16, kTF32 };

TLDSL_DEV float round_tf32(float x) {
#if defined(TLDSL_HOST_EMULATION)
  unsigned u = __float_as_uint(x);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;   // finite: ties away
  return __uint_as_float(u);
#else
  unsigned u;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
  return __uint_as_float(u);
#endif
}

#if !defined(TLDSL_HOST_EMULATION)
template <MmaKind K>
TLDSL_DEV unsigned pack2(float lo, float hi) {
  if constexpr (K == MmaKind::kF16) {
    return unsigned(comm::float_to_f16(lo)) | (unsigned(comm::float_to_f16(hi)) << 16);
  } else {
    return unsigned(comm::float_to_bf16(lo)) | (unsigned(comm::float_to_bf16(hi)) << 16);
  }
}
#endif

// C[M, N] = A[M, K] @ B[K, N] in fp32. `a(i, k)` / `b(k, j)` give operand elements (inside the
// tile only; the padding to whole mma shapes reads 0), `c(i, j, v)` takes each result element.
// Every warp of the CTA takes warp tiles of WM x WN atoms (16 x 8 outputs each) in turn: per K
// step it loads WM A fragments and WN B fragments and runs WM * WN atoms on them (a fragment is
// reused across a row or column of atoms).
template <MmaKind Kind, int M, int N, int K, class FA, class FB, class FC>
TLDSL_DEV void mma_dot(FA a, FB b, FC c) {
#if defined(TLDSL_HOST_EMULATION)
  for (int e = (int)threadIdx.x; e < M * N; e += (int)blockDim.x) {
    const int i = e / N, j = e % N;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) {
      float x = a(i, k), y = b(k, j);
      if (Kind == MmaKind::kTF32) {
        x = round_tf32(x);
        y = round_tf32(y);
      }
      acc = comm::fadd(acc, comm::fmul(x, y));
    }
    c(i, j, acc);
  }
#else
  constexpr int KS = Kind == MmaKind::kTF32 ? 8 : 16;
  constexpr int TM = (M + 15) / 16, TN = (N + 7) / 8;
  constexpr int WM = TM < 2 ? TM : 2, WN = TN < 4 ? TN : 4;             // atoms per warp tile
  constexpr int TWM = (TM + WM - 1) / WM, TWN = (TN + WN - 1) / WN;
  const int warp = (int)threadIdx.x / 32, nwarps = (int)blockDim.x / 32;
  const int lane = (int)threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  auto A = [&](int i, int k) { return (i < M && k < K) ? a(i, k) : 0.0f; };
  auto B = [&](int k, int j) { return (k < K && j < N) ? b(k, j) : 0.0f; };
#pragma unroll 1
  for (int wt = warp; wt < TWM * TWN; wt += nwarps) {
    const int m0 = (wt / TWN) * WM * 16, n0 = (wt % TWN) * WN * 8;
    float d[WM][WN][4];
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) d[i][j][q] = 0.0f;
#pragma unroll 1
    for (int k0 = 0; k0 < K; k0 += KS) {
      unsigned fa[WM][4], fb[WN][2];
#pragma unroll
      for (int i = 0; i < WM; ++i) {
        const int r0 = m0 + 16 * i + g, r1 = r0 + 8;
        if constexpr (Kind == MmaKind::kTF32) {
          fa[i][0] = __float_as_uint(round_tf32(A(r0, k0 + t)));
          fa[i][1] = __float_as_uint(round_tf32(A(r1, k0 + t)));
          fa[i][2] = __float_as_uint(round_tf32(A(r0, k0 + t + 4)));
          fa[i][3] = __float_as_uint(round_tf32(A(r1, k0 + t + 4)));
        } else {
          const int kc = k0 + 2 * t;
          fa[i][0] = pack2<Kind>(A(r0, kc), A(r0, kc + 1));
          fa[i][1] = pack2<Kind>(A(r1, kc), A(r1, kc + 1));
          fa[i][2] = pack2<Kind>(A(r0, kc + 8), A(r0, kc + 9));
          fa[i][3] = pack2<Kind>(A(r1, kc + 8), A(r1, kc + 9));
        }
      }
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        const int cn = n0 + 8 * j + g;
        if constexpr (Kind == MmaKind::kTF32) {
          fb[j][0] = __float_as_uint(round_tf32(B(k0 + t, cn)));
          fb[j][1] = __float_as_uint(round_tf32(B(k0 + t + 4, cn)));
        } else {
          const int kc = k0 + 2 * t;
          fb[j][0] = pack2<Kind>(B(kc, cn), B(kc + 1, cn));
          fb[j][1] = pack2<Kind>(B(kc + 8, cn), B(kc + 9, cn));
        }
      }
#pragma unroll
      for (int i = 0; i < WM; ++i)
#pragma unroll
        for (int j = 0; j < WN; ++j) {
          float* dd = d[i][j];
          if constexpr (Kind == MmaKind::kTF32) {
            cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(dd[0], dd[1], dd[2], dd[3], fa[i][0], fa[i][1], fa[i][2],
                                                     fa[i][3], fb[j][0], fb[j][1], dd[0], dd[1], dd[2], dd[3]);
          } else if constexpr (Kind == MmaKind::kF16) {
            cute::SM80_16x8x16_F32F16F16F32_TN::fma(dd[0], dd[1], dd[2], dd[3], fa[i][0], fa[i][1], fa[i][2],
                                                    fa[i][3], fb[j][0], fb[j][1], dd[0], dd[1], dd[2], dd[3]);
          } else {
            cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(dd[0], dd[1], dd[2], dd[3], fa[i][0], fa[i][1], fa[i][2],
                                                      fa[i][3], fb[j][0], fb[j][1], dd[0], dd[1], dd[2], dd[3]);
          }
        }
    }
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        const int r0 = m0 + 16 * i + g, r1 = r0 + 8, c0 = n0 + 8 * j + 2 * t;
        if (r0 < M && c0 < N) c(r0, c0, d[i][j][0]);
        if (r0 < M && c0 + 1 < N) c(r0, c0 + 1, d[i][j][1]);
        if (r1 < M && c0 < N) c(r1, c0, d[i][j][2]);
        if (r1 < M && c0 + 1 < N) c(r1, c0 + 1, d[i][j][3]);
      }
  }
#endif
}

}  // namespace gen
}  // namespace tldsl
