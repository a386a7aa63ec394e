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

namespace tldsl {
namespace gen {

using comm::bf16;
using comm::f16;

// -- storage <-> value: a tile element as tile math sees it (float, int or bool) --------------
TLDSL_DEV float get(float x) { return x; }
TLDSL_DEV float get(f16 x) { return comm::f16_to_float(x.bits); }
TLDSL_DEV float get(bf16 x) { return comm::bf16_to_float(x.bits); }
TLDSL_DEV int get(int x) { return x; }
TLDSL_DEV bool get(bool x) { return x; }

// A double as a float rounded to odd: toward zero, with the last bit set where bits were lost.
// Rounding that to a 16-bit float is then the one rounding of the double (float keeps more than
// two bits beyond f16's), as numpy's float64 -> float16; a plain (float) first rounds twice.
TLDSL_DEV float to_float_odd(double x) {
  const float f = (float)x;
  if ((double)f == x || f != f || f - f != 0.0f) return f;          // exact, NaN or infinite
  unsigned u = __float_as_uint(f);
  if ((f < 0.0f ? -(double)f : (double)f) > (x < 0.0 ? -x : x)) u -= 1u;  // rounded away from zero: step back
  return __uint_as_float(u | 1u);
}

template <class T>
struct Put;
template <>
struct Put<float> {
  static TLDSL_DEV float from(double v) { return (float)v; }
};
template <>
struct Put<f16> {
  static TLDSL_DEV f16 from(double v) { return f16{comm::float_to_f16(to_float_odd(v))}; }
};
template <>
struct Put<bf16> {
  static TLDSL_DEV bf16 from(double v) { return bf16{comm::float_to_bf16((float)v)}; }
};
template <>
struct Put<int> {
  static TLDSL_DEV int from(int v) { return v; }
};
template <>
struct Put<bool> {
  static TLDSL_DEV bool from(bool v) { return v; }
};
template <class T, class V>
TLDSL_DEV T put(V v) {
  return Put<T>::from(v);
}

// -- conversions (tl.cast and the rounding of 16-bit results) ----------------------------------
TLDSL_DEV float round_f16(double x) { return comm::round_f16(to_float_odd(x)); }
TLDSL_DEV float round_bf16(double x) { return comm::round_bf16((float)x); }
// float -> i32 as numpy does on x86: truncation, INT_MIN for NaN and out-of-range values
TLDSL_DEV int f2i(double x) {
  return (x != x || x >= 2147483648.0 || x < -2147483648.0) ? (int)0x80000000u : (int)x;
}

// -- arithmetic, exactly rounded ----------------------------------------------------------------
#if defined(TLDSL_HOST_EMULATION)
inline double dadd(double a, double b) { return a + b; }
inline double dsub(double a, double b) { return a - b; }
inline double dmul(double a, double b) { return a * b; }
inline double ddiv(double a, double b) { return a / b; }
#else
TLDSL_DEV double dadd(double a, double b) { return __dadd_rn(a, b); }
TLDSL_DEV double dsub(double a, double b) { return __dsub_rn(a, b); }
TLDSL_DEV double dmul(double a, double b) { return __dmul_rn(a, b); }
TLDSL_DEV double ddiv(double a, double b) { return __ddiv_rn(a, b); }
#endif
TLDSL_DEV float add(float a, float b) { return comm::fadd(a, b); }
TLDSL_DEV float sub(float a, float b) { return comm::fsub(a, b); }
TLDSL_DEV float mul(float a, float b) { return comm::fmul(a, b); }
TLDSL_DEV float div(float a, float b) { return comm::fdiv(a, b); }
TLDSL_DEV double add(double a, double b) { return dadd(a, b); }
TLDSL_DEV double sub(double a, double b) { return dsub(a, b); }
TLDSL_DEV double mul(double a, double b) { return dmul(a, b); }
TLDSL_DEV double div(double a, double b) { return ddiv(a, b); }
TLDSL_DEV int add(int a, int b) { return comm::iadd(a, b); }   // i32 wraps
TLDSL_DEV int sub(int a, int b) { return comm::isub(a, b); }
TLDSL_DEV int mul(int a, int b) { return comm::imul(a, b); }
TLDSL_DEV int neg(int a) { return comm::isub(0, a); }
TLDSL_DEV float neg(float a) { return -a; }
TLDSL_DEV double neg(double a) { return -a; }
TLDSL_DEV int abs_(int a) { return a < 0 ? neg(a) : a; }      // abs(INT_MIN) wraps to INT_MIN
TLDSL_DEV float abs_(float a) { return fabsf(a); }
TLDSL_DEV double abs_(double a) { return fabs(a); }

// numpy's maximum / minimum: NaN wins
template <class T>
TLDSL_DEV T max_(T a, T b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}
template <class T>
TLDSL_DEV T min_(T a, T b) {
  return a != a ? a : (b != b ? b : (a < b ? a : b));
}
// f32: comm's (one instruction on the GPU)
TLDSL_DEV float max_(float a, float b) { return comm::fmax_nan(a, b); }
TLDSL_DEV float min_(float a, float b) { return comm::fmin_nan(a, b); }

// numpy's integer floor division and modulo: 0 for a zero divisor, INT_MIN // -1 wraps
TLDSL_DEV int floordiv(int a, int b) { return tldsl::floordiv(a, b); }
TLDSL_DEV int mod(int a, int b) { return tldsl::floormod(a, b); }

// numpy's float divmod: the remainder takes the divisor's sign, the quotient is snapped to the
// nearest integer of (a - remainder) / b; a zero divisor gives a / b and fmod(a, b).
template <class T>
TLDSL_DEV T fmod_(T a, T b);
template <>
TLDSL_DEV float fmod_(float a, float b) { return fmodf(a, b); }
template <>
TLDSL_DEV double fmod_(double a, double b) { return fmod(a, b); }
template <class T>
TLDSL_DEV T divmod(T a, T b, T* rem) {
  T m = fmod_(a, b);
  if (b == T(0)) {
    *rem = m;
    return div(a, b);
  }
  T q = div(sub(a, m), b);
  if (m != T(0)) {
    if ((b < T(0)) != (m < T(0))) {
      m = add(m, b);
      q = sub(q, T(1));
    }
  } else {
    m = copysign(T(0), b);
  }
  T fq;
  if (q != T(0)) {
    fq = floor(q);
    if (sub(q, fq) > T(0.5)) fq = add(fq, T(1));
  } else {
    fq = copysign(T(0), div(a, b));
  }
  *rem = m;
  return fq;
}
TLDSL_DEV float floordiv(float a, float b) {
  float r;
  return divmod(a, b, &r);
}
TLDSL_DEV double floordiv(double a, double b) {
  double r;
  return divmod(a, b, &r);
}
TLDSL_DEV float mod(float a, float b) {
  float r;
  divmod(a, b, &r);
  return r;
}
TLDSL_DEV double mod(double a, double b) {
  double r;
  divmod(a, b, &r);
  return r;
}

// -- math functions (float, or double where numpy computes in float64) -------------------------
TLDSL_DEV float exp_(float x) { return expf(x); }
TLDSL_DEV double exp_(double x) { return exp(x); }
TLDSL_DEV float exp2_(float x) { return exp2f(x); }
TLDSL_DEV double exp2_(double x) { return exp2(x); }
TLDSL_DEV float log_(float x) { return logf(x); }
TLDSL_DEV double log_(double x) { return log(x); }
TLDSL_DEV float sqrt_(float x) { return sqrtf(x); }
TLDSL_DEV double sqrt_(double x) { return sqrt(x); }
TLDSL_DEV float tanh_(float x) { return tanhf(x); }
TLDSL_DEV double tanh_(double x) { return tanh(x); }
TLDSL_DEV float erf_(float x) { return erff(x); }
TLDSL_DEV double erf_(double x) { return erf(x); }
// 1 / (1 + e^-x): 0 where e^-x overflows
template <class T>
TLDSL_DEV T sigmoid(T x) {
  return div(T(1), add(T(1), exp_(-x)));
}
// 1 / sqrt(x), both correctly rounded (the simulator's two roundings; inf at 0, NaN below)
template <class T>
TLDSL_DEV T rsqrt(T x) {
  return div(T(1), sqrt_(x));
}
template <class T>
TLDSL_DEV T recip(T x) {
  return div(T(1), x);
}

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
