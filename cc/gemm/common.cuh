// What the GEMM kernels share: the order of their output tiles and the walk over the groups that
// finds a tile's group on the device.
//
// Tiles, in the order a persistent grid takes them (block b takes t = b, b + G, b + 2G, ...):
// group after group; in MODE_RAGGED group i has ceil(size_i / TM) row blocks (starting at its
// first row off_i, not at a multiple of TM: a row block never holds rows of an earlier group),
// then a last pseudo-group of the rows past the groups' sum (zero tiles); in MODE_CONTRACT every
// group has the ceil(k / TM) x ceil(n / TN) tiles of its out[i]. Inside a group the tiles go in
// bands of BAND_ROWS rows (BAND_ROWS / TM row blocks, whatever the tiles' height), down a band's
// column of tiles first, so that the tiles running at once share their rows of a and their columns
// of b in L2.
// PAIRS (MODE_RAGGED, clusters of two blocks): the walk's tiles are pairs of tiles that share an
// operand. A group's row blocks go two by two (one tile above the other: the same columns of b); an
// odd last row block goes in pairs of tiles side by side (the same rows of a), so that no block of a
// pair idles at a group's end whatever the group's size (at most the second tile of its last pair,
// where the row has an odd count of tiles, lies past n).
#pragma once
#include <climits>

#include "gemm/gemm.h"
#include "tk/tk.cuh"

namespace jax_tk::gemm {

constexpr int BAND_ROWS = 2048;

// A tile as the kernels take it.
struct alignas(16) TileSlot {
  int t;       // its number; INT_MAX: no more tiles
  int group;   // its group (MODE_RAGGED: -1 for the zero tiles past the groups' sum)
  int m0, n0;  // first row and column of out (MODE_CONTRACT: of out[group], m0 along k)
  int r0, r1;  // the group's rows [r0, r1) of a (and of out in MODE_RAGGED)
  int across;  // (pairs) 1: the pair's blocks take two tiles side by side (same rows); 0: one above the other
};

// The walk over the groups by one warp (every lane calls it, with the same t, in increasing t): a
// window of 32 groups from gb, the first of them starting at row `rows` and tile `tiles`. Each step
// reads 32 sizes, scans them (the row offsets, saturating at m) and the tiles they make (scan of
// the counts); the first lane whose groups hold tile t has it. The window then starts at that
// group, so the next, later tile is found from there.
template <int TM, int TN, bool PAIRS = false> struct GroupWalk {
  static_assert(BAND_ROWS % (2 * TM) == 0);
  int gb = 0, rows = 0, tiles = 0;

  __device__ __forceinline__ TileSlot find(const Params &p, int t) {
    const int lane = tk::laneid();
    const int last = p.mode == MODE_RAGGED ? p.groups : p.groups - 1;  // (MODE_RAGGED: + the zero rows)
    const int nt = (p.n + TN - 1) / TN, per_group = (p.k + TM - 1) / TM * nt;  // (MODE_CONTRACT)
    for (;;) {
      const int idx = gb + lane;
      long long s = idx < p.groups ? max(__ldg(p.group_sizes + idx), 0) : 0;
      s = min(s, (long long)p.m);
      long long incl = s;  // saturating inclusive scan: min(sum, m)
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const long long v = __shfl_up_sync(~0u, incl, d);
        if (lane >= d) incl = min(incl + v, (long long)p.m);
      }
      long long excl = __shfl_up_sync(~0u, incl, 1);
      if (lane == 0) excl = 0;
      const int off = int(min(rows + excl, (long long)p.m));
      const int end = idx == p.groups && p.mode == MODE_RAGGED ? p.m : int(min(rows + incl, (long long)p.m));
      int count = 0;
      if (idx <= last) count = p.mode == MODE_RAGGED ? ragged_tiles((end - off + TM - 1) / TM, nt) : per_group;
      int tincl = count;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(~0u, tincl, d);
        if (lane >= d) tincl += v;
      }
      tincl += tiles;
      const unsigned hit = __ballot_sync(~0u, tincl > t);
      if (hit) {
        const int L = __ffs(hit) - 1;
        gb += L;
        rows = __shfl_sync(~0u, off, L);
        tiles = __shfl_sync(~0u, tincl - count, L);
        const int r1 = __shfl_sync(~0u, end, L);
        return coords(p, t, rows, r1);
      }
      if (gb + 31 >= last) return TileSlot{INT_MAX, 0, 0, 0, 0, 0};
      rows = __shfl_sync(~0u, end, 31);
      tiles = __shfl_sync(~0u, tincl, 31);
      gb += 32;
    }
  }

  // A group's tiles in MODE_RAGGED: of mt row blocks and nt column tiles.
  __device__ __forceinline__ static int ragged_tiles(int mt, int nt) {
    return PAIRS ? mt / 2 * nt + mt % 2 * ((nt + 1) / 2) : mt * nt;
  }

  // Tile t of the group at gb (rows [r0, r1), first tile `tiles`): its place in the bands.
  __device__ __forceinline__ TileSlot coords(const Params &p, int t, int r0, int r1) const {
    const int nt = (p.n + TN - 1) / TN;
    int mt = p.mode == MODE_RAGGED ? (r1 - r0 + TM - 1) / TM : (p.k + TM - 1) / TM;
    int rem = t - tiles, tm = TM, across = 0;
    if (PAIRS && p.mode == MODE_RAGGED) {  // (pairs of row blocks, then the odd one's pairs of columns)
      tm = 2 * TM;
      if (rem >= mt / 2 * nt) across = 1, rem -= mt / 2 * nt;
      mt /= 2;
    }
    TileSlot x{t, gb, 0, 0, r0, r1, across};
    if (across) {
      x.m0 = mt * tm, x.n0 = 2 * rem * TN;
    } else {
      const int band_h = BAND_ROWS / tm, band = rem / (band_h * nt), r = rem - band * band_h * nt;
      const int h = min(band_h, mt - band * band_h);
      x.m0 = (band * band_h + r % h) * tm, x.n0 = r / h * TN;
    }
    if (p.mode == MODE_RAGGED) {
      x.m0 += r0;
      if (gb == p.groups) x.group = -1;
    }
    return x;
  }
};

}  // namespace jax_tk::gemm
