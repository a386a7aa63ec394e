// tldsl: grouped GEMMs over run-time tile tables (MoE) and a row-gather combine, for Hopper
// (sm_90a). Instantiated by the grouped_gemm and combine recipes (codegen/recipes/); reuses the
// GEMM pieces of sm90_gemm.hpp as they are (GemmTraits' shared-memory map and GMMA descriptors,
// the swizzle, the WGMMA call, the epilogue stores, the tile order) and the signal primitives
// of signals.hpp (the generated hooks' waits, release fence and relaxed adds).
//
// 1. grouped_gemm_kernel — per output tile (pid0, pid1) of a 2-D grid, visited persistently
//    in the schedule's order:
//      if (!prog.active(pid0, pid1))  ->  skip, or store zeros (Cfg::kStoreInactive)
//      prog.waits(pid0, pid1, lane, n)    acquire spins (the tile program's prologue), the
//                                         iterations of its waiting loops shared by n lanes
//      acc = sum_k A_tile(k) @ B[prog.batch(pid0, pid1)](k, pid1)
//      prog.late_waits(pid0, pid1, lane, n)  (Prog::kHasLateWaits, rows added into C: the consumers')
//      C[pid0*BM.., pid1*BN..] = acc      TMA store, converted to C's type
//      prog.notifies(pid0, pid1)          release adds, after the stores completed
//    A is either dense (TMA 2-D, like sm90::gemm_kernel) or *gathered* (Cfg::kGather): tile
//    row r is row prog.row(pid0, pid1, r) of A (negative or >= kM: zeros), copied by the
//    producer warpgroup's 128 threads with 16-byte cp.async (zero-fill for invalid rows and
//    columns >= K) into the same 128/64/32-byte swizzled K-major layout a TMA load produces,
//    so the consumers' GMMA descriptors are the GEMM's. Hopper has no TMA gather. The producer
//    threads' instruction stream bounds the gather (BENCHMARKS.md, thirty-seventh session), so a
//    copy is kept to three instructions where a stage's rows all lie in A: a row's offset
//    (computed once a tile) added onto the stage's base (LEA, LEA.HI.X) and an unpredicated
//    cp.async at an immediate shared offset; a half tile's producer copies its 64 rows only.
//    B is [K, N] (TMA 2-D) or [E, K, N] (Cfg::kBatched, TMA 3-D with a box of 1 along E: the
//    expert's weights, out-of-range experts/rows/cols read zero).
//    Consumers: warpgroup w owns rows [w*BM/2, (w+1)*BM/2) of the tile, or, with Cfg::kSplitN
//    (BM = 64: smaller tiles for small experts), columns [w*BN/2, (w+1)*BN/2) of all 64 rows —
//    both read the stage's one A tile, each its half of B. Ping-pong (Cfg::kPingPong: 128 x 128
//    tiles, A by TMA): each warpgroup owns whole tiles, the CTA's tiles alternating between the
//    two, and they take turns at the K loop (named barriers 6 + w): one hands the other its turn
//    once its tile's WGMMAs are issued, then stores that tile while the other computes. (Measured
//    on one H200 at 128 x 128, MoE+ReduceScatter's grouped GEMM: 10-16 % faster than both
//    warpgroups sharing each tile on the small-expert rows, 5 % on Mixtral's; about the speed of
//    the shared 128 x 256 tile. BENCHMARKS.md, twenty-eighth session.)
//
//    Stage ring (full/empty mbarriers, as in sm90_gemm.hpp). With a gathered A, the full
//    barrier of a stage expects 1 + 128 arrivals: the TMA thread's arrive.expect_tx (B's
//    bytes) and one `cp.async.mbarrier.arrive.noinc` per producer thread, which fires when
//    that thread's cp.asyncs have landed. cp.async writes shared memory through the generic
//    proxy and WGMMA reads it through the async proxy, so consumers issue
//    fence.proxy.async.shared::cta after the full-barrier wait and before the WGMMAs.
//
//    Clusters (Cfg::kClusterM = 2): the two CTAs take tiles (2*cm, n) and (2*cm + 1, n) of a
//    cluster tile (cm, n), the order walking cluster tiles as sm90::gemm_kernel's does. Both read
//    both guards and experts (PairTile): the pair runs its K loop when either guard holds, in
//    step (a stage is released on both CTAs, so each empty barrier counts both CTAs' consumers);
//    when both hold on the same expert each CTA loads half of B's chunks and multicasts them
//    into both CTAs' stage, else each loads its own B; a CTA whose guard is false arrives on its
//    full barriers without loading and its consumers pass the stages on (no waits, no WGMMAs).
//
//    Waits: with a gathered A one producer thread spins (acquire), then a named barrier
//    over the producer warpgroup orders every thread's cp.async after it (a CTA barrier
//    after an acquire, as CUTLASS's generic barrier does); the TMA thread then issues
//    fence.proxy.async.global before its TMA loads.
//    Notifies: every consumer warpgroup that stored the tile waits for its TMA stores to
//    complete (cp.async.bulk.wait_group 0) and fences the async proxy; then (cooperative) all
//    consumers meet at a named barrier and one thread runs the notifies, or (ping-pong) the
//    tile's warpgroup's thread 0 runs them (one fence.acq_rel, then relaxed red.adds).
//    Deferred (kDeferNotifies: a part that notifies and never waits): a tile's notifies run
//    once its warpgroup's *next* tile's K loop is done (ping-pong: two of the CTA's tiles later),
//    when its stores have long completed, so the consumers never wait for a store's round trip;
//    and with a TMA producer and no side program, warp 1 of the producer warpgroup runs them
//    (kNotifierWarp): each storing warpgroup's thread 0, its stores complete and fenced, arrives
//    on a ring slot (Tr::kNotifySlots full/empty mbarriers: one ring, or one of kNotifySlots / 2
//    per warpgroup in ping-pong) the notifier waits on, so neither the fence.acq_rel nor the
//    adds hold up a consumer; its 32 lanes share a tile's adds (Prog::notifies_lanes: each lane
//    fences, then takes every 32nd iteration of the outermost notify loops). A part whose notifies all sit
//    inside its guard (Prog::kNotifiesGuarded) hands over only the tiles the guard lets through.
//    Waiting parts notify at once: their next tile may wait on what this one releases.
//    (Measured on one H200, MoE+ReduceScatter's grouped GEMM at Qwen3-30B's shape: 0.286 ms
//    notifying at once, 0.215 ms with no notifies at all, 0.237-0.273 deferred; BENCHMARKS.md,
//    twenty-seventh session: what is left is the hand-over, not the notifier's fence or adds.)
//
//    A side program (Side::kEnabled; A by TMA only): a row-gather part folded in (an MoE
//    combine behind the GEMM, or the row gather that stages A ahead of it). Warps 1-3 of the
//    producer warpgroup, idle where one thread issues the TMA loads, run its tiles
//    (combine_tiles, 96 threads, named barrier 5) while the GEMM's run, each once its waits
//    hold — in this or any other CTA. The two wait on each other one way at most (the planner
//    refuses a cycle): either the side never waits for the GEMM's tiles or the GEMM never for
//    the side's, so neither's progress depends on a tile queued behind its own; the CTA ends
//    when both are done.
//
// 2. combine_kernel — a plain (non-tensor-core) kernel for
//      acc = fill; for k in loop: acc += gather_rows(Y, rows(k), col) * scale(k)
//      store(OUT, (row0, col0), acc); notifies
//    Each thread owns 1, 2, 4 or 8 consecutive columns of a tile row (vector loads/stores, fp32 math);
//    the generated Prog::body() holds the per-row index and scale expressions. Waits: one
//    thread spins, then __syncthreads(); notifies: __syncthreads(), then one thread releases.
#pragma once

#include "tldsl/grouped_tiles.hpp"
#include "tldsl/sm90_gemm.hpp"

namespace tldsl {
namespace grouped {

using sm90::cdiv;

// ---- primitives -------------------------------------------------------------------------------

// 16-byte global -> shared copy (cp.async, L2 only); `valid == false` writes 16 zero bytes and
// reads nothing (src-size 0).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem, bool valid) {
  const uint32_t src_bytes = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes)
               : "memory");
}

// The same copy, always whole: no source-size operand, nothing to predicate (a stage whose rows
// are all read takes this one).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem) : "memory");
}

// A pointer the optimizer cannot see through: a stage's base, so that each row's address is formed
// from it (one 64-bit add) where it is used, not hoisted out of the K loop as one 64-bit pointer a row.
template <class T>
__device__ __forceinline__ const T* opaque_ptr(const T* p) {
  const T* q;
  asm volatile("mov.b64 %0, %1;" : "=l"(q) : "l"(p));
  return q;
}

// Arrive on `bar` once this thread's earlier cp.asyncs completed (no pending-count increment:
// the barrier's expected count includes this arrival).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(cute::cast_smem_ptr_to_uint(bar))
               : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Coherent global loads (ld.global, never the non-coherent .nc path): for tensors another part
// of the kernel writes while this one runs (read after a wait). Tables the host filled before
// the launch are read with plain C++ loads (the compiler may use .nc for them).
__device__ __forceinline__ int ld_coherent(const int* p) {
  int v;
  asm volatile("ld.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float ld_coherent(const float* p) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ __half ld_coherent(const __half* p) {
  unsigned short v;
  asm volatile("ld.global.b16 %0, [%1];\n" : "=h"(v) : "l"(p) : "memory");
  return __ushort_as_half(v);
}
__device__ __forceinline__ __nv_bfloat16 ld_coherent(const __nv_bfloat16* p) {
  unsigned short v;
  asm volatile("ld.global.b16 %0, [%1];\n" : "=h"(v) : "l"(p) : "memory");
  return __ushort_as_bfloat16(v);
}
__device__ __forceinline__ float4 ld_coherent_v4(const float* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ uint2 ld_coherent_v2(const void* p) {
  uint2 v;
  asm volatile("ld.global.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}

// Element reads for the generated per-row expressions: out-of-bounds reads zero (the
// simulator's tile-load semantics).
__device__ __forceinline__ float value_of(float x) { return x; }
__device__ __forceinline__ float value_of(__half x) { return __half2float(x); }
__device__ __forceinline__ float value_of(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ int value_of(int x) { return x; }   // i32 tables stay integers

template <bool kCoherent, class T>
__device__ __forceinline__ auto ld_elem(const T* p, long long i) -> decltype(value_of(T())) {
  if constexpr (kCoherent) return value_of(ld_coherent(p + i));
  else return value_of(p[i]);
}
template <bool kCoherent = false, class T>
__device__ __forceinline__ auto ld1(const T* p, int i, int n) -> decltype(value_of(T())) {
  return (unsigned)i < (unsigned)n ? ld_elem<kCoherent>(p, i) : decltype(value_of(T()))(0);
}
template <bool kCoherent = false, class T>
__device__ __forceinline__ auto ld2(const T* p, int i, int j, int n0, int n1) -> decltype(value_of(T())) {
  return ((unsigned)i < (unsigned)n0 && (unsigned)j < (unsigned)n1) ? ld_elem<kCoherent>(p, (long long)i * n1 + j)
                                                                    : decltype(value_of(T()))(0);
}

// 4 consecutive elements of row `row`, columns [col, col + 4), as fp32; zeros where the row is
// negative or >= rows, or the columns are >= cols (cols % 4 == 0 and col % 4 == 0: the 4 are
// all in or all out). Coherent loads: the gathered rows are typically written by another part
// (the grouped GEMM) while this kernel runs.
template <class T>
__device__ __forceinline__ void load4(const T* p, int row, int rows, int col, int cols, float (&x)[4]);
template <>
__device__ __forceinline__ void load4<float>(const float* p, int row, int rows, int col, int cols,
                                             float (&x)[4]) {
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
    const float4 v = ld_coherent_v4(p + (long long)row * cols + col);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
  } else {
    x[0] = x[1] = x[2] = x[3] = 0.0f;
  }
}
template <>
__device__ __forceinline__ void load4<__half>(const __half* p, int row, int rows, int col, int cols,
                                              float (&x)[4]) {
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
    const uint2 v = ld_coherent_v2(p + (long long)row * cols + col);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
    x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
  } else {
    x[0] = x[1] = x[2] = x[3] = 0.0f;
  }
}
template <>
__device__ __forceinline__ void load4<__nv_bfloat16>(const __nv_bfloat16* p, int row, int rows, int col,
                                                     int cols, float (&x)[4]) {
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
    const uint2 v = ld_coherent_v2(p + (long long)row * cols + col);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
    x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
  } else {
    x[0] = x[1] = x[2] = x[3] = 0.0f;
  }
}

// Store 4 fp32 values to row `row`, columns [col, col + 4), converted; out-of-bounds: dropped.
template <class T>
__device__ __forceinline__ void store4(T* __restrict__ p, int row, int rows, int col, int cols, const float (&x)[4]);
template <>
__device__ __forceinline__ void store4<float>(float* __restrict__ p, int row, int rows, int col, int cols,
                                              const float (&x)[4]) {
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols)
    *reinterpret_cast<float4*>(p + (long long)row * cols + col) = make_float4(x[0], x[1], x[2], x[3]);
}
template <>
__device__ __forceinline__ void store4<__half>(__half* __restrict__ p, int row, int rows, int col, int cols,
                                               const float (&x)[4]) {
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
    __half2 a = __floats2half2_rn(x[0], x[1]), b = __floats2half2_rn(x[2], x[3]);
    uint2 v;
    v.x = *reinterpret_cast<uint32_t*>(&a);
    v.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p + (long long)row * cols + col) = v;
  }
}
template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* __restrict__ p, int row, int rows, int col,
                                                      int cols, const float (&x)[4]) {
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
    __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
    uint2 v;
    v.x = *reinterpret_cast<uint32_t*>(&a);
    v.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p + (long long)row * cols + col) = v;
  }
}

// N consecutive elements as fp32, N the combine's width: 8 16-bit ones (one coherent 16-byte load)
// where the gathered rows are 16-bit and every column offset a multiple of 8, 4 (load4), or 1 or 2
// (load_narrow) where the columns are no multiple of 4.
__device__ __forceinline__ uint4 ld_coherent_v4b32(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ float2 pair_to_float2(uint32_t w, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 pair_to_float2(uint32_t w, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
__device__ __forceinline__ uint32_t float2_to_pair(float a, float b, __half) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t float2_to_pair(float a, float b, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 1 or 2 consecutive elements as fp32 (one coherent load of 2 to 8 bytes): the width of a combine
// whose columns are no multiple of 4. Zeros out of bounds (cols % N == 0, col % N == 0).
template <int N, class T>
__device__ __forceinline__ void load_narrow(const T* p, int row, int rows, int col, int cols, float (&x)[N]) {
  static_assert(N == 1 || N == 2, "narrow gathers are 1 or 2 elements");
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
    const T* q = p + (long long)row * cols + col;
    if constexpr (N == 1) {
      x[0] = value_of(ld_coherent(q));
    } else if constexpr (sizeof(T) == 4) {
      const uint2 v = ld_coherent_v2(q);
      x[0] = __uint_as_float(v.x);
      x[1] = __uint_as_float(v.y);
    } else {
      const float2 f = pair_to_float2((uint32_t)ld_coherent(reinterpret_cast<const int*>(q)), T());
      x[0] = f.x;
      x[1] = f.y;
    }
  } else {
#pragma unroll
    for (int q = 0; q < N; ++q) x[q] = 0.0f;
  }
}

// Store 1 or 2 fp32 values to row `row`, columns [col, col + N), converted; out of bounds: dropped.
template <int N, class T>
__device__ __forceinline__ void store_narrow(T* __restrict__ p, int row, int rows, int col, int cols,
                                             const float (&x)[N]) {
  static_assert(N == 1 || N == 2, "narrow stores are 1 or 2 elements");
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
    T* q = p + (long long)row * cols + col;
    if constexpr (sizeof(T) == 4) {
      if constexpr (N == 1) q[0] = x[0];
      else *reinterpret_cast<float2*>(q) = make_float2(x[0], x[1]);
    } else if constexpr (N == 2) {
      *reinterpret_cast<uint32_t*>(q) = float2_to_pair(x[0], x[1], T());
    } else if constexpr (cuda::std::is_same_v<T, __half>) {
      q[0] = __float2half_rn(x[0]);
    } else {
      q[0] = __float2bfloat16_rn(x[0]);
    }
  }
}

template <int N, class T>
__device__ __forceinline__ void loadv(const T* p, int row, int rows, int col, int cols, float (&x)[N]) {
  if constexpr (N <= 2) {
    load_narrow<N, T>(p, row, rows, col, cols, x);
  } else if constexpr (N == 4) {
    load4<T>(p, row, rows, col, cols, x);
  } else {
    static_assert(N == 8 && sizeof(T) == 2, "8-wide gathers are 16-byte loads of 16-bit elements");
    if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
      const uint4 v = ld_coherent_v4b32(p + (long long)row * cols + col);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = pair_to_float2(w[q], T());
        x[2 * q] = f.x;
        x[2 * q + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int q = 0; q < 8; ++q) x[q] = 0.0f;
    }
  }
}

// Store N (1, 2, 4 or 8) fp32 values to row `row`, columns [col, col + N), converted; out of bounds: dropped.
template <int N, class T>
__device__ __forceinline__ void storev(T* __restrict__ p, int row, int rows, int col, int cols, const float (&x)[N]) {
  if constexpr (N <= 2) {
    store_narrow<N, T>(p, row, rows, col, cols, x);
  } else if constexpr (N == 4) {
    store4<T>(p, row, rows, col, cols, x);
  } else {
    static_assert(N == 8, "the combine stores 1, 2, 4 or 8 columns a thread");
    if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols) {
      if constexpr (sizeof(T) == 4) {
        float4* q = reinterpret_cast<float4*>(p + (long long)row * cols + col);
        q[0] = make_float4(x[0], x[1], x[2], x[3]);
        q[1] = make_float4(x[4], x[5], x[6], x[7]);
      } else {
        uint4 v;
        v.x = float2_to_pair(x[0], x[1], T());
        v.y = float2_to_pair(x[2], x[3], T());
        v.z = float2_to_pair(x[4], x[5], T());
        v.w = float2_to_pair(x[6], x[7], T());
        *reinterpret_cast<uint4*>(p + (long long)row * cols + col) = v;
      }
    }
  }
}

// ---- grouped GEMM -----------------------------------------------------------------------------

// Cfg: everything sm90::GemmTraits reads, plus
//   kGather (bool: A rows gathered by Prog::row with cp.async), kBatched (bool: B is [E, K, N]),
//   kStoreInactive (bool: tiles whose guard is false store zeros instead of nothing),
//   kM (rows of A: gathered rows >= kM read zero), kK, kGridM, kGridN (the part's grid),
//   kPairRows (bool: the program's tiles have 64 rows and the CTA's 128 — two program tiles of one
//   expert run as one CTA tile, see pair_tile).
template <class Cfg>
struct GroupedTraits : sm90::GemmTraits<Cfg> {
  using Base = sm90::GemmTraits<Cfg>;
  static constexpr int kUnitsA = Base::BK * Base::kElemBytes / 16;     // 16-byte units per A row per stage
  static constexpr int kUnitsPerChunkA = Base::SA / 16;                // ... per swizzle chunk
  static constexpr int kProducerThreads = 128;
  static constexpr int kRowStep = kProducerThreads / kUnitsA;           // rows one cp.async pass covers
  static constexpr int kRowsPerThread = Base::BM / kRowStep;            // gathered rows per producer thread
  static_assert(!Cfg::kGather || kRowsPerThread <= 32, "a thread's gathered rows: one bit each of a 32-bit mask");
  // a gathered element's offset in A: 32 bits where every one formed fits — the largest, a last row's
  // 16 bytes of the last K step, is below kM * kK + BK
  static constexpr bool kOffsets32 = (long long)Cfg::kM * Cfg::kK + Base::BK < (1ll << 31);
  using GatherOffset = cuda::std::conditional_t<kOffsets32, unsigned, long long>;   // (unsigned: a zero-extending add)
  // the rows one thread copies lie kRowStep apart: where that is a multiple of the swizzle's 8-row
  // period, they share one swizzled column, so row i's shared address is the first's + a constant
  static constexpr bool kRowsShareSwizzle = kRowStep % 8 == 0;
  // a thread's rows a half tile reads (its first 64): row i is row0 + i * kRowStep with row0 < kRowStep,
  // so where kRowStep divides 64 they are the first 64 / kRowStep; else none is skipped
  static constexpr int kHalfRowsPerThread = 64 % kRowStep == 0 ? 64 / kRowStep : kRowsPerThread;
  static constexpr int kTxBytes = (Cfg::kGather ? 0 : Base::kStageBytesA) + Base::kStageBytesB;
  static constexpr int kFullArrivals = Cfg::kGather ? 1 + kProducerThreads : 1;
  static constexpr uint32_t kProducerBarrier = 3, kConsumersBarrier = 4;  // named barriers (1, 2: epilogues)
  static_assert(!Cfg::kGather || (kProducerThreads % kUnitsA == 0 && Base::BM % kRowStep == 0),
                "the gather's thread mapping needs BK/8 to divide 128 and BM to be a multiple of 128/(BK/8)");
  static_assert(Cfg::kK % 8 == 0, "16-byte rows: K must be a multiple of 8");
  static_assert(Cfg::kM > 0 && Cfg::kGridM > 0 && Cfg::kGridN > 0, "empty grouped GEMM");
};

// B's (BK x BN) tile of expert `e` at (k0, n0) into stage `sb`, completing on `bar`: all chunks by
// this CTA, or (`shared`, clusters) the chunks c with c % kClusterM == cl_rank, multicast into the
// same stage of both CTAs (the partner loads the others). K-major B (Tr::kBKMajor, B stored [N, K] or
// [E, N, K]): chunk c is BN rows of EB columns of K at (n0, k0 + c * EB).
template <class Cfg, class Tr>
__device__ __forceinline__ void load_b(const cute::TmaDescriptor* tma_b, uint64_t* bar, unsigned char* sb, int n0,
                                       int k0, int e, bool shared, int cl_rank) {
  constexpr uint64_t kCacheHint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  constexpr int kCl = Cfg::kClusterM;
  constexpr uint16_t kMask = uint16_t((1u << kCl) - 1u);
#pragma unroll
  for (int c = 0; c < Tr::kChunksB; ++c) {
    unsigned char* dst = sb + c * Tr::kChunkBytesB;
    // the box's coordinates, innermost first: (n, k) of an MN-major B, (k, n) of a K-major one
    const int x = Tr::kBKMajor ? k0 + c * Tr::EB : n0 + c * Tr::EB;
    const int y = Tr::kBKMajor ? n0 : k0;
    if (kCl > 1 && shared) {
      if (c % kCl == cl_rank) {
        if constexpr (Cfg::kBatched)
          cute::SM90_TMA_LOAD_MULTICAST_3D::copy(tma_b, bar, kMask, kCacheHint, dst, x, y, e);
        else
          cute::SM90_TMA_LOAD_MULTICAST_2D::copy(tma_b, bar, kMask, kCacheHint, dst, x, y);
      }
    } else if constexpr (Cfg::kBatched) {
      cute::SM90_TMA_LOAD_3D::copy(tma_b, bar, kCacheHint, dst, x, y, e);
    } else {
      cute::SM90_TMA_LOAD_2D::copy(tma_b, bar, kCacheHint, dst, x, y);
    }
  }
}

// Whether the consumers store tile p, and whether they notify for it: the consumers and the notifier warp
// skip the same tiles (ping-pong: the tile's warpgroup, and so its notify ring, is its index among them).
template <class Cfg>
__device__ __forceinline__ bool tile_stores(bool valid, bool active) {
  return valid && (active || Cfg::kStoreInactive);
}
template <class Cfg, class Prog>
__device__ __forceinline__ bool tile_notifies(bool valid, bool active) {
  return valid && Prog::kHasNotifies && (active || !Prog::kNotifiesGuarded);
}

// Ping-pong: hand the other consumer warpgroup its turn at the K loop (its named barrier `id`).
struct HandTurn {
  uint32_t id;
  __device__ __forceinline__ void operator()() const { cutlass::arch::NamedBarrier::arrive(256, id); }
};

// No side program: the producer warpgroup's spare warps idle.
struct NoSide {
  static constexpr bool kEnabled = false;
};
struct NoSideCfg {};

// A side program's tiles run on warps 1-3 of a TMA producer warpgroup (96 threads, named barrier 5).
constexpr int kSideThreads = 96, kSideBarrier = 5;

template <class SideCfg, int kThreads, int kBarrier, class Prog>
__device__ __forceinline__ void combine_tiles(int rank, const Prog& prog, int tid, int first, int step);

// 64 rows x kChunks * EC columns of C at (m0, n0) from one m64 block's accumulators — the block's row r
// is the tile's row `row0 + r`, stored as zero from the tile's row `valid` on (kZero: all of them, `acc`
// unread): registers -> swizzled smem -> TMA store, one 64 x EC chunk at a time through this
// warpgroup's epilogue buffers.
template <class Cfg, class Tr, int kChunks, bool kZero>
__device__ __forceinline__ void store_block(const cute::TmaDescriptor* tma_c, unsigned char* smem, uint32_t smem_u32,
                                            uint32_t epi0, int& epi_count, const float* acc, int m0, int n0,
                                            int row0, int valid,
                                            int tid, uint32_t bar_id) {
  const int lane = tid % 32, wq = tid / 32;
#pragma unroll
  for (int q = 0; q < kChunks; ++q) {
    const uint32_t buf = epi0 + (epi_count % Tr::kEpiBuffers) * Tr::kEpiBufBytes;
    if (tid == 0) sm90::bulk_wait_read<Tr::kEpiBuffers - 1>();   // the store that last used `buf` read it
    cutlass::arch::NamedBarrier::sync(128, bar_id);
    if constexpr (Tr::kOutBytes == 2 && (Tr::EC / 8) % 2 == 0) {
      // 16-bit C: stmatrix, two 8-column groups of the warp's 16 rows an instruction; a thread's
      // rows lane / 4 and + 8 stored, or zeros, by the tile's valid rows
      const auto keep = [&](int h) { return !kZero && row0 + wq * 16 + lane / 4 + 8 * h < valid; };
#pragma unroll
      for (int jj = 0; jj < Tr::EC / 8; jj += 2)
        sm90::stmatrix_pair<typename Cfg::ElemC, Tr::SC>(acc, q * (Tr::EC / 8) + jj, jj, buf, wq, lane, keep);
    } else {
#pragma unroll
      for (int jj = 0; jj < Tr::EC / 8; ++jj) {       // constant trip counts: acc stays in registers
        const int j = q * (Tr::EC / 8) + jj;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wq * 16 + lane / 4 + 8 * h;
          const int col = 8 * jj + 2 * (lane % 4);
          const uint32_t off = sm90::swizzle(uint32_t(row * Tr::SC + col * Tr::kOutBytes), Tr::SC);
          const bool keep = !kZero && row0 + row < valid;   // (no overflow: row0 + row < 256)
          sm90::store_pair<typename Cfg::ElemC>(buf + off, keep ? acc[4 * j + 2 * h] : 0.0f,
                                                keep ? acc[4 * j + 2 * h + 1] : 0.0f);
        }
      }
    }
    cute::tma_store_fence();               // generic-proxy smem writes -> visible to TMA
    cutlass::arch::NamedBarrier::sync(128, bar_id);
    if (tid == 0) {
      cute::SM90_TMA_STORE_2D::copy(tma_c, smem + (buf - smem_u32), n0 + q * Tr::EC, m0);
      cute::tma_store_arrive();              // commit this store as one bulk group
    }
    ++epi_count;
  }
}

// The row a tile row is added into (tl.add_rows), for a Prog that adds rows; -1 (none) otherwise.
template <class P>
__device__ __forceinline__ int row_target_of(const P& prog, int pm, int pn, int r) {
  if constexpr (P::kAddRows) return prog.row_target(pm, pn, r);
  else return -1;
}
// ... and the factor it is scaled by first (1 where the program scales nothing).
template <class P>
__device__ __forceinline__ float row_scale_of(const P& prog, int pm, int pn, int r) {
  if constexpr (P::kRowScale) return prog.row_scale(pm, pn, r);
  else return 1.0f;
}

// The kernel body. `tma_a` is unused (may be null) when A is gathered; `a` is unused when not.
// `side` (Side::kEnabled, TMA A only): a row-gather part whose tiles warps 1-3 of the producer
// warpgroup run while the GEMM's run — a combine chained after this GEMM (its waits are this
// GEMM's notifies: its tiles start as the GEMM's complete, not after the launch) or the row
// gather this GEMM is chained after (the GEMM's waits are its notifies: each GEMM tile starts as
// its rows are gathered, not after a launch of their own).
template <class Cfg, class SideCfg = NoSideCfg, class Prog, class Side = NoSide>
__device__ __forceinline__ void grouped_gemm_kernel(const cute::TmaDescriptor* tma_a,
                                                    const cute::TmaDescriptor* tma_b,
                                                    const cute::TmaDescriptor* tma_c,
                                                    const typename Cfg::ElemAB* __restrict__ a, int rank,
                                                    const Prog& prog, const Side& side = Side{}) {
  using Tr = GroupedTraits<Cfg>;
  static_assert(!(Side::kEnabled && Cfg::kGather), "a side program runs on a TMA producer's spare warps only");
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  constexpr uint64_t kCacheHint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);

  extern __shared__ unsigned char tldsl_smem_raw[];
  const uint32_t raw = cute::cast_smem_ptr_to_uint(tldsl_smem_raw);
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;
  unsigned char* smem = tldsl_smem_raw + pad;
  const uint32_t smem_u32 = raw + pad;
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Tr::kOffBar);
  uint64_t* empty_bar = full_bar + Tr::kStages;

  const int warp = int(threadIdx.x) / 32;
  const int wg = int(threadIdx.x) / 128;
  constexpr int kCl = Tr::kClusterM;
  constexpr int k_tiles = cdiv(Cfg::kK, Tr::BK);
  const int cl_rank = kCl > 1 ? int(cute::block_rank_in_cluster()) : 0;
  // the CTA's tiles (grouped_tiles.hpp: cluster tiles of the order, or slots of two paired program tiles)
  const TileWalk<Cfg> walk(int(blockIdx.x) / kCl, int(gridDim.x) / kCl, rank);
  constexpr bool kDeferNotifies = Prog::kHasNotifies && !Prog::kHasWaits;
  // Cfg::kHalfTiles: a tile whose program stores its rows from Prog::valid_rows() on as zeros, and which
  // has at most 64 valid rows, runs as a half tile — its 64 rows on both consumer warpgroups, each a
  // 64 x BN/2 WGMMA (Cfg::GmmaHalf) on its half of B's columns, or (ping-pong) on the tile's one
  // warpgroup as one m64 block instead of two — and stores its other 64 rows as zeros without
  // computing them (MoE experts whose last tile is at most half full: smaller M tiles, the layout
  // still in 128-row tiles; Cfg::kPairRows: a layout in 64-row tiles, see pair_tile)
  constexpr bool kHalf = Cfg::kHalfTiles;
  // rows of one of the part's tiles (Cfg::kPairRows: 64, a CTA tile holding one or two of them)
  constexpr int kTileRows = Cfg::kPairRows ? 64 : Tr::BM;
  static_assert(!Cfg::kPairRows || (kHalf && Tr::BM == 128 && !Tr::kPingPong && !Side::kEnabled &&
                                    Prog::kRowLimit),
                "paired program tiles: half tiles of 128-row CTA tiles, cooperative, nothing folded in");
  // Tr::kPingPong: each consumer warpgroup owns whole tiles — the CTA's tiles alternate between the two
  // (the j-th one it works on is warpgroup j % 2's), and the two take turns at the K loop (named barriers
  // kTurnBarrier + w): while one runs its tile's WGMMAs, the other stores its previous tile and runs its
  // notifies, so the tensor cores do not wait for an epilogue (small K: a few K steps per tile)
  constexpr bool kPP = Tr::kPingPong;
  // named barrier ids as cutlass::arch::NamedBarrier's static calls take them (it adds the barriers it
  // reserves): 6, 7 (1, 2: the epilogues, 3-5 elsewhere)
  constexpr uint32_t kTurnBarrier = 6;
  static_assert(kTurnBarrier + 1 + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount <
                    cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers,
                "the turn barriers must be hardware barriers");
  static_assert(!kHalf || (Prog::kRowLimit && !Tr::kSplitN && Tr::kConsumerWGs == 2 &&
                           (kPP ? Tr::MB == 2
                                : (Tr::MB == 1 && (Tr::BN / 2) % Tr::EC == 0 &&
                                   (Tr::kBKMajor || (Tr::BN / 2) % Tr::EB == 0)))),
                "half tiles: a row limit, 128-row tiles on two warpgroups, BN/2 whole C chunks and B chunks");
  static_assert(!kPP || (Tr::kConsumerWGs == 2 && Tr::MB * Tr::kAccPerBlock <= 128 && !Cfg::kGather),
                "ping-pong: two consumer warpgroups, a whole tile's accumulators on each, A by TMA");
  constexpr bool kNotifierWarp = kDeferNotifies && !Side::kEnabled && !Cfg::kGather;
  static_assert(Cfg::kNotifierWarp == kNotifierWarp, "host/device notifier warp mismatch (which notify hook exists)");
  // the notify ring: one for both warpgroups, or (ping-pong) one per warpgroup, kRingSlots slots each
  constexpr int kRingSlots = kPP ? Tr::kNotifySlots / 2 : Tr::kNotifySlots;
  static_assert(!kNotifierWarp || (kRingSlots > 0 && (!kPP || Tr::kNotifySlots % 2 == 0)),
                "the notifier warp needs the notify ring's barriers");
  uint64_t* notify_full = empty_bar + Tr::kStages;          // kNotifySlots each
  uint64_t* notify_empty = notify_full + Tr::kNotifySlots;

  if (threadIdx.x == 0) {
    if constexpr (!Cfg::kGather) cute::prefetch_tma_descriptor(tma_a);
    cute::prefetch_tma_descriptor(tma_b);
    cute::prefetch_tma_descriptor(tma_c);
    for (int s = 0; s < Tr::kStages; ++s) {
      FullBar::init(&full_bar[s], Tr::kFullArrivals);
      EmptyBar::init(&empty_bar[s], Tr::kWGsPerTile * kCl);    // both CTAs' consumers release a stage
    }
    for (int s = 0; s < Tr::kNotifySlots; ++s) {
      EmptyBar::init(&notify_full[s], Tr::kWGsPerTile);        // the storing warpgroups' stores are done
      EmptyBar::init(&notify_empty[s], 1);                     // the notifier has run the slot's notifies
    }
  }
  cutlass::arch::fence_barrier_init();
  if constexpr (kCl > 1) {
    cute::cluster_sync();                  // the partner's barriers exist before any multicast / remote arrive
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    // ---------------- producer warpgroup ----------------
    if constexpr (Cfg::kProducerRegs > 0) cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if constexpr (Cfg::kGather) {
      // all 128 threads gather A; thread 0 also runs the waits and issues B's TMA loads
      const int ptid = int(threadIdx.x);
      const int unit = ptid % Tr::kUnitsA, row0 = ptid / Tr::kUnitsA;
      const int chunk = unit / Tr::kUnitsPerChunkA, unit_in_chunk = unit % Tr::kUnitsPerChunkA;
      int it = 0;
      for (int u = walk.first; u < walk.end; u = walk.next(u)) {
        const PairTile p = pair_tile<Cfg, true>(prog, walk.tile(u), cl_rank);
        if (!p.run) continue;
        if constexpr (Prog::kHasWaits) {
          if (p.active) {
            if (ptid < 32) {                           // acquire: the rows this tile gathers,
              prog.waits(p.m, p.n, ptid, 32);          // a warp's acquires in flight together
              if (p.two) prog.waits(p.m + 1, p.n, ptid, 32);
            }
            cutlass::arch::NamedBarrier::sync(Tr::kProducerThreads, Tr::kProducerBarrier);
            if (ptid == 0) fence_proxy_async_global();  // ... also before this thread's TMA loads
          }
        }
        // each row's element offset in A and (bit i of `gathered`) whether it is read at all (a row past
        // the tile's valid ones or past A is zero-filled): computed once a tile (Tr::GatherOffset: 32
        // bits where A's offsets fit), so that a stage's copy costs a 64-bit add onto the stage's base
        typename Tr::GatherOffset rows[Tr::kRowsPerThread];
        uint32_t gathered = 0;
#pragma unroll
        for (int i = 0; i < Tr::kRowsPerThread; ++i) {
          const int ri = row0 + i * Tr::kRowStep;
          int r = -1;
          if (p.active) {
            if constexpr (Cfg::kPairRows)   // the second 64 rows: the next program tile's, where it pairs
              r = ri < 64 ? prog.row(p.m, p.n, ri) : (p.two ? prog.row(p.m + 1, p.n, ri - 64) : -1);
            else
              r = prog.row(p.m, p.n, ri);
          }
          const bool in_a = r >= 0 && r < Cfg::kM;
          rows[i] = in_a ? typename Tr::GatherOffset(r) * Cfg::kK : 0;
          gathered |= uint32_t(in_a) << i;
        }
        // a half tile (as its consumers decide it) reads its first 64 rows only: the others are not
        // copied; the stage's copies are all whole where every row read lies in A
        bool half = false;
        if constexpr (kHalf) {
          if constexpr (Cfg::kPairRows) half = !p.two;
          else half = p.active && prog.valid_rows(p.m, p.n) <= 64;
        }
        const int nrows = half ? Tr::kHalfRowsPerThread : Tr::kRowsPerThread;
        const uint32_t needed = nrows >= 32 ? ~0u : (1u << nrows) - 1u;
        const bool all_rows = (gathered & needed) == needed;
        const int n0 = p.n * Tr::BN;
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % Tr::kStages;
          const uint32_t phase = uint32_t(it / Tr::kStages) & 1u;
          EmptyBar::wait(&empty_bar[s], phase ^ 1u);
          if (!p.active) {                    // the partner's tile runs: pass the stage on, empty
            if (ptid == 0) FullBar::arrive(&full_bar[s]);
            FullBar::arrive(&full_bar[s]);
            continue;
          }
          const int k0 = kt * Tr::BK;
          if (ptid == 0) {
            FullBar::arrive_and_expect_tx(&full_bar[s], Tr::kTxBytes);
            load_b<Cfg, Tr>(tma_b, &full_bar[s], smem + Tr::kOffB + s * Tr::kStageBytesB, n0, k0, p.e, p.shared,
                            cl_rank);
          }
          // (K a multiple of BK: every column of a stage lies in A)
          const int col = k0 + unit * (16 / Tr::kElemBytes);
          const bool col_ok = Cfg::kK % Tr::BK == 0 || col < Cfg::kK;
          // this thread's 16 bytes of the stage's first row of A (past K's end, A's first element: every
          // pointer formed lies in A), and of its row 0 in shared memory
          const typename Cfg::ElemAB* ak = opaque_ptr(a + (col_ok ? col : 0));
          const uint32_t sa = smem_u32 + Tr::kOffA + s * Tr::kStageBytesA + chunk * Tr::kChunkBytesA;
          const uint32_t sa_row0 = sa + sm90::swizzle(uint32_t(row0 * Tr::SA + unit_in_chunk * 16), Tr::SA);
          auto dst = [&](int i) {
            if constexpr (Tr::kRowsShareSwizzle)
              return sa_row0 + uint32_t(i * Tr::kRowStep * Tr::SA);
            else
              return sa + sm90::swizzle(uint32_t((row0 + i * Tr::kRowStep) * Tr::SA + unit_in_chunk * 16), Tr::SA);
          };
          if (col_ok && all_rows) {
#pragma unroll
            for (int i = 0; i < Tr::kRowsPerThread; ++i)
              if (i < nrows) cp_async_16(dst(i), ak + rows[i]);
          } else {
#pragma unroll
            for (int i = 0; i < Tr::kRowsPerThread; ++i)
              if (i < nrows) cp_async_16_zfill(dst(i), ak + rows[i], col_ok && ((gathered >> i) & 1u));
          }
          cp_async_arrive_noinc(&full_bar[s]);
        }
      }
      cp_async_wait_all();
    } else if (warp != 0) {
      // warps 1-3 have no part in a TMA producer: a side program's tiles (a row gather or combine folded in)
      if constexpr (Side::kEnabled) {
        combine_tiles<SideCfg, kSideThreads, kSideBarrier>(rank, side, int(threadIdx.x) - 32, int(blockIdx.x),
                                                           int(gridDim.x));
      } else if constexpr (kNotifierWarp) {
        if (warp == 1) {
          // the notifier: the notifies of this CTA's tiles, in the consumers' order, each once the
          // consumer warpgroups that stored it have arrived (their stores complete and fenced)
          int seq = 0, handed0 = 0, handed1 = 0;   // tiles the consumers work on; tiles each ring carried
          for (int u = walk.first; u < walk.end; u = walk.next(u)) {
            const PairTile p = pair_tile<Cfg, false>(prog, walk.tile(u), cl_rank);
            const bool notify = tile_notifies<Cfg, Prog>(p.valid, p.active);
            if (!p.run && !tile_stores<Cfg>(p.valid, p.active) && !notify) continue;   // as the consumers skip it
            const int ring = kPP ? (seq & 1) : 0;                  // ping-pong: the tile's warpgroup's ring
            ++seq;
            if (!notify) continue;
            const int j = ring ? handed1++ : handed0++;
            const int s = ring * kRingSlots + j % kRingSlots;
            EmptyBar::wait(&notify_full[s], uint32_t(j / kRingSlots) & 1u);
            prog.notifies_lanes(p.m, p.n, int(threadIdx.x) % 32);   // the tile's adds spread over the warp
            if (p.two) prog.notifies_lanes(p.m + 1, p.n, int(threadIdx.x) % 32);
            __syncwarp();
            if (int(threadIdx.x) % 32 == 0) EmptyBar::arrive(&notify_empty[s]);
          }
        }
      }
    } else if (cute::elect_one_sync()) {
      int it = 0;
      for (int u = walk.first; u < walk.end; u = walk.next(u)) {
        const PairTile p = pair_tile<Cfg, true>(prog, walk.tile(u), cl_rank);
        if (!p.run) continue;
        if constexpr (Prog::kHasWaits) {
          if (p.active) {
            prog.waits(p.m, p.n, 0, 1);        // acquire: every signal this tile's data depends on
            if (p.two) prog.waits(p.m + 1, p.n, 0, 1);
            fence_proxy_async_global();        // ... before the async proxy (TMA) reads that data
          }
        }
        const int m0 = p.m * kTileRows, n0 = p.n * Tr::BN;
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % Tr::kStages;
          const uint32_t phase = uint32_t(it / Tr::kStages) & 1u;
          EmptyBar::wait(&empty_bar[s], phase ^ 1u);
          if (!p.active) {                     // the partner's tile runs: pass the stage on, empty
            FullBar::arrive(&full_bar[s]);
            continue;
          }
          FullBar::arrive_and_expect_tx(&full_bar[s], Tr::kTxBytes);
          const int k0 = kt * Tr::BK;
          unsigned char* sa = smem + Tr::kOffA + s * Tr::kStageBytesA;
#pragma unroll
          for (int c = 0; c < Tr::kChunksA; ++c)
            cute::SM90_TMA_LOAD_2D::copy(tma_a, &full_bar[s], kCacheHint, sa + c * Tr::kChunkBytesA,
                                         k0 + c * Tr::EA, m0);
          load_b<Cfg, Tr>(tma_b, &full_bar[s], smem + Tr::kOffB + s * Tr::kStageBytesB, n0, k0, p.e, p.shared,
                          cl_rank);
        }
      }
    }
  } else {
    // ---------------- consumer warpgroups ----------------
    if constexpr (Cfg::kConsumerRegs > 0) cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int cw = wg - 1;                        // consumer index
    const int tid = int(threadIdx.x) % 128;       // thread in the warpgroup
    const uint32_t bar_id = 1 + cw;               // named barrier of this warpgroup (0 = __syncthreads)
    // rows (split N: columns) of the tile this warpgroup owns: its A rows / B columns in a stage
    // (ping-pong: all of a tile's)
    const int wg_row = (Tr::kSplitN || kPP) ? 0 : cw * Tr::MB * 64, wg_col = Tr::kSplitN ? cw * Tr::kWgN : 0;
    const uint32_t stage_a0 = smem_u32 + Tr::kOffA + wg_row * Tr::SA;
    const uint32_t stage_b0 = smem_u32 + Tr::kOffB + Tr::b_col_offset(wg_col);
    const uint32_t epi0 = smem_u32 + Tr::kOffC + cw * Tr::kEpiBuffers * Tr::kEpiBufBytes;
    int it = 0;
    int epi_count = 0;
    float acc[Tr::MB][Tr::kAccPerBlock];
    // Cfg::kOverlapStore: each tile's C held in registers and stored during this warpgroup's next K loop
    // (sm90::HeldTile); its notifies, deferred, run once that loop is done and the stores complete
    constexpr bool kOverlap = sm90::overlap_store<Cfg>::value;
    static_assert(!kOverlap || (!kPP && !Side::kEnabled && (!Prog::kHasNotifies || kDeferNotifies)),
                  "held tiles: cooperative consumers, nothing folded in, notifies (if any) deferred to the next tile");
    cuda::std::conditional_t<kOverlap,
                             cuda::std::conditional_t<Prog::kAddRows, sm90::HeldAddedTile<Tr, typename Cfg::ElemC, Prog::kRowsC>,
                                                      sm90::HeldTile<Tr, typename Cfg::ElemC>>,
                             sm90::NoHeldTile>
        held;
    const int lane = tid % 32, wq = tid / 32;
    // Prog::kAddRows (tl.add_rows): each held tile's rows added into rows of C (Prog::out) instead of stored
    static_assert(!Prog::kAddRows || (kOverlap && !Cfg::kPairRows && !Prog::kHasNotifies),
                  "tiles added into rows of C: held tiles, unpaired, no notifies");
    auto store_held = [&]() {
      if constexpr (kOverlap && Prog::kAddRows)
        held.add_next(prog.out, Prog::kLdc, epi0, epi_count, bar_id, tid, wq, lane);
      else if constexpr (kOverlap)
        held.store_next(tma_c, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane);
    };
    auto flush_held = [&]() {
      if constexpr (kOverlap && Prog::kAddRows)
        held.add_flush(prog.out, Prog::kLdc, epi0, epi_count, bar_id, tid, wq, lane);
      else if constexpr (kOverlap)
        held.flush(tma_c, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane);
    };
    (void)lane, (void)wq;
    // the tile whose stores are issued and whose notifies are not yet run (kDeferNotifies: until the
    // next tile's K loop is done), how many tiles were handed to the notifier warp (on this warpgroup's
    // ring, ping-pong), and how many tiles the consumers worked on (ping-pong: tile j is warpgroup j % 2's)
    bool pending = false, pending_two = false;
    int pending_m = 0, pending_n = 0, handed = 0, seq = 0;
    // ping-pong: the other warpgroup's turn, once a tile's WGMMAs are issued (or it has none); else nothing
    const auto hand_turn = [&]() {
      if constexpr (kPP) return HandTurn{kTurnBarrier + uint32_t(cw ^ 1)};
      else return sm90::NothingIssued{};
    }();
    auto run_notifies = [&]() {
      if constexpr (Prog::kHasNotifies) {
        if (!pending) return;
        pending = false;
        if (tid == 0) {                             // this warpgroup's stores are complete and visible ...
          sm90::bulk_wait_all();
          fence_proxy_async_global();
        }
        if constexpr (kNotifierWarp) {              // ... before the notifier releases them
          if (tid == 0) {
            const int s = (kPP ? cw * kRingSlots : 0) + handed % kRingSlots;
            EmptyBar::wait(&notify_empty[s], (uint32_t(handed / kRingSlots) & 1u) ^ 1u);
            EmptyBar::arrive(&notify_full[s]);
          }
          ++handed;
        } else if constexpr (kPP) {                 // ... before this warpgroup's thread releases them
          if (tid == 0) prog.notifies(pending_m, pending_n);
        } else {                                    // ... before one consumer thread releases them
          cutlass::arch::NamedBarrier::sync(128 * Tr::kConsumerWGs, Tr::kConsumersBarrier);
          if (cw == 0 && tid == 0) {
            prog.notifies(pending_m, pending_n);
            if (pending_two) prog.notifies(pending_m + 1, pending_n);
          }
        }
      }
    };

    for (int u = walk.first; u < walk.end; u = walk.next(u)) {
      const PairTile p = pair_tile<Cfg, false>(prog, walk.tile(u), cl_rank);
      // tile_stores / tile_notifies, written out: calling them here changes NVRTC's code for the folded
      // kernels (the SASS the GPU measurements ran, BENCHMARKS.md, twenty-eighth session)
      const bool store = p.valid && (p.active || Cfg::kStoreInactive);
      const bool notify = p.valid && Prog::kHasNotifies && (p.active || !Prog::kNotifiesGuarded);
      if (!p.run && !store && !notify) continue;
      if constexpr (kPP) {
        const int j = seq++;
        if ((j & 1) != cw) {                      // the other warpgroup's tile: pass over its stages
          if (p.run) it += k_tiles;
          continue;
        }
        if (j > 0) cutlass::arch::NamedBarrier::sync(256, kTurnBarrier + cw);   // its K loop is issued
      }
#pragma unroll
      for (int mb = 0; mb < Tr::MB; ++mb)
#pragma unroll
        for (int i = 0; i < Tr::kAccPerBlock; ++i) acc[mb][i] = 0.0f;

      // the tile's valid rows (from them on the program stores zeros) and whether it runs as a half tile
      int valid = Tr::BM;                 // (an inactive tile stores zeros: its accumulators are)
      if constexpr (Prog::kRowLimit) {
        if (p.active) {                   // (read where the program reads it: past the guard)
          if constexpr (Cfg::kPairRows)   // a pair: the first tile is full
            valid = p.two ? 64 + min(prog.valid_rows(p.m + 1, p.n), 64) : min(prog.valid_rows(p.m, p.n), 64);
          else
            valid = prog.valid_rows(p.m, p.n);
        }
      }
      // (paired program tiles: an inactive tile too — its 64 rows of zeros, where it stores them)
      const bool half = kHalf && (Cfg::kPairRows ? !p.two : p.active && valid <= 64);
      if (p.active) {
        bool whole = true;
        if constexpr (kHalf) {
          if (half) {
            if constexpr (kPP) {
              // the tile's first 64 rows: one m64 block instead of two
              sm90::consume_k_loop<Tr, typename Cfg::Gmma, 1, Tr::kAccPerBlock, Cfg::kGather>(
                  acc, it, k_tiles, full_bar, empty_bar, stage_a0, stage_b0, tid, hand_turn, store_held);
            } else {
              // both warpgroups on the tile's first 64 rows, each on its half of the columns
              sm90::consume_k_loop<Tr, typename Cfg::GmmaHalf, 1, Tr::BN / 4, Cfg::kGather>(
                  acc, it, k_tiles, full_bar, empty_bar, smem_u32 + Tr::kOffA,
                  smem_u32 + Tr::kOffB + Tr::b_col_offset(cw * (Tr::BN / 2)), tid, sm90::NothingIssued{},
                  store_held);
            }
            whole = false;
          }
        }
        if (whole)
          sm90::consume_k_loop<Tr, typename Cfg::Gmma, Tr::MB, Tr::kAccPerBlock, Cfg::kGather>(
              acc, it, k_tiles, full_bar, empty_bar, stage_a0, stage_b0, tid, hand_turn, store_held);
      } else if (p.run) {
        // the partner's tile runs: take each (empty) stage and release it on both CTAs
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % Tr::kStages;
          FullBar::wait(&full_bar[s], uint32_t(it / Tr::kStages) & 1u);
          sm90::release_stage<kCl>(&empty_bar[s], tid);
        }
        hand_turn();
      } else {
        hand_turn();
      }

      flush_held();                                   // (a K loop shorter than the held chunks)
      if constexpr (kDeferNotifies) run_notifies();   // the previous tile's: its stores done by now
      if (kOverlap && store) {
        if constexpr (kOverlap) {
          bool whole = true;
          if constexpr (Prog::kHasLateWaits) {
            // waits after the K loop (the tile program's, before its tl.add_rows): this warpgroup's warp 0
            // acquires, its barrier orders every thread's adds of this tile after them (one program tile:
            // added rows never pair tiles, static_assert above)
            if (wq == 0) {
              prog.late_waits(p.m, p.n, lane, 32);
              __syncwarp();                      // (the lanes' spins reconverged before the barrier)
            }
            cutlass::arch::NamedBarrier::sync(128, bar_id);
          }
          if constexpr (Prog::kAddRows)      // where this warpgroup's rows go (half tile: its first 64 rows)
            held.hold_targets([&](int pm, int pn, int r) { return row_target_of(prog, pm, pn, r); }, p.m, p.n,
                              half ? 0 : wg_row, half ? 1 : Tr::MB, tid);
          if constexpr (kHalf) {
            if (half) {        // this warpgroup's half of the columns, then (unpaired) 64 rows of zeros
              if constexpr (Prog::kAddRows)
                held.hold_half(acc, p.n * Tr::BN + cw * (Tr::BN / 2), p.m * kTileRows, valid, !Cfg::kPairRows, wq,
                               lane, [&](int r) { return row_scale_of(prog, p.m, p.n, r); });
              else
                held.hold_half(acc, p.n * Tr::BN + cw * (Tr::BN / 2), p.m * kTileRows, valid, !Cfg::kPairRows, wq,
                               lane);
              whole = false;
            }
          }
          if (whole) {
            if constexpr (Prog::kAddRows)
              held.hold_rows(acc, p.n * Tr::BN + wg_col, p.m * kTileRows + wg_row, wg_row, valid, wq, lane,
                             [&](int r) { return row_scale_of(prog, p.m, p.n, r); });
            else
              held.hold_rows(acc, p.n * Tr::BN + wg_col, p.m * kTileRows + wg_row, wg_row, valid, wq, lane);
          }
        }
      } else if (store) {
        // ---- epilogue: registers -> swizzled smem -> TMA store, one 64 x EC chunk at a time ----
        if (kPP && kHalf && half) {
          // the 64 computed rows, then 64 rows of zeros
          const int m0 = p.m * Tr::BM, n0 = p.n * Tr::BN;
          store_block<Cfg, Tr, Tr::kWgChunksC, false>(tma_c, smem, smem_u32, epi0, epi_count, acc[0], m0, n0, 0,
                                                      valid, tid, bar_id);
          store_block<Cfg, Tr, Tr::kWgChunksC, true>(tma_c, smem, smem_u32, epi0, epi_count, acc[0], m0 + 64, n0, 64,
                                                     0, tid, bar_id);
        } else if (kHalf && half) {
          // this warpgroup's half of the columns: the 64 computed rows, then 64 rows of zeros (paired
          // program tiles: the next 64 rows are another tile's)
          constexpr int kHalfChunks = (Tr::BN / 2) / Tr::EC;
          const int m0 = p.m * kTileRows, n0 = p.n * Tr::BN + cw * (Tr::BN / 2);
          store_block<Cfg, Tr, kHalfChunks, false>(tma_c, smem, smem_u32, epi0, epi_count, acc[0], m0, n0, 0, valid,
                                                   tid, bar_id);
          if constexpr (!Cfg::kPairRows)
            store_block<Cfg, Tr, kHalfChunks, true>(tma_c, smem, smem_u32, epi0, epi_count, acc[0], m0 + 64, n0, 64,
                                                    0, tid, bar_id);
        } else {
          const int m0 = p.m * kTileRows + wg_row, n0 = p.n * Tr::BN + wg_col;
#pragma unroll
          for (int mb = 0; mb < Tr::MB; ++mb)
            store_block<Cfg, Tr, Tr::kWgChunksC, false>(tma_c, smem, smem_u32, epi0, epi_count, acc[mb],
                                                        m0 + mb * 64, n0, wg_row + mb * 64, valid, tid, bar_id);
        }
      }
      if constexpr (Prog::kHasNotifies) {
        if (notify) {
          pending = true;
          pending_two = p.two;
          pending_m = p.m;
          pending_n = p.n;
          if constexpr (!kDeferNotifies) run_notifies();
        }
      }
    }
    flush_held();
    run_notifies();                                 // the last tile's
    if constexpr (kPP) {
      // the turn handed over after the last tile's K loop, which no tile took: take it (its barrier's
      // arrivals all matched before the CTA ends)
      if (seq > 0 && (seq & 1) == cw) cutlass::arch::NamedBarrier::sync(256, kTurnBarrier + cw);
    }
    if (tid == 0) sm90::bulk_wait_all();
  }
  if constexpr (kCl > 1) cute::cluster_sync();   // no CTA leaves while its partner may still write to it
}

// ---- row-gather combine --------------------------------------------------------------------------

// The kThreads threads of a combine meet: the whole CTA (kBarrier 0) or named barrier kBarrier.
template <int kThreads, int kBarrier>
__device__ __forceinline__ void combine_sync() {
  if constexpr (kBarrier == 0)
    __syncthreads();
  else
    cutlass::arch::NamedBarrier::sync(kThreads, kBarrier);
}

// Cfg: kThreads, kGridM, kGridN, kOrder, kGroupM, kWorldSize, kAlignShift.
// Prog: kHasWaits, kHasNotifies, waits(pid0, pid1, lane, lanes), notifies(pid0, pid1), body(pid0, pid1, tid).
// The tiles first, first + step, ... of the combine's order, by kThreads threads (tid 0..) that
// meet at named barrier kBarrier (0: the whole CTA, __syncthreads).
template <class Cfg, int kThreads, int kBarrier, class Prog>
__device__ __forceinline__ void combine_tiles(int rank, const Prog& prog, int tid, int first, int step) {
  constexpr int gm = Cfg::kGridM, gn = Cfg::kGridN;
  static_assert(Cfg::kThreads == kThreads, "the combine's body strides by its Cfg::kThreads");
  static_assert(kThreads >= 32, "a warp of the combine's threads runs its waits");
  const int start_row = comm_aligned_start(gm, rank, Cfg::kWorldSize, Cfg::kAlignShift);
  for (int t = first; t < gm * gn; t += step) {
    const TileCoord tc = tile_at(Cfg::kOrder, t, gm, gn, Cfg::kGroupM, start_row);
    if constexpr (Prog::kHasWaits) {
      if (tid < 32) prog.waits(tc.m, tc.n, tid, 32);   // acquire, a warp's in flight together ...
      combine_sync<kThreads, kBarrier>();      // ... for every thread's loads of this tile
    }
    prog.body(tc.m, tc.n, tid);
    if constexpr (Prog::kHasNotifies) {
      combine_sync<kThreads, kBarrier>();      // every thread's stores of this tile ...
      if (tid == 0) prog.notifies(tc.m, tc.n); // ... before the release
    }
  }
}

template <class Cfg, class Prog>
__device__ __forceinline__ void combine_kernel(int rank, const Prog& prog) {
  combine_tiles<Cfg, Cfg::kThreads, 0>(rank, prog, int(threadIdx.x), int(blockIdx.x), int(gridDim.x));
}

}  // namespace grouped
}  // namespace tldsl
