// tldsl: the NVSHMEM transport of communication kernels (CommSchedule(transport="nvshmem")).
//
// NVSHMEM's device API compiled in header-only mode (-D__NVSHMEM_NUMBA_SUPPORT__: every
// transfer inlined, no device library to link, which NVRTC cannot do): the module then holds
// its own copy of NVSHMEM's device state, which the host must fill with
// nvshmemx_cumodule_init(module) after loading it and before the first launch. Buffers and
// signals addressed on peers must come from nvshmem_malloc (symmetric heap).
//
//   peer data   tldsl::comm::peer(sym, pe)           nvshmem_ptr: a load/store address over NVLink
//   peer notify tldsl::comm::cta_notify_peer(s, pe)  CTA barrier, system-scope release fence, then
//                                                    nvshmemx_signal_op(s, 1, ADD, pe) (nvshmem_fence
//                                                    first: puts to pe are ordered before it)
// Waits stay the acquire spins of comm.hpp on this rank's own counters.
//
// NVSHMEM 3.4.5's headers under NVRTC need std:: type traits and the build-options header
// first, and IBGDA compiled out (it needs the device library).
#pragma once

#include <cuda/std/type_traits>
namespace std {
using cuda::std::is_integral;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
}  // namespace std
#include <non_abi/nvshmem_build_options.h>
#undef NVSHMEM_IBGDA_SUPPORT
#undef NVSHMEM_IBGDA_SUPPORT_GPUMEM_ONLY
#include <nvshmem.h>
#include <nvshmemx.h>

#include "tldsl/comm.hpp"

namespace tldsl {
namespace comm {

// `sym` (a symmetric address on this rank) as mapped for loads and stores to rank `pe`'s copy.
// Null if `pe` is not reachable by load/store: this transport needs NVLink peers.
template <class T>
TLDSL_DEV T* peer(T* sym, int pe) {
  T* p = static_cast<T*>(nvshmem_ptr(sym, pe));
  if (p == nullptr) {
    printf("tldsl: rank %d is not reachable by load/store (nvshmem_ptr returned null)\n", pe);
    __trap();
  }
  return p;
}

template <class T>
TLDSL_DEV const T* peer(const T* sym, int pe) {
  return peer(const_cast<T*>(sym), pe);
}

// Release to rank `pe`: the CTA's writes (stores through peer(), puts) before +1 on its counter.
TLDSL_DEV void cta_notify_peer(unsigned long long* sym_slot, int pe) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel<kScopeSys>();
    nvshmem_fence();
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_slot), 1ull, NVSHMEM_SIGNAL_ADD, pe);
  }
}

}  // namespace comm
}  // namespace tldsl
