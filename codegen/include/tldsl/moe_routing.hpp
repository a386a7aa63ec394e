// MoE routing tables on the GPU: the dynamic mapping of the grouped GEMMs (tldsl/ops/moe.py,
// MoERouting) built from topk_ids [T, topk] on the device, with no host synchronisation.
//
// The routed rows p = t * topk + k are sorted by expert, stably (inside an expert p increases,
// so tokens increase), each expert's rows padded to a multiple of BM: exactly the host tables of
// moe_routing(), entry for entry. Three kernels on one stream, each reading what the previous
// one wrote (no grid-wide barrier, no atomics whose order shows in the tables); launched with
// programmatic dependent launch, the next kernel's blocks start early and wait in griddep_wait
// (the scatter kernel reads the ids and ranks its rows before it waits):
//
//  1. count:   block b counts the experts of its chunk of kChunk routed rows (shared-memory
//              atomics) into block_counts[b, :]; it records the first routed row of its chunk
//              whose id is outside [0, E) (block_bad[b], -1 if none) and zeroes the token-tile
//              producer counts the third kernel adds to.
//  2. scatter: every block sums block_counts (its own prefix over earlier blocks and the
//              totals), scans the experts' tile counts ceil(count / BM) into tile starts, writes
//              its share of the per-tile tables (tile_expert, tile_valid_rows) and, block 0,
//              expert_counts and the info words; then ranks its rows stably inside each expert
//              (warps take consecutive runs of rows; one ballot per bit of the expert id finds
//              the lanes of one round with the same expert; per-warp counts scanned across warps
//              give each warp's start) and scatters token ids to sorted_token_ids and sorted rows to token_pos.
//  3. tiles:   one warp per row tile reads its tile's tokens (ascending), writes the padding
//              rows (-1), tile_tokens and tile_ranks (first and last token), the distinct token
//              tiles (token // BM) it holds and adds one to each one's producer count.
//
// Ids outside [0, E) never index memory: their routed row joins no expert (token_pos = -1, the
// combine reads zeros for it) and info[1] = 1, info[2] = the first such row p (else 0 and -1).
// info[0] = the number of row tiles in use: tiles [info[0], NT) are unused (expert -1), so a
// persistent grouped GEMM may stop there.
#pragma once

namespace tldsl {
namespace moe_routing {

constexpr int kWarp = 32;
constexpr int kNoBad = 0x7fffffff;

template <class IdT>
__device__ __forceinline__ int expert_of(const IdT* __restrict__ ids, long long p, int R, int E) {
  if (p >= R) return -1;
  const IdT v = ids[p];
  return (v >= IdT(0) && v < IdT(E)) ? int(v) : -2;      // -1: past the end, -2: a bad id
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The lanes of the warp holding the same expert e >= 0 (meaningless where e < 0): one ballot per
// bit of the id, nbits = the bits of E - 1; every lane must call it.
__device__ __forceinline__ unsigned peers_of(int e, int nbits) {
  unsigned m = __ballot_sync(0xffffffffu, e >= 0);
  for (int bit = 0; bit < nbits; ++bit) {
    const bool one = (e >> bit) & 1;
    const unsigned ones = __ballot_sync(0xffffffffu, one);
    m &= one ? ones : ~ones;
  }
  return m;
}

__device__ __forceinline__ int id_bits(int E) { return E > 1 ? 32 - __clz(E - 1) : 0; }

// Programmatic dependent launch: the next kernel of the stream may start now (its blocks wait in
// griddep_wait until this grid completed), and: wait until the previous grid completed and its
// writes are visible. Both are no-ops where the kernel was launched without the attribute.
__device__ __forceinline__ void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Kernel 1. Dynamic shared memory: E ints.
template <class IdT, int kThreads, int kItems>
__device__ void count_kernel(const IdT* __restrict__ ids, int R, int E, int* __restrict__ block_counts,
                             int* __restrict__ block_bad, int* __restrict__ producers, int TT) {
  constexpr int kChunk = kThreads * kItems;
  extern __shared__ int smem[];
  int* hist = smem;
  __shared__ int bad_s;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  griddep_launch_dependents();                     // the scatter kernel reads the ids meanwhile
  for (int e = tid; e < E; e += kThreads) hist[e] = 0;
  if (tid == 0) bad_s = kNoBad;
  for (int j = blockIdx.x * kThreads + tid; j < TT; j += gridDim.x * kThreads) producers[j] = 0;
  __syncthreads();
  // the row map of the scatter kernel: warp w takes rows [w*32*kItems, (w+1)*32*kItems) of the chunk
  const long long base = (long long)blockIdx.x * kChunk + warp * (kWarp * kItems) + lane;
  const int nbits = id_bits(E);
  int bad = kNoBad, ex[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) ex[j] = expert_of(ids, base + j * kWarp, R, E);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = ex[j];
    const unsigned peers = peers_of(e, nbits);     // one shared-memory atomic per expert of the round
    if (e >= 0 && (peers & lanemask_lt()) == 0) atomicAdd(&hist[e], __popc(peers));
    else if (e == -2 && bad == kNoBad) bad = int(base + j * kWarp);   // rows increase with j: the least
  }
  if (bad != kNoBad) atomicMin(&bad_s, bad);
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) block_counts[(long long)blockIdx.x * E + e] = hist[e];
  if (tid == 0) block_bad[blockIdx.x] = bad_s == kNoBad ? -1 : bad_s;
}

// An exclusive scan of x[0, n) in place by the whole block (n any size); returns the total.
template <int kThreads>
__device__ int block_exclusive_scan(int* x, int n, int* warp_sums) {
  constexpr int kWarps = kThreads / kWarp;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int per = (n + kThreads - 1) / kThreads;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int mine = 0;
  for (int i = lo; i < hi; ++i) mine += x[i];
  int incl = mine;
#pragma unroll
  for (int d = 1; d < kWarp; d *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == kWarp - 1) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < kWarp; d *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    if (lane < kWarps) warp_sums[lane] = w;              // inclusive over warps
  }
  __syncthreads();
  int run = incl - mine + (warp > 0 ? warp_sums[warp - 1] : 0);
  const int total = warp_sums[kWarps - 1];
  for (int i = lo; i < hi; ++i) {
    const int v = x[i];
    x[i] = run;
    run += v;
  }
  __syncthreads();
  return total;
}

// Kernel 2. Dynamic shared memory: (3 * E + 1 + kWarps * E) ints.
template <class IdT, int kThreads, int kItems>
__device__ void scatter_kernel(const IdT* __restrict__ ids, int R, int T, int topk, int E, int BM, int NT,
                               const int* __restrict__ block_counts, const int* __restrict__ block_bad,
                               int* __restrict__ sorted_token_ids, int* __restrict__ token_pos,
                               int* __restrict__ tile_expert, int* __restrict__ tile_valid_rows,
                               int* __restrict__ expert_counts, int* __restrict__ info) {
  constexpr int kChunk = kThreads * kItems, kWarps = kThreads / kWarp;
  extern __shared__ int smem[];
  int* total = smem;                 // [E] rows of expert e (all blocks)
  int* prefix = total + E;           // [E] rows of expert e in blocks before this one
  int* tstart = prefix + E;          // [E + 1] first tile of expert e; tstart[E] = tiles in use
  int* wcnt = tstart + E + 1;        // [kWarps, E] rows of expert e per warp, then each warp's first row
  __shared__ int warp_sums[kWarps];
  __shared__ int bad_s;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int nb = gridDim.x, b = blockIdx.x;
  griddep_launch_dependents();                     // the tiles kernel's blocks may wait resident
  for (int e = tid; e < E; e += kThreads) total[e] = prefix[e] = 0;
  for (int i = tid; i < kWarps * E; i += kThreads) wcnt[i] = 0;
  if (tid == 0) bad_s = kNoBad;
  __syncthreads();

  // this chunk's rows: expert (-1 past the end, -2 bad id) and the lanes of the round with the same one
  // (all of this overlaps the count kernel: it reads only the ids)
  const long long base = (long long)b * kChunk + warp * (kWarp * kItems) + lane;
  const int nbits = id_bits(E);
  int ex[kItems];
  unsigned peers[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) ex[j] = expert_of(ids, base + j * kWarp, R, E);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    peers[j] = peers_of(ex[j], nbits);
    if (ex[j] >= 0 && (peers[j] & lanemask_lt()) == 0) wcnt[warp * E + ex[j]] += __popc(peers[j]);
    __syncwarp();
  }
  griddep_wait();                                  // the count kernel's block_counts and block_bad
  // totals and this block's prefix over the blocks' counts: `parts` threads sum each column
  {
    const int parts = E >= kThreads ? 1 : kThreads / E, cols = kThreads / parts, part = tid / cols;
    if (part < parts)
      for (int e = tid % cols; e < E; e += cols) {
        int tot = 0, pre = 0;
#pragma unroll 8
        for (int bb = part; bb < nb; bb += parts) {
          const int v = __ldcg(block_counts + bb * E + e);
          tot += v;
          pre += bb < b ? v : 0;
        }
        atomicAdd(&total[e], tot);
        atomicAdd(&prefix[e], pre);
      }
  }
  if (b == 0)
    for (int i = tid; i < nb; i += kThreads) {
      const int x = __ldcg(block_bad + i);
      if (x >= 0) atomicMin(&bad_s, x);
    }
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) tstart[e] = (total[e] + BM - 1) / BM;
  __syncthreads();
  const int used = block_exclusive_scan<kThreads>(tstart, E, warp_sums);
  if (tid == 0) tstart[E] = used;
  // each warp's first sorted row of expert e: the expert's first row + earlier blocks + earlier warps
  for (int e = tid; e < E; e += kThreads) {
    int run = tstart[e] * BM + prefix[e];
    for (int w = 0; w < kWarps; ++w) {
      const int c = wcnt[w * E + e];
      wcnt[w * E + e] = run;
      run += c;
    }
  }
  __syncthreads();

  if (b == 0) {
    for (int e = tid; e < E; e += kThreads) expert_counts[e] = total[e];
    if (tid == 0) {
      info[0] = used;
      info[1] = bad_s != kNoBad;
      info[2] = bad_s == kNoBad ? -1 : bad_s;
    }
  }
  // the per-tile tables, shared out over the grid
  for (int i = b * kThreads + tid; i < NT; i += nb * kThreads) {
    int e = -1, valid = 0;
    if (i < used) {                               // the last e with tstart[e] <= i
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tstart[mid] <= i) lo = mid; else hi = mid - 1;
      }
      e = lo;
      valid = min(BM, total[e] - (i - tstart[e]) * BM);
    }
    tile_expert[i] = e;
    tile_valid_rows[i] = valid;
  }

  // stable ranks: round j's lanes after this warp's earlier rounds, earlier lanes first
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = ex[j];
    const long long p = base + j * kWarp;
    int pos = -1;
    if (e >= 0) pos = wcnt[warp * E + e] + __popc(peers[j] & lanemask_lt());
    __syncwarp();
    if (e >= 0 && (peers[j] & lanemask_lt()) == 0) wcnt[warp * E + e] += __popc(peers[j]);
    __syncwarp();
    if (e != -1) {                                 // a routed row (bad ids: pos -1)
      const int t = int(p / topk), k = int(p - (long long)t * topk);
      token_pos[(long long)k * T + t] = pos;
      if (pos >= 0) sorted_token_ids[pos] = t;
    }
  }
}

// Kernel 3: one warp per row tile.
template <int kThreads>
__device__ void tiles_kernel(int* __restrict__ sorted_token_ids, const int* __restrict__ tile_valid_rows, int NT,
                             int BM, int Ms, int width, int* __restrict__ tile_tokens, int* __restrict__ tile_ranks,
                             int* __restrict__ tile_token_tiles, int* __restrict__ tile_num_token_tiles,
                             int* __restrict__ producers) {
  constexpr int kWarps = kThreads / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int i = blockIdx.x * kWarps + threadIdx.x / kWarp;
  griddep_wait();                                  // the scatter kernel's rows and tile tables
  if (i >= NT) return;
  const int valid = __ldcg(tile_valid_rows + i);
  int* rows = sorted_token_ids + (long long)i * BM;
  int* tts = tile_token_tiles + (long long)i * width;
  int count = 0, prev = -1, first = 0, last = -1;
  for (int q0 = 0; q0 < BM; q0 += kWarp) {
    const int q = q0 + lane;
    int tok = -1, tt = -1;
    if (q < valid) {
      tok = __ldcg(rows + q);
      tt = tok / BM;
    } else if (q < BM) {
      rows[q] = -1;                                // padding rows (all rows of an unused tile)
    }
    int before = __shfl_up_sync(0xffffffffu, tt, 1);
    if (lane == 0) before = prev;
    const bool fresh = q < valid && tt != before;  // tokens ascend: a new token tile starts here
    const unsigned ballot = __ballot_sync(0xffffffffu, fresh);
    if (fresh) {
      tts[count + __popc(ballot & lanemask_lt())] = tt;
      atomicAdd(&producers[tt], 1);
    }
    count += __popc(ballot);
    prev = __shfl_sync(0xffffffffu, tt, kWarp - 1);
    if (q == 0) first = tok;
    if (q == valid - 1) last = tok;
  }
  for (int s = count + lane; s < width; s += kWarp) tts[s] = -1;
  first = __shfl_sync(0xffffffffu, first, 0);
  const int owner = valid > 0 ? (valid - 1) % kWarp : 0;
  last = __shfl_sync(0xffffffffu, last, owner);
  if (lane == 0) {
    tile_num_token_tiles[i] = count;
    if (valid > 0) {
      tile_tokens[2 * i] = first;
      tile_tokens[2 * i + 1] = last + 1;
      tile_ranks[2 * i] = first / Ms;
      tile_ranks[2 * i + 1] = last / Ms + 1;
    } else {
      tile_tokens[2 * i] = tile_tokens[2 * i + 1] = 0;
      tile_ranks[2 * i] = tile_ranks[2 * i + 1] = 0;
    }
  }
}

}  // namespace moe_routing
}  // namespace tldsl
