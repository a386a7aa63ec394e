// MoE routing tables on the GPU: the dynamic mapping of the grouped GEMMs (tldsl/ops/moe.py,
// MoERouting) built from topk_ids [T, topk] on the device, with no host synchronisation.
//
// The routed rows p = t * topk + k are sorted by expert, stably (inside an expert p increases,
// so tokens increase), each expert's rows padded to a multiple of BM: exactly the host tables of
// moe_routing(), entry for entry. The work falls into three phases, each reading what the
// previous one wrote (no atomics whose order shows in the tables):
//
//  1. count:   chunk c (kChunk routed rows; warps take consecutive runs of rows) counts its
//              experts into block_counts[c, :]; it records the first routed row of the chunk
//              whose id is outside [0, E) (block_bad[c], -1 if none); the token-tile producer
//              counts phase 3 adds to are zeroed.
//  2. scatter: a chunk sums block_counts (its own prefix over earlier chunks, and the totals),
//              scans the experts' tile counts ceil(count / BM) into tile starts, writes its share
//              of the per-tile tables (tile_expert, tile_valid_rows) and, chunk 0,
//              expert_counts and the info words; then ranks its rows stably inside each expert
//              (one ballot per bit of the expert id finds the lanes of one round with the same
//              expert; per-warp counts scanned across warps give each warp's start), lays the
//              chunk out sorted by expert in shared memory and stores each expert's run of
//              sorted_token_ids contiguously (coalesced: a scattered 4-byte store per row was
//              most of this phase's time); token_pos is stored per row.
//  3. tiles:   one warp per row tile reads its tile's tokens (ascending), writes the padding
//              rows (-1), tile_tokens and tile_ranks (first and last token), the distinct token
//              tiles (token // BM) it holds and adds one to each one's producer count; then the
//              tile's place in tile_visit (visit_from: arithmetic on the experts' tile counts).
//
// Two ways to run them. Three kernels on one stream (count, scatter, tiles), launched with
// programmatic dependent launch where allowed (the next kernel's blocks start early and wait in
// griddep_wait; the scatter kernel reads and ranks its ids before it waits): the default. Or the
// fused kernel: all three phases in one cooperative launch (every block resident at once, so a
// grid-wide barrier between phases cannot deadlock), the chunk's ranks kept in registers from
// phase 1 to phase 2; measured 1-2 us slower than the three kernels with PDL on an H200 (its two
// barriers cost about what two kernel boundaries do under PDL, and its 128 registers a thread
// leave phase 3 one block of 16 warps per multiprocessor).
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

// The expert of routed row p: -1 past the end, -2 an id outside [0, E).
template <class IdT>
__device__ __forceinline__ int expert_of(const IdT* __restrict__ ids, long long p, int R, int E) {
  if (p >= R) return -1;
  const IdT v = ids[p];
  return (v >= IdT(0) && v < IdT(E)) ? int(v) : -2;
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

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A barrier of the whole grid, for a cooperative launch only (every block resident). The word's
// top bit flips once all blocks arrived (block 0 adds 2^31 - (blocks - 1), the others 1): the
// word must start at 0 (or any value whose low 31 bits cannot carry into the top bit before all
// arrived), and every barrier adds 2^31, so a launch's two barriers leave it as they found it.
// A word that started wrong could hold blocks forever: after seconds of waiting (a barrier
// takes microseconds) the kernel traps, an error for the caller rather than a hung GPU.
__device__ __forceinline__ void grid_sync(unsigned* word) {
  constexpr unsigned long long kGiveUpNs = 4000000000ull;
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    __threadfence();                               // this block's writes before its arrival
    const unsigned old = atomicAdd(word, add);
    const unsigned long long t0 = global_ns();
    unsigned now;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
      if ((old ^ now) & 0x80000000u) break;
      if (global_ns() - t0 > kGiveUpNs) __trap();
    }
    __threadfence();
  }
  __syncthreads();
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

// The shared memory of phases 1 and 2 (dynamic, ints): see smem_ints. Phase 3 of the fused kernel
// reuses wcnt (done with by then) for expert_tiles' two ints per expert.
template <int kThreads, int kItems>
struct Shared {
  static constexpr int kWarps = kThreads / kWarp, kChunk = kThreads * kItems;
  int* total;    // [E] rows of expert e (all chunks)
  int* base;     // [E] first sorted row of this chunk's rows of expert e (first: rows of e in earlier chunks)
  int* tstart;   // [E + 1] first tile of expert e; tstart[E] = tiles in use
  int* local;    // [E] this chunk's rows of expert e, then (scanned) where they start in the chunk's layout
  int* wcnt;     // [kWarps, E] rows of expert e per warp, then each warp's first rank inside the chunk
  int* tok;      // [kChunk] the chunk's tokens, sorted by expert
  int* dst;      // [kChunk] and their rows of sorted_token_ids
  __device__ explicit Shared(int* s, int E)
      : total(s), base(s + E), tstart(s + 2 * E), local(s + 3 * E + 1), wcnt(s + 4 * E + 1),
        tok(s + (4 + kWarps) * E + 1), dst(s + (4 + kWarps) * E + 1 + kChunk) {}
  static constexpr int smem_ints(int E) { return (4 + kWarps) * E + 1 + 2 * kChunk; }
};

// Phase 1 of chunk c: each row's expert (ex), the lanes of its round with the same expert
// (peers), the chunk's rows per warp and expert (sh.wcnt, zeroed by the caller) and the first bad
// row of this thread (kNoBad if none). Reads only the ids.
template <class IdT, int kThreads, int kItems>
__device__ int rank_chunk(const IdT* __restrict__ ids, int c, int R, int E, int* wcnt, int (&ex)[kItems],
                          unsigned (&peers)[kItems]) {
  constexpr int kChunk = kThreads * kItems;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const long long first = (long long)c * kChunk + warp * (kWarp * kItems) + lane;
  const int nbits = id_bits(E);
  int bad = kNoBad;
#pragma unroll
  for (int j = 0; j < kItems; ++j) ex[j] = expert_of(ids, first + j * kWarp, R, E);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    peers[j] = peers_of(ex[j], nbits);
    if (ex[j] >= 0 && (peers[j] & lanemask_lt()) == 0) wcnt[warp * E + ex[j]] += __popc(peers[j]);
    else if (ex[j] == -2 && bad == kNoBad) bad = int(first + j * kWarp);   // rows increase with j: the least
    __syncwarp();
  }
  return bad;
}

// After rank_chunk (and a block barrier): each warp's first rank inside the chunk for expert e,
// in place, and the chunk's rows of expert e in sh.local. All of a column's loads are issued
// before its stores.
template <int kThreads, int kItems>
__device__ void scan_warps(const Shared<kThreads, kItems>& sh, int E) {
  constexpr int kWarps = kThreads / kWarp;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int c[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) c[w] = sh.wcnt[w * E + e];
    int run = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sh.wcnt[w * E + e] = run;
      run += c[w];
    }
    sh.local[e] = run;
  }
  __syncthreads();
}

// Phase 1, whole: rank chunk c, publish its counts and its first bad row. Leaves ex, peers,
// sh.wcnt (scanned) and sh.local (counts) for phase 2.
template <class IdT, int kThreads, int kItems>
__device__ void count_chunk(const IdT* __restrict__ ids, int c, int R, int E, const Shared<kThreads, kItems>& sh,
                            int* bad_s, int* block_counts, int* block_bad, int (&ex)[kItems],
                            unsigned (&peers)[kItems]) {
  constexpr int kWarps = kThreads / kWarp;
  for (int i = threadIdx.x; i < kWarps * E; i += kThreads) sh.wcnt[i] = 0;
  if (threadIdx.x == 0) *bad_s = kNoBad;
  __syncthreads();
  const int bad = rank_chunk<IdT, kThreads, kItems>(ids, c, R, E, sh.wcnt, ex, peers);
  if (bad != kNoBad) atomicMin(bad_s, bad);
  __syncthreads();
  scan_warps(sh, E);
  for (int e = threadIdx.x; e < E; e += kThreads) block_counts[(long long)c * E + e] = sh.local[e];
  if (threadIdx.x == 0) block_bad[c] = *bad_s == kNoBad ? -1 : *bad_s;
}

// Phase 2, first part: the totals (when `totals`) and chunk c's prefix over earlier chunks,
// into sh.total and sh.base (zeroed by the caller); `parts` threads sum each column. The counts
// were written by other blocks of this launch or by the previous kernel: read through L2, in
// batches of kBatch loads issued before any is added (a plain loop waited for each load in turn:
// 16-32 round trips to L2, most of this phase's time).
template <int kThreads, int kItems>
__device__ void sum_counts(const int* block_counts, int nc, int c, int E, bool totals,
                           const Shared<kThreads, kItems>& sh) {
  constexpr int kBatch = 16;
  const int tid = threadIdx.x;
  const int parts = E >= kThreads ? 1 : kThreads / E, cols = kThreads / parts, part = tid / cols;
  if (part >= parts) return;
  const int upto = totals ? nc : c;
  for (int e = tid % cols; e < E; e += cols) {
    int tot = 0, pre = 0;
    for (int b0 = part; b0 < upto; b0 += kBatch * parts) {
      int v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int b = b0 + k * parts;
        v[k] = b < upto ? __ldcg(block_counts + (long long)b * E + e) : 0;
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        tot += v[k];
        pre += b0 + k * parts < c ? v[k] : 0;
      }
    }
    if (totals) atomicAdd(&sh.total[e], tot);
    atomicAdd(&sh.base[e], pre);
  }
}

// Phase 2: the experts' tile starts (scan of ceil(total / BM)); returns the tiles in use.
template <int kThreads, int kItems>
__device__ int tile_starts(const Shared<kThreads, kItems>& sh, int E, int BM, int* warp_sums) {
  for (int e = threadIdx.x; e < E; e += kThreads) sh.tstart[e] = (sh.total[e] + BM - 1) / BM;
  __syncthreads();
  const int used = block_exclusive_scan<kThreads>(sh.tstart, E, warp_sums);
  if (threadIdx.x == 0) sh.tstart[E] = used;
  return used;
}

// sh.base: from rows of expert e in earlier chunks to the chunk's first sorted row of expert e.
template <int kThreads, int kItems>
__device__ void add_tile_starts(const Shared<kThreads, kItems>& sh, int E, int BM) {
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) sh.base[e] += sh.tstart[e] * BM;
  __syncthreads();
}

// Phase 2: tile_expert and tile_valid_rows of tiles b, b + nb, ... (in threads' units), and, the
// block with b == 0, expert_counts and the info words.
template <int kThreads, int kItems>
__device__ void write_tile_tables(const Shared<kThreads, kItems>& sh, int b, int nb, int E, int BM, int NT,
                                  int used, int bad, int* tile_expert, int* tile_valid_rows, int* expert_counts,
                                  int* info) {
  const int tid = threadIdx.x;
  if (b == 0) {
    for (int e = tid; e < E; e += kThreads) expert_counts[e] = sh.total[e];
    if (tid == 0) {
      info[0] = used;
      info[1] = bad != kNoBad;
      info[2] = bad == kNoBad ? -1 : bad;
    }
  }
  for (int i = b * kThreads + tid; i < NT; i += nb * kThreads) {
    int e = -1, valid = 0;
    if (i < used) {                               // the last e with tstart[e] <= i
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (sh.tstart[mid] <= i) lo = mid; else hi = mid - 1;
      }
      e = lo;
      valid = min(BM, sh.total[e] - (i - sh.tstart[e]) * BM);
    }
    tile_expert[i] = e;
    tile_valid_rows[i] = valid;
  }
}

// Phase 2, last part: the stable ranks of chunk c's rows (round j's lanes after this warp's
// earlier rounds, earlier lanes first), token_pos per row, and sorted_token_ids through the
// shared-memory layout (sh.local: the chunk's counts, scanned here; sh.wcnt: each warp's start).
template <int kThreads, int kItems>
__device__ void scatter_chunk(int c, const int (&ex)[kItems], const unsigned (&peers)[kItems], int T, int topk,
                              int E, const Shared<kThreads, kItems>& sh, int* warp_sums, int* sorted_token_ids,
                              int* token_pos) {
  constexpr int kChunk = kThreads * kItems;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int n = block_exclusive_scan<kThreads>(sh.local, E, warp_sums);
  const int first = c * kChunk + warp * (kWarp * kItems) + lane;   // rows that exist are < R < 2^31
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = ex[j];
    const unsigned before = peers[j] & lanemask_lt();
    int rank = 0;
    if (e >= 0) rank = sh.wcnt[warp * E + e] + __popc(before);
    __syncwarp();
    if (e >= 0 && before == 0) sh.wcnt[warp * E + e] += __popc(peers[j]);
    __syncwarp();
    if (e != -1) {                                 // a routed row (bad ids: pos -1)
      const int p = first + j * kWarp, t = p / topk, k = p - t * topk;
      int pos = -1;
      if (e >= 0) {
        pos = sh.base[e] + rank;
        const int slot = sh.local[e] + rank;
        sh.tok[slot] = t;
        sh.dst[slot] = pos;
      }
      token_pos[k * T + t] = pos;
    }
  }
  __syncthreads();
  for (int i = tid; i < n; i += kThreads) sorted_token_ids[sh.dst[i]] = sh.tok[i];
  __syncthreads();                                 // the layout may be reused by the next chunk
}

// Phase 3, by one warp per row tile: what it reads first. The tile's valid rows and its first
// kTileRounds rounds of 32 tokens are read through L2 (other blocks wrote them), all at once:
// the tokens are masked by the valid count afterwards.
constexpr int kTileRounds = 4;
struct TileLoad {
  int raw[kTileRounds];
  int valid;
};

__device__ __forceinline__ TileLoad load_tile(int i, const int* tile_valid_rows, const int* sorted_token_ids,
                                              int BM) {
  const int lane = threadIdx.x % kWarp;
  const int* rows = sorted_token_ids + (long long)i * BM;
  TileLoad t;
#pragma unroll
  for (int r = 0; r < kTileRounds; ++r) t.raw[r] = r * kWarp + lane < BM ? __ldcg(rows + r * kWarp + lane) : -1;
  t.valid = __ldcg(tile_valid_rows + i);
  return t;
}

// Phase 3 for row tile i given load_tile's: padding rows, tile_tokens, tile_ranks, the distinct
// token tiles and the producer counts.
__device__ __forceinline__ void finish_tile(int i, const TileLoad& t, int* sorted_token_ids, int BM, int Ms,
                                            int width, int* tile_tokens, int* tile_ranks, int* tile_token_tiles,
                                            int* tile_num_token_tiles, int* producers) {
  const int lane = threadIdx.x % kWarp;
  const int valid = t.valid;
  const int shift = (BM & (BM - 1)) == 0 ? __ffs(BM) - 1 : -1;   // token // BM by a shift where BM = 2^k
  int* rows = sorted_token_ids + (long long)i * BM;
  int* tts = tile_token_tiles + (long long)i * width;
  int raw[kTileRounds];
#pragma unroll
  for (int r = 0; r < kTileRounds; ++r) raw[r] = t.raw[r];
  int count = 0, prev = -1, first = 0, last = -1;
  for (int q0 = 0; q0 < BM; q0 += kTileRounds * kWarp) {
    if (q0 > 0) {
#pragma unroll
      for (int r = 0; r < kTileRounds; ++r) {
        const int q = q0 + r * kWarp + lane;
        raw[r] = q < valid ? __ldcg(rows + q) : -1;
      }
    }
#pragma unroll
    for (int r = 0; r < kTileRounds; ++r) {
      const int q = q0 + r * kWarp + lane;
      if (q0 + r * kWarp >= BM) break;             // warp-uniform
      int tok = -1, tt = -1;
      if (q < valid) {
        tok = raw[r];
        tt = shift >= 0 ? tok >> shift : tok / BM;
      } else if (q < BM) {
        rows[q] = -1;                              // padding rows (all rows of an unused tile)
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

// Phase 3 for tiles i, i + stride, ... by one warp: the next tile's reads are issued before the
// current one is finished, so a warp with two tiles waits for L2 about once.
__device__ __forceinline__ void tiles_from(int i, int stride, int NT, const int* tile_valid_rows,
                                           int* sorted_token_ids, int BM, int Ms, int width, int* tile_tokens,
                                           int* tile_ranks, int* tile_token_tiles, int* tile_num_token_tiles,
                                           int* producers) {
  if (i >= NT) return;
  TileLoad cur = load_tile(i, tile_valid_rows, sorted_token_ids, BM);
  for (;;) {
    const int next = i + stride;
    TileLoad nxt;
    if (next < NT) nxt = load_tile(next, tile_valid_rows, sorted_token_ids, BM);
    finish_tile(i, cur, sorted_token_ids, BM, Ms, width, tile_tokens, tile_ranks, tile_token_tiles,
                tile_num_token_tiles, producers);
    if (next >= NT) return;
    i = next;
    cur = nxt;
  }
}

// Every expert's tile count ceil(count / BM) into n[0, E) and its first tile into first[0, E) (shared
// memory), by the whole block (warp_sums: kThreads / 32 ints): what visit_from reads for each tile.
template <int kThreads>
__device__ void expert_tiles(int E, int BM, const int* expert_counts, int* n, int* first, int* warp_sums) {
  for (int e = threadIdx.x; e < E; e += kThreads) first[e] = n[e] = (__ldcg(expert_counts + e) + BM - 1) / BM;
  __syncthreads();
  block_exclusive_scan<kThreads>(first, E, warp_sums);
}

// How many of the n_q tiles l' of expert q sort before tile l of the n_e tiles of expert e, by
// (2l' + 1) / n_q against (2l + 1) / n_e, ties first where q < e (T: 32-bit where the products fit).
template <class T>
__device__ __forceinline__ int tiles_before(T l, T ne, T nq, bool tie_first) {
  const T a = (2 * l + 1) * nq, d = a / ne;
  const T c = tie_first ? (d + 1) / 2 : (d + (a - d * ne != 0 ? 1 : 0)) / 2;
  return int(c < nq ? c : nq);
}

// Phase 3's tile_visit for tiles i, i + stride, ... by one warp (tldsl.ops.moe.visit_order): the used
// tiles ordered by (2l + 1) / n_e (tile l of the n_e tiles of expert e), ties by expert, so row tile i
// goes to position l + the count, over every other expert q, of its tiles that sort before (no sort:
// the lanes take the experts). Unused tiles keep their place. n, first: expert_tiles'. Below
// kNarrowTiles row tiles (moe_routing.py's NARROW_TILES) every (2l + 1) n_q fits 32 bits.
template <int kNarrowTiles>
__device__ __forceinline__ void visit_from(int i, int stride, int NT, int E, const int* tile_expert, const int* n,
                                           const int* first, int* tile_visit) {
  const int lane = threadIdx.x % kWarp;
  const bool narrow = NT < kNarrowTiles;
  for (; i < NT; i += stride) {
    const int e = __ldcg(tile_expert + i);         // phase 2 wrote it
    if (e < 0) {
      if (lane == 0) tile_visit[i] = i;
      continue;
    }
    const int l = i - first[e], ne = n[e];
    int before = 0;
    for (int q = lane; q < E; q += kWarp) {
      if (q == e)
        before += l;
      else if (narrow)
        before += tiles_before<unsigned>(l, ne, n[q], q < e);
      else
        before += tiles_before<unsigned long long>(l, ne, n[q], q < e);
    }
#pragma unroll
    for (int d = kWarp / 2; d > 0; d /= 2) before += __shfl_xor_sync(0xffffffffu, before, d);
    if (lane == 0) tile_visit[before] = i;
  }
}

// The first bad routed row over all chunks (block 0 only needs it): a min over block_bad.
template <int kThreads>
__device__ void reduce_bad(const int* block_bad, int nc, int* bad_s) {
  for (int i = threadIdx.x; i < nc; i += kThreads) {
    const int x = __ldcg(block_bad + i);
    if (x >= 0) atomicMin(bad_s, x);
  }
}

// Phase 2 of chunk c for the block that owns it, given phase 1's ranks and counts: totals and
// tile starts (`first`: the block's first chunk, which also writes its share of the per-tile
// tables), the chunk's bases, then the scatter. `b`, `nb`: this block's share of the tile tables.
template <int kThreads, int kItems>
__device__ void scatter_phase(int c, bool first, int b, int nb, const int (&ex)[kItems],
                              const unsigned (&peers)[kItems], const int* block_counts, const int* block_bad, int nc,
                              int T, int topk, int E, int BM, int NT, const Shared<kThreads, kItems>& sh,
                              int* warp_sums, int* bad_s, int* sorted_token_ids, int* token_pos, int* tile_expert,
                              int* tile_valid_rows, int* expert_counts, int* info) {
  for (int e = threadIdx.x; e < E; e += kThreads) {
    if (first) sh.total[e] = 0;
    sh.base[e] = 0;
  }
  if (threadIdx.x == 0) *bad_s = kNoBad;
  __syncthreads();
  sum_counts(block_counts, nc, c, E, first, sh);
  if (first && b == 0) reduce_bad<kThreads>(block_bad, nc, bad_s);
  __syncthreads();
  if (first) {
    const int used = tile_starts(sh, E, BM, warp_sums);
    write_tile_tables(sh, b, nb, E, BM, NT, used, *bad_s, tile_expert, tile_valid_rows, expert_counts, info);
  }
  add_tile_starts(sh, E, BM);
  scatter_chunk(c, ex, peers, T, topk, E, sh, warp_sums, sorted_token_ids, token_pos);
}

// -- the three kernels ---------------------------------------------------------------------------

// Kernel 1: phase 1 of chunk blockIdx.x (counts by shared-memory atomics: one per expert of a
// round); zeroes the producer counts. Dynamic shared memory: E ints.
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
  const long long first = (long long)blockIdx.x * kChunk + warp * (kWarp * kItems) + lane;
  const int nbits = id_bits(E);
  int bad = kNoBad, ex[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) ex[j] = expert_of(ids, first + j * kWarp, R, E);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = ex[j];
    const unsigned peers = peers_of(e, nbits);
    if (e >= 0 && (peers & lanemask_lt()) == 0) atomicAdd(&hist[e], __popc(peers));
    else if (e == -2 && bad == kNoBad) bad = int(first + j * kWarp);
  }
  if (bad != kNoBad) atomicMin(&bad_s, bad);
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) block_counts[(long long)blockIdx.x * E + e] = hist[e];
  if (tid == 0) block_bad[blockIdx.x] = bad_s == kNoBad ? -1 : bad_s;
}

// Kernel 2: phase 2 of chunk blockIdx.x; ranks its rows before it waits for kernel 1.
// Dynamic shared memory: Shared::smem_ints(E) ints.
template <class IdT, int kThreads, int kItems>
__device__ void scatter_kernel(const IdT* __restrict__ ids, int R, int T, int topk, int E, int BM, int NT,
                               const int* block_counts, const int* block_bad, int* __restrict__ sorted_token_ids,
                               int* __restrict__ token_pos, int* __restrict__ tile_expert,
                               int* __restrict__ tile_valid_rows, int* __restrict__ expert_counts,
                               int* __restrict__ info) {
  constexpr int kWarps = kThreads / kWarp;
  extern __shared__ int smem[];
  const Shared<kThreads, kItems> sh(smem, E);
  __shared__ int warp_sums[kWarps];
  __shared__ int bad_s;
  griddep_launch_dependents();                     // the tiles kernel's blocks may wait resident
  for (int i = threadIdx.x; i < kWarps * E; i += kThreads) sh.wcnt[i] = 0;
  __syncthreads();
  int ex[kItems];
  unsigned peers[kItems];
  rank_chunk<IdT, kThreads, kItems>(ids, blockIdx.x, R, E, sh.wcnt, ex, peers);   // overlaps kernel 1
  __syncthreads();
  scan_warps(sh, E);
  griddep_wait();                                  // kernel 1's block_counts and block_bad
  scatter_phase(int(blockIdx.x), true, blockIdx.x, gridDim.x, ex, peers, block_counts, block_bad, gridDim.x, T,
                topk, E, BM, NT, sh, warp_sums, &bad_s, sorted_token_ids, token_pos, tile_expert, tile_valid_rows,
                expert_counts, info);
}

// Kernel 3: phase 3, one warp per row tile.
template <int kThreads, int kMaxExperts, int kNarrowTiles>
__device__ void tiles_kernel(int* sorted_token_ids, const int* tile_valid_rows, int NT, int BM, int Ms, int width,
                             int* __restrict__ tile_tokens, int* __restrict__ tile_ranks,
                             int* __restrict__ tile_token_tiles, int* __restrict__ tile_num_token_tiles,
                             int* __restrict__ producers, const int* tile_expert, const int* expert_counts, int E,
                             int* __restrict__ tile_visit) {
  constexpr int kWarps = kThreads / kWarp;
  __shared__ int n[kMaxExperts], first[kMaxExperts], warp_sums[kWarps];
  const int i = blockIdx.x * kWarps + threadIdx.x / kWarp;
  griddep_wait();                                  // the scatter kernel's rows and tile tables
  tiles_from(i, NT, NT, tile_valid_rows, sorted_token_ids, BM, Ms, width, tile_tokens, tile_ranks,
             tile_token_tiles, tile_num_token_tiles, producers);
  expert_tiles<kThreads>(E, BM, expert_counts, n, first, warp_sums);
  visit_from<kNarrowTiles>(i, NT, NT, E, tile_expert, n, first, tile_visit);
}

// -- the fused kernel ----------------------------------------------------------------------------

// All three phases in one cooperative launch, two grid barriers between them. Block g takes
// chunks g, g + G, ... (G = gridDim.x, nc chunks); where a block has one chunk (nc <= G) its
// ranks stay in registers and shared memory across the first barrier, else phase 2 ranks each
// chunk again. Blocks beyond the chunks join in phase 3 only. Dynamic shared memory:
// Shared::smem_ints(E) ints.
template <class IdT, int kThreads, int kItems, int kNarrowTiles>
__device__ void fused_kernel(const IdT* __restrict__ ids, int R, int T, int topk, int E, int BM, int NT, int Ms,
                             int width, int TT, int nc, int* block_counts, int* block_bad, int* sorted_token_ids,
                             int* token_pos, int* tile_expert, int* tile_valid_rows, int* expert_counts, int* info,
                             int* tile_tokens, int* tile_ranks, int* tile_token_tiles, int* tile_num_token_tiles,
                             int* producers, int* tile_visit, unsigned* barrier) {
  constexpr int kWarps = kThreads / kWarp;
  extern __shared__ int smem[];
  const Shared<kThreads, kItems> sh(smem, E);
  __shared__ int warp_sums[kWarps];
  __shared__ int bad_s;
  const int G = gridDim.x, g = blockIdx.x;
  for (int j = g * kThreads + threadIdx.x; j < TT; j += G * kThreads) producers[j] = 0;
  int ex[kItems];
  unsigned peers[kItems];
  for (int c = g; c < nc; c += G)
    count_chunk<IdT, kThreads, kItems>(ids, c, R, E, sh, &bad_s, block_counts, block_bad, ex, peers);
  grid_sync(barrier);
  const int owners = min(G, nc);                   // the blocks with a chunk share the tile tables
  for (int c = g; c < nc; c += G) {
    if (c != g || nc > G) {                        // phase 1's ranks of this chunk are gone: again
      for (int i = threadIdx.x; i < kWarps * E; i += kThreads) sh.wcnt[i] = 0;
      __syncthreads();
      rank_chunk<IdT, kThreads, kItems>(ids, c, R, E, sh.wcnt, ex, peers);
      __syncthreads();
      scan_warps(sh, E);
    }
    scatter_phase(c, c == g, g, owners, ex, peers, block_counts, block_bad, nc, T, topk, E, BM, NT, sh, warp_sums,
                  &bad_s, sorted_token_ids, token_pos, tile_expert, tile_valid_rows, expert_counts, info);
  }
  grid_sync(barrier);
  tiles_from(g * kWarps + threadIdx.x / kWarp, G * kWarps, NT, tile_valid_rows, sorted_token_ids, BM, Ms, width,
             tile_tokens, tile_ranks, tile_token_tiles, tile_num_token_tiles, producers);
  int* n = sh.wcnt;                                // phase 2's per-warp counts are done with: 2E of kWarps * E
  expert_tiles<kThreads>(E, BM, expert_counts, n, n + E, warp_sums);
  visit_from<kNarrowTiles>(g * kWarps + threadIdx.x / kWarp, G * kWarps, NT, E, tile_expert, n, n + E, tile_visit);
}

}  // namespace moe_routing
}  // namespace tldsl
