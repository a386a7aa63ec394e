// tldsl: the tiles a persistent grouped-GEMM CTA visits, and what it does with each.
//
// Every role of the kernel (TMA producer, gathering producer, notifier warp, consumer warpgroups)
// walks the same sequence and makes the same choices from it, so their barrier rings stay in step.
// Plain C++ (no CUDA headers) so that the host test suite can compile and check the walk.
#pragma once

#include "tldsl/tile_order.hpp"

namespace tldsl {
namespace grouped {

// What one CTA does with a cluster tile (kClusterM vertically adjacent tiles of one tile column;
// one tile without clusters): its own tile (m, n); `valid`: m is a tile row of the grid (an odd
// grid's last cluster has a partner past it); `active`: the tile's guard holds; `run`: the
// cluster runs the K loop (the guard holds on either tile: both CTAs then step through the same
// stages, a CTA with nothing to compute only passes them on); `shared`: both tiles are active on
// the same expert, so the two CTAs load one half of B each and multicast it to both; `e`: the
// expert (kExpert only: the producers need it, the consumers do not).
//
// Cfg::kPairRows (no clusters): the part's tiles have 64 rows (an expert pads to 64 rows, not 128) and
// the CTA's tiles 128. An even tile m whose successor is active on the same expert, m itself full,
// leads: its CTA tile is rows m*64 .. m*64+127, both program tiles (`two`), and the successor has
// nothing of its own (not `valid`). Any other active tile runs alone as a half tile (64 rows).
struct PairTile {
  int m, n, e;
  bool valid, active, run, shared;
  bool two = false;
};

template <class Cfg, class Prog>
TLDSL_HD bool leads_pair(const Prog& prog, int m, int n) {
  return m + 1 < Cfg::kGridM && prog.active(m, n) && prog.active(m + 1, n) &&
         prog.batch(m, n) == prog.batch(m + 1, n) && prog.valid_rows(m, n) >= 64;
}

template <class Cfg, bool kExpert, class Prog>
TLDSL_HD PairTile pair_tile(const Prog& prog, TileCoord ct, int cl_rank) {
  constexpr int kCl = Cfg::kClusterM;
  PairTile p;
  p.m = ct.m * kCl + cl_rank;
  p.n = ct.n;
  p.valid = p.m < Cfg::kGridM;
  p.active = p.valid && prog.active(p.m, p.n);
  p.e = (kExpert && p.active) ? prog.batch(p.m, p.n) : 0;
  p.run = p.active;
  p.shared = false;
  if constexpr (kCl > 1) {
    const int q = ct.m * kCl + (cl_rank ^ 1);
    const bool q_active = q < Cfg::kGridM && prog.active(q, p.n);
    p.run = p.active || q_active;
    if constexpr (kExpert) p.shared = p.active && q_active && prog.batch(q, p.n) == p.e;
  }
  if constexpr (Cfg::kPairRows) {
    static_assert(kCl == 1, "paired program tiles: no clusters");
    if (p.valid) {
      if (p.m & 1) {
        if (leads_pair<Cfg>(prog, p.m - 1, p.n)) p.valid = p.active = p.run = false;   // its leader runs it
      } else {
        p.two = p.active && leads_pair<Cfg>(prog, p.m, p.n);
      }
    }
  }
  return p;
}

// The persistent walk of CTA `first_tile` of `tile_step` (cluster tiles: blockIdx.x / kClusterM of
// gridDim.x / kClusterM): the tiles t = first, first + step, ... of the schedule's order, each a
// cluster tile. Cfg::kPairRows: slots of two program tiles (kSub), the two of a slot taken one
// after the other by the same CTA — an order over program tiles would give leaders and followers
// to different CTAs, half of them idle. u = kSub * (place in the order) + which tile of the slot;
// tile(u) is the cluster tile whose row the CTA's pair_tile takes (the program tile, paired).
template <class Cfg>
struct TileWalk {
  static constexpr int kSub = Cfg::kPairRows ? 2 : 1;
  static constexpr int kCl = Cfg::kClusterM;
  static constexpr int gmc = ((Cfg::kGridM + kSub - 1) / kSub + kCl - 1) / kCl, gn = Cfg::kGridN;
  static constexpr int num_tiles = gmc * gn;
  int start_row, step, first, end;

  TLDSL_HD TileWalk(int first_tile, int tile_step, int rank)
      : start_row(comm_aligned_start(gmc, rank, Cfg::kWorldSize, Cfg::kAlignShift)), step(tile_step),
        first(first_tile * kSub), end(num_tiles * kSub) {}

  TLDSL_HD int next(int u) const { return u % kSub == kSub - 1 ? u + 1 + (step - 1) * kSub : u + 1; }

  TLDSL_HD TileCoord tile(int u) const {
    TileCoord c = tile_at(Cfg::kOrder, u / kSub, gmc, gn, Cfg::kGroupM, start_row);
    c.m = c.m * kSub + u % kSub;
    return c;
  }
};

}  // namespace grouped
}  // namespace tldsl
