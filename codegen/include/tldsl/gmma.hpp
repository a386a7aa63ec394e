// tldsl: the WGMMA pieces every sm_90a lowering shares — GMMA shared-memory descriptors and one
// warpgroup MMA on CuTe's arch-level GMMA ops (cute/arch/mma_sm90_gmma.hpp). Used by the GEMM,
// grouped-GEMM and attention mainloops (sm90_gemm.hpp) and by the general lowering's `dot`
// (general_wgmma.hpp).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cuda/std/utility>

namespace tldsl {
namespace sm90 {

// GMMA shared-memory descriptor "layout type" field (bits 62-63) for a swizzle width in bytes
// (anything else: 0, no swizzle, the "interleave" layout of 8 x 16-byte core matrices).
__host__ __device__ constexpr int gmma_layout_type(int swizzle_bytes) {
  return swizzle_bytes == 128 ? 1 : swizzle_bytes == 64 ? 2 : swizzle_bytes == 32 ? 3 : 0;
}

// The constant part of a GMMA descriptor: layout type, stride byte offset, leading byte offset
// (both in 16-byte units). The start address (bits 0-13, 16-byte units) is added per use.
__host__ __device__ constexpr uint64_t gmma_desc_bits(int swizzle_bytes, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return (uint64_t(gmma_layout_type(swizzle_bytes)) << 62) | (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) |
         (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16);
}

// One WGMMA on an m64 block: D[64 x N] += A(desc_a) * B(desc_b), D in this thread's registers.
template <class Op, int... I>
__device__ __forceinline__ void gmma(uint64_t desc_a, uint64_t desc_b, float* d,
                                     cuda::std::integer_sequence<int, I...>) {
  Op::fma(desc_a, desc_b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}

}  // namespace sm90
}  // namespace tldsl
