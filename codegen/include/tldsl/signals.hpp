// tldsl: device side of the TileLink signal primitives.
//
// A signal is an array of 64-bit counters in global memory (symmetric signals: this rank's
// copy; a peer's copy through its mapping of the symmetric allocation). Notifies add to a
// slot with release semantics; a wait spins with an *acquire* load of the slot until it
// reaches its target. Targets count per launch ("epoch" counting): with epoch=True the target
// is count * launch (launch is 1-based and passed by the host), so counters are never reset
// and a value left by an earlier launch cannot satisfy a wait.
//
// Memory scope: consumer_tile_wait / producer_tile_notify at .gpu scope (this GPU);
// peer_tile_* / rank_* at .sys scope (peers over NVLink, the copy engine), unless the tile
// program asked for another scope on a notify.
//
// A notify is a release pattern: fence_acq_rel<S>() then red_relaxed_add<S>() (one fence may
// cover several adds), issued by one thread after the data it publishes is complete — after
// a CTA barrier for data written by the whole CTA, after cp.async.bulk.wait_group 0 and
// fence.proxy.async for data written by TMA stores.
//
// A wait that guards TMA loads must be followed by fence_proxy_async_global(): the acquire
// is made through the generic proxy, TMA reads global memory through the async proxy.
//
// TLDSL_WAIT_TIMEOUT_NS: a wait that spins longer traps (a hang becomes an error). Debug builds
// also define TLDSL_WAIT_TIMEOUT_REPORT: the wait prints its slot, the value and the target first.
// The report is debug-only because a printf anywhere in a kernel's waits costs the whole kernel
// speed (measured on one H200: the grouped GEMM with AllGather+MoE's row gather folded in, 18 %
// slower with it, as fast as without any timeout without it; BENCHMARKS.md, thirty-third session).
//
// TLDSL_HOST_EMULATION (the test suite's CPU emulation of communication kernels, built by a
// host C++ compiler): the same functions on host atomics (acquire loads, relaxed adds,
// sequentially consistent fences), so generated code can run on CPU threads.
#pragma once

#if defined(TLDSL_HOST_EMULATION)
#include <thread>
#else
#include <cuda/std/cstdint>
#endif

// Where a kernel records a failed run-time check (below); at global scope, so the runtime finds
// it by this name (cuModuleGetGlobal) and points it at host memory it maps.
#if defined(TLDSL_HOST_EMULATION)
inline unsigned long long* tldsl_run_checks = nullptr;
#else
__device__ unsigned long long* tldsl_run_checks = nullptr;
#endif

namespace tldsl {

enum Scope : int { kScopeGpu = 0, kScopeSys = 1 };

// Run-time checks of what the simulator refuses while it runs: a wait whose traced count is not
// positive, or more than its slot's notifies per launch. Where a check fails the kernel records
// it in one 64-bit word of host memory the runtime maps (`tldsl_run_checks`: (site + 1) << 32 | the
// count as 32 bits) and the wait then passes (as count 0 would), so nothing hangs; after the
// launch the host raises a typed error naming the wait's line. Where no runtime reads a word
// (null: launchers of their own) the count is used as it is. `site` names the wait by its count
// value (codegen/ir_queries.py: wait_site).
#if defined(TLDSL_HOST_EMULATION)
inline long long checked_count(long long count, unsigned int site, long long most) {
  if ((count > 0 && (most <= 0 || count <= most)) || tldsl_run_checks == nullptr) return count;
  __atomic_store_n(tldsl_run_checks, ((unsigned long long)(site + 1u) << 32) | (unsigned int)count, __ATOMIC_SEQ_CST);
  return 0;
}
#else
// false where nothing reads the word (the count is then used as it is)
static __device__ __noinline__ bool count_check_failed(long long count, unsigned int site) {
  volatile unsigned long long* word = tldsl_run_checks;
  if (word == nullptr) return false;
  *word = ((unsigned long long)(site + 1u) << 32) | (unsigned int)count;    // one store: no torn record
  __threadfence_system();
  return true;
}
__device__ __forceinline__ long long checked_count(long long count, unsigned int site, long long most) {
  if (count > 0 && (most <= 0 || count <= most)) return count;
  return count_check_failed(count, site) ? 0 : count;
}
#endif

#if defined(TLDSL_HOST_EMULATION)

template <int S>
inline unsigned long long ld_acquire(const unsigned long long* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <int S>
inline void fence_acq_rel() {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
template <int S>
inline void red_relaxed_add(unsigned long long* p, unsigned long long v) {
  __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
template <int S>
inline void wait_at_least(const unsigned long long* slot, unsigned long long target) {
  while (ld_acquire<S>(slot) < target) std::this_thread::yield();
}
inline void fence_proxy_async_global() {}

#else

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

// The fence half of a release pattern at scope S (MEMBAR.ALL.GPU / .SYS in SASS).
template <int S>
__device__ __forceinline__ void fence_acq_rel() {
  if constexpr (S == kScopeSys) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  } else {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
}

// The strong write half: a relaxed atomic add at scope S (RED.E.ADD.64.STRONG.GPU / .SYS).
template <int S>
__device__ __forceinline__ void red_relaxed_add(unsigned long long* p, unsigned long long v) {
  if constexpr (S == kScopeSys) {
    asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  } else {
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#if defined(TLDSL_WAIT_TIMEOUT_NS)
// A wait ran out of time: report it (debug builds), then trap. Out of line: the spin loops keep
// their code small.
static __device__ __noinline__ void wait_timed_out(const unsigned long long* slot, unsigned long long v,
                                                   unsigned long long target) {
#if defined(TLDSL_WAIT_TIMEOUT_REPORT)
  printf("tldsl: wait timed out: slot %p holds %llu, needs %llu (block %d, thread %d)\n", (const void*)slot, v, target,
         (int)blockIdx.x, (int)threadIdx.x);
#endif
  __trap();
}
#endif

// Spin until *slot >= target (acquire at scope S). With TLDSL_WAIT_TIMEOUT_NS the timer is read only
// once a wait has to spin: a wait already satisfied costs what it costs without the timeout.
template <int S>
__device__ __forceinline__ void wait_at_least(const unsigned long long* slot, unsigned long long target) {
  unsigned long long v = ld_acquire<S>(slot);
  if (v >= target) return;
#if defined(TLDSL_WAIT_TIMEOUT_NS)
  const unsigned long long t0 = globaltimer_ns();
#endif
  do {
    __nanosleep(20);
#if defined(TLDSL_WAIT_TIMEOUT_NS)
    if (globaltimer_ns() - t0 > (unsigned long long)(TLDSL_WAIT_TIMEOUT_NS)) wait_timed_out(slot, v, target);
#endif
    v = ld_acquire<S>(slot);
  } while (v < target);
}

// A launch's work split into parts, finished by threads after they have made their own stores
// visible (fenced): count the `parts` this thread finished in `parts_done` (all launches; an
// earlier launch is complete before a later one starts, so within a launch only its last add
// reaches a multiple of `parts_per_launch`), and the thread that completes the launch releases
// everyone's stores at system scope and writes `value` into slot `rank` of every peer's arrival
// array (`peer_arrive[p]`: rank p's array as mapped here).
__device__ __forceinline__ void arrive_on_peers_when_done(unsigned long long* parts_done,
                                                          unsigned long long parts_per_launch,
                                                          unsigned long long* const* peer_arrive, int rank, int world,
                                                          unsigned long long value, unsigned long long parts = 1ull) {
  const unsigned long long done = atomicAdd(parts_done, parts) + parts;
  if (done % parts_per_launch != 0) return;
  fence_acq_rel<kScopeSys>();
  for (int p = 0; p < world; ++p)
    if (p != rank) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(peer_arrive[p] + rank), "l"(value) : "memory");
}

// Order this thread's acquired view before its later TMA (async-proxy) reads of global memory,
// and its completed TMA (async-proxy) writes before its later generic-proxy release.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

#endif  // TLDSL_HOST_EMULATION

#if defined(TLDSL_HOST_EMULATION)
#define TLDSL_SIG_HD inline
#else
#define TLDSL_SIG_HD __host__ __device__ __forceinline__
#endif

// numpy's floor division and modulo on i32 (the IR's `floordiv` / `mod`): 0 for a zero divisor, and
// INT_MIN // -1 wraps to INT_MIN (C's a / b is undefined for both: a trap on x86, any value on a GPU).
TLDSL_SIG_HD constexpr int floordiv(int a, int b) {
  return b == 0 ? 0
       : b == -1 ? int(0u - unsigned(a))
       : (a / b) - (((a % b) != 0) && ((a < 0) != (b < 0)) ? 1 : 0);
}
TLDSL_SIG_HD constexpr int floormod(int a, int b) {
  return (b == 0 || b == -1) ? 0 : int(unsigned(a) - unsigned(floordiv(a, b)) * unsigned(b));
}
TLDSL_SIG_HD constexpr int imin(int a, int b) { return a < b ? a : b; }
TLDSL_SIG_HD constexpr int imax(int a, int b) { return a > b ? a : b; }

}  // namespace tldsl
