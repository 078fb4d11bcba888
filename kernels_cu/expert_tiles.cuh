// What every expert GEMM kernel shares: which tile a block computes, how its operands stream into
// shared memory, and how a pair of output columns is written.
//
// The m-tiles of all experts form one list (tile_offsets, written by dispatch_scan); block indices are
// swizzled in groups of GROUP_M m-tiles across all n-tiles, so neighbouring blocks share weight tiles
// in L2.
//   GATED (gate/up):  A rows are gathered from x through sorted_slots; the B tile holds gate rows
//                     [n0, n0+BN) then up rows [N+n0, N+n0+BN) of w13[e]; C is h [S, N], N = I.
//   !GATED (down):    A rows are this expert's rows of h; B holds rows [n0, n0+BN) of w2[e]; C is y [S, N].
// K streams in tiles of BK = 64 through cp.async into 128-byte-swizzled shared tiles, the layout both
// ldmatrix (conflict-free) and wgmma (128B swizzle mode) read.
#pragma once
#include "common.cuh"

constexpr int BK = 64;
constexpr int GROUP_M = 8;

struct Tile {
  int expert;
  int slot_base;  // first sorted slot of the tile
  int rows;       // valid rows, <= BM
  int n0;         // first output column
};

// Returns false when this block has no tile (the grid is sized by an upper bound).
template <int BM, int BN>
__device__ __forceinline__ bool find_tile(const int* offsets, const int* tile_offsets, int num_experts,
                                          int n_out, Tile& tile) {
  const int n_tiles = n_out / BN;
  const int m_bound = gridDim.x / n_tiles;
  const int first_m = (blockIdx.x / (GROUP_M * n_tiles)) * GROUP_M;
  const int group_m = min(GROUP_M, m_bound - first_m);
  const int in_group = blockIdx.x % (GROUP_M * n_tiles);
  const int m_tile = first_m + in_group % group_m;
  if (m_tile >= tile_offsets[num_experts]) return false;
  int lo = 0, hi = num_experts;  // tile_offsets[lo] <= m_tile < tile_offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_offsets[mid] <= m_tile) lo = mid; else hi = mid;
  }
  const int row0 = (m_tile - tile_offsets[lo]) * BM;
  tile.expert = lo;
  tile.slot_base = offsets[lo] + row0;
  tile.rows = min(BM, offsets[lo + 1] - offsets[lo] - row0);
  tile.n0 = (in_group / group_m) * BN;
  return true;
}

// Per-thread cp.async source pointers for one tile; load() copies K-tile kt into a pipeline stage.
template <int BM, int BN, int THREADS, bool GATED>
struct TileLoader {
  static constexpr int B_ROWS = GATED ? 2 * BN : BN;
  static constexpr int A_ITERS = BM * 8 / THREADS;
  static constexpr int B_ITERS = B_ROWS * 8 / THREADS;
  static constexpr int A_BYTES = BM * 128, B_BYTES = B_ROWS * 128;  // one stage
  static_assert(A_ITERS * THREADS == BM * 8 && B_ITERS * THREADS == B_ROWS * 8, "loader shape");

  const u16* a_src[A_ITERS];
  bool a_valid[A_ITERS];
  const u16* b_src[B_ITERS];

  __device__ __forceinline__ TileLoader(const Tile& t, const u16* a, const int* sorted_slots, int top_k,
                                        const u16* w, int n_out, int k_dim) {
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int idx = threadIdx.x + i * THREADS, r = idx >> 3;
      a_valid[i] = r < t.rows;
      long long src_row = 0;
      if (a_valid[i]) src_row = GATED ? sorted_slots[t.slot_base + r] / top_k : t.slot_base + r;
      a_src[i] = a + src_row * k_dim + (idx & 7) * 8;
    }
    const long long w_rows = GATED ? 2LL * n_out : n_out;
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int idx = threadIdx.x + i * THREADS, r = idx >> 3;
      const long long w_row = (GATED && r >= BN) ? n_out + t.n0 + (r - BN) : t.n0 + r;
      b_src[i] = w + (t.expert * w_rows + w_row) * k_dim + (idx & 7) * 8;
    }
  }

  __device__ __forceinline__ void load(u32 s_a, u32 s_b, int kt) const {
    const int k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int idx = threadIdx.x + i * THREADS;
      cp_async_16(s_a + swizzled_offset(idx >> 3, idx & 7), a_src[i] + k0, a_valid[i]);
    }
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int idx = threadIdx.x + i * THREADS;
      cp_async_16(s_b + swizzled_offset(idx >> 3, idx & 7), b_src[i] + k0, true);
    }
  }
};

// Writes C[row, col..col+1] of the tile (row < tile.rows is the caller's check).
template <class T>
__device__ __forceinline__ void store_pair(u16* c, const Tile& t, int row, int n_out, int col, float v0, float v1) {
  *reinterpret_cast<u32*>(c + (long long)(t.slot_base + row) * n_out + t.n0 + col) = Float16Traits<T>::pack(v0, v1);
}
