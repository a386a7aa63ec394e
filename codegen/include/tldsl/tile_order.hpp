// tldsl: the order in which a persistent kernel visits a 2-D grid of output tiles.
//
// Mirrors tldsl.ir.schedule.ComputeSchedule.tile_order exactly (the simulator's order), so a
// schedule means the same thing on the CPU and on the GPU:
//   row_major     t -> (t / gn, t % gn)
//   swizzled      groups of `group_m` tile rows; inside a group, column by column
//   comm_aligned  swizzled over the tile rows rotated to start at ((rank + align_shift) % W) * gm / W
// A persistent CTA b of P visits t = b, b + P, b + 2P, ... of this sequence.
//
// Plain C++ (no CUDA headers) so that the host test suite can compile and check it.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TLDSL_HD __host__ __device__ __forceinline__
#else
#define TLDSL_HD inline
#endif

namespace tldsl {

enum TileOrderKind : int { kRowMajor = 0, kSwizzled = 1, kCommAligned = 2 };

struct TileCoord {
  int m;
  int n;
};

// First tile row of the comm_aligned order on `rank`: the rows of rank (rank + align_shift) mod
// world_size, a modulo that is never negative, as Python's % (the host renders align_shift reduced
// to [0, world_size): codegen/plan/tile_order.py; C++'s % keeps the dividend's sign).
TLDSL_HD constexpr int comm_aligned_start(int gm, int rank, int world_size, int align_shift) {
  const int s = (rank + align_shift) % world_size;
  return ((s < 0 ? s + world_size : s) * gm) / world_size;
}

// The t-th tile (0 <= t < gm * gn) of the order `kind`.
// A group of gm rows or more is the whole grid: group_m is bounded by gm first, so that
// g * gn (<= gm * gn) cannot overflow (the schedule takes any positive group_m).
TLDSL_HD constexpr TileCoord tile_at(int kind, int t, int gm, int gn, int group_m, int start_row) {
  if (kind == kSwizzled || kind == kCommAligned) {
    const int g = group_m < gm ? group_m : gm;
    const int first = (t / (g * gn)) * g;                   // first row of t's group
    const int rows = (gm - first) < g ? (gm - first) : g;
    const int r = t - first * gn;                             // index inside the group
    const int m = first + r % rows;
    return TileCoord{kind == kSwizzled ? m : (start_row + m) % gm, r / rows};
  }
  return TileCoord{t / gn, t % gn};
}

}  // namespace tldsl
