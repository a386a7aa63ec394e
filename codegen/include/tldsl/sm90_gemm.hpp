// tldsl: a warp-specialized, persistent TMA + WGMMA GEMM mainloop for Hopper (sm_90a),
// written on CuTe's *arch-level* ops only (cute/arch: SM90 TMA copies, SM90 GMMA ops;
// cutlass/arch: mbarriers, named barriers, register reconfiguration). No CuTe layout
// algebra: tile coordinates, shared-memory offsets and GMMA descriptors are plain integer
// arithmetic fixed at compile time, which keeps NVRTC compiles short and lets the Python
// side (codegen/plan/wgmma.py, codegen/plan/gemm.py) compute the same numbers for the host
// (TMA descriptors, dynamic shared memory) — the generated code static_asserts that both agree.
//
//   C[M, N] = A[M, K] @ B[K, N]      A row-major (K contiguous, "K-major" for WGMMA)
//                                    B row-major (N contiguous, "MN-major" for WGMMA), or, with
//                                    Cfg::kBKMajor, stored [N, K] (K contiguous: a torch Linear's
//                                    weight, `tl.dot(a, tl.trans(w_tile))`)
//                                    C row-major, fp32 accumulation, converted on store
//
// CTA = 1 producer warpgroup + kConsumerWGs consumer warpgroups (128 threads each).
//  * producer: one elected thread of warp 0 walks this CTA's tiles in the schedule's order;
//    per tile it first runs the tile's waits (Waits::operator(), generated from the tile
//    program: acquire loads on signal slots, then fence.proxy.async.global), then streams the
//    K loop through kStages shared-memory stages with TMA (full barrier: 1 arrival +
//    transaction bytes; empty barrier: one arrival per consumer warpgroup).
//  * consumers: warpgroup w owns rows [w*BM/kConsumerWGs, (w+1)*BM/kConsumerWGs) of the tile,
//    as MB = BM/(64*kConsumerWGs) m64 blocks of 64 x BN fp32 accumulators; per stage it issues
//    BK/16 WGMMAs per m64 block, keeps one batch in flight (wgmma.wait_group 1) and releases
//    the previous stage. Epilogue: fp32 -> output type, staged through 128-byte-swizzled
//    shared memory, TMA store per 64 x EC chunk (OOB rows/cols are clipped by TMA); then, if
//    the tile program notifies after its store (GEMM + ReduceScatter), the tile's release:
//    stores complete (cp.async.bulk.wait_group 0), fence.proxy.async, named barrier of the
//    consumer warpgroups, fence.acq_rel at the notifies' scope, one red per notify.
//  * out-of-bounds loads read zero (TMA), so M, N, K need not be tile multiples; TMA needs
//    16-byte aligned base addresses and row pitches (K, N multiples of 8 for 16-bit types).
//  * thread-block clusters (Cfg::kClusterM = 2, the schedule's cluster (2, 1)): the two CTAs
//    of a cluster compute vertically adjacent tiles (rows 2*cm and 2*cm + 1 of the same tile
//    column), walking *cluster tiles* (cm, n) of a (ceil(gm / 2), gn) grid in the schedule's
//    order. Both need the same B tile: each CTA loads half of its chunks (K-major B: half of every
//    chunk's rows) and multicasts them to both (TMA .multicast::cluster), so B crosses L2 -> SM once
//    per cluster. A stage of either
//    CTA is then written by both producers, so its empty barrier counts the consumer
//    warpgroups of both CTAs, and a consumer releases a stage on both CTAs (remote mbarrier
//    arrive). A CTA whose row is past the last tile row (odd gm) still loads, multicasts and
//    computes zeros in step with its partner, but runs no waits, stores nothing (TMA clips the
//    box) and notifies nothing.
//
// Shared memory (from a 1024-byte aligned base): A stages | B stages | C staging | barriers.
// A stage: BK/EA chunks, each BM rows x SA bytes (SA = min(128, 2*BK), swizzle SA bytes);
// B stage: BN/EB chunks, each BK rows x SB bytes (SB = min(128, 2*BN), swizzle SB bytes); K-major
// B (kBKMajor): BK/EB chunks, each BN rows x SB bytes (SB = min(128, 2*BK)), laid out as A's.
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/utility>
#include <cuda/std/type_traits>

#include "tldsl/gmma.hpp"   // GMMA descriptors, gmma()
#include "tldsl/signals.hpp"
#include "tldsl/tile_order.hpp"

namespace tldsl {
namespace sm90 {

using GmmaMajor = cute::SM90::GMMA::Major;

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
// The largest divisor of n (> 0) that is at most bound (at least 1).
__host__ __device__ constexpr int divisor_at_most(int n, int bound) {
  int d = cmax(1, cmin(n, bound));
  while (n % d != 0) --d;
  return d;
}

// Cfg::kBKMajor where the configuration has it (only a K-major B's renders it), else false.
template <class C, class = void>
struct b_k_major : cuda::std::false_type {};
template <class C>
struct b_k_major<C, cuda::std::void_t<decltype(C::kBKMajor)>> : cuda::std::bool_constant<C::kBKMajor> {};

// Everything derived from the generated configuration `Cfg`:
//   Cfg::ElemAB, Cfg::ElemC, Cfg::Gmma (a cute::SM90::GMMA::MMA_64x{kWgN}x16_F32xx_SS<K, MN>),
//   Cfg::BM, BN, BK, kStages, kConsumerWGs, kEpiBuffers, kOrder, kGroupM, kWorldSize,
//   kAlignShift, kProducerRegs, kConsumerRegs (0 = no register reconfiguration), kSplitN: the
//   consumer warpgroups split the tile's columns instead of its rows (BM = 64: a 64-row tile keeps
//   both warpgroups busy, each on 64 x BN/kConsumerWGs; A's stage is shared), and kPingPong: each
//   consumer warpgroup owns whole tiles, the two taking turns (sm90_grouped_gemm.hpp).
template <class Cfg>
struct GemmTraits {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kStages = Cfg::kStages;
  static constexpr int kClusterM = Cfg::kClusterM;
  static_assert(kClusterM == 1 || kClusterM == 2, "cluster shapes (1, 1) and (2, 1) are lowered");
  static constexpr int kConsumerWGs = Cfg::kConsumerWGs;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kElemBytes = int(sizeof(typename Cfg::ElemAB));
  static constexpr int kOutBytes = int(sizeof(typename Cfg::ElemC));
  static_assert(kElemBytes == 2, "the SM90 GEMM lowering supports 16-bit A/B (f16, bf16)");
  static constexpr bool kSplitN = Cfg::kSplitN;
  static constexpr bool kPingPong = Cfg::kPingPong;
  static_assert(!(kSplitN && kPingPong), "split N and ping-pong consumers exclude each other");
  static constexpr int kWGsPerTile = kPingPong ? 1 : kConsumerWGs;   // consumer warpgroups on a tile (a stage's readers)
  static_assert(kSplitN ? (BM == 64 && BN % (64 * kConsumerWGs) == 0) : BM % (64 * kWGsPerTile) == 0,
                "BM must be a multiple of 64 per consumer warpgroup (split N: BM 64, BN a multiple of 64 per "
                "consumer warpgroup)");
  static_assert(BK % 16 == 0 && BK <= 256, "BK must be a multiple of 16 (WGMMA K) and <= 256 (TMA box)");
  static_assert(BN % 16 == 0 && BN <= 256, "BN must be a multiple of 16 and <= 256 (WGMMA N)");
  static_assert(BM <= 256, "BM <= 256 (TMA box)");
  static constexpr int MB = kSplitN ? 1 : BM / (64 * kWGsPerTile);    // m64 blocks per consumer warpgroup
  static constexpr int kWgN = kSplitN ? BN / kConsumerWGs : BN;        // tile columns per consumer warpgroup
  static constexpr int kAccPerBlock = kWgN / 2;                        // fp32 accumulators per thread per m64 block

  // A: K-major, chunks of EA elements (SA bytes) along K
  static constexpr int SA = cmin(128, BK * kElemBytes);
  static constexpr int EA = SA / kElemBytes;
  static constexpr int kChunksA = BK / EA;
  static constexpr int kChunkBytesA = BM * SA;
  static constexpr int kStageBytesA = BM * BK * kElemBytes;
  // B: MN-major, chunks of EB elements (SB bytes) along N, each BK rows; or K-major (kBKMajor), chunks
  // of EB elements along K, each BN rows (as A's)
  static constexpr bool kBKMajor = b_k_major<Cfg>::value;
  static constexpr int SB = cmin(128, (kBKMajor ? BK : BN) * kElemBytes);
  static constexpr int EB = SB / kElemBytes;
  static constexpr int kChunksB = (kBKMajor ? BK : BN) / EB;
  static constexpr int kChunkBytesB = (kBKMajor ? BN : BK) * SB;
  static constexpr int kStageBytesB = BK * BN * kElemBytes;
  // B's bytes in a stage: from its k16 step `kk` (the WGMMA's start) and from its tile column `col` (a
  // warpgroup's first column: a multiple of EB MN-major; K-major a multiple of 8, whole swizzle rows)
  static constexpr uint32_t b_k_offset(int kk) {
    return kBKMajor ? uint32_t((kk * 16 / EB) * kChunkBytesB + ((kk * 16) % EB) * kElemBytes)
                    : uint32_t(kk * 16 * SB);
  }
  static constexpr uint32_t b_col_offset(int col) {
    return kBKMajor ? uint32_t(col * SB) : uint32_t((col / EB) * kChunkBytesB);
  }
  static constexpr int kTxBytes = kStageBytesA + kStageBytesB;
  // C staging: 64 rows x EC columns (SC bytes per row), swizzled SC bytes
  static constexpr int SC = cmin(128, BN * kOutBytes);
  static constexpr int EC = SC / kOutBytes;
  static constexpr int kChunksC = BN / EC;
  static constexpr int kWgChunksC = kWgN / EC;                         // ... of one consumer warpgroup
  static constexpr int kEpiBufBytes = round_up(64 * SC, 1024);
  static constexpr int kEpiBuffers = Cfg::kEpiBuffers;

  static_assert(SA >= 32 && SB >= 32 && SC >= 32, "swizzle widths below 32 bytes are not used");
  static_assert(kStageBytesA % 1024 == 0, "A stages must keep 1024-byte alignment");

  // shared-memory map (offsets from the 1024-byte aligned base)
  static constexpr int kOffA = 0;
  static constexpr int kOffB = kOffA + kStages * kStageBytesA;
  static constexpr int kOffC = round_up(kOffB + kStages * kStageBytesB, 1024);
  static constexpr int kOffBar = kOffC + kConsumerWGs * kEpiBuffers * kEpiBufBytes;
  // then the full / empty barriers of the deferred-notify ring (sm90_grouped_gemm.hpp; 0 slots elsewhere)
  static constexpr int kNotifySlots = Cfg::kNotifySlots;
  static constexpr int kSmemUsed = kOffBar + 2 * kStages * 8 + 2 * kNotifySlots * 8;
  static constexpr int kSmemBytes = kSmemUsed + 1024;        // + slack to align the dynamic base
  static_assert(kSmemBytes <= 232448, "shared memory over the sm_90 limit of 227 KiB per block");

  // GMMA descriptors (start address added per stage / m64 block / k16 step)
  static constexpr uint64_t kDescA = gmma_desc_bits(SA, 16, 8 * SA);             // K-major: LBO unused (1)
  static constexpr uint64_t kDescB = kBKMajor ? gmma_desc_bits(SB, 16, 8 * SB)   // K-major: as A
                                               : gmma_desc_bits(SB, kChunkBytesB, 8 * SB);   // MN-major: LBO = chunk stride
};

__device__ __forceinline__ uint32_t swizzle(uint32_t offset, int swizzle_bytes) {
  // TMA / GMMA swizzle on shared-memory byte offsets (1024-byte aligned region):
  // 16-byte unit bits [4, 4+b) ^= bits [7, 7+b), b = log2(swizzle_bytes / 16).
  const uint32_t mask = uint32_t(swizzle_bytes / 16 - 1) << 4;
  return offset ^ ((offset >> 3) & mask);
}

template <class T>
__device__ __forceinline__ void store_pair(uint32_t smem_addr, float x, float y);

template <>
__device__ __forceinline__ void store_pair<__half>(uint32_t smem_addr, float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  uint32_t bits = *reinterpret_cast<uint32_t*>(&h);
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_addr), "r"(bits));
}

template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(uint32_t smem_addr, float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  uint32_t bits = *reinterpret_cast<uint32_t*>(&h);
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_addr), "r"(bits));
}

template <>
__device__ __forceinline__ void store_pair<float>(uint32_t smem_addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(smem_addr), "f"(x), "f"(y));
}

// Two fp32 values as one 32-bit register of the 16-bit output type (the lower column in the low half).
template <class T>
__device__ __forceinline__ uint32_t pack_pair(float x, float y) {
  if constexpr (cuda::std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// Four 8 x 8 matrices of 16-bit values from the accumulators of a warp into shared memory, one
// instruction (stmatrix .x4): matrix i's row (lane % 8) at `row_addr` of lane 8 i + (lane % 8); its
// elements are the WGMMA accumulator fragment's (thread t: row t / 4, columns 2 (t % 4) and + 1), in
// register r_i. A quarter of the st.shared a pair at a time costs.
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(row_addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Where lane `lane` of warp `wq` points stmatrix .x4 at, storing column groups (jj, jj + 1) of the warp's 16
// rows into a swizzled chunk at `buf` (SC bytes a row): matrix lane / 8's row lane % 8 — matrices (rows 0-7,
// group jj), (8-15, jj), (0-7, jj + 1), (8-15, jj + 1).
template <int SC>
__device__ __forceinline__ uint32_t stmatrix_row_addr(uint32_t buf, int jj, int wq, int lane) {
  const int m = lane / 8;
  const int row = wq * 16 + lane % 8 + 8 * (m % 2);
  return buf + swizzle(uint32_t(row * SC + 8 * (jj + m / 2) * 2), SC);
}

// The 64 rows x 16 columns at column group pair (j, j + 1) (8 columns each) of one m64 block's
// accumulators `acc`, converted to 16-bit T, into the swizzled chunk at `buf` (SC bytes a row): the
// warp `wq` writes its 16 rows; `keep(h)` says whether the thread's row lane / 4 + 8 h is stored
// (else zeros). Matrices: (rows 0-7, group j), (8-15, j), (0-7, j + 1), (8-15, j + 1).
template <class T, int SC, class Keep>
__device__ __forceinline__ void stmatrix_pair(const float* acc, int j, int jj, uint32_t buf, int wq, int lane,
                                              Keep keep) {
  const uint32_t addr = stmatrix_row_addr<SC>(buf, jj, wq, lane);
  const bool k0 = keep(0), k1 = keep(1);
  stmatrix_x4(addr, k0 ? pack_pair<T>(acc[4 * j + 0], acc[4 * j + 1]) : 0u,
              k1 ? pack_pair<T>(acc[4 * j + 2], acc[4 * j + 3]) : 0u,
              k0 ? pack_pair<T>(acc[4 * j + 4], acc[4 * j + 5]) : 0u,
              k1 ? pack_pair<T>(acc[4 * j + 6], acc[4 * j + 7]) : 0u);
}

// A TMA store whose lines L2 evicts first: data written for later (A_gathered's copy) must not
// push the GEMM's reused A and B tiles out of L2.
__device__ __forceinline__ void tma_store_2d_evict_first(const cute::TmaDescriptor* desc, const void* smem, int c0,
                                                         int c1) {
  constexpr uint64_t kEvictFirst = uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST);
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3}], [%1], %4;"
               ::"l"(reinterpret_cast<uint64_t>(desc)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(c0), "r"(c1),
               "l"(kEvictFirst)
               : "memory");
}

__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// A consumer warpgroup is done with a stage: one arrival on its empty barrier in every CTA of
// the cluster (each CTA's producer multicasts into all of them).
template <int kCl>
__device__ __forceinline__ void release_stage(uint64_t* empty_bar, int tid) {
  if constexpr (kCl == 1) {
    if (tid == 0) cutlass::arch::ClusterBarrier::arrive(empty_bar);
  } else {
#pragma unroll
    for (int c = 0; c < kCl; ++c) cutlass::arch::ClusterBarrier::arrive(empty_bar, uint32_t(c), uint32_t(tid == 0));
  }
}

// Generic-proxy shared-memory writes (cp.async, st.shared) -> visible to the async proxy (WGMMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One tile's K loop on a consumer warpgroup — the plain and the grouped GEMM's: kBlocks m64 blocks (A
// rows from stage_a0, B columns from stage_b0), kAcc fp32 accumulators each, one Gmma per block and
// 16-wide K step; each stage released once the next stage's WGMMAs are issued (one batch stays in
// flight). kCpAsyncA: A's stages are written by cp.async (a gathered A), fenced for the async proxy.
// `issued()` runs once the last stage's WGMMAs are issued, before waiting for them (ping-pong: the other
// consumer warpgroup's turn, so that the tensor cores never run dry between two tiles).
// `during()` runs once per stage, between issuing its WGMMAs and waiting for the previous stage's (the
// previous tile's held stores, HeldTile: work for the warps while the tensor cores run).
struct NothingIssued {
  __device__ __forceinline__ void operator()() const {}
};
template <class Tr, class Gmma, int kBlocks, int kAcc, bool kCpAsyncA, class Issued = NothingIssued,
          class During = NothingIssued>
__device__ __forceinline__ void consume_k_loop(float (&acc)[Tr::MB][Tr::kAccPerBlock], int& it, int k_tiles,
                                               uint64_t* full_bar, uint64_t* empty_bar, uint32_t stage_a0,
                                               uint32_t stage_b0, int tid, const Issued& issued = Issued{},
                                               During&& during = During{}) {
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  static_assert(kBlocks <= Tr::MB && kAcc <= Tr::kAccPerBlock, "the accumulators of a block fit its array");
  int prev_stage = -1;
  for (int kt = 0; kt < k_tiles; ++kt, ++it) {
    const int s = it % Tr::kStages;
    const uint32_t phase = uint32_t(it / Tr::kStages) & 1u;
    FullBar::wait(&full_bar[s], phase);
    if constexpr (kCpAsyncA) fence_proxy_async_shared();   // cp.async data -> async proxy
#pragma unroll
    for (int mb = 0; mb < kBlocks; ++mb)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) cute::warpgroup_fence_operand(acc[mb][i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < Tr::BK / 16; ++kk) {
      const uint32_t a_off = (kk * 16 / Tr::EA) * Tr::kChunkBytesA + ((kk * 16) % Tr::EA) * Tr::kElemBytes;
      const uint32_t b_addr = stage_b0 + s * Tr::kStageBytesB + Tr::b_k_offset(kk);
      const uint64_t desc_b = Tr::kDescB | uint64_t((b_addr & 0x3FFFF) >> 4);
#pragma unroll
      for (int mb = 0; mb < kBlocks; ++mb) {
        const uint32_t a_addr = stage_a0 + s * Tr::kStageBytesA + mb * 64 * Tr::SA + a_off;
        const uint64_t desc_a = Tr::kDescA | uint64_t((a_addr & 0x3FFFF) >> 4);
        gmma<Gmma>(desc_a, desc_b, acc[mb], cuda::std::make_integer_sequence<int, kAcc>{});
      }
    }
    cute::warpgroup_commit_batch();
    during();
    cute::warpgroup_wait<1>();                // the previous stage's WGMMAs are done ...
#pragma unroll
    for (int mb = 0; mb < kBlocks; ++mb)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) cute::warpgroup_fence_operand(acc[mb][i]);
    if (prev_stage >= 0) release_stage<Tr::kClusterM>(&empty_bar[prev_stage], tid);   // ... release it
    prev_stage = s;
  }
  issued();
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int mb = 0; mb < kBlocks; ++mb)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) cute::warpgroup_fence_operand(acc[mb][i]);
  if (prev_stage >= 0) release_stage<Tr::kClusterM>(&empty_bar[prev_stage], tid);
}

// The accumulators of one consumer warpgroup (rows m0 .. m0 + 64*MB of the tile, n0 .. n0 + BN)
// stored as ElemOut: converted into 128-byte-swizzled shared memory, one TMA store per 64 x E
// chunk (E = SC / sizeof(ElemOut), SC = min(128, BN * sizeof(ElemOut))), through kEpiBuffers
// rotating buffers (a buffer is rewritten once the store that last used it has read it).
template <class Tr, class ElemOut>
__device__ __forceinline__ void store_acc(float (&acc)[Tr::MB][Tr::kAccPerBlock], const cute::TmaDescriptor* tma,
                                          unsigned char* smem, uint32_t smem_u32, uint32_t epi0, int& epi_count,
                                          uint32_t bar_id, int tid, int wq, int lane, int n0, int m0) {
  constexpr int kBytes = int(sizeof(ElemOut));
  constexpr int SC = cmin(128, Tr::BN * kBytes);
  constexpr int EC = SC / kBytes;
  static_assert(64 * SC <= Tr::kEpiBufBytes, "the output type's staging chunk must fit an epilogue buffer");
#pragma unroll
  for (int mb = 0; mb < Tr::MB; ++mb) {
#pragma unroll
    for (int q = 0; q < Tr::BN / EC; ++q) {
      const uint32_t buf = epi0 + (epi_count % Tr::kEpiBuffers) * Tr::kEpiBufBytes;
      if (tid == 0) bulk_wait_read<Tr::kEpiBuffers - 1>();   // the store that last used `buf` has read it
      cutlass::arch::NamedBarrier::sync(128, bar_id);
      if constexpr (kBytes == 2 && (EC / 8) % 2 == 0) {
        // 16-bit C: stmatrix, two 8-column groups of the warp's 16 rows an instruction
#pragma unroll
        for (int jj = 0; jj < EC / 8; jj += 2)
          stmatrix_pair<ElemOut, SC>(acc[mb], q * (EC / 8) + jj, jj, buf, wq, lane, [](int) { return true; });
      } else {
#pragma unroll
        for (int jj = 0; jj < EC / 8; ++jj) {       // constant trip counts: acc stays in registers
          const int j = q * (EC / 8) + jj;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = wq * 16 + lane / 4 + 8 * h;
            const int col = 8 * j + 2 * (lane % 4) - q * EC;
            const uint32_t off = swizzle(uint32_t(row * SC + col * kBytes), SC);
            store_pair<ElemOut>(buf + off, acc[mb][4 * j + 2 * h], acc[mb][4 * j + 2 * h + 1]);
          }
        }
      }
      cute::tma_store_fence();               // generic-proxy smem writes -> visible to TMA
      cutlass::arch::NamedBarrier::sync(128, bar_id);
      if (tid == 0) {
        cute::SM90_TMA_STORE_2D::copy(tma, smem + (buf - smem_u32), n0 + q * EC, m0 + mb * 64);
        cute::tma_store_arrive();              // commit this store as one bulk group
      }
      ++epi_count;
    }
  }
}

// Cfg::kOverlapStore where the configuration has it (rendered only when true), else false.
template <class C, class = void>
struct overlap_store : cuda::std::false_type {};
template <class C>
struct overlap_store<C, cuda::std::void_t<decltype(C::kOverlapStore)>> : cuda::std::bool_constant<C::kOverlapStore> {};

// One tile's 16-bit output held in registers (Cfg::kOverlapStore): a consumer warpgroup converts its
// accumulators into pairs once the tile's K loop is done, then stores one 64 x EC chunk per stage of
// its next tile's K loop, between issuing that stage's WGMMAs and waiting for them. The tensor cores
// then wait between two tiles for the conversion only, not for C's staging in shared memory and its
// TMA stores (at a short K those took a third of the kernel: BENCHMARKS.md, fifty-seventh session).
// The pairs take half the accumulators' registers again (MB * kWgN / 4 per thread).
//
// A held tile is MB 64-row blocks of kWgN columns (the warpgroup's rows of the tile), rows from the
// tile's `valid` on held as zeros; or (the grouped GEMM's half tile) its first block's first half of
// the columns only, optionally followed by as many chunks of zeros 64 rows below (the half tile's
// other rows).
template <class Tr, class ElemOut>
struct HeldTile {
  static_assert(sizeof(ElemOut) == 2, "held tiles are 16-bit pairs");
  static constexpr int SC = Tr::SC, EC = Tr::EC;
  static_assert((EC / 8) % 2 == 0, "a chunk is stored by pairs of 8-column groups (stmatrix .x4)");
  static constexpr int kChunksPerBlock = Tr::kWgN / EC;
  static constexpr int kChunks = Tr::MB * kChunksPerBlock;
  static_assert(64 * SC <= Tr::kEpiBufBytes, "a chunk fits an epilogue buffer");
  static constexpr int kHalfBand = kChunksPerBlock / 2 > 0 ? kChunksPerBlock / 2 : 1;
  enum Form : int { kWhole, kHalf, kHalfAndZeros };
  uint32_t pairs[Tr::MB][Tr::kAccPerBlock / 2];
  int n0 = 0, m0 = 0;
  int next = kChunks;          // the next chunk to store, of count() held (kChunks: nothing held, any form)
  int form = kWhole;           // kHalf*: kHalfBand chunks a 64-row band, (kHalfAndZeros) the second one zeros

  __device__ __forceinline__ int count() const {
    return form == kWhole ? kChunks : form == kHalf ? kHalfBand : 2 * kHalfBand;
  }

  // Hold the accumulators of the tile at (row m0, column n0) of C, every row.
  __device__ __forceinline__ void hold(float (&acc)[Tr::MB][Tr::kAccPerBlock], int n, int m) {
    hold_rows(acc, n, m, 0, Tr::BM, 0, 0);   // (the row test folds away: rows mb * 64 + 8 h < BM)
  }

  // ... its rows from the tile's `valid` on as zeros (the block's row r is the tile's row row0 + r; this
  // thread's rows by its warp `wq` and `lane`).
  __device__ __forceinline__ void hold_rows(float (&acc)[Tr::MB][Tr::kAccPerBlock], int n, int m, int row0,
                                            int valid, int wq, int lane) {
#pragma unroll
    for (int mb = 0; mb < Tr::MB; ++mb)
#pragma unroll
      for (int i = 0; i < Tr::kAccPerBlock / 2; ++i) {
        const bool keep = row0 + mb * 64 + wq * 16 + lane / 4 + 8 * (i % 2) < valid;   // pair i: row h = i % 2
        pairs[mb][i] = keep ? pack_pair<ElemOut>(acc[mb][2 * i], acc[mb][2 * i + 1]) : 0u;
      }
    n0 = n, m0 = m, next = 0, form = kWhole;
  }

  // A half tile: the first block's first kWgN / 2 columns (rows from `valid` on as zeros), then, with
  // `zero_rows`, the 64 rows below it as zeros.
  __device__ __forceinline__ void hold_half(float (&acc)[Tr::MB][Tr::kAccPerBlock], int n, int m, int valid,
                                            bool zero_rows, int wq, int lane) {
    static_assert(kChunksPerBlock % 2 == 0 && 2 * kHalfBand <= kChunks, "a half tile's columns are whole chunks");
#pragma unroll
    for (int i = 0; i < Tr::kAccPerBlock / 4; ++i) {
      const bool keep = wq * 16 + lane / 4 + 8 * (i % 2) < valid;
      pairs[0][i] = keep ? pack_pair<ElemOut>(acc[0][2 * i], acc[0][2 * i + 1]) : 0u;
    }
    n0 = n, m0 = m, next = 0, form = zero_rows ? kHalfAndZeros : kHalf;
  }

  // Chunk c of the held tile: its 64 x EC pairs (or zeros) -> a swizzled epilogue buffer (stmatrix)
  // -> TMA store.
  template <int c>
  __device__ __forceinline__ void store_chunk(const cute::TmaDescriptor* tma, unsigned char* smem, uint32_t smem_u32,
                                              uint32_t epi0, int& epi_count, uint32_t bar_id, int tid, int wq,
                                              int lane) {
    constexpr int mb = c / kChunksPerBlock, q = c % kChunksPerBlock;
    const bool half = form != kWhole;
    const int band = half ? c / kHalfBand : mb, col = half ? c % kHalfBand : q;
    const bool zero = half && c >= kHalfBand;
    const uint32_t buf = epi0 + (epi_count % Tr::kEpiBuffers) * Tr::kEpiBufBytes;
    if (tid == 0) bulk_wait_read<Tr::kEpiBuffers - 1>();   // the store that last used `buf` has read it
    cutlass::arch::NamedBarrier::sync(128, bar_id);
#pragma unroll
    for (int jj = 0; jj < EC / 8; jj += 2) {
      const int j = q * (EC / 8) + jj;        // (a constant after unrolling: the pairs stay in registers)
      stmatrix_x4(stmatrix_row_addr<SC>(buf, jj, wq, lane), zero ? 0u : pairs[mb][2 * j], zero ? 0u : pairs[mb][2 * j + 1],
                  zero ? 0u : pairs[mb][2 * j + 2], zero ? 0u : pairs[mb][2 * j + 3]);
    }
    cute::tma_store_fence();                  // generic-proxy smem writes -> visible to TMA
    cutlass::arch::NamedBarrier::sync(128, bar_id);
    if (tid == 0) {
      cute::SM90_TMA_STORE_2D::copy(tma, smem + (buf - smem_u32), n0 + col * EC, m0 + band * 64);
      cute::tma_store_arrive();
    }
    ++epi_count;
  }

  template <int... c>
  __device__ __forceinline__ void store_at(int i, cuda::std::integer_sequence<int, c...>, const cute::TmaDescriptor* tma,
                                           unsigned char* smem, uint32_t smem_u32, uint32_t epi0, int& epi_count,
                                           uint32_t bar_id, int tid, int wq, int lane) {
    ((i == c ? store_chunk<c>(tma, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane) : void()), ...);
  }

  // The next held chunk, if any is left.
  __device__ __forceinline__ void store_next(const cute::TmaDescriptor* tma, unsigned char* smem, uint32_t smem_u32,
                                             uint32_t epi0, int& epi_count, uint32_t bar_id, int tid, int wq, int lane) {
    if (next >= count()) return;
    store_at(next, cuda::std::make_integer_sequence<int, kChunks>{}, tma, smem, smem_u32, epi0, epi_count, bar_id,
             tid, wq, lane);
    ++next;
  }

  // Every chunk still held.
  __device__ __forceinline__ void flush(const cute::TmaDescriptor* tma, unsigned char* smem, uint32_t smem_u32,
                                        uint32_t epi0, int& epi_count, uint32_t bar_id, int tid, int wq, int lane) {
    while (next < count()) store_next(tma, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane);
  }
};

// A held tile whose rows are added into rows of C instead of stored there (tl.add_rows): each row times
// its factor `scale(row)` when held; each chunk then through a swizzled epilogue buffer (stmatrix), its
// rows' 16-byte pieces read back and added into row target(pm, pn, tile row) of `out` (ldc elements a
// row, all of them C's columns; kRowsC rows) by vector reductions at L2 (red.global.add.v4 of 16-bit pairs). A row whose
// target is negative (or past C) adds nothing, nor do a half tile's rows of zeros.
// Why these reductions: their cost is the memory system's, not the consumers' instructions. Measured on
// an H100 (BENCHMARKS.md, sixty-second session): with no global operation this GEMM is faster than the one
// storing its rows; plain 16-byte stores to the same rows cost about half what the reductions do (small
// experts); the TMA unit's bulk reductions (cp.reduce.async.bulk, a row at a time) six to eight times; an L2
// evict_last policy on them changes nothing. sm_90 has no wider 16-bit reduction (.v8 is refused).
template <class Tr, class ElemOut, int kRowsC>
struct HeldAddedTile : HeldTile<Tr, ElemOut> {
  using Base = HeldTile<Tr, ElemOut>;
  using Base::pairs, Base::n0, Base::m0, Base::next, Base::form, Base::count;
  static constexpr int SC = Base::SC, EC = Base::EC, kChunks = Base::kChunks;
  static constexpr int kChunksPerBlock = Base::kChunksPerBlock, kHalfBand = Base::kHalfBand;
  static constexpr int kUnits = SC / 16;                 // 16-byte pieces of a chunk's row
  static constexpr int kRowsEach = 64 * kUnits / 128;     // rows of a 64-row band a thread adds pieces of
  // the target rows of this thread's rows of each band, read when the tile is held (not in the next K loop,
  // whose WGMMAs the same threads issue): thread tid adds piece tid % kUnits of rows tid / kUnits + 128 / kUnits i.
  // Where C has at most 2^15 rows, two to a register (16 bits each, -1 for none): the consumers' registers
  // are the held tile's limit (32-bit targets spilled 16-32 bytes beside a cluster's state)
  static constexpr bool kPacked = kRowsC <= 32768 && kRowsEach % 2 == 0;
  uint32_t tgt[Tr::MB][kPacked ? kRowsEach / 2 : kRowsEach];

  template <class Target>
  __device__ __forceinline__ void hold_targets(Target target, int pm, int pn, int row0, int bands, int tid) {
#pragma unroll
    for (int mb = 0; mb < Tr::MB; ++mb)
#pragma unroll
      for (int i = 0; i < kRowsEach; ++i) {
        int t = mb < bands ? target(pm, pn, row0 + mb * 64 + tid / kUnits + (128 / kUnits) * i) : -1;
        t = t < kRowsC ? t : -1;              // (a row id past C adds nothing, as the simulator refuses it)
        if constexpr (kPacked) {
          if (i % 2 == 0) tgt[mb][i / 2] = uint32_t(t) & 0xffffu;
          else tgt[mb][i / 2] |= uint32_t(t) << 16;
        } else {
          tgt[mb][i] = uint32_t(t);
        }
      }
  }

  __device__ __forceinline__ int target_of(int mb, int i) const {
    if constexpr (kPacked) return int(int16_t(uint16_t(tgt[mb][i / 2] >> (16 * (i % 2)))));
    else return int(tgt[mb][i]);
  }

  template <class Scale>
  __device__ __forceinline__ void hold_rows(float (&acc)[Tr::MB][Tr::kAccPerBlock], int n, int m, int row0, int valid,
                                            int wq, int lane, Scale scale) {
#pragma unroll
    for (int mb = 0; mb < Tr::MB; ++mb) {
      const int rr = row0 + mb * 64 + wq * 16 + lane / 4;      // this thread's rows rr and rr + 8
      const float s[2] = {scale(rr), scale(rr + 8)};
#pragma unroll
      for (int i = 0; i < Tr::kAccPerBlock / 2; ++i) {
        const bool keep = rr + 8 * (i % 2) < valid;    // (a row masked off: 0 * its factor, as the program's)
        pairs[mb][i] = pack_pair<ElemOut>((keep ? acc[mb][2 * i] : 0.0f) * s[i % 2],
                                          (keep ? acc[mb][2 * i + 1] : 0.0f) * s[i % 2]);
      }
    }
    n0 = n, m0 = m, next = 0, form = Base::kWhole;
  }

  template <class Scale>
  __device__ __forceinline__ void hold_half(float (&acc)[Tr::MB][Tr::kAccPerBlock], int n, int m, int valid,
                                            bool zero_rows, int wq, int lane, Scale scale) {
    const int rr = wq * 16 + lane / 4;
    const float s[2] = {scale(rr), scale(rr + 8)};
#pragma unroll
    for (int i = 0; i < Tr::kAccPerBlock / 4; ++i) {
      const bool keep = rr + 8 * (i % 2) < valid;
      pairs[0][i] = pack_pair<ElemOut>((keep ? acc[0][2 * i] : 0.0f) * s[i % 2],
                                       (keep ? acc[0][2 * i + 1] : 0.0f) * s[i % 2]);
    }
    n0 = n, m0 = m, next = 0, form = zero_rows ? Base::kHalfAndZeros : Base::kHalf;
  }

  template <int c>
  __device__ __forceinline__ void add_chunk(ElemOut* out, int ldc, uint32_t epi0, int& epi_count,
                                            uint32_t bar_id, int tid, int wq, int lane) {
    constexpr int mb = c / kChunksPerBlock, q = c % kChunksPerBlock;
    const bool half = form != Base::kWhole;
    if (half && c >= kHalfBand) return;      // the half tile's other rows: zeros
    const int col = half ? c % kHalfBand : q;
    const uint32_t buf = epi0 + (epi_count % Tr::kEpiBuffers) * Tr::kEpiBufBytes;
    cutlass::arch::NamedBarrier::sync(128, bar_id);   // every thread has read what `buf` last held
#pragma unroll
    for (int jj = 0; jj < EC / 8; jj += 2) {
      const int j = q * (EC / 8) + jj;
      stmatrix_x4(stmatrix_row_addr<SC>(buf, jj, wq, lane), pairs[mb][2 * j], pairs[mb][2 * j + 1],
                  pairs[mb][2 * j + 2], pairs[mb][2 * j + 3]);
    }
    cutlass::arch::NamedBarrier::sync(128, bar_id);
    const int u = tid % kUnits, cc = n0 + col * EC + u * 8;
#pragma unroll
    for (int i = 0; i < kRowsEach; ++i) {
      const int r = tid / kUnits + (128 / kUnits) * i;
      const int t = half ? target_of(0, i) : target_of(mb, i);
      if (t < 0 || cc + 8 > ldc) continue;
      uint32_t v0, v1, v2, v3;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                   : "r"(buf + swizzle(uint32_t(r * SC + u * 16), SC)));
      ElemOut* dst = out + (long long)t * ldc + cc;
      if constexpr (cuda::std::is_same_v<ElemOut, __half>)
        asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v0), "r"(v1),
                     "r"(v2), "r"(v3)
                     : "memory");
      else
        asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v0), "r"(v1),
                     "r"(v2), "r"(v3)
                     : "memory");
    }
    ++epi_count;
  }

  template <int... c>
  __device__ __forceinline__ void add_at(int i, cuda::std::integer_sequence<int, c...>, ElemOut* out, int ldc,
                                         uint32_t epi0, int& epi_count, uint32_t bar_id, int tid, int wq, int lane) {
    ((i == c ? add_chunk<c>(out, ldc, epi0, epi_count, bar_id, tid, wq, lane) : void()), ...);
  }

  // The next held chunk, added, if any is left.
  __device__ __forceinline__ void add_next(ElemOut* out, int ldc, uint32_t epi0, int& epi_count,
                                           uint32_t bar_id, int tid, int wq, int lane) {
    if (next >= count()) return;
    add_at(next, cuda::std::make_integer_sequence<int, kChunks>{}, out, ldc, epi0, epi_count, bar_id, tid, wq,
           lane);
    ++next;
  }

  // Every chunk still held, added.
  __device__ __forceinline__ void add_flush(ElemOut* out, int ldc, uint32_t epi0, int& epi_count,
                                            uint32_t bar_id, int tid, int wq, int lane) {
    while (next < count()) add_next(out, ldc, epi0, epi_count, bar_id, tid, wq, lane);
  }
};

struct NoHeldTile {};   // (stores at once)

// What a generated epilogue (`Epilogue::operator()(ctx, pm, pn)`) works with: this consumer
// thread's accumulators and the epilogue's staging state. Every consumer thread runs the
// epilogue (its conditions depend on the tile and the rank only, so all take the same path).
template <class Tr, int kCl>
struct EpilogueCtx {
  float (&acc)[Tr::MB][Tr::kAccPerBlock];
  unsigned char* smem;
  uint32_t smem_u32, epi0;
  int& epi_count;
  uint32_t bar_id;
  int tid, wq, lane, cw;

  // Store the accumulators as ElemOut at (row m0, column n0) of the TMA descriptor's tensor.
  template <class ElemOut>
  __device__ __forceinline__ void store(const cute::TmaDescriptor* tma, int n0, int m0) {
    store_acc<Tr, ElemOut>(acc, tma, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane, n0,
                           m0 + cw * Tr::MB * 64);
  }

  // The tile's stores are complete and visible (every consumer warpgroup's), then a fence at
  // scope S on the notifying thread: its relaxed adds that follow are releases.
  template <int S>
  __device__ __forceinline__ void release() {
    constexpr uint32_t kNotifyBar = 1 + Tr::kConsumerWGs;   // after the per-warpgroup barriers
    if (tid == 0) {
      bulk_wait_all();
      fence_proxy_async_global();
    }
    if constexpr (Tr::kConsumerWGs > 1) cutlass::arch::NamedBarrier::sync(128 * Tr::kConsumerWGs, kNotifyBar);
    if (notifier()) fence_acq_rel<S>();
  }

  __device__ __forceinline__ bool notifier() const { return cw == 0 && tid == 0; }

  // For each of this thread's accumulator pairs (tile row `row`, columns col and col + 1):
  // v = fetch(row, col) (the loads), then combine(x0, x1, v) (the arithmetic). The loads of a
  // batch of pairs are issued before any of their arithmetic, so their latencies overlap (at most
  // 256 bytes of fetched values per thread in flight: a few dozen registers). A batch is the most
  // column blocks within those bytes that divides the tile's BN / 8 (a reduce-scatter summing three
  // peers' fp16 pairs, a 12-byte V: 256 / 24 = 10 blocks, which do not tile 16 of them; 8 do).
  template <class Fetch, class Combine>
  __device__ __forceinline__ void apply(Fetch&& fetch, Combine&& combine) {
    using V = decltype(fetch(0, 0));
    constexpr int kPerJ = 2 * int(sizeof(V));                      // bytes fetched per column block j
    constexpr int kBatch = divisor_at_most(Tr::BN / 8, 256 / kPerJ);  // column blocks per batch
    static_assert((Tr::BN / 8) % kBatch == 0, "batches must tile the accumulator columns");
#pragma unroll
    for (int mb = 0; mb < Tr::MB; ++mb) {
#pragma unroll
      for (int j0 = 0; j0 < Tr::BN / 8; j0 += kBatch) {
        V v[kBatch][2];
#pragma unroll
        for (int jj = 0; jj < kBatch; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            v[jj][h] = fetch(cw * Tr::MB * 64 + mb * 64 + wq * 16 + lane / 4 + 8 * h, 8 * (j0 + jj) + 2 * (lane % 4));
#pragma unroll
        for (int jj = 0; jj < kBatch; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            combine(acc[mb][4 * (j0 + jj) + 2 * h], acc[mb][4 * (j0 + jj) + 2 * h + 1], v[jj][h]);
      }
    }
  }
};

// Elementwise epilogue math: float arithmetic rounded like the simulator (no contraction, 16-bit
// results rounded at every op) and guarded element loads (out of bounds reads 0).
template <class T>
__device__ __forceinline__ float epi_round(float x) {
  if constexpr (cuda::std::is_same_v<T, __half>) return __half2float(__float2half_rn(x));
  else if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(__float2bfloat16_rn(x));
  else return x;
}

// A pair of adjacent elements (columns col, col + 1) of a row-major [rows, cols] tensor, zero
// outside it (cols is even and col too, so a pair is all in or all out). Loads go through L2 only
// (ld.global.cg): other GPUs write these tensors while the kernel runs, before the waits that
// precede the loads.
template <class T> struct EpiPair;
template <> struct EpiPair<float> { using type = float2; };
template <> struct EpiPair<__half> { using type = __half2; };
template <> struct EpiPair<__nv_bfloat16> { using type = __nv_bfloat162; };

template <class T>
__device__ __forceinline__ typename EpiPair<T>::type epi_load2(const T* p, int row, int col, int rows, int cols) {
  using P = typename EpiPair<T>::type;
  if ((unsigned)row >= (unsigned)rows || (unsigned)col >= (unsigned)cols) {
    P z;
    *reinterpret_cast<typename cuda::std::conditional<sizeof(P) == 8, unsigned long long, unsigned>::type*>(&z) = 0;
    return z;
  }
  return __ldcg(reinterpret_cast<const P*>(p + (long long)row * cols + col));
}

__device__ __forceinline__ float epi_lo(float2 v) { return v.x; }
__device__ __forceinline__ float epi_hi(float2 v) { return v.y; }
__device__ __forceinline__ float epi_lo(__half2 v) { return __low2float(v); }
__device__ __forceinline__ float epi_hi(__half2 v) { return __high2float(v); }
__device__ __forceinline__ float epi_lo(__nv_bfloat162 v) { return __low2float(v); }
__device__ __forceinline__ float epi_hi(__nv_bfloat162 v) { return __high2float(v); }

// No per-tile waits (a GEMM whose tile program has none).
struct NoWaits {
  static constexpr bool kEnabled = false;
  static constexpr bool kStaged = false;      // no waits in the K loop
  __device__ __forceinline__ void operator()(int, int) const {}
  __device__ __forceinline__ int stage(int, int, int) const { return 0; }
};

// No per-tile notifies: the epilogue compiles to exactly the plain GEMM's.
struct NoNotifies {
  static constexpr bool kEnabled = false;
  static constexpr int kScope = kScopeGpu;
  __device__ __forceinline__ void operator()(int, int) const {}
};

// No generated epilogue: the tile is stored into C (then notified, with Notifies).
struct NoEpilogue {
  static constexpr bool kEnabled = false;
  template <class Ctx>
  __device__ __forceinline__ void operator()(Ctx&, int, int) const {}
};

// This rank's rows of A come from A_gathered like every other row (the plain GEMM).
struct NoOwnRows {
  static constexpr bool kEnabled = false;
  static constexpr bool kStoresOnRefill = false;
  static constexpr bool kPushes = false;
  static constexpr int cols = 0;
  __device__ __forceinline__ bool owns(int, int, int) const { return false; }
};

// AllGather+GEMM staging its shard itself (the runtime's staging="gemm"): this rank's rows of
// A_gathered, [rank * M/W, (rank + 1) * M/W), are loaded from the shard (`shard`, [M/W, K]) —
// no staging pass before the GEMM, and no waits for them — and the tiles of each of those tile
// rows in columns n < `cols` store the A stages they load (a stager thread in the producer
// warpgroup, between a stage's arrival and its release), by TMA from shared memory, into the
// symmetric slot peers pull the shard from (`slot`) and into A_gathered's rows: column n the
// stages k with k % cols == n, so the staging traffic is spread over `cols` tiles. Before its first
// store into the slot a CTA waits until every peer has arrived at launch - 1 (its copies of
// launch - 2, the last reads of this slot, are done); once a tile's stores are complete it adds
// 1 to `staged`, and whoever completes the launch's count (tile rows x cols) writes `launch`
// into this rank's slot of every peer's arrival array (their copy streams wait for it). M/W must
// be whole tiles.
template <int kWorld>
struct OwnRows {
  static constexpr bool kEnabled = true;
  static constexpr bool kStoresOnRefill = false;   // a stager thread stores each stage as it lands
  static constexpr bool kPushes = false;
  const cute::TmaDescriptor* shard;
  const cute::TmaDescriptor* slot;
  unsigned long long* staged;
  const unsigned long long* arrive;
  unsigned long long* const* peer_arrive;
  unsigned long long launch;
  int cols;                                // tile columns that stage (1 <= cols <= the grid's columns)

  __device__ __forceinline__ bool owns(int m0, int M, int rank) const {
    const int rows = M / kWorld;
    return m0 >= rank * rows && m0 < (rank + 1) * rows;
  }
  __device__ __forceinline__ void wait_slot_free(int rank) const {
    if (launch > 1)
      for (int p = 0; p < kWorld; ++p)
        if (p != rank) wait_at_least<kScopeSys>(arrive + p, launch - 1);
  }
  // Tiles that stage: this rank's rows.
  __device__ __forceinline__ bool stages(int m0, int M, int rank) const { return owns(m0, M, rank); }
  // Before a CTA's first store: the slot must be free.
  __device__ __forceinline__ void before_first_store(int rank) const { wait_slot_free(rank); }
  // One chunk of a staged stage (loaded at A_gathered row m0), into the slot and into A_gathered.
  __device__ __forceinline__ void store(const cute::TmaDescriptor* tma_a, void* chunk, int k, int m0, int M,
                                        int rank) const {
    cute::SM90_TMA_STORE_2D::copy(slot, chunk, k, m0 - rank * (M / kWorld));
    cute::SM90_TMA_STORE_2D::copy(tma_a, chunk, k, m0);
  }
  // One staged tile row (its stores complete); the last of the launch's publishes the arrival.
  // (`cols`: the tile columns that stage, clamped to the grid's)
  __device__ __forceinline__ void staged_row(int rank, int M, int bm, int cols) const {
    bulk_wait_all();
    fence_proxy_async_global();          // the TMA stores (async proxy) before the release
    fence_acq_rel<kScopeSys>();
    arrive_on_peers_when_done(staged, (unsigned long long)(M / kWorld / bm * cols), peer_arrive, rank, kWorld,
                              launch);
  }
};

// AllGather+GEMM with the peers pushing their shards (the runtime's copy-engine push): every
// peer's copy engine writes its shard straight from its own tensor into this rank's landing
// buffer (A's descriptor, rows [p * M/W, (p + 1) * M/W), each shard behind its flag), and this
// rank's rows come from its shard (`shard`, no waits). Nobody stages anything before the GEMM:
// the tiles in columns n < `cols` store the A stages they load — every row, column n the stages
// k with k % cols == n — into the A_gathered the op returns (`gathered`). The producer stores a
// stage when it is about to refill it (the consumers are done with it, its data still there),
// so no stage is held for a store while it could be computed on and no other thread follows
// the pipeline; the stores are marked evict-first in L2. With kOnRefill = false the stager
// thread of OwnRows stores each stage as it lands instead (kept to measure the two against each
// other: `probe ag_gather`). Nothing is published: the copy streams' flags are the handshake.
//
// kPush (the runtime's pusher="gemm"): no copy engine either — the GEMM pushes this rank's rows
// itself. Each stage of this rank's rows that a tile stores into A_gathered it also stores into
// every peer's landing buffer (`push[q]`: peer (rank + 1 + q) % kWorld's, both slots; rows from
// `push_row0`, the slot of this launch). A CTA leaving this rank's rows (or ending) stores what it
// still holds, waits for its stores, and counts its storing tiles in `pushed`; the tile that
// completes the launch's `tiles_per_launch` writes `launch` into this rank's flag on every peer
// (`peer_flags`) — the flag a copy engine would have written. The landing slot is free by call
// order: this launch runs after this rank's previous GEMM, which waited for every peer's previous
// push, made during the peer's previous GEMM, which started after the peer's GEMM two launches
// back (the last reader of this slot) had finished.
template <int kWorld, bool kOnRefill = true, bool kPush = false>
struct GatherRows {
  static constexpr bool kEnabled = true;
  static constexpr bool kStoresOnRefill = kOnRefill;
  static constexpr bool kPushes = kPush;
  static_assert(!kPush || kOnRefill, "the GEMM pushes the stages its producer stores on refill");
  const cute::TmaDescriptor* shard;
  const cute::TmaDescriptor* gathered;
  int cols;                                // tile columns that store (1 <= cols <= the grid's columns)
  // kPush only (left zero otherwise)
  const cute::TmaDescriptor* push[kWorld > 1 ? kWorld - 1 : 1];
  unsigned long long* pushed;              // this rank's storing tiles pushed, all launches
  unsigned long long* const* peer_flags;   // every rank's flag array, as mapped here
  unsigned long long launch;
  int push_row0;                           // the landing slot's first row: (launch % 2) * M
  unsigned long long tiles_per_launch;     // this rank's storing tiles: (M / kWorld / BM) * cols

  __device__ __forceinline__ bool owns(int m0, int M, int rank) const {
    const int rows = M / kWorld;
    return m0 >= rank * rows && m0 < (rank + 1) * rows;
  }
  __device__ __forceinline__ bool stages(int, int, int) const { return true; }
  __device__ __forceinline__ void before_first_store(int) const {}
  __device__ __forceinline__ void store(const cute::TmaDescriptor*, void* chunk, int k, int m0, int M,
                                        int rank) const {
    tma_store_2d_evict_first(gathered, chunk, k, m0);
    if constexpr (kPush) {
      if (owns(m0, M, rank))
#pragma unroll
        for (int q = 0; q < kWorld - 1; ++q) cute::SM90_TMA_STORE_2D::copy(push[q], chunk, k, push_row0 + m0);
    }
  }
  __device__ __forceinline__ void staged_row(int, int, int, int) const {}
  // `tiles` storing tiles of this rank's rows, every store issued: complete them, then count them
  // (the launch's last publishes it to the peers).
  __device__ __forceinline__ void publish(int tiles, int rank) const {
    bulk_wait_all();
    fence_proxy_async_global();          // the TMA stores (async proxy) before the release
    fence_acq_rel<kScopeSys>();
    arrive_on_peers_when_done(pushed, tiles_per_launch, peer_flags, rank, kWorld, launch,
                              (unsigned long long)tiles);
  }
};

// One A stage (loaded at A_gathered row m0, column k) stored by Own, its stores having read the
// stage before this returns (the caller releases or refills it next).
template <class Tr, class Own>
__device__ __forceinline__ void store_stage(const Own& own, const cute::TmaDescriptor* tma_a, unsigned char* sa, int k,
                                            int m0, int M, int rank) {
  cute::tma_store_fence();
#pragma unroll
  for (int c = 0; c < Tr::kChunksA; ++c) own.store(tma_a, sa + c * Tr::kChunkBytesA, k + c * Tr::EA, m0, M, rank);
  cute::tma_store_arrive();
  bulk_wait_read<0>();
}

// Own::kStoresOnRefill: store what the last kStages fills before iteration `it` still hold (their
// pending rows and columns), each once the consumers are done with it — and, with kClear, mark
// them stored (more fills follow). (The pending arrays are indexed by constants only, so they
// stay in registers.)
template <class Tr, bool kClear, class Own>
__device__ __forceinline__ void store_held_stages(const Own& own, const cute::TmaDescriptor* tma_a, unsigned char* smem,
                                                  uint64_t* empty_bar, int it, int (&pend_m)[Tr::kStages],
                                                  const int (&pend_k)[Tr::kStages], int M, int rank) {
#pragma unroll
  for (int j = 0; j < Tr::kStages; ++j) {
    const int i = it - Tr::kStages + j;   // stage i % kStages holds iteration i's fill
    if (i < 0) continue;
    const int s = i % Tr::kStages;
    int pm = -1, pk = 0;
#pragma unroll
    for (int q = 0; q < Tr::kStages; ++q)
      if (q == s) {
        pm = pend_m[q], pk = pend_k[q];
        if constexpr (kClear) pend_m[q] = -1;
      }
    if (pm < 0) continue;
    cutlass::arch::ClusterBarrier::wait(&empty_bar[s], uint32_t(i / Tr::kStages) & 1u);
    store_stage<Tr>(own, tma_a, smem + Tr::kOffA + s * Tr::kStageBytesA, pk, pm, M, rank);
  }
}

// The kernel body. `waits(pm, pn)` runs on the producer thread before tile (pm, pn)'s loads;
// `notifies(pm, pn)` on one consumer thread once the tile's TMA stores are complete (every
// consumer warpgroup's storing thread waits for its bulk async-groups and fences the async
// proxy, the consumer warpgroups meet at a named barrier, then one thread fences at
// Notifies::kScope and adds to the signal slots).
//
// With a generated Epilogue (the tile program's code after the K loop: conditional stores,
// waits, elementwise sums of the accumulator with loaded tiles, notifies), every consumer
// thread runs `epilogue(ctx, pm, pn)` instead of the store into C and the notifies.
template <class Cfg, class Waits, class Notifies = NoNotifies, class Epilogue = NoEpilogue, class Own = NoOwnRows>
__device__ __forceinline__ void gemm_kernel(const cute::TmaDescriptor* tma_a, const cute::TmaDescriptor* tma_b,
                                            const cute::TmaDescriptor* tma_c, int M, int N, int K, int rank,
                                            const Waits& waits, const Notifies& notifies = Notifies{},
                                            const Epilogue& epilogue = Epilogue{}, const Own& own = Own{}) {
  using Tr = GemmTraits<Cfg>;
  static_assert(!Tr::kSplitN, "the plain GEMM's consumer warpgroups split rows");
  static_assert(!Own::kEnabled || Cfg::kClusterM == 1, "a GEMM staging its own rows runs without clusters");
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
  const int gm = cdiv(M, Tr::BM), gn = cdiv(N, Tr::BN);
  const int k_tiles = cdiv(K, Tr::BK);
  // the tile grid the schedule orders: cluster tiles (kClusterM tile rows each) x tile columns
  constexpr int kCl = Tr::kClusterM;
  const int gmc = cdiv(gm, kCl);
  const int num_tiles = gmc * gn;
  const int start_row = comm_aligned_start(gmc, rank, Cfg::kWorldSize, Cfg::kAlignShift);
  const int cl_rank = kCl > 1 ? int(cute::block_rank_in_cluster()) : 0;
  const int first_tile = int(blockIdx.x) / kCl, tile_step = int(gridDim.x) / kCl;

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(tma_a);
    cute::prefetch_tma_descriptor(tma_b);
    cute::prefetch_tma_descriptor(tma_c);
    for (int s = 0; s < Tr::kStages; ++s) {
      FullBar::init(&full_bar[s], 1);
      // both CTAs' consumers release a stage (with Own's stager thread, it too)
      EmptyBar::init(&empty_bar[s], Tr::kConsumerWGs * kCl + (Own::kEnabled && !Own::kStoresOnRefill ? 1 : 0));
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
    if (warp == 0 && cute::elect_one_sync()) {
      int it = 0;
      // Own::kStoresOnRefill: what each stage holds that is still to be stored (row, k; row -1: nothing)
      int pend_m[Tr::kStages], pend_k[Tr::kStages];
#pragma unroll
      for (int s = 0; s < Tr::kStages; ++s) pend_m[s] = -1, pend_k[s] = 0;
      const int store_cols = own.cols < gn ? own.cols : gn;
      (void)store_cols;
      int push_tiles = 0;                    // Own::kPushes: storing tiles of this rank's rows not yet published
      (void)push_tiles;
      for (int t = first_tile; t < num_tiles; t += tile_step) {
        const TileCoord ct = tile_at(Cfg::kOrder, t, gmc, gn, Cfg::kGroupM, start_row);
        const TileCoord tc{ct.m * kCl + cl_rank, ct.n};
        if constexpr (Own::kPushes) {
          // leaving this rank's rows: store every stage still held, complete the stores and
          // publish them — before this tile's waits (the peers' GEMMs may wait for this publish)
          const bool own_tile = own.owns(tc.m * Tr::BM, M, rank);
          if (push_tiles > 0 && !own_tile) {
            store_held_stages<Tr, true>(own, tma_a, smem, empty_bar, it, pend_m, pend_k, M, rank);
            own.publish(push_tiles, rank);
            push_tiles = 0;
          }
          if (own_tile && tc.n < store_cols) ++push_tiles;
        }
        // with Own, this rank's own rows come from its shard (no waits: nothing else writes them)
        if constexpr (Waits::kEnabled) {
          if (tc.m < gm && !own.owns(tc.m * Tr::BM, M, rank)) {
            waits(tc.m, tc.n);             // acquire: every signal this tile's data depends on
            fence_proxy_async_global();    // ... before the async proxy (TMA) reads that data
          }
        }
        // the tile program's waits in its K loop (Waits::kStaged: e.g. a column-sliced all-gather,
        // each slice waited for when the loop reaches it), not for this rank's rows read from its shard
        const bool stage_waits = Waits::kStaged && tc.m < gm && !own.owns(tc.m * Tr::BM, M, rank);
        (void)stage_waits;
        const int m0 = tc.m * Tr::BM, n0 = tc.n * Tr::BN;
        const cute::TmaDescriptor* ta = tma_a;
        int am0 = m0;
        if constexpr (Own::kEnabled) {
          if (own.owns(m0, M, rank)) {
            ta = own.shard;
            am0 = m0 - rank * (M / Cfg::kWorldSize);
          }
        }
        int kmod = 0;                        // kt % store_cols, counted (Own::kStoresOnRefill)
        (void)kmod;
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % Tr::kStages;
          const uint32_t phase = uint32_t(it / Tr::kStages) & 1u;
          if constexpr (Waits::kStaged) {
            // acquire: the data of this stage has landed, before the async proxy (TMA) reads it
            if (stage_waits && waits.stage(tc.m, tc.n, kt * Tr::BK) > 0) fence_proxy_async_global();
          }
          EmptyBar::wait(&empty_bar[s], phase ^ 1u);
          const int k0 = kt * Tr::BK;
          unsigned char* sa = smem + Tr::kOffA + s * Tr::kStageBytesA;
          unsigned char* sb = smem + Tr::kOffB + s * Tr::kStageBytesB;
          if constexpr (Own::kStoresOnRefill) {
            // (the pending arrays indexed by constants only, so they stay in registers)
            const bool store_next = tc.n < store_cols && kmod == tc.n && own.stages(m0, M, rank);
            if (++kmod == store_cols) kmod = 0;
            int pm = -1, pk = 0;
#pragma unroll
            for (int j = 0; j < Tr::kStages; ++j)
              if (j == s) {
                pm = pend_m[j], pk = pend_k[j];
                pend_m[j] = store_next ? m0 : -1, pend_k[j] = k0;
              }
            // the consumers are done with the stage: store what it held, then refill it
            if (pm >= 0) store_stage<Tr>(own, tma_a, sa, pk, pm, M, rank);
          }
          FullBar::arrive_and_expect_tx(&full_bar[s], Tr::kTxBytes);
#pragma unroll
          for (int c = 0; c < Tr::kChunksA; ++c)
            cute::SM90_TMA_LOAD_2D::copy(ta, &full_bar[s], kCacheHint, sa + c * Tr::kChunkBytesA,
                                         k0 + c * Tr::EA, am0);
          if constexpr (Tr::kBKMajor) {
            // B [N, K]: chunk c is BN rows of EB columns at (n0, k0 + c * EB); with a cluster each CTA
            // loads its 1/kCl of every chunk's rows (TMA box BN / kCl rows) and multicasts them
            constexpr int kRows = Tr::BN / kCl;
            static_assert(kRows % 8 == 0, "a CTA's rows of B keep the swizzle's 8-row period");
#pragma unroll
            for (int c = 0; c < Tr::kChunksB; ++c) {
              unsigned char* dst = sb + c * Tr::kChunkBytesB + cl_rank * kRows * Tr::SB;
              if constexpr (kCl == 1)
                cute::SM90_TMA_LOAD_2D::copy(tma_b, &full_bar[s], kCacheHint, dst, k0 + c * Tr::EB, n0);
              else
                cute::SM90_TMA_LOAD_MULTICAST_2D::copy(tma_b, &full_bar[s], uint16_t((1u << kCl) - 1u), kCacheHint,
                                                       dst, k0 + c * Tr::EB, n0 + cl_rank * kRows);
            }
          } else if constexpr (kCl == 1) {
#pragma unroll
            for (int c = 0; c < Tr::kChunksB; ++c)
              cute::SM90_TMA_LOAD_2D::copy(tma_b, &full_bar[s], kCacheHint, sb + c * Tr::kChunkBytesB,
                                           n0 + c * Tr::EB, k0);
          } else {
            // B chunk c comes from CTA c % kCl of the cluster, into both CTAs' stage s
            constexpr uint16_t kMask = uint16_t((1u << kCl) - 1u);
#pragma unroll
            for (int c = 0; c < Tr::kChunksB; ++c)
              if (c % kCl == cl_rank)
                cute::SM90_TMA_LOAD_MULTICAST_2D::copy(tma_b, &full_bar[s], kMask, kCacheHint,
                                                       sb + c * Tr::kChunkBytesB, n0 + c * Tr::EB, k0);
          }
        }
      }
      if constexpr (Own::kStoresOnRefill) {
        // the last fills: each stored once the consumers are done with it
        store_held_stages<Tr, false>(own, tma_a, smem, empty_bar, it, pend_m, pend_k, M, rank);
        bulk_wait_all();                     // every store of A complete before the CTA exits
        if constexpr (Own::kPushes) {
          if (push_tiles > 0) own.publish(push_tiles, rank);
        }
      }
    }
    if constexpr (Own::kEnabled && !Own::kStoresOnRefill) {
      // ---- the stager (Own): warp 1 of the producer warpgroup follows every stage (so its
      // arrival, counted by the empty barriers, paces it) and stores the stages of the tile rows
      // Own stages (OwnRows: this rank's; GatherRows: all) that the first `cols` tile columns
      // load: the consumers never wait for a store.
      if (warp == 1 && cute::elect_one_sync()) {
        const int cols = own.cols < gn ? own.cols : gn;
        bool first_store = true;
        int it = 0;
        for (int t = first_tile; t < num_tiles; t += tile_step) {
          const TileCoord tc = tile_at(Cfg::kOrder, t, gmc, gn, Cfg::kGroupM, start_row);
          const int m0 = tc.m * Tr::BM;
          const bool stage_tile = tc.n < cols && own.stages(m0, M, rank);
          for (int kt = 0; kt < k_tiles; ++kt, ++it) {
            const int s = it % Tr::kStages;
            FullBar::wait(&full_bar[s], uint32_t(it / Tr::kStages) & 1u);
            if (stage_tile && kt % cols == tc.n) {
              if (first_store) {
                own.before_first_store(rank);
                first_store = false;
              }
              cute::tma_store_fence();
              unsigned char* sa = smem + Tr::kOffA + s * Tr::kStageBytesA;
#pragma unroll
              for (int c = 0; c < Tr::kChunksA; ++c)
                own.store(tma_a, sa + c * Tr::kChunkBytesA, kt * Tr::BK + c * Tr::EA, m0, M, rank);
              cute::tma_store_arrive();
              bulk_wait_read<0>();           // the stores have read the stage ...
            }
            EmptyBar::arrive(&empty_bar[s]);  // ... before it is released
          }
          if (stage_tile) own.staged_row(rank, M, Tr::BM, cols);
        }
        bulk_wait_all();                       // every store of A complete before the CTA exits
      }
    }
  } else {
    // ---------------- consumer warpgroups ----------------
    if constexpr (Cfg::kConsumerRegs > 0) cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int cw = wg - 1;                        // consumer index
    const int tid = int(threadIdx.x) % 128;       // thread in the warpgroup
    const int lane = tid % 32, wq = tid / 32;
    const uint32_t bar_id = 1 + cw;               // named barrier of this warpgroup (0 = __syncthreads)
    const uint32_t stage_a0 = smem_u32 + Tr::kOffA + cw * Tr::MB * 64 * Tr::SA;
    const uint32_t stage_b0 = smem_u32 + Tr::kOffB;
    const uint32_t epi0 = smem_u32 + Tr::kOffC + cw * Tr::kEpiBuffers * Tr::kEpiBufBytes;
    int it = 0;
    int epi_count = 0;
    float acc[Tr::MB][Tr::kAccPerBlock];
    // Cfg::kOverlapStore (16-bit C stored plainly: no generated epilogue): each tile's stores run
    // during the next tile's K loop, and its notifies (if any) once they are complete: after that loop
    constexpr bool kOverlap = overlap_store<Cfg>::value;
    static_assert(!kOverlap || !Epilogue::kEnabled, "a held tile is stored plainly: no generated epilogue");
    cuda::std::conditional_t<kOverlap, HeldTile<Tr, typename Cfg::ElemC>, NoHeldTile> held;
    // release a tile: its stores complete (both warpgroups' halves), then one thread notifies
    const auto release = [&](const TileCoord& c) {
      constexpr uint32_t kNotifyBar = 1 + Tr::kConsumerWGs;   // after the per-warpgroup barriers
      if (tid == 0) {
        bulk_wait_all();                       // this warpgroup's TMA stores of the tile are done
        fence_proxy_async_global();            // async-proxy writes -> before the generic release
      }
      if constexpr (Tr::kConsumerWGs > 1) cutlass::arch::NamedBarrier::sync(128 * Tr::kConsumerWGs, kNotifyBar);
      if (cw == 0 && tid == 0) {
        fence_acq_rel<Notifies::kScope>();
        notifies(c.m, c.n);
      }
    };
    bool pending = false;                        // (held tiles with notifies) the held tile is notified ...
    TileCoord pending_tc{0, 0};                  // ... once its stores, issued during the next K loop, are done
    (void)pending, (void)pending_tc;

    for (int t = first_tile; t < num_tiles; t += tile_step) {
      const TileCoord ct = tile_at(Cfg::kOrder, t, gmc, gn, Cfg::kGroupM, start_row);
      const TileCoord tc{ct.m * kCl + cl_rank, ct.n};
#pragma unroll
      for (int mb = 0; mb < Tr::MB; ++mb)
#pragma unroll
        for (int i = 0; i < Tr::kAccPerBlock; ++i) acc[mb][i] = 0.0f;

      // (the previous tile's held chunks stored while this tile's WGMMAs run)
      consume_k_loop<Tr, typename Cfg::Gmma, Tr::MB, Tr::kAccPerBlock, false>(
          acc, it, k_tiles, full_bar, empty_bar, stage_a0, stage_b0, tid, NothingIssued{}, [&] {
            if constexpr (kOverlap) held.store_next(tma_c, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane);
          });
      if constexpr (kOverlap) {
        held.flush(tma_c, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane);   // a K loop shorter than a tile's chunks
        if constexpr (Notifies::kEnabled) {
          if (pending) release(pending_tc);      // the previous tile: its chunks were stored during this K loop
          pending = tc.m < gm, pending_tc = tc;  // (a cluster partner past the last tile row notifies nothing)
        }
        held.hold(acc, tc.n * Tr::BN, tc.m * Tr::BM + cw * Tr::MB * 64);   // (every row valid)
        continue;
      }

      if constexpr (Epilogue::kEnabled) {
        // the tile program's own epilogue (stores, waits, elementwise sums, notifies)
        if (tc.m < gm) {
          EpilogueCtx<Tr, kCl> ctx{acc, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane, cw};
          epilogue(ctx, tc.m, tc.n);
        }
        continue;
      }
      // ---- epilogue: registers -> swizzled smem -> TMA store, one 64 x EC chunk at a time ----
      store_acc<Tr, typename Cfg::ElemC>(acc, tma_c, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane,
                                         tc.n * Tr::BN, tc.m * Tr::BM + cw * Tr::MB * 64);
      if constexpr (Notifies::kEnabled) {
        if (tc.m >= gm) continue;                // a cluster partner past the last tile row
        release(tc);
      }
    }
    if constexpr (kOverlap) {
      held.flush(tma_c, smem, smem_u32, epi0, epi_count, bar_id, tid, wq, lane);   // the last tile
      if constexpr (Notifies::kEnabled) {
        if (pending) release(pending_tc);
      }
    }
    if (tid == 0) bulk_wait_all();
  }
  if constexpr (kCl > 1) cute::cluster_sync();   // no CTA leaves while its partner may still write to it
}

}  // namespace sm90
}  // namespace tldsl
