// tldsl: device side of the TileLink signal primitives (waits, for now).
//
// A signal is an array of 64-bit counters in global memory (symmetric signals: this rank's
// copy). Notifies add to a slot with release semantics; a wait spins with an *acquire* load of
// the slot until it reaches its target. Targets count per launch ("epoch" counting): with
// epoch=True the target is count * launch (launch is 1-based and passed by the host), so
// counters are never reset and a value left by an earlier launch cannot satisfy a wait.
//
// Memory scope: consumer_tile_wait acquires at .gpu scope (producers on this GPU);
// peer_tile_wait / rank_wait at .sys scope (peers over NVLink, the copy engine).
//
// A wait that guards TMA loads must be followed by fence_proxy_async_global(): the acquire
// is made through the generic proxy, TMA reads global memory through the async proxy.
//
// Debug builds may define TLDSL_WAIT_TIMEOUT_NS: a wait that spins longer prints the slot,
// the value and the target, then traps (a hang becomes an error).
#pragma once

#include <cuda/std/cstdint>

namespace tldsl {

enum Scope : int { kScopeGpu = 0, kScopeSys = 1 };

template <int S>
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  if constexpr (S == kScopeSys) {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  }
  return v;
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *slot >= target (acquire at scope S).
template <int S>
__device__ __forceinline__ void wait_at_least(const unsigned long long* slot, unsigned long long target) {
  unsigned long long v = ld_acquire<S>(slot);
#if defined(TLDSL_WAIT_TIMEOUT_NS)
  const unsigned long long t0 = globaltimer_ns();
#endif
  while (v < target) {
    __nanosleep(20);
#if defined(TLDSL_WAIT_TIMEOUT_NS)
    if (globaltimer_ns() - t0 > (unsigned long long)(TLDSL_WAIT_TIMEOUT_NS)) {
      printf("tldsl: wait timed out: slot %p holds %llu, needs %llu (block %d, thread %d)\n", (const void*)slot, v,
             target, (int)blockIdx.x, (int)threadIdx.x);
      __trap();
    }
#endif
    v = ld_acquire<S>(slot);
  }
}

// Order this thread's acquired view before its later TMA (async-proxy) reads of global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Python's floor division and modulo on ints (the IR's `floordiv` / `mod`).
__host__ __device__ __forceinline__ constexpr int floordiv(int a, int b) {
  return (a / b) - (((a % b) != 0) && ((a < 0) != (b < 0)) ? 1 : 0);
}
__host__ __device__ __forceinline__ constexpr int floormod(int a, int b) {
  return a - floordiv(a, b) * b;
}
__host__ __device__ __forceinline__ constexpr int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ constexpr int imax(int a, int b) { return a > b ? a : b; }

}  // namespace tldsl
