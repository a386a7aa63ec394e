// tldsl: the CuTe WGMMA op of the general lowering's dots, and the fence before them (general_wgmma.hpp: both operands
// K-major; general_pipeline.hpp: the right operand MN-major), by operand kind, N and the right
// operand's major: m64nNk16, both operands from shared memory, fp32 accumulators.
#pragma once

#include "tldsl/general.hpp"

#if !defined(TLDSL_HOST_EMULATION)
#include "tldsl/gmma.hpp"
#endif

namespace tldsl {
namespace gen {

// What this thread wrote to shared memory with ordinary stores, visible to the WGMMAs (the
// async proxy) that read it after the next barrier.
TLDSL_DEV void fence_view_async_shared() {
#if !defined(TLDSL_HOST_EMULATION)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#if !defined(TLDSL_HOST_EMULATION)

template <MmaKind Kind, int N, cute::SM90::GMMA::Major MajorB>
struct GmmaSS;
#define TLDSL_GMMA_SS(n)                                                                                        \
  template <cute::SM90::GMMA::Major MajorB>                                                                     \
  struct GmmaSS<MmaKind::kF16, n, MajorB> {                                                                     \
    using type = cute::SM90::GMMA::MMA_64x##n##x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, MajorB>;            \
  };                                                                                                            \
  template <cute::SM90::GMMA::Major MajorB>                                                                     \
  struct GmmaSS<MmaKind::kBF16, n, MajorB> {                                                                    \
    using type = cute::SM90::GMMA::MMA_64x##n##x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, MajorB>;          \
  };
TLDSL_GMMA_SS(8)
TLDSL_GMMA_SS(16)
TLDSL_GMMA_SS(32)
TLDSL_GMMA_SS(64)
TLDSL_GMMA_SS(96)
TLDSL_GMMA_SS(128)
TLDSL_GMMA_SS(192)
TLDSL_GMMA_SS(256)
#undef TLDSL_GMMA_SS
#endif

}  // namespace gen
}  // namespace tldsl
