// tldsl: the general lowering's pipelined dot loop (chosen by codegen/plan/dot_loop.py, rendered
// by codegen/rules/dot_loop.py): a `tl.range` loop whose body only loads f16 / bf16 tiles and
// accumulates their `dot`s into fragments runs as a GEMM mainloop would —
//  * the loads of an iteration go straight from global memory into one stage of a ring of
//    shared-memory stages with cp.async (16 bytes a thread at a time, zeros past the tensor's
//    edges), several iterations ahead of the tensor cores, in the 128-byte-swizzled layout
//    WGMMA reads: a tile of R rows x C columns (C a multiple of 64) as C / 64 chunks of
//    R rows x 128 bytes, the 16-byte unit u of row r stored at unit u ^ (r % 8);
//  * a dot's left operand [M, K] is then K-major, its right operand [K, N] MN-major (N
//    contiguous): no transposition on the way, every dot reads its operands where they landed;
//    (or, where every loaded tensor's rows are 16-byte multiples, one thread copies them with
//    TMA, an mbarrier per stage counting the bytes);
//  * the accumulators stay in registers for the whole loop (warpgroup w of the CTA holds the
//    m64 blocks w * MB .. w * MB + MB - 1 of every dot's output), and go to the fragment's
//    slot once, after the loop.
// Per iteration (S stages, lookahead S - 2): wait for this iteration's copies, fence them into
// the async proxy, CTA barrier; issue every dot's WGMMAs on the stage (one commit group); issue
// the copies of iteration + S - 2 into the stage read two iterations ago (free: every
// warpgroup waited for its WGMMAs of that iteration before the barrier); wait until one WGMMA
// group is in flight.
//
// Under TLDSL_HOST_EMULATION the copies are plain copies and a dot's k-tile is computed, for
// exactly the accumulator elements a thread holds on the GPU, from the swizzled stage — the
// layout and ownership arithmetic the GPU runs, checked on the CPU.
#pragma once

#include "tldsl/general.hpp"
#include "tldsl/general_gmma_op.hpp"

#if !defined(TLDSL_HOST_EMULATION)
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include "tldsl/gmma.hpp"
#else
#include <type_traits>
#ifndef __grid_constant__
#define __grid_constant__
#endif
#endif

namespace tldsl {
namespace gen {

// -- the shared-memory layout of a staged tile ---------------------------------------------------
// Byte offset of 16-byte unit `u` (columns 8u .. 8u + 7 of its chunk) of row `r` of column chunk
// `c` of a staged tile of R rows.
template <int R>
TLDSL_DEV int sw128_offset(int c, int r, int u) {
  return c * (R * 128) + r * 128 + ((u ^ (r & 7)) << 4);
}

#if !defined(TLDSL_HOST_EMULATION)
TLDSL_DEV void cp_async_16(unsigned char* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
               "l"(src)
               : "memory");
}
TLDSL_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
TLDSL_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#else
inline void cp_async_16(unsigned char* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
#endif

// Stage tile [R x C] of a row-major 2-D tensor `src` (`nrows` x `ncols`) at (r0, c0) into `dst`
// (1024-byte aligned) by the group's `nthreads` threads: cp.async where a 16-byte unit lies
// inside the tensor and `vec` holds (the tensor's base, row pitch and c0 16-byte aligned),
// zeros outside, element by element across the right edge or where not aligned.
template <class T, int R, int C>
TLDSL_DEV void stage_tile_sw128(unsigned char* dst, const T* src, int nrows, int ncols, int r0, int c0, bool vec,
                                int tid, int nthreads) {
  static_assert(sizeof(T) == 2 && C % 64 == 0, "staged tiles: 16-bit elements, chunks of 64 columns");
  constexpr int kUnits = R * (C / 8);
  for (int e = tid; e < kUnits; e += nthreads) {
    const int c = e / (R * 8), r = (e / 8) % R, u = e % 8;
    const int row = r0 + r, col = c0 + c * 64 + u * 8;
    unsigned char* const d = dst + sw128_offset<R>(c, r, u);
    const bool row_in = (unsigned)row < (unsigned)nrows;
    if (vec && row_in && col >= 0 && col + 8 <= ncols) {
      cp_async_16(d, src + (long long)row * ncols + col);
    } else {
      T v[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const bool in = row_in && (unsigned)(col + q) < (unsigned)ncols;
        v[q] = in ? src[(long long)row * ncols + col + q] : T{0};
      }
      unsigned w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) w[q] = unsigned(v[2 * q].bits) | (unsigned(v[2 * q + 1].bits) << 16);
#if defined(TLDSL_HOST_EMULATION)
      std::memcpy(d, w, 16);
#else
      *reinterpret_cast<uint4*>(d) = make_uint4(w[0], w[1], w[2], w[3]);
#endif
    }
  }
}

// -- TMA stages: one elected thread copies a stage's tiles, an mbarrier per stage counts the bytes
// (the same 128-byte-swizzled layout as stage_tile_sw128: TMA's SWIZZLE_128B on 64-column boxes).
#if !defined(TLDSL_HOST_EMULATION)
using TmaDesc = cute::TmaDescriptor;
using StageBar = cutlass::arch::ClusterTransactionBarrier;
#else
struct TmaDesc {
  unsigned char bytes[128];
};
#endif

// Every thread, before the barrier that precedes the first TMA copy: what this CTA's threads
// wrote with ordinary stores — to global memory (a store, or data a wait acquired, the loop's
// TMA copies will read) and to shared memory (earlier slots in the ring's memory, which TMA now
// overwrites) — ordered before the async proxy's accesses.
TLDSL_DEV void fence_proxy_async_all() {
#if !defined(TLDSL_HOST_EMULATION)
  asm volatile("fence.proxy.async;" ::: "memory");
#endif
}

// Thread 0 of the group: the ring's S mbarriers (one arrival each: the elected thread's), made
// visible to the async proxy; the group's barrier follows.
TLDSL_DEV void stage_bars_init(uint64_t* bars, int n, int tid) {
#if !defined(TLDSL_HOST_EMULATION)
  if (tid == 0) {
    for (int i = 0; i < n; ++i) StageBar::init(&bars[i], 1);
    cutlass::arch::fence_barrier_init();
  }
#else
  (void)bars, (void)n, (void)tid;
#endif
}

// Thread 0, after the last wait: the barriers' memory goes back to ordinary use.
TLDSL_DEV void stage_bars_inval(uint64_t* bars, int n, int tid) {
#if !defined(TLDSL_HOST_EMULATION)
  if (tid == 0)
    for (int i = 0; i < n; ++i)
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"((unsigned)__cvta_generic_to_shared(&bars[i]))
                   : "memory");
#else
  (void)bars, (void)n, (void)tid;
#endif
}

// The elected thread: the stage's bytes expected on its barrier (every box is counted whole:
// TMA writes zeros past the tensor's edges).
TLDSL_DEV void stage_bar_expect(uint64_t* bar, int bytes) {
#if !defined(TLDSL_HOST_EMULATION)
  StageBar::arrive_and_expect_tx(bar, (uint32_t)bytes);
#else
  (void)bar, (void)bytes;
#endif
}

// Every thread: wait until the stage's copies of this use (parity `phase`) have landed.
TLDSL_DEV void stage_bar_wait(uint64_t* bar, int phase) {
#if !defined(TLDSL_HOST_EMULATION)
  StageBar::wait(bar, (uint32_t)phase);
#else
  (void)bar, (void)phase;
#endif
}

// The elected thread: tile [R x C] at (r0, c0) of the 2-D tensor `desc` describes (64 x R boxes,
// SWIZZLE_128B) into `dst`, C / 64 copies completing on `bar`. Under emulation the group's
// threads copy it as stage_tile_sw128 does (`src`, `nrows`, `ncols`: the same tensor).
template <class T, int R, int C>
TLDSL_DEV void tma_stage_tile(const TmaDesc* desc, uint64_t* bar, unsigned char* dst, const T* src, int nrows,
                              int ncols, int r0, int c0, int tid, int nthreads) {
  static_assert(sizeof(T) == 2 && C % 64 == 0 && R <= 256, "TMA stages: 16-bit elements, 64 x R boxes");
#if !defined(TLDSL_HOST_EMULATION)
  (void)src, (void)nrows, (void)ncols, (void)nthreads;
  if (tid == 0) {
#pragma unroll
    for (int c = 0; c < C / 64; ++c)
      cute::SM90_TMA_LOAD_2D::copy(desc, bar, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL), dst + c * (R * 128),
                                   c0 + c * 64, r0);
  }
#else
  (void)desc, (void)bar;
  stage_tile_sw128<T, R, C>(dst, src, nrows, ncols, r0, c0, false, tid, nthreads);
#endif
}

// The accumulators of one dot that one thread holds: MB m64 blocks of an M x N output.
template <int MB, int N>
struct DotAcc {
  float v[MB][N / 2];
};

// Begin the WGMMAs of one iteration (every dot's are issued between wgmma_begin and wgmma_end).
template <int MB, int N>
TLDSL_DEV void wgmma_fence_acc(DotAcc<MB, N>& acc) {
#if !defined(TLDSL_HOST_EMULATION)
#pragma unroll
  for (int m = 0; m < MB; ++m)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) cute::warpgroup_fence_operand(acc.v[m][i]);
#else
  (void)acc;
#endif
}

TLDSL_DEV void wgmma_begin() {
#if !defined(TLDSL_HOST_EMULATION)
  cute::warpgroup_arrive();
#endif
}

// Commit the WGMMAs issued since wgmma_begin as one group.
TLDSL_DEV void wgmma_commit() {
#if !defined(TLDSL_HOST_EMULATION)
  cute::warpgroup_commit_batch();
#endif
}

// Wait until at most `InFlight` WGMMA groups of this warpgroup are still running.
template <int InFlight>
TLDSL_DEV void wgmma_wait() {
#if !defined(TLDSL_HOST_EMULATION)
  cute::warpgroup_wait<InFlight>();
#endif
}

// acc += A[M x K] @ B[K x N], both staged (stage_tile_sw128), warpgroup `wg` on its MB blocks.
// BKMajor: B was loaded as an [N x K] tile (the dot's `tl.trans(w_tile)`) and staged so, K-major as A.
template <MmaKind Kind, int M, int N, int K, int MB, bool BKMajor = false>
TLDSL_DEV void wgmma_staged(const unsigned char* sa, const unsigned char* sb, DotAcc<MB, N>& acc, int wg) {
  static_assert(M % 64 == 0 && N % 64 == 0 && N <= 256 && K % 64 == 0, "staged dot shapes");
#if !defined(TLDSL_HOST_EMULATION)
  using Gmma = typename GmmaSS<Kind, N, BKMajor ? cute::SM90::GMMA::Major::K : cute::SM90::GMMA::Major::MN>::type;
  constexpr uint64_t kDescA = sm90::gmma_desc_bits(128, 16, 1024);       // K-major, swizzled: LBO unused
  constexpr uint64_t kDescB = BKMajor ? kDescA                             // K-major: as A
                                      : sm90::gmma_desc_bits(128, K * 128, 1024);  // MN-major: LBO = chunk stride
  const uint32_t a0 = (uint32_t)__cvta_generic_to_shared(sa), b0 = (uint32_t)__cvta_generic_to_shared(sb);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    // B's k16 step: a row block of K (MN-major), or 32 bytes along the rows of its K chunk (K-major)
    const uint32_t b = BKMajor ? b0 + (kk / 4) * (N * 128) + (kk % 4) * 32 : b0 + kk * 16 * 128;
    const uint64_t db = kDescB | uint64_t((b & 0x3FFFF) >> 4);
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      const uint32_t a = a0 + (kk / 4) * (M * 128) + (wg * MB + m) * 64 * 128 + (kk % 4) * 32;
      const uint64_t da = kDescA | uint64_t((a & 0x3FFFF) >> 4);
      sm90::gmma<Gmma>(da, db, acc.v[m], cuda::std::make_integer_sequence<int, N / 2>{});
    }
  }
#else
  using T = std::conditional_t<Kind == MmaKind::kF16, f16, bf16>;
  const int tid = (int)threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  auto at = [&](const unsigned char* s, int rows, int r, int col) {
    const int c = col / 64, u = (col % 64) / 8, q = col % 8;
    T x;
    std::memcpy(&x, s + c * (rows * 128) + r * 128 + ((u ^ (r & 7)) << 4) + q * 2, 2);
    return get(x);
  };
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < N / 2; ++v) {
      const int i = (wg * MB + m) * 64 + warp * 16 + lane / 4 + 8 * ((v / 2) % 2);
      const int j = (v / 4) * 8 + 2 * (lane % 4) + v % 2;
      float s = acc.v[m][v];
      for (int k = 0; k < K; ++k) s += at(sa, M, i, k) * (BKMajor ? at(sb, N, j, k) : at(sb, K, k, j));
      acc.v[m][v] = s;
    }
#endif
}

// Element (row, column) of the output and the accumulator index of every value a thread holds
// (the WGMMA m64nN accumulator layout): f(row, col, value) for each.
template <int MB, int N, class F>
TLDSL_DEV void for_each_acc(DotAcc<MB, N>& acc, int wg, F f) {
  const int tid = (int)threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int m = 0; m < MB; ++m)
#pragma unroll
    for (int v = 0; v < N / 2; ++v) {
      const int i = (wg * MB + m) * 64 + warp * 16 + lane / 4 + 8 * ((v / 2) % 2);
      const int j = (v / 4) * 8 + 2 * (lane % 4) + v % 2;
      f(i, j, acc.v[m][v]);
    }
}

// The accumulators into a row-major [rows x N] fp32 tile (a fragment's slot): neighbouring
// columns a thread holds as one 8-byte store.
template <int MB, int N>
TLDSL_DEV void store_acc(DotAcc<MB, N>& acc, int wg, float* dst) {
  const int tid = (int)threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int m = 0; m < MB; ++m)
#pragma unroll
    for (int v = 0; v < N / 2; v += 2) {
      const int i = (wg * MB + m) * 64 + warp * 16 + lane / 4 + 8 * ((v / 2) % 2);
      const int j = (v / 4) * 8 + 2 * (lane % 4);
#if defined(TLDSL_HOST_EMULATION)
      dst[i * N + j] = acc.v[m][v];
      dst[i * N + j + 1] = acc.v[m][v + 1];
#else
      *reinterpret_cast<float2*>(dst + i * N + j) = make_float2(acc.v[m][v], acc.v[m][v + 1]);
#endif
    }
}

}  // namespace gen
}  // namespace tldsl
