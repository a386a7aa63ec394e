// tldsl: `dot` on WGMMA for the general lowering (general.hpp; chosen per dot by
// codegen/plan/general.py): a dot of f16 / bf16 tiles whose M is a multiple of 64, in a CTA of
// whole warpgroups (128 threads each). Smaller or f32 dots stay on mma_dot (mma.sync).
//
// C[M, N] = A[M, K] @ B[K, N], fp32 accumulation, in three steps per chunk of KC columns of A
// (rows of B):
//  1. staging: every thread of the CTA computes operand elements (`a(i, k)`, `b(k, j)`: a slot
//     of shared memory, or any element expression — a transposed or computed tile) and writes
//     them, 16 bytes at a time, into a staging area of shared memory the plan reserves, in the
//     K-major no-swizzle ("interleave") layout of GMMA descriptors: 8-row x 16-byte core
//     matrices, K-neighbours 128 bytes apart (LBO), 8-row groups KC * 16 bytes apart (SBO).
//     A is stored as M rows of KC, B as its transpose (NT * tiles rows of KC); padding (rows
//     and columns past the tile, K past the end) is zero. Then fence.proxy.async (generic writes
//     -> visible to the async proxy WGMMA reads through) and a CTA barrier.
//  2. each warpgroup takes output tiles of 64 rows x NT columns in turn (tile t = its index,
//     + the CTA's warpgroups); per tile: wgmma.fence, KC / 16 WGMMAs (m64nNTk16, both operands
//     from shared memory), commit_group, wait_group 0.
//  3. each tile's accumulators go to `c(i, j, v)` (inside the tile only) — the statement that
//     consumes the dot (`acc += dot`, a stored element value) or the dot's own slot.
// Where K needs several chunks (staging is capped at what the plan allows), a CTA barrier
// separates each chunk's WGMMAs from the next chunk's staging and every warpgroup walks the
// tiles in the same passes; with one chunk the operands are staged once for all tiles.
//
// Under TLDSL_HOST_EMULATION the product is computed as mma_dot's emulation computes it (the
// same element-by-element fp32 accumulation of exactly representable 16-bit inputs).
#pragma once

#include "tldsl/general.hpp"
#include "tldsl/general_gmma_op.hpp"

#if !defined(TLDSL_HOST_EMULATION)
#include "tldsl/gmma.hpp"
#endif

namespace tldsl {
namespace gen {

// The bytes of shared memory wgmma_dot stages its operands in (the plan reserves as many:
// codegen/plan/general.py staging_bytes).
constexpr int wgmma_staging_bytes(int M, int N, int NT, int KC) {
  return (M + (N + NT - 1) / NT * NT) * KC * 2;
}

// C[M, N] = A[M, K] @ B[K, N] on WGMMA (see the top of this file): `stage` is the staging
// area (wgmma_staging_bytes(M, N, NT, KC), 16-byte aligned), NT the columns of a warpgroup's
// output tile, KC the K columns staged at once (a multiple of 16). Every thread of the CTA
// calls it; blockDim.x is a multiple of 128.
template <MmaKind Kind, int M, int N, int K, int NT, int KC, class FA, class FB, class FC>
TLDSL_DEV void wgmma_dot(void* stage, FA a, FB b, FC c) {
  static_assert(Kind != MmaKind::kTF32, "WGMMA dots take f16 / bf16 operands");
  static_assert(M % 64 == 0 && NT % 8 == 0 && NT <= 256 && KC % 16 == 0 && KC > 0, "WGMMA tile shapes");
#if defined(TLDSL_HOST_EMULATION)
  (void)stage;
  mma_dot<Kind, M, N, K>(a, b, c);
#else
  constexpr int kTilesN = (N + NT - 1) / NT, kTiles = (M / 64) * kTilesN;
  constexpr int kRowsB = kTilesN * NT;                 // B^T rows staged (past N: zeros)
  constexpr int kChunks = (K + KC - 1) / KC;
  constexpr int kCores = KC / 8;                       // 16-byte core-matrix rows along K
  constexpr int kUnitsA = M * kCores, kUnitsB = kRowsB * kCores;
  constexpr uint64_t kDesc = sm90::gmma_desc_bits(0, 128, KC * 16);
  using Gmma = typename GmmaSS<Kind, NT, cute::SM90::GMMA::Major::K>::type;
  unsigned char* const sa = static_cast<unsigned char*>(stage);
  unsigned char* const sb = sa + M * KC * 2;
  const int wg = (int)threadIdx.x / 128, nwg = (int)blockDim.x / 128, tid = (int)threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;

  // 16-byte unit u of an operand: core matrix u / 8 (row group (u / 8) / kCores, K group
  // (u / 8) % kCores), row u % 8 of it — neighbouring threads on neighbouring rows of a core
  // matrix, 16 bytes apart: no bank conflicts
  auto stage_chunk = [&](int k0) {
    for (int u = (int)threadIdx.x; u < kUnitsA; u += (int)blockDim.x) {
      const int core = u / 8, i = (core / kCores) * 8 + u % 8, k = k0 + (core % kCores) * 8;
      unsigned w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int kk = k + 2 * q;
        w[q] = pack2<Kind>(kk < K ? a(i, kk) : 0.0f, kk + 1 < K ? a(i, kk + 1) : 0.0f);
      }
      *reinterpret_cast<uint4*>(sa + u * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    for (int u = (int)threadIdx.x; u < kUnitsB; u += (int)blockDim.x) {
      const int core = u / 8, j = (core / kCores) * 8 + u % 8, k = k0 + (core % kCores) * 8;
      unsigned w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int kk = k + 2 * q;
        const bool in = j < N;
        w[q] = pack2<Kind>(in && kk < K ? b(kk, j) : 0.0f, in && kk + 1 < K ? b(kk + 1, j) : 0.0f);
      }
      *reinterpret_cast<uint4*>(sb + u * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    fence_view_async_shared();   // the staged operands, visible to the WGMMAs (async proxy)
    __syncthreads();
  };
  // the WGMMAs of one staged chunk into tile t's accumulators, complete on return
  auto multiply = [&](int t, float* d) {
    const int mb = t / kTilesN, nb = t % kTilesN;
    const uint32_t a0 = (uint32_t)__cvta_generic_to_shared(sa) + mb * 64 * KC * 2;
    const uint32_t b0 = (uint32_t)__cvta_generic_to_shared(sb) + nb * NT * KC * 2;
#pragma unroll
    for (int v = 0; v < NT / 2; ++v) cute::warpgroup_fence_operand(d[v]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < KC / 16; ++kk) {   // a k16 step: two core matrices along K, 256 bytes
      const uint64_t da = kDesc | uint64_t(((a0 + kk * 256) & 0x3FFFF) >> 4);
      const uint64_t db = kDesc | uint64_t(((b0 + kk * 256) & 0x3FFFF) >> 4);
      sm90::gmma<Gmma>(da, db, d, cuda::std::make_integer_sequence<int, NT / 2>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int v = 0; v < NT / 2; ++v) cute::warpgroup_fence_operand(d[v]);
  };
  // accumulator v of this thread: row warp * 16 + lane / 4 (+ 8), column (v / 4) * 8 + 2 * (lane % 4) (+ 1)
  auto emit = [&](int t, const float* d) {
    const int i0 = (t / kTilesN) * 64 + warp * 16 + lane / 4, j0 = (t % kTilesN) * NT + 2 * (lane % 4);
#pragma unroll
    for (int v = 0; v < NT / 2; ++v) {
      const int j = j0 + (v / 4) * 8 + v % 2;
      if (N % NT == 0 || j < N) c(i0 + 8 * ((v / 2) % 2), j, d[v]);
    }
  };
  float d[NT / 2];
  if constexpr (kChunks == 1) {
    stage_chunk(0);
#pragma unroll 1
    for (int t = wg; t < kTiles; t += nwg) {
#pragma unroll
      for (int v = 0; v < NT / 2; ++v) d[v] = 0.0f;
      multiply(t, d);
      emit(t, d);
    }
  } else {
#pragma unroll 1
    for (int t0 = 0; t0 < kTiles; t0 += nwg) {
      const int t = t0 + wg;
#pragma unroll
      for (int v = 0; v < NT / 2; ++v) d[v] = 0.0f;
#pragma unroll 1
      for (int ch = 0; ch < kChunks; ++ch) {
        if (t0 > 0 || ch > 0) __syncthreads();   // every warpgroup is done with the staged chunk
        stage_chunk(ch * KC);
        if (t < kTiles) multiply(t, d);
      }
      if (t < kTiles) emit(t, d);
    }
  }
#endif
}

}  // namespace gen
}  // namespace tldsl
