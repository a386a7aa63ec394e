// tldsl: a warp-specialized, persistent TMA + WGMMA flash-attention forward kernel for Hopper
// (sm_90a), driven by generated control code (codegen/recipes/attention.py), on CuTe's arch-level
// ops only (TMA copies, GMMA ops, mbarriers, named barriers, register reconfiguration) -- the
// same building blocks, descriptor arithmetic and conventions as sm90_gemm.hpp.
//
// What it computes, per task (pid0, pid1) of the tile program's grid (one query block of BM
// rows, one head of D columns; sp_attention's grid is (heads, query blocks)):
//
//   Q = q[q_row : q_row+BM, q_col : q_col+D]                      (TMA, zero outside q)
//   for every key block b the control code yields, in the tile program's order:
//     K_b, V_b = BN rows of k / v starting at row b.row of shard b.shard (a 3-D TMA view
//                [shards, L, width] of the gathered tensors: rows past the shard end read 0
//                and are never fetched -- the tile program's load_rows with -1 rows)
//     S = Q K_b^T * scale, masked (key j of row i is kept iff j < b.valid and, when causal,
//         b.key_pos0 + j <= b.q_pos0 + i [+ the shift of a SplitKeyBlock's second run]) to the
//         program's fill value
//     m_new = max(m, rowmax S);  a = exp(m - m_new);  P = masked ? 0 : exp(S - m_new)
//     l = l * a + rowsum P;  O = O * a + P(as input type) V_b;  m = m_new
//   o[o_row : o_row+BM, o_col : o_col+D] = O / (l > 0 ? l : 1)    (TMA store, clipped)
// Exponentials are base 2 on log2(e)-prescaled scores (the same values up to rounding).
//
// CTA = 1 producer warpgroup + kConsumerWGs = BM/64 consumer warpgroups (128 threads each).
//  * producer: one elected thread walks this CTA's tiles (persistent, tile order of the compute
//    schedule). Per tile: wait until the consumers freed the Q buffer, run the tile program's
//    top-level waits, TMA-load Q; then for each key block (Prog::run<true> yields them after
//    the tile program's waits for that block: acquire loads of the signal slots) issue
//    fence.proxy.async.global and TMA-load K and V into the next stage of a kStages ring
//    (full barriers: 1 arrival + transaction bytes, K and V separately; empty barrier: one
//    arrival per consumer warpgroup).
//  * consumer warpgroup w owns query rows [64w, 64w+64) of the tile: S = Q K^T by SS-WGMMA
//    (m64 n=BN k16, both operands K-major), online softmax in registers (each thread holds
//    2 rows x BN/4 columns; row reductions over the 4-lane quad), P converted in registers to
//    the A fragments of an RS-WGMMA O += P V (m64 n=D k16, V MN-major). With kOverlap the
//    WGMMA P_{j-1} V_{j-1} runs while the softmax of block j is computed (S_j issued first).
//    Epilogue: normalise, write O (input type) into this warpgroup's rows of the Q buffer
//    (swizzled like Q), TMA-store, and release the Q buffer once the store has read it.
//
// Shared memory (from a 1024-byte aligned base): Q | K stages | V stages | barriers.
// Q: D/E chunks of BM rows x S bytes (S = min(128, 2D) bytes = E elements, swizzle S bytes);
// each K and V stage: D/E chunks of BN rows x S bytes. The same TMA box (E, rows) fills them;
// GMMA descriptors read Q and K as K-major, V as MN-major (leading byte offset = chunk size).
//
// The first part of this header is plain C++ (no CUDA): the records the generated control
// code hands over, so that the host test suite can compile and run that control code.
#pragma once

#include "tldsl/tile_order.hpp"

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TLDSL_CONTROL __device__ __forceinline__
#else
#define TLDSL_CONTROL inline
#endif

namespace tldsl {
namespace attn {

// The Q load / O store coordinates of one tile (top-level values of the tile program).
struct TileInfo {
  int q_row, q_col;      // first row / column of the Q tile in q
  int o_row, o_col;      // first row / column of the O tile in o
};

// One key block, in the order the tile program visits them.
struct KeyBlock {
  int k_col, v_col;      // first column of the K / V tile (the head's columns)
  int row;               // first row inside the shard (>= 0)
  int shard;             // shard index (TMA coordinate 2 of the [shards, L, width] view)
  int valid;             // keys j < valid lie inside the shard (L - row)
  int key_pos0;          // position of key 0 for the causal mask
  int q_pos0;            // position of query row 0 of the tile for the causal mask
};

// A key block of a tile whose query rows come from two runs of positions (a query block that
// straddles the two chunks of a zig-zag layout): rows i >= q_split are at q_pos1 + i.
struct SplitKeyBlock : KeyBlock {
  int q_split;           // first tile row of the second run (may lie outside 0 .. BM-1)
  int q_pos1;            // position of the second run's row 0 (extrapolated)
};

// How far query row `row` of the tile lies from q_pos0 + row (the causal mask's shift).
TLDSL_CONTROL int query_shift(const KeyBlock&, int) { return 0; }
TLDSL_CONTROL int query_shift(const SplitKeyBlock& b, int row) { return row < b.q_split ? 0 : b.q_pos1 - b.q_pos0; }

// The causal position of the first of query rows [r0, r1) of the tile, and of the first row of
// the second run when it starts inside: the smallest position of the range (each run ascends).
TLDSL_CONTROL int min_query_pos(const KeyBlock& b, int r0, int) { return b.q_pos0 + r0; }
TLDSL_CONTROL int min_query_pos(const SplitKeyBlock& b, int r0, int r1) {
  const int p = b.q_pos0 + query_shift(b, r0) + r0;
  const int p1 = b.q_pos1 + b.q_split;
  return (b.q_split > r0 && b.q_split < r1 && p1 < p) ? p1 : p;
}

// Whether the block masks any key of query rows [r0, r1): keys past the shard end (valid < bn)
// or, when causal, keys past a row's position. Blocks that mask none take the mask-free softmax.
template <class B>
TLDSL_CONTROL bool block_needs_mask(const B& b, int bn, bool causal, int r0, int r1) {
  return b.valid < bn || (causal && min_query_pos(b, r0, r1) - b.key_pos0 < bn - 1);
}

}  // namespace attn
}  // namespace tldsl

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

#include "tldsl/sm90_gemm.hpp"   // arch headers, gmma_desc_bits, swizzle, store_pair, bulk waits

namespace tldsl {
namespace sm90 {

// Everything derived from the generated configuration `Cfg`:
//   Cfg::Elem (q/k/v), Cfg::ElemO (o), Cfg::GmmaS (MMA_64xBNx16_*_SS<K, K>),
//   Cfg::GmmaO (MMA_64xDx16_*_RS<K, MN>), BM, BN, D, kStages, kConsumerWGs, kOrder, kGroupM,
//   kWorldSize, kAlignShift, kGridM, kGridN, kProducerRegs, kConsumerRegs, kCausal, kOverlap,
//   kFoldScale (the scale folded into the exponent's FFMA), kMaskFree (a mask-free body for key
//   blocks that mask nothing),
//   kScaleLog2 (scale * log2 e), kFillLog2 (masked score * log2 e), kInitLog2 (initial max).
template <class Cfg>
struct AttnTraits {
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, D = Cfg::D, kStages = Cfg::kStages;
  static constexpr int kConsumerWGs = Cfg::kConsumerWGs;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kElemBytes = int(sizeof(typename Cfg::Elem));
  static_assert(kElemBytes == 2 && sizeof(typename Cfg::ElemO) == 2, "16-bit q/k/v and o (f16, bf16)");
  static_assert(BM == 64 * kConsumerWGs && (kConsumerWGs == 1 || kConsumerWGs == 2),
                "one consumer warpgroup per 64 query rows, BM = 64 or 128");
  static_assert(D == 16 || D == 32 || D == 64 || D == 128, "head dim 16, 32, 64 or 128");
  static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "BN a multiple of 16 (WGMMA K of P V), <= 256");
  static_assert(kStages >= 1, "at least one stage");
  static_assert(!Cfg::kOverlap || kStages >= 2, "overlapping P V with the next S needs two stages");

  static constexpr int S = cmin(128, D * kElemBytes);      // swizzle bytes of a row chunk
  static constexpr int E = S / kElemBytes;                  // elements per row chunk
  static constexpr int kChunks = D / E;
  static constexpr int kChunkBytesQ = BM * S;
  static constexpr int kChunkBytesKV = BN * S;
  static constexpr int kQBytes = BM * D * kElemBytes;
  static constexpr int kKVBytes = BN * D * kElemBytes;      // one K (or V) tile
  static constexpr int kStageStride = round_up(kKVBytes, 1024);
  static constexpr int kSAcc = BN / 2;                      // fp32 S values per thread
  static constexpr int kOAcc = D / 2;                       // fp32 O values per thread

  static constexpr int kOffQ = 0;
  static constexpr int kOffK = round_up(kQBytes, 1024);
  static constexpr int kOffV = kOffK + kStages * kStageStride;
  static constexpr int kOffBar = kOffV + kStages * kStageStride;
  static constexpr int kBarriers = 2 + 3 * kStages;         // full_q, empty_q, full_k[], full_v[], empty[]
  static constexpr int kSmemUsed = kOffBar + kBarriers * 8;
  static constexpr int kSmemBytes = kSmemUsed + 1024;       // + slack to align the dynamic base
  static_assert(kSmemBytes <= 232448, "shared memory over the sm_90 limit of 227 KiB per block");

  static constexpr uint64_t kDescQK = gmma_desc_bits(S, 16, 8 * S);              // K-major
  static constexpr uint64_t kDescV = gmma_desc_bits(S, kChunkBytesKV, 8 * S);     // MN-major
};

template <class Op, int... I>
__device__ __forceinline__ void gmma_ss(uint64_t desc_a, uint64_t desc_b, float* d,
                                        cute::SM90::GMMA::ScaleOut scale,
                                        cuda::std::integer_sequence<int, I...>) {
  Op::fma(desc_a, desc_b, d[I]..., scale);
}

template <class Op, int... I>
__device__ __forceinline__ void gmma_rs(const uint32_t* a, uint64_t desc_b, float* d,
                                        cuda::std::integer_sequence<int, I...>) {
  Op::fma(a[0], a[1], a[2], a[3], desc_b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Online softmax of one key block on this thread's two rows (h = 0: row r, h = 1: row r + 8).
// s: the block's raw scores (WGMMA accumulator layout) -> P (unnormalised, fp32).
// lim[h]: the last kept key column of row h (BN - 1 or more: nothing masked). m, l: running max
// (log2 domain) and this thread's partial row sums; alpha: the rescale factors of this block.
// Masking is done with selects, not branches: a WGMMA may be in flight meanwhile, and ptxas
// serialises WGMMAs whose registers are live across divergent code.
// kFold (Cfg::kFoldScale): the scale is folded into the exponent, P = 2^(s c - m) by one FFMA
// and one EX2 per score (c = scale log2 e, m already in the log2 domain), the row max taken over
// the kept raw scores and scaled once (c > 0: rounding is monotone, so fl(c max s) = max fl(c s));
// without kMasked no key is masked (lim ignored, no selects). Otherwise every score is scaled and
// masked first (FMUL + select), then P = 2^(s' - m) (FADD + EX2): the kernel of before.
template <class Cfg, bool kMasked>
__device__ __forceinline__ void softmax_block(float* s, float (&m)[2], float (&l)[2], float (&alpha)[2],
                                              const int (&lim)[2], int lane) {
  using Tr = AttnTraits<Cfg>;
  constexpr bool kFold = Cfg::kFoldScale;
  constexpr float c = Cfg::kScaleLog2;
  const int c0 = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int lh = lim[h] - c0;                   // column 8j + e is kept iff 8j + e <= lh
    float mx = m[h];
    if constexpr (kFold && c > 0.0f) {
      float r = -__int_as_float(0x7f800000);      // the max of the kept raw scores
#pragma unroll
      for (int j = 0; j < Tr::BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          r = fmaxf(r, (!kMasked || 8 * j + e <= lh) ? s[4 * j + 2 * h + e] : -__int_as_float(0x7f800000));
      mx = fmaxf(mx, r * c);
      // a masked score counts as the fill value (lim[h] is the same in the row's 4 lanes)
      if constexpr (kMasked) mx = lim[h] < Tr::BN - 1 ? fmaxf(mx, Cfg::kFillLog2) : mx;
    } else {
#pragma unroll
      for (int j = 0; j < Tr::BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          const float y = (!kMasked || 8 * j + e <= lh) ? x * c : Cfg::kFillLog2;
          if constexpr (!kFold) x = y;
          mx = fmaxf(mx, y);
        }
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    alpha[h] = ex2(m[h] - mx);
    const float nmx = -mx;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < Tr::BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        const float t = kFold ? fmaf(x, c, nmx) : x - mx;
        const float p = (!kMasked || 8 * j + e <= lh) ? ex2(t) : 0.0f;
        x = p;
        sum += p;
      }
    }
    l[h] = l[h] * alpha[h] + sum;
    m[h] = mx;
  }
}

// The kernel body. `prog.run<kWaits>(pid0, pid1, on_tile, on_block)` is the generated control
// code of the tile program: it computes the tile's coordinates (on_tile), then yields every key
// block in order (on_block), running the tile program's waits first when kWaits.
template <class Cfg, class Prog>
__device__ __forceinline__ void attention_kernel(const cute::TmaDescriptor* tma_q, const cute::TmaDescriptor* tma_k,
                                                 const cute::TmaDescriptor* tma_v, const cute::TmaDescriptor* tma_o,
                                                 const Prog& prog) {
  using Tr = AttnTraits<Cfg>;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  using attn::KeyBlock;
  using attn::TileInfo;
  constexpr uint64_t kHintQ = uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST);
  constexpr uint64_t kHintKV = uint64_t(cute::TMA::CacheHintSm90::EVICT_LAST);

  extern __shared__ unsigned char tldsl_smem_raw[];
  const uint32_t raw = cute::cast_smem_ptr_to_uint(tldsl_smem_raw);
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;
  unsigned char* smem = tldsl_smem_raw + pad;
  const uint32_t smem_u32 = raw + pad;
  uint64_t* full_q = reinterpret_cast<uint64_t*>(smem + Tr::kOffBar);
  uint64_t* empty_q = full_q + 1;
  uint64_t* full_k = full_q + 2;
  uint64_t* full_v = full_k + Tr::kStages;
  uint64_t* empty_kv = full_v + Tr::kStages;

  const int warp = int(threadIdx.x) / 32;
  const int wg = int(threadIdx.x) / 128;
  constexpr int kNumTiles = Cfg::kGridM * Cfg::kGridN;
  const int start_row = comm_aligned_start(Cfg::kGridM, prog.rank, Cfg::kWorldSize, Cfg::kAlignShift);

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(tma_q);
    cute::prefetch_tma_descriptor(tma_k);
    cute::prefetch_tma_descriptor(tma_v);
    cute::prefetch_tma_descriptor(tma_o);
    FullBar::init(full_q, 1);
    EmptyBar::init(empty_q, Tr::kConsumerWGs);
    for (int s = 0; s < Tr::kStages; ++s) {
      FullBar::init(&full_k[s], 1);
      FullBar::init(&full_v[s], 1);
      EmptyBar::init(&empty_kv[s], Tr::kConsumerWGs);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer warpgroup ----------------
    if constexpr (Cfg::kProducerRegs > 0) cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (warp == 0 && cute::elect_one_sync()) {
      int it = 0, tile_iter = 0;
      for (int t = blockIdx.x; t < kNumTiles; t += gridDim.x, ++tile_iter) {
        const TileCoord tc = tile_at(Cfg::kOrder, t, Cfg::kGridM, Cfg::kGridN, Cfg::kGroupM, start_row);
        prog.template run<true>(
            tc.m, tc.n,
            [&](const TileInfo& ti) {
              EmptyBar::wait(empty_q, uint32_t(tile_iter & 1) ^ 1u);   // the consumers are done with Q
              if constexpr (Prog::kHasWaits) fence_proxy_async_global();
              FullBar::arrive_and_expect_tx(full_q, Tr::kQBytes);
#pragma unroll
              for (int c = 0; c < Tr::kChunks; ++c)
                cute::SM90_TMA_LOAD_2D::copy(tma_q, full_q, kHintQ, smem + Tr::kOffQ + c * Tr::kChunkBytesQ,
                                             ti.q_col + c * Tr::E, ti.q_row);
            },
            [&](const KeyBlock& b) {
              const int s = it % Tr::kStages;
              const uint32_t phase = uint32_t(it / Tr::kStages) & 1u;
              EmptyBar::wait(&empty_kv[s], phase ^ 1u);
              // the waits for this block ran (acquire); order them before the async proxy's reads
              if constexpr (Prog::kHasWaits) fence_proxy_async_global();
              unsigned char* sk = smem + Tr::kOffK + s * Tr::kStageStride;
              unsigned char* sv = smem + Tr::kOffV + s * Tr::kStageStride;
              FullBar::arrive_and_expect_tx(&full_k[s], Tr::kKVBytes);
#pragma unroll
              for (int c = 0; c < Tr::kChunks; ++c)
                cute::SM90_TMA_LOAD_3D::copy(tma_k, &full_k[s], kHintKV, sk + c * Tr::kChunkBytesKV,
                                             b.k_col + c * Tr::E, b.row, b.shard);
              FullBar::arrive_and_expect_tx(&full_v[s], Tr::kKVBytes);
#pragma unroll
              for (int c = 0; c < Tr::kChunks; ++c)
                cute::SM90_TMA_LOAD_3D::copy(tma_v, &full_v[s], kHintKV, sv + c * Tr::kChunkBytesKV,
                                             b.v_col + c * Tr::E, b.row, b.shard);
              ++it;
            });
      }
    }
  } else {
    // ---------------- consumer warpgroups ----------------
    if constexpr (Cfg::kConsumerRegs > 0) cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    using Elem = typename Cfg::Elem;
    const int cw = wg - 1;
    const int tid = int(threadIdx.x) % 128;
    const int lane = tid % 32, wq = tid / 32;
    const uint32_t bar_id = 1 + cw;                   // named barrier of this warpgroup
    const int row0 = cw * 64 + wq * 16 + lane / 4;    // tile row of this thread's h = 0 values
    const uint32_t q_base = smem_u32 + Tr::kOffQ + cw * 64 * Tr::S;
    constexpr auto kSeqS = cuda::std::make_integer_sequence<int, Tr::kSAcc>{};
    constexpr auto kSeqO = cuda::std::make_integer_sequence<int, Tr::kOAcc>{};
    int it = 0, tile_iter = 0;

    for (int t = blockIdx.x; t < kNumTiles; t += gridDim.x, ++tile_iter) {
      const TileCoord tc = tile_at(Cfg::kOrder, t, Cfg::kGridM, Cfg::kGridN, Cfg::kGroupM, start_row);
      float o[Tr::kOAcc];
      float s[Tr::kSAcc];
      uint32_t pa[Tr::BN / 16][4];
      float m[2] = {Cfg::kInitLog2, Cfg::kInitLog2};
      float l[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < Tr::kOAcc; ++i) o[i] = 0.0f;
      TileInfo info{0, 0, 0, 0};
      // kOverlap: block j issues S_j, then P_{j-1} V_{j-1} (in flight during the softmax of block
      // j). The first block of a tile issues P V with P = 0 on its own V stage instead, so every
      // block runs the same WGMMA sequence (no WGMMA in a data-dependent branch; adding 0 * V is
      // what the tile program's own dot of a fully masked block does).
      bool pending = false;                           // P of block `pv_stage` awaits P V
      int pv_stage = 0;
      uint32_t pv_phase = 0;
      if constexpr (Cfg::kOverlap) {
#pragma unroll
        for (int kk = 0; kk < Tr::BN / 16; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q) pa[kk][q] = 0u;
      }

      // O += P V on stage `st` (P in pa); commits one WGMMA batch
      auto issue_pv = [&](int st) {
        const uint32_t v_base = smem_u32 + Tr::kOffV + st * Tr::kStageStride;
#pragma unroll
        for (int i = 0; i < Tr::kOAcc; ++i) cute::warpgroup_fence_operand(o[i]);
#pragma unroll
        for (int kk = 0; kk < Tr::BN / 16; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q) cute::warpgroup_fence_operand(pa[kk][q]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < Tr::BN / 16; ++kk) {
          const uint64_t desc_v = Tr::kDescV | uint64_t(((v_base + kk * 16 * Tr::S) & 0x3FFFF) >> 4);
          gmma_rs<typename Cfg::GmmaO>(pa[kk], desc_v, o, kSeqO);
        }
        cute::warpgroup_commit_batch();
      };
      auto release = [&](int st) {
        if (tid == 0) EmptyBar::arrive(&empty_kv[st]);   // K and V of this stage are consumed
      };

      // One key block (a KeyBlock or a SplitKeyBlock); kMasked: some key of this warpgroup's rows
      // is masked (always, without kMaskFree).
      auto key_block = [&](const auto& b, auto masked) {
        constexpr bool kMasked = decltype(masked)::value;
        const int st = it % Tr::kStages;
        const uint32_t phase = uint32_t(it / Tr::kStages) & 1u;
        ++it;
        // ---- S = Q K^T ----
        FullBar::wait(&full_k[st], phase);
        const uint32_t k_base = smem_u32 + Tr::kOffK + st * Tr::kStageStride;
#pragma unroll
        for (int i = 0; i < Tr::kSAcc; ++i) cute::warpgroup_fence_operand(s[i]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < Tr::D / 16; ++kk) {
          const uint32_t off = ((kk * 16) % Tr::E) * Tr::kElemBytes;   // k16 step inside a chunk
          const uint32_t qa = q_base + (kk * 16 / Tr::E) * Tr::kChunkBytesQ + off;
          const uint32_t ka = k_base + (kk * 16 / Tr::E) * Tr::kChunkBytesKV + off;
          gmma_ss<typename Cfg::GmmaS>(Tr::kDescQK | uint64_t((qa & 0x3FFFF) >> 4),
                                       Tr::kDescQK | uint64_t((ka & 0x3FFFF) >> 4), s,
                                       kk == 0 ? cute::SM90::GMMA::ScaleOut::Zero
                                               : cute::SM90::GMMA::ScaleOut::One,
                                       kSeqS);
        }
        cute::warpgroup_commit_batch();
        if constexpr (Cfg::kOverlap) {
          if (!pending) {                         // first block: P = 0 on this block's V
            pv_stage = st;
            pv_phase = phase;
          }
          FullBar::wait(&full_v[pv_stage], pv_phase);
          issue_pv(pv_stage);                     // behind S in the WGMMA queue
          cute::warpgroup_wait<1>();              // S is done, P V may still run
        } else {
          cute::warpgroup_wait<0>();
        }
#pragma unroll
        for (int i = 0; i < Tr::kSAcc; ++i) cute::warpgroup_fence_operand(s[i]);

        // ---- online softmax ----
        float alpha[2];
        int lim[2];
        if constexpr (Cfg::kCausal) {
          const int d0 = b.q_pos0 - b.key_pos0;
          lim[0] = imin(b.valid - 1, d0 + attn::query_shift(b, row0) + row0);
          lim[1] = imin(b.valid - 1, d0 + attn::query_shift(b, row0 + 8) + row0 + 8);
        } else {
          lim[0] = lim[1] = b.valid - 1;
        }
        softmax_block<Cfg, kMasked>(s, m, l, alpha, lim, lane);

        if constexpr (Cfg::kOverlap) {
          cute::warpgroup_wait<0>();              // O is complete up to the previous block
#pragma unroll
          for (int i = 0; i < Tr::kOAcc; ++i) cute::warpgroup_fence_operand(o[i]);
          if (pending) release(pv_stage);
        }
        // ---- O = O * alpha; P -> A fragments (the accumulator layout of S is that of A) ----
#pragma unroll
        for (int j = 0; j < Tr::D / 8; ++j) {
          o[4 * j + 0] *= alpha[0];
          o[4 * j + 1] *= alpha[0];
          o[4 * j + 2] *= alpha[1];
          o[4 * j + 3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < Tr::BN / 16; ++kk)
#pragma unroll
          for (int q = 0; q < 4; ++q) pa[kk][q] = pack2<Elem>(s[8 * kk + 2 * q], s[8 * kk + 2 * q + 1]);

        if constexpr (Cfg::kOverlap) {
          pending = true;
          pv_stage = st;
          pv_phase = phase;
        } else {
          FullBar::wait(&full_v[st], phase);
          issue_pv(st);
          cute::warpgroup_wait<0>();
#pragma unroll
          for (int i = 0; i < Tr::kOAcc; ++i) cute::warpgroup_fence_operand(o[i]);
          release(st);
        }
      };

      prog.template run<false>(
          tc.m, tc.n,
          [&](const TileInfo& ti) {
            info = ti;
            FullBar::wait(full_q, uint32_t(tile_iter & 1));
          },
          [&](const auto& b) {                        // a KeyBlock or a SplitKeyBlock
            if constexpr (Cfg::kMaskFree) {
              // the same WGMMA sequence in both bodies, none in flight across the branch
              if (attn::block_needs_mask(b, Tr::BN, Cfg::kCausal, cw * 64, cw * 64 + 64))
                key_block(b, cuda::std::true_type{});
              else
                key_block(b, cuda::std::false_type{});
            } else {
              key_block(b, cuda::std::true_type{});
            }
          });
      if constexpr (Cfg::kOverlap) {
        if (pending) {                                // P V of the last block
          FullBar::wait(&full_v[pv_stage], pv_phase);
          issue_pv(pv_stage);
          cute::warpgroup_wait<0>();
#pragma unroll
          for (int i = 0; i < Tr::kOAcc; ++i) cute::warpgroup_fence_operand(o[i]);
          release(pv_stage);
        }
      }

      // ---- epilogue: O / l -> this warpgroup's rows of the Q buffer -> TMA store ----
      float inv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float tot = l[h];
        tot += __shfl_xor_sync(0xffffffffu, tot, 1);
        tot += __shfl_xor_sync(0xffffffffu, tot, 2);
        inv[h] = tot > 0.0f ? 1.0f / tot : 1.0f;
      }
      cutlass::arch::NamedBarrier::sync(128, bar_id);      // every warp is past its last WGMMA on Q
#pragma unroll
      for (int j = 0; j < Tr::D / 8; ++j) {
        const int col = 8 * j + 2 * (lane % 4);
        const int chunk = col / Tr::E;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wq * 16 + lane / 4 + 8 * h;
          const uint32_t off = swizzle(uint32_t(row * Tr::S + (col - chunk * Tr::E) * Tr::kElemBytes), Tr::S);
          store_pair<typename Cfg::ElemO>(q_base + chunk * Tr::kChunkBytesQ + off, o[4 * j + 2 * h] * inv[h],
                                          o[4 * j + 2 * h + 1] * inv[h]);
        }
      }
      cute::tma_store_fence();                             // generic-proxy writes -> visible to TMA
      cutlass::arch::NamedBarrier::sync(128, bar_id);
      if (tid == 0) {
#pragma unroll
        for (int c = 0; c < Tr::kChunks; ++c)
          cute::SM90_TMA_STORE_2D::copy(tma_o, smem + (q_base - smem_u32) + c * Tr::kChunkBytesQ,
                                        info.o_col + c * Tr::E, info.o_row + cw * 64);
        cute::tma_store_arrive();
        bulk_wait_read<0>();                               // the store has read the Q buffer ...
        EmptyBar::arrive(empty_q);                         // ... so the next tile's Q may land there
      }
    }
    if (tid == 0) bulk_wait_all();
  }
}

}  // namespace sm90
}  // namespace tldsl

#endif  // CUDA
