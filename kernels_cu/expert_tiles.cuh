// What every expert GEMM kernel shares: which tile a block computes, how its operands stream into
// shared memory, and how a pair of output columns is written.
//
// The m-tiles of all experts form one list (the tile map of tile_map.cuh, written by the dispatch). Work items run
// expert by expert; an expert's m-tiles go in groups of up to GROUP_M, each group across all n-tiles
// with its m-tiles innermost, so neighbouring items share a weight tile or a tile's rows in L2.
//   GATED (gate/up):  A rows are gathered from x through sorted_slots; the B tile holds gate rows
//                     [n0, n0+BN) then up rows [N+n0, N+n0+BN) of w13[e]; C is h [S, N], N = I.
//   !GATED (down):    A rows are this expert's rows of h; B holds rows [n0, n0+BN) of w2[e]; C is y [S, N].
// K streams in tiles of BK (64) values through cp.async (and TMA, for the persistent kernel's weights) into
// 128-byte-swizzled shared tiles, the layout ldmatrix (conflict-free), wgmma (128B swizzle mode)
// and TMA (SWIZZLE_128B) share.
#pragma once
#include "common.cuh"
#include "tile_map.cuh"

constexpr int GROUP_M = 8;

// The scales of an FP8 GEMM's operands, passed by value (cupymoe/_gpu_experts.py's FP8_SCALES); null for bf16/fp16.
struct Fp8Scales {
  const float* a;  // [rows of A, K / FP8_BLOCK]: x's by token (gate/up), h's by row (down)
  const float* w;  // the weights': SCALE_BLOCK [E, W rows / FP8_BLOCK, K / FP8_BLOCK], SCALE_CHANNEL [E, W rows]
  float* h;        // gate/up on expert_gemm_ws: h's scales [rows, N / FP8_BLOCK], written beside its e4m3 bytes in C
};
// A GEMM's FP8 template argument is NOT_FP8, or the layout of its weight scales, SCALE_BLOCK or
// SCALE_CHANNEL (the host widens per-expert scales to channels).

struct Tile {
  int expert;
  int slot_base;  // first sorted slot of the tile
  int rows;       // valid rows, <= BM
  int n0;         // first output column
};

// Whether a launch for ``plan`` works: the host may launch the kernels of two plans, its own (0)
// and one for skewed routing (1), of which the dispatch chose one (tile_map in dispatch.cu); -1:
// the only plan.
__device__ __forceinline__ bool plan_chosen(const int* tile_offsets, int num_experts, int plan) {
  return plan < 0 || chosen_plan(tile_offsets, num_experts) == plan;
}

// The tile of work item ``work``; false past the last (a grid sized on the host may have more blocks).
// An expert of two m-tiles is split about evenly (u8192's ~256 rows as 128 + 128, not 160 + 96), so
// the two read its weights in step.
template <int BM, int BN>
__device__ __forceinline__ bool find_tile(int work, const int* offsets, const int* tile_offsets, int num_experts,
                                          int n_out, Tile& tile) {
  const int n_tiles = n_out / BN;
  const int m_tile_of_work = work / n_tiles;  // items of expert e: [tile_offsets[e], tile_offsets[e + 1]) * n_tiles
  if (m_tile_of_work >= tile_total(tile_offsets, num_experts)) return false;
  int lo = 0, hi = num_experts;  // tile_offsets[lo] <= m_tile_of_work < tile_offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_offsets[mid] <= m_tile_of_work) lo = mid; else hi = mid;
  }
  const int expert_tiles = tile_offsets[lo + 1] - tile_offsets[lo];
  const int local = work - tile_offsets[lo] * n_tiles;
  const int first_m = local / (GROUP_M * n_tiles) * GROUP_M;  // the group's first m-tile, within the expert
  const int group_m = min(GROUP_M, expert_tiles - first_m);
  const int in_group = local - first_m * n_tiles;
  const int m_tile = first_m + in_group % group_m;  // ... of the expert
  const int count = offsets[lo + 1] - offsets[lo];
  constexpr int SPLIT_STEP = BM % 32 == 0 ? 32 : BM;  // an expert of two chunks splits at a multiple of this
  const int chunk_rows = expert_tiles == 2
                             ? min(BM, ((count + 1) / 2 + SPLIT_STEP - 1) / SPLIT_STEP * SPLIT_STEP)
                             : BM;
  const int row0 = m_tile * chunk_rows;
  tile.expert = lo;
  tile.slot_base = offsets[lo] + row0;
  tile.rows = min(chunk_rows, count - row0);
  tile.n0 = (in_group / group_m) * BN;
  return true;
}

// The A rows of a tile one thread copies: 16-byte chunk (threadIdx.x % 8) of rows
// threadIdx.x / 8 + i * ROW_STEP. load() copies K-tile kt into a pipeline stage. Kept small (row
// indices only): the persistent kernel's loading warpgroup holds one in 88 registers.
template <int BM, int THREADS, bool GATED>
struct RowGather {
  static constexpr int ROW_STEP = THREADS / 8;
  static constexpr int A_ITERS = BM / ROW_STEP;
  static constexpr int A_BYTES = BM * ROW_BYTES;  // one stage
  static_assert(A_ITERS * ROW_STEP == BM, "gather shape");

  int a_row[A_ITERS];  // row of a (x or h) for each A row this thread loads; -1: past the expert

  RowGather() = default;
  // Row r of tile t is entry slot_base + r of ``order``, or that index itself where order is null:
  // for gate/up a routed slot, whose token's row of x it reads; for down a row of h.
  __device__ __forceinline__ RowGather(const Tile& t, const int* order, int top_k) {
    const int r0 = threadIdx.x >> 3;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int r = r0 + i * ROW_STEP, entry = t.slot_base + r;
      a_row[i] = r >= t.rows ? -1 : (order ? order[entry] : entry) / (GATED ? top_k : 1);
    }
  }

  __device__ __forceinline__ void load(u32 s_a, const u16* a, int k_dim, int kt) const {
    const int r0 = threadIdx.x >> 3, chunk = threadIdx.x & 7, k0 = kt * BK + chunk * 8;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i)
      cp_async_16(s_a + swizzled_offset(r0 + i * ROW_STEP, chunk),
                  a + (long long)max(a_row[i], 0) * k_dim + k0, a_row[i] >= 0);
  }
  // FP8: the scales of K-tile kt of these rows (``scales`` [rows of a, k_tiles]) into BM floats at
  // s_scale, by the threads of chunk 0; 0 past the expert.
  __device__ __forceinline__ void load_scales(u32 s_scale, const float* scales, int k_tiles, int kt) const {
    if (threadIdx.x & 7) return;
    const int r0 = threadIdx.x >> 3;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i)
      cp_async_4(s_scale + 4 * (r0 + i * ROW_STEP), scales + (long long)max(a_row[i], 0) * k_tiles + kt, a_row[i] >= 0);
  }
};

// A tile's A rows and its B rows (the weights), by cp.async. ``w_k``: a weight row's length in
// 16-bit units (K, or K / 2 for e4m3 weights beside 16-bit A: cupymoe's w8a16).
template <int BM, int BN, int THREADS, bool GATED>
struct TileLoader {
  using Gather = RowGather<BM, THREADS, GATED>;
  static constexpr int B_ROWS = GATED ? 2 * BN : BN;
  static constexpr int B_ITERS = B_ROWS / Gather::ROW_STEP;
  static constexpr int A_BYTES = Gather::A_BYTES, B_BYTES = B_ROWS * ROW_BYTES;  // one stage
  static_assert(B_ITERS * Gather::ROW_STEP == B_ROWS && BN % Gather::ROW_STEP == 0, "loader shape");

  Gather gather;
  const u16* b_src;  // this thread's first weight row and chunk

  __device__ __forceinline__ TileLoader(const Tile& t, const int* order, int top_k, const u16* w,
                                        int n_out, int w_k)
      : gather(t, order, top_k) {
    const long long w_rows = GATED ? 2LL * n_out : n_out;
    b_src = w + (t.expert * w_rows + t.n0 + (threadIdx.x >> 3)) * w_k + (threadIdx.x & 7) * 8;
  }

  // K-tile kt of the weight rows.
  __device__ __forceinline__ void load_weights(u32 s_b, int n_out, int w_k, int kt) const {
    const int r0 = threadIdx.x >> 3, chunk = threadIdx.x & 7;
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int r = i * Gather::ROW_STEP;  // GATED: rows from BN on are the up projection, n_out rows further
      const long long skip = (GATED && r >= BN) ? n_out - BN : 0;
      cp_async_16(s_b + swizzled_offset(r0 + r, chunk), b_src + (r + skip) * w_k + kt * BK, true);
    }
  }
  // K-tile kt of A and of the weights, whose rows are as long (both 16-bit, or both e4m3).
  __device__ __forceinline__ void load(u32 s_a, u32 s_b, const u16* a, int n_out, int k_dim, int kt) const {
    gather.load(s_a, a, k_dim, kt);
    load_weights(s_b, n_out, k_dim, kt);
  }
};

// Writes C[row, col..col+1] of the tile (row < tile.rows is the caller's check).
template <class T>
__device__ __forceinline__ void store_pair(u16* c, const Tile& t, int row, int n_out, int col, float v0, float v1) {
  *reinterpret_cast<u32*>(c + (long long)(t.slot_base + row) * n_out + t.n0 + col) = Float16Traits<T>::pack(v0, v1);
}
