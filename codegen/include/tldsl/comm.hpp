// tldsl: device side of communication parts on SMs (codegen/recipes/sm_comm.py).
//
// A communication part becomes one persistent kernel: `lanes` CTAs, CTA b running tasks
// b, b + gridDim.x, ... of the communication schedule's task order. Every thread evaluates the
// part's index code (uniform across the CTA); data moves through the whole CTA:
//
//  * a *statement* (store, tile_push_data, tile_pull_data into a tensor) streams its tile in
//    chunks of V consecutive elements of one row (V * sizeof(T) >= 16 bytes): a batch of
//    chunks per thread is loaded first (16-byte vector loads where a chunk is in bounds and
//    aligned, element loads otherwise), then the element code of the tile expression runs and
//    the chunks are stored (16-byte vector stores, or element stores where clipped);
//  * loads outside a tensor read 0, stores outside it are dropped (the simulator's and TMA's
//    rule); a memory-to-memory copy moves only the elements inside both tensors;
//  * a wait is spun by thread 0 (acquire load at the wait's scope), then a CTA barrier;
//  * a notify is a CTA barrier, then thread 0 issues fence.acq_rel + a relaxed atomic add at
//    the notify's scope (a release pattern: everything the CTA wrote before it is visible to
//    whoever acquires the slot).
//
// Remote memory is plain loads and stores through a peer's mapping of a symmetric buffer (the
// kernel gets a table of W pointers per symmetric buffer it addresses on other ranks).
//
// TLDSL_HOST_EMULATION builds the same code with a host C++ compiler: CUDA's thread indices,
// __syncthreads and the PTX below become a small emulation (one std::thread per CUDA thread,
// a std::barrier per CTA), so the test suite can run generated kernels on the CPU.
#pragma once

#if defined(TLDSL_HOST_EMULATION)
#include <math.h>

#include <barrier>
#include <bit>
#include <cstring>

namespace tldsl_emu {
struct Dim3u {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3u thread_idx, block_idx, block_dim, grid_dim;
inline thread_local std::barrier<>* cta_barrier = nullptr;
}  // namespace tldsl_emu

#define threadIdx tldsl_emu::thread_idx
#define blockIdx tldsl_emu::block_idx
#define blockDim tldsl_emu::block_dim
#define gridDim tldsl_emu::grid_dim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
inline void __syncthreads() { tldsl_emu::cta_barrier->arrive_and_wait(); }
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned i;
  std::memcpy(&i, &f, 4);
  return i;
}
#define TLDSL_DEV inline
#else
#define TLDSL_DEV __device__ __forceinline__
#endif

#include "tldsl/signals.hpp"

namespace tldsl {
namespace comm {

// Storage types of 16-bit floats (bit patterns; arithmetic happens in float).
struct f16 {
  unsigned short bits;
};
struct bf16 {
  unsigned short bits;
};

// -- conversions (round to nearest even, as numpy and the simulator do) ----------------------

TLDSL_DEV float bf16_to_float(unsigned short b) { return __uint_as_float(unsigned(b) << 16); }

#if defined(TLDSL_HOST_EMULATION)
inline float f16_to_float(unsigned short h) { return float(std::bit_cast<_Float16>(h)); }
inline unsigned short float_to_f16(float f) { return std::bit_cast<unsigned short>(static_cast<_Float16>(f)); }
inline unsigned short float_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;   // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
#else
TLDSL_DEV float f16_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
TLDSL_DEV unsigned short float_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
TLDSL_DEV unsigned short float_to_bf16(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif

// Elem<T>: storage type T <-> the type tile math runs in (float for floats, int, bool).
template <class T>
struct Elem;
template <>
struct Elem<float> {
  using C = float;
  static TLDSL_DEV float get(float x) { return x; }
  static TLDSL_DEV float put(float x) { return x; }
};
template <>
struct Elem<f16> {
  using C = float;
  static TLDSL_DEV float get(f16 x) { return f16_to_float(x.bits); }
  static TLDSL_DEV f16 put(float x) { return f16{float_to_f16(x)}; }
};
template <>
struct Elem<bf16> {
  using C = float;
  static TLDSL_DEV float get(bf16 x) { return bf16_to_float(x.bits); }
  static TLDSL_DEV bf16 put(float x) { return bf16{float_to_bf16(x)}; }
};
template <>
struct Elem<int> {
  using C = int;
  static TLDSL_DEV int get(int x) { return x; }
  static TLDSL_DEV int put(int x) { return x; }
};

// A tile value of a 16-bit float type, rounded as the IR's type says (math ran in float).
TLDSL_DEV float round_f16(float x) { return f16_to_float(float_to_f16(x)); }
TLDSL_DEV float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// -- exact float arithmetic: explicitly rounded, never contracted into an FMA (numpy's results) --

#if defined(TLDSL_HOST_EMULATION)
inline float fadd(float a, float b) { return a + b; }
inline float fsub(float a, float b) { return a - b; }
inline float fmul(float a, float b) { return a * b; }
inline float fdiv(float a, float b) { return a / b; }
// PTX's max.NaN / min.NaN: NaN wins, -0 below +0 (IEEE 754-2019; the simulator's too)
inline float fmax_nan(float a, float b) {
  return a != a ? a : (b != b ? b : (a == 0.0f && b == 0.0f ? (signbit(a) ? b : a) : (a > b ? a : b)));
}
inline float fmin_nan(float a, float b) {
  return a != a ? a : (b != b ? b : (a == 0.0f && b == 0.0f ? (signbit(a) ? a : b) : (a < b ? a : b)));
}
#else
// one PTX instruction each: NAME(a, b) is INSTR a, b
#define TLDSL_F32_BINARY(NAME, INSTR)                                  \
  TLDSL_DEV float NAME(float a, float b) {                             \
    float d;                                                           \
    asm(INSTR " %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));              \
    return d;                                                          \
  }
TLDSL_F32_BINARY(fadd, "add.rn.f32")
TLDSL_F32_BINARY(fsub, "sub.rn.f32")
TLDSL_F32_BINARY(fmul, "mul.rn.f32")
TLDSL_F32_BINARY(fdiv, "div.rn.f32")
// numpy's maximum / minimum: NaN wins (one instruction where the portable form takes four)
TLDSL_F32_BINARY(fmax_nan, "max.NaN.f32")
TLDSL_F32_BINARY(fmin_nan, "min.NaN.f32")
#undef TLDSL_F32_BINARY
#endif
TLDSL_DEV int iadd(int a, int b) { return int(unsigned(a) + unsigned(b)); }   // i32 wraps
TLDSL_DEV int isub(int a, int b) { return int(unsigned(a) - unsigned(b)); }
TLDSL_DEV int imul(int a, int b) { return int(unsigned(a) * unsigned(b)); }

// -- chunks: V consecutive elements of one row ------------------------------------------------

// Raw bits of a storage type (in the low 16 or 32 bits of an unsigned).
template <class T>
struct Bits;
template <>
struct Bits<float> {
  static TLDSL_DEV unsigned to(float x) { return __float_as_uint(x); }
  static TLDSL_DEV float from(unsigned b) { return __uint_as_float(b); }
};
template <>
struct Bits<int> {
  static TLDSL_DEV unsigned to(int x) { return unsigned(x); }
  static TLDSL_DEV int from(unsigned b) { return int(b); }
};
template <>
struct Bits<f16> {
  static TLDSL_DEV unsigned to(f16 x) { return x.bits; }
  static TLDSL_DEV f16 from(unsigned b) { return f16{(unsigned short)b}; }
};
template <>
struct Bits<bf16> {
  static TLDSL_DEV unsigned to(bf16 x) { return x.bits; }
  static TLDSL_DEV bf16 from(unsigned b) { return bf16{(unsigned short)b}; }
};

// V elements held as 32-bit words. Elements are reached with constant indices once the
// element loops are unrolled, and nothing takes the chunk's address, so chunks live in
// registers (type punning through a pointer would put them on the stack).
template <class T, int V>
struct Chunk {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "2- and 4-byte elements");
  static constexpr int kWords = (V * int(sizeof(T)) + 3) / 4;
  unsigned w[kWords];

  TLDSL_DEV T get(int e) const {
    if constexpr (sizeof(T) == 4) {
      return Bits<T>::from(w[e]);
    } else {
      return Bits<T>::from((w[e >> 1] >> ((e & 1) * 16)) & 0xffffu);
    }
  }
  TLDSL_DEV void set(int e, T v) {
    if constexpr (sizeof(T) == 4) {
      w[e] = Bits<T>::to(v);
    } else {
      const int sh = (e & 1) * 16;
      w[e >> 1] = (w[e >> 1] & ~(0xffffu << sh)) | (Bits<T>::to(v) << sh);
    }
  }
};

template <class T, int V>
TLDSL_DEV void ld_vec(Chunk<T, V>& out, const T* p) {
  static_assert((V * sizeof(T)) % 16 == 0, "a chunk is a whole number of 16-byte vectors");
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int k = 0; k < Chunk<T, V>::kWords / 4; ++k) {
    const uint4 x = q[k];
    out.w[4 * k] = x.x;
    out.w[4 * k + 1] = x.y;
    out.w[4 * k + 2] = x.z;
    out.w[4 * k + 3] = x.w;
  }
}

template <class T, int V>
TLDSL_DEV void st_vec(T* p, const Chunk<T, V>& in) {
  uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int k = 0; k < Chunk<T, V>::kWords / 4; ++k) {
    uint4 x;
    x.x = in.w[4 * k];
    x.y = in.w[4 * k + 1];
    x.z = in.w[4 * k + 2];
    x.w = in.w[4 * k + 3];
    q[k] = x;
  }
}

// Load columns [col, col + V) of a row. `row`: the row's first element, nullptr when the row
// is outside the tensor; `ncols`: the row's length; `limit`: how many of the V columns belong
// to the tile; `vec_ok`: the tensor's row pitch and the access's column offset are multiples
// of V (so an in-bounds chunk is 16-byte aligned). Elements outside read as 0. Returns the
// mask of elements that were inside the tensor (bit e: column col + e).
template <class T, int V>
TLDSL_DEV unsigned load_chunk(Chunk<T, V>& out, const T* row, int col, int ncols, int limit, bool vec_ok) {
  if (row != nullptr && vec_ok && limit >= V && col >= 0 && col + V <= ncols) {
    ld_vec<T, V>(out, row + col);
    return (V >= 32) ? ~0u : ((1u << V) - 1u);
  }
  unsigned mask = 0;
#pragma unroll
  for (int k = 0; k < Chunk<T, V>::kWords; ++k) out.w[k] = 0u;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int cc = col + e;
    if (row != nullptr && e < limit && cc >= 0 && cc < ncols) {
      out.set(e, row[cc]);
      mask |= 1u << e;
    }
  }
  return mask;
}

// Store columns [col, col + V) of a row (nullptr: outside the tensor, dropped); only elements in
// `mask`, among the first `limit`, inside the row.
template <class T, int V>
TLDSL_DEV void store_chunk(T* row, int col, int ncols, int limit, bool vec_ok, unsigned mask,
                           const Chunk<T, V>& in) {
  if (row == nullptr) return;
  const unsigned full = (V >= 32) ? ~0u : ((1u << V) - 1u);
  if (vec_ok && (mask & full) == full && limit >= V && col >= 0 && col + V <= ncols) {
    st_vec<T, V>(row + col, in);
    return;
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const int cc = col + e;
    if (((mask >> e) & 1u) && e < limit && cc >= 0 && cc < ncols) row[cc] = in.get(e);
  }
}

// A zero of each element type at an address that is always valid: what load_elem reads
// outside the tensor.
#if defined(TLDSL_HOST_EMULATION)
template <class T>
inline const T kZeroElem{};
#else
template <class T>
__device__ const T kZeroElem{};
#endif

// One element (0 outside the tensor). The load's address is always valid — the element, or the
// zero above — so a load the compiler runs before knowing whether it is needed cannot fault (on
// an H200 a guarded `cond ? row[col] : 0` read through a null row pointer:
// CUDA_ERROR_ILLEGAL_ADDRESS).
template <class T>
TLDSL_DEV T load_elem(const T* row, int col, int ncols) {
  const bool inside = row != nullptr && col >= 0 && col < ncols;
  return *(inside ? row + col : &kZeroElem<T>);
}

// A value the optimizer cannot see through (so code depending on it is not hoisted above here).
#if defined(TLDSL_HOST_EMULATION)
inline int opaque(int x) { return x; }
#else
TLDSL_DEV int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
#endif

// -- signals, for a whole CTA -----------------------------------------------------------------

// Acquire: thread 0 spins until *slot >= target, then the CTA meets (nothing after runs earlier).
template <int S>
TLDSL_DEV void cta_wait(const unsigned long long* slot, unsigned long long target) {
  if (threadIdx.x == 0) wait_at_least<S>(slot, target);
  __syncthreads();
}

// Release: the CTA meets (every thread's writes are done), then thread 0 fences and adds 1.
template <int S>
TLDSL_DEV void cta_notify(unsigned long long* slot) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel<S>();
    red_relaxed_add<S>(slot, 1ull);
  }
}

}  // namespace comm
}  // namespace tldsl
