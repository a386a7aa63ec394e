// tldsl: the element math of tile programs (tldsl::gen), as the simulator's numpy rules compute it:
// 16-bit floats compute in float and round at every op, float arithmetic is explicitly rounded
// (never contracted into an FMA), i32 wraps, integer division by zero gives 0, maximum / minimum
// propagate NaN, floor division and modulo of floats follow numpy's divmod, values that mix i32
// and float compute in double, float -> i32 as numpy on x86. The general lowering's kernels
// (general.hpp) and the communication kernels with element math (recipes/sm_comm.py) include it;
// it needs only comm.hpp, not CuTe.
#pragma once

#include "tldsl/comm.hpp"

#if defined(TLDSL_HOST_EMULATION)
#include <math.h>
#include <stdint.h>

#include <mutex>
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

// -- tl.add_rows: one element added into memory (atomically on the GPU): the term rounded to the
// element's type, then added, the sum rounded ------------------------------------------------------
#if defined(TLDSL_HOST_EMULATION)
inline std::mutex& add_lock() {   // (the emulation's threads add into the same elements too)
  static std::mutex m;
  return m;
}
inline void add_to(float* p, float v) {
  std::lock_guard<std::mutex> g(add_lock());
  *p = *p + v;
}
inline void add_to(f16* p, float v) {   // (the term rounded first, as red.global.add takes it)
  std::lock_guard<std::mutex> g(add_lock());
  p->bits = comm::float_to_f16(get(*p) + get(put<f16>(v)));
}
inline void add_to(bf16* p, float v) {
  std::lock_guard<std::mutex> g(add_lock());
  p->bits = comm::float_to_bf16(get(*p) + get(put<bf16>(v)));
}
#else
TLDSL_DEV void add_to(float* p, float v) { atomicAdd(p, v); }
TLDSL_DEV void add_to(f16* p, float v) {
  asm volatile("red.global.add.noftz.f16 [%0], %1;" ::"l"(p), "h"(put<f16>(v).bits) : "memory");
}
TLDSL_DEV void add_to(bf16* p, float v) {
  asm volatile("red.global.add.noftz.bf16 [%0], %1;" ::"l"(p), "h"(put<bf16>(v).bits) : "memory");
}
TLDSL_DEV void red_pair(f16* p, unsigned bits) {     // (bits: p[0] low, p[1] high)
  asm volatile("red.global.add.noftz.f16x2 [%0], %1;" ::"l"(p), "r"(bits) : "memory");
}
TLDSL_DEV void red_pair(bf16* p, unsigned bits) {
  asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(p), "r"(bits) : "memory");
}
#endif

// Two adjacent elements p[0], p[1], each added where its flag says (as add_to): where both are and p
// is 4-byte aligned, one packed 16-bit pair reduction — sm_90 has scalar 16-bit reductions only as
// compare-and-swap loops (SASS ATOMG.E.CAS), its pairs as one REDG. Each element rounds as add_to's.
template <class T>
TLDSL_DEV void add_pair(T* p, float v0, float v1, bool add0, bool add1) {
#if !defined(TLDSL_HOST_EMULATION)
  if constexpr (sizeof(T) == 2) {
    if (add0 && add1 && (reinterpret_cast<unsigned long long>(p) & 3ull) == 0) {
      red_pair(p, unsigned(put<T>(v0).bits) | (unsigned(put<T>(v1).bits) << 16));
      return;
    }
  }
#endif
  if (add0) add_to(p, v0);
  if (add1) add_to(p + 1, v1);
}

}  // namespace gen
}  // namespace tldsl
