// Per-expert GEMMs on mma.sync m16n8k16 tensor cores (fp32 accumulation): the portable path, sm_80+.
// A block of WM x WN warps computes a BM x BN tile (expert_tiles.cuh says which, and what A, B, C are);
// K streams through a STAGES-deep cp.async pipeline whose stages hold KG consecutive K-tiles each, so
// a weight row is read KG * 128 contiguous bytes at a time (DRAM streams 128-byte pieces of many rows
// a few percent slower); fragments come from shared memory by ldmatrix.
// GATED blocks keep gate and up accumulators for the same columns and write h = act(gate, up);
// epilogue.cuh adds the biases and the routing weight on the input (the EPILOGUE flags).
// FP8 (w8a8, cupymoe/fp8.py; sm_89+): A and B hold e4m3 bytes, taken as 16-bit pairs, so that the
// loaders, the 128-byte rows and ldmatrix serve unchanged (k_dim counts pairs): a K-tile is then
// FP8_BLOCK values, one scale group, whose m16n8k32 products sum in the accumulators; after each
// K-tile they are added to the totals times the group's scales (Fp8Scales) and cleared. The FP8
// template argument says which: NOT_FP8, or the weight scales' layout.
// WEIGHT_ONLY (w8a16, any sm_80+): FP8 weights beside 16-bit A. A weight K-tile (128 e4m3 bytes a
// row, one scale group) meets two of A's; ldmatrix gives each lane the m16n8k32 fragment of 4 bytes
// (k = 4q..4q+3 and 16 on, q = lane % 4), widened exactly in registers to the B of two m16n8k16
// MMAs whose K runs in that order; A's fragments follow it, 8 bytes (k = 4q..4q+3) a load.
// Two kernels compute such tiles:
//   expert_gemm: the tiles of the dispatch's m-tile map, one per block from a grid of all tiles;
//                from a smaller grid (one wave, for a launch that may not be the dispatch's choice,
//                so that it costs little when it is not) block b takes tile b, then claims more from
//                the map's counter, as the persistent kernel does.
//   slot_gemm:   for a few slots, without a dispatch: one block per routed slot (and n-tile); the
//                block of an expert's first slot, and of every BM-th after it, finds the expert's
//                next BM slots itself and computes them, as the dispatch would have grouped them.
//                A and C rows are in slot order (h and y [T * k, N]). Its down GEMM (!GATED) also
//                writes the combine's slot_positions: the slot, or -1 where the id is outside
//                [0, E). The tiles are expert_gemm's, so are the bits.
#include "epilogue.cuh"
#include "expert_tiles.cuh"

// The warp tiles of a block's BM x BN tile: WM x WN warps of WTM x WTN, each MI x NI m16n8 MMAs.
template <int BM, int BN, int WM, int WN>
struct WarpTiles {
  static constexpr int THREADS = WM * WN * 32;
  static constexpr int WTM = BM / WM, WTN = BN / WN;
  static constexpr int MI = WTM / 16, NI = WTN / 8;
  static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0 && WTM % 16 == 0, "warp tile shape");
};

// The weight scales of this thread's columns: ``col`` those of its column 0 (weight rows w_row + ni * 8 + p),
// fixed for SCALE_CHANNEL; for SCALE_BLOCK one per K group of the tile's 128-row block, set by block_scale.
template <int NI, int FP8>
struct ColumnScales {
  float col[FP8 == SCALE_CHANNEL ? NI : 1][2];
  float block;

  __device__ __forceinline__ ColumnScales(const Fp8Scales& s, int expert, int w_rows, int w_row) {
    if constexpr (FP8 == SCALE_CHANNEL) {
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int p = 0; p < 2; ++p) col[ni][p] = s.w[(long long)expert * w_rows + w_row + ni * 8 + p];
    }
  }
  __device__ __forceinline__ void block_scale(const Fp8Scales& s, int expert, int w_rows, int w_row, int k_groups,
                                              int kg) {
    if constexpr (FP8 == SCALE_BLOCK)
      block = s.w[((long long)expert * (w_rows / FP8_BLOCK) + w_row / FP8_BLOCK) * k_groups + kg];
  }
  __device__ __forceinline__ float of(int ni, int p) const {
    if constexpr (FP8 == SCALE_CHANNEL) return col[ni][p]; else return block;
  }
};

// total += acc * (row scale * weight scale) for one K group, then acc = 0; ``a_scale`` holds the
// scales of this thread's accumulator rows (mi, half).
template <int MI, int NI, int FP8>
__device__ __forceinline__ void promote(float (&total)[MI][NI][4], float (&acc)[MI][NI][4],
                                        const float (&a_scale)[MI][2], const ColumnScales<NI, FP8>& w_scale) {
#pragma unroll
  for (int ni = 0; ni < NI; ++ni)
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        total[mi][ni][i] = fmaf(acc[mi][ni][i], a_scale[mi][i >> 1] * w_scale.of(ni, i & 1), total[mi][ni][i]);
        acc[mi][ni][i] = 0.0f;
      }
}

template <int FP8, class F>
__device__ __forceinline__ void mma_step(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (FP8 != NOT_FP8) mma_e4m3(d, a, b0, b1); else F::mma(d, a, b0, b1);
}

// One K-tile of 16-bit A (or of e4m3 A and weights, FP8) at ``sa`` times its weights at ``sb``,
// summed into the accumulators (GATED: the up rows, BN on, into acc_up).
template <class T, int BM, int BN, int WM, int WN, bool GATED, int FP8, class Acc, class AccUp>
__device__ __forceinline__ void mma_k_tile(Acc& acc, AccUp& acc_up, u32 sa, u32 sb, int warp_m, int warp_n, int lane) {
  using W = WarpTiles<BM, BN, WM, WN>;
  using F = Float16Traits<T>;
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    u32 af[W::MI][4];
#pragma unroll
    for (int mi = 0; mi < W::MI; ++mi)
      ldmatrix_x4(af[mi], sa + swizzled_offset(warp_m * W::WTM + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
    for (int nj = 0; nj < W::NI / 2; ++nj) {
      const int n_row = warp_n * W::WTN + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int chunk = kk * 2 + ((lane >> 3) & 1);
      u32 bf[4];
      ldmatrix_x4(bf, sb + swizzled_offset(n_row, chunk));
#pragma unroll
      for (int mi = 0; mi < W::MI; ++mi) {
        mma_step<FP8, F>(acc[mi][2 * nj], af[mi], bf[0], bf[1]);
        mma_step<FP8, F>(acc[mi][2 * nj + 1], af[mi], bf[2], bf[3]);
      }
      if constexpr (GATED) {
        ldmatrix_x4(bf, sb + swizzled_offset(BN + n_row, chunk));
#pragma unroll
        for (int mi = 0; mi < W::MI; ++mi) {
          mma_step<FP8, F>(acc_up[mi][2 * nj], af[mi], bf[0], bf[1]);
          mma_step<FP8, F>(acc_up[mi][2 * nj + 1], af[mi], bf[2], bf[3]);
        }
      }
    }
  }
}

// WEIGHT_ONLY: 16 weight rows' e4m3 fragment of one 32-value step (ldmatrix at ``b_addr``), widened
// to T, times A's fragments ``af`` of the step's halves: four m16n8k16 MMAs per mi into sums[mi][2nj], [2nj + 1].
template <class T, int MI, class Sums>
__device__ __forceinline__ void widened_mmas(Sums& sums, const u32 (&af)[MI][2][4], u32 b_addr, int nj) {
  u32 bf[4], b[4][2];
  ldmatrix_x4(bf, b_addr);
#pragma unroll
  for (int i = 0; i < 4; ++i) widen_e4m3<T>(bf[i], b[i][0], b[i][1]);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int i = 0; i < 4; ++i)  // bf[i]: rows 8 * (i / 2) on, k 16 * (i % 2) on
      Float16Traits<T>::mma(sums[mi][2 * nj + (i >> 1)], af[mi][i & 1], b[i][0], b[i][1]);
}

// WEIGHT_ONLY: one weight K-tile of e4m3 at ``sb`` times A's two K-tiles at ``sa`` (16-bit), 32 K
// values a step: A's fragments of the step's halves (k 0..15, 16..31), 8-byte loads of rows g and
// g + 8 in the widened fragments' K order (the file's header).
template <class T, int BM, int BN, int WM, int WN, bool GATED, class Acc, class AccUp>
__device__ __forceinline__ void mma_k_tile_weight_only(Acc& acc, AccUp& acc_up, u32 sa, u32 sb, int warp_m, int warp_n,
                                                       int lane) {
  using W = WarpTiles<BM, BN, WM, WN>;
  constexpr u32 A_TILE_BYTES = BM * ROW_BYTES;
#pragma unroll
  for (int step = 0; step < 2 * BK / 32; ++step) {
    const u32 s_step = sa + (step >> 1) * A_TILE_BYTES;
    u32 af[W::MI][2][4];
#pragma unroll
    for (int mi = 0; mi < W::MI; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = warp_m * W::WTM + mi * 16 + (lane >> 2) + r * 8;
          const int chunk = (step & 1) * 4 + half * 2 + ((lane & 3) >> 1);
          lds_64(af[mi][half][r], af[mi][half][2 + r], s_step + swizzled_offset(row, chunk) + (lane & 1) * 8);
        }
#pragma unroll
    for (int nj = 0; nj < W::NI / 2; ++nj) {
      const int n_row = warp_n * W::WTN + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int chunk = step * 2 + ((lane >> 3) & 1);
      widened_mmas<T, W::MI>(acc, af, sb + swizzled_offset(n_row, chunk), nj);
      if constexpr (GATED) widened_mmas<T, W::MI>(acc_up, af, sb + swizzled_offset(BN + n_row, chunk), nj);
    }
  }
}

// The epilogue (epilogue.cuh): writes the tile's valid rows of a warp's accumulators, gate/up
// through the activation, C's row r at order[r] when SLOT_ORDER, else at the tile's slot_base + r.
// Gate/up's row r is the slot order[slot_base + r] (SLOT_ORDER: slot_base 0).
template <class T, int BM, int BN, int WM, int WN, bool GATED, int ACT, int EPILOGUE, bool SLOT_ORDER, class Acc,
          class AccUp>
__device__ __forceinline__ void store_tile(const Acc& acc, const AccUp& acc_up, u16* __restrict__ c, const Tile& tile,
                                           const int* __restrict__ order, int n_out, int warp_m, int warp_n,
                                           int lane, const EpilogueArgs& epilogue) {
  using W = WarpTiles<BM, BN, WM, WN>;
#pragma unroll
  for (int mi = 0; mi < W::MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * W::WTM + mi * 16 + (lane >> 2) + half * 8;
      if (r >= tile.rows) continue;
      float weight = 1.0f;
      if constexpr (GATED && (EPILOGUE & EPILOGUE_INPUT_WEIGHT)) weight = epilogue.slot_weights[order[tile.slot_base + r]];
#pragma unroll
      for (int ni = 0; ni < W::NI; ++ni) {
        float v0 = acc[mi][ni][2 * half], v1 = acc[mi][ni][2 * half + 1];
        const int col = warp_n * W::WTN + ni * 8 + (lane & 3) * 2;
        if constexpr (GATED) {
          float u0 = acc_up[mi][ni][2 * half], u1 = acc_up[mi][ni][2 * half + 1];
          if constexpr (EPILOGUE & EPILOGUE_INPUT_WEIGHT) {
            v0 *= weight, v1 *= weight, u0 *= weight, u1 *= weight;
          }
          if constexpr (EPILOGUE & EPILOGUE_BIAS) {
            const float2 gate = bias_pair<T>(epilogue.bias, tile.expert, 2 * n_out, tile.n0 + col);
            const float2 up = bias_pair<T>(epilogue.bias, tile.expert, 2 * n_out, n_out + tile.n0 + col);
            v0 += gate.x, v1 += gate.y, u0 += up.x, u1 += up.y;
          }
          v0 = activate<ACT>(v0, u0);
          v1 = activate<ACT>(v1, u1);
        } else if constexpr (EPILOGUE & EPILOGUE_BIAS) {
          const float2 bias = bias_pair<T>(epilogue.bias, tile.expert, n_out, tile.n0 + col);
          v0 += bias.x, v1 += bias.y;
        }
        store_pair<T>(c, tile, SLOT_ORDER ? order[r] : r, n_out, col, v0, v1);
      }
    }
  }
}

// One block's tile, start to end: the main loop streams the K-tiles through STAGES shared stages
// of KG K-tiles each (the last group may be short), multiplying each stage once it has landed;
// then the epilogue. ``order`` as RowGather reads it; SLOT_ORDER: C's row r is order[r]
// (slot_base 0), else slot_base + r. FP8 (but NOT_FP8): e4m3 weights with their ``scales``, and
// e4m3 A unless WEIGHT_ONLY; k_dim is A's row in 16-bit units.
template <class T, int BM, int BN, int WM, int WN, int STAGES, int KG, bool GATED, int ACT, int EPILOGUE,
          bool SLOT_ORDER, int FP8, bool WEIGHT_ONLY>
__device__ __forceinline__ void gemm_tile(const Tile& tile, const u16* __restrict__ a,
                                          const int* __restrict__ order, int top_k,
                                          const u16* __restrict__ w, int n_out, int k_dim,
                                          u16* __restrict__ c, const EpilogueArgs& epilogue,
                                          const Fp8Scales& scales) {
  using W = WarpTiles<BM, BN, WM, WN>;
  using Loader = TileLoader<BM, BN, W::THREADS, GATED>;
  constexpr bool SCALED = FP8 != NOT_FP8;
  static_assert(SCALED || !WEIGHT_ONLY, "weight-only takes FP8 weights");
  constexpr int A_TILES = WEIGHT_ONLY ? 2 : 1;  // A's K-tiles per weight K-tile
  constexpr int A_STEP = A_TILES * Loader::A_BYTES;

  const int w_k = k_dim / A_TILES;  // a weight row, 16-bit units
  const Loader loader(tile, order, top_k, w, n_out, w_k);

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 s_a = smem_addr(smem);
  const u32 s_b = s_a + STAGES * KG * A_STEP;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_m = warp % WM, warp_n = warp / WM;
  float acc[W::MI][W::NI][4] = {};
  float acc_up[GATED ? W::MI : 1][GATED ? W::NI : 1][4] = {};  // GATED: the up projection's columns
  float total[SCALED ? W::MI : 1][SCALED ? W::NI : 1][4] = {};  // FP8: the scaled sums of the K-tiles so far
  float total_up[SCALED && GATED ? W::MI : 1][SCALED && GATED ? W::NI : 1][4] = {};
  int a_row[SCALED ? W::MI : 1][2];  // FP8: the row of A (and of its scales) of each accumulator row; -1 past the tile
  const int w_rows = GATED ? 2 * n_out : n_out;
  const int w_row = tile.n0 + warp_n * W::WTN + (lane & 3) * 2;  // of this thread's column 0
  ColumnScales<W::NI, FP8> w_scale(scales, tile.expert, w_rows, w_row);
  ColumnScales<W::NI, GATED ? FP8 : NOT_FP8> w_scale_up(scales, tile.expert, w_rows, w_row + n_out);
  if constexpr (SCALED) {
#pragma unroll
    for (int mi = 0; mi < W::MI; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp_m * W::WTM + mi * 16 + (lane >> 2) + half * 8, entry = tile.slot_base + r;
        a_row[mi][half] = r >= tile.rows ? -1 : (order ? order[entry] : entry) / (GATED ? top_k : 1);
      }
  }

  const int k_tiles = w_k / BK;
  const int k_groups = (k_tiles + KG - 1) / KG;
  const auto load_group = [&](int g) {
#pragma unroll
    for (int j = 0; j < KG; ++j) {
      const int sub = (g % STAGES) * KG + j, kt = g * KG + j;
      if (kt >= k_tiles) continue;
#pragma unroll
      for (int i = 0; i < A_TILES; ++i)
        loader.gather.load(s_a + sub * A_STEP + i * Loader::A_BYTES, a, k_dim, kt * A_TILES + i);
      loader.load_weights(s_b + sub * Loader::B_BYTES, n_out, w_k, kt);
    }
  };
#pragma unroll
  for (int g = 0; g < STAGES - 1; ++g) {
    if (g < k_groups) load_group(g);
    cp_async_commit();
  }
  for (int g = 0; g < k_groups; ++g) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (g + STAGES - 1 < k_groups) load_group(g + STAGES - 1);
    cp_async_commit();
#pragma unroll
    for (int j = 0; j < KG; ++j) {
      const int kt = g * KG + j;
      if (kt == k_tiles) break;
      const u32 sa = s_a + ((g % STAGES) * KG + j) * A_STEP;
      const u32 sb = s_b + ((g % STAGES) * KG + j) * Loader::B_BYTES;
      float a_scale[SCALED ? W::MI : 1][2];
      if constexpr (SCALED) {  // this K-tile's scales, loaded before its MMAs so that they land meanwhile
#pragma unroll
        for (int mi = 0; mi < W::MI; ++mi)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            a_scale[mi][half] = WEIGHT_ONLY ? 1.0f  // A is not quantized
                                : a_row[mi][half] < 0 ? 0.0f : scales.a[(long long)a_row[mi][half] * k_tiles + kt];
        w_scale.block_scale(scales, tile.expert, w_rows, w_row, k_tiles, kt);
        if constexpr (GATED) w_scale_up.block_scale(scales, tile.expert, w_rows, w_row + n_out, k_tiles, kt);
      }
      if constexpr (WEIGHT_ONLY)
        mma_k_tile_weight_only<T, BM, BN, WM, WN, GATED>(acc, acc_up, sa, sb, warp_m, warp_n, lane);
      else
        mma_k_tile<T, BM, BN, WM, WN, GATED, FP8>(acc, acc_up, sa, sb, warp_m, warp_n, lane);
      if constexpr (SCALED) {
        promote(total, acc, a_scale, w_scale);
        if constexpr (GATED) promote(total_up, acc_up, a_scale, w_scale_up);
      }
    }
  }
  cp_async_wait<0>();
  if constexpr (SCALED)
    store_tile<T, BM, BN, WM, WN, GATED, ACT, EPILOGUE, SLOT_ORDER>(total, total_up, c, tile, order, n_out, warp_m,
                                                                     warp_n, lane, epilogue);
  else
    store_tile<T, BM, BN, WM, WN, GATED, ACT, EPILOGUE, SLOT_ORDER>(acc, acc_up, c, tile, order, n_out, warp_m, warp_n,
                                                                     lane, epilogue);
}

// Shared memory bounds the occupancy of both kernels; without the 1, ptxas holds them to fewer
// registers and spills.
template <class T, int BM, int BN, int WM, int WN, int STAGES, int KG, bool GATED, int ACT, int EPILOGUE, int FP8,
          bool WEIGHT_ONLY>
__global__ void __launch_bounds__(WM * WN * 32, 1)
expert_gemm(const u16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
            const u16* __restrict__ w, const int* __restrict__ offsets,
            int* __restrict__ tile_offsets, int plan, int num_experts, int n_out, int k_dim,
            u16* __restrict__ c, EpilogueArgs epilogue, Fp8Scales scales) {
  if (!plan_chosen(tile_offsets, num_experts, plan)) return;
  const bool one_each = gridDim.x >= tile_total(tile_offsets, num_experts) * (n_out / BN);
  __shared__ int claimed;
  for (int work = blockIdx.x;;) {
    Tile tile;
    if (!find_tile<BM, BN>(work, offsets, tile_offsets, num_experts, n_out, tile)) return;
    // down's rows of h are its tiles' positions
    gemm_tile<T, BM, BN, WM, WN, STAGES, KG, GATED, ACT, EPILOGUE, false, FP8, WEIGHT_ONLY>(
        tile, a, GATED ? sorted_slots : nullptr, top_k, w, n_out, k_dim, c, epilogue, scales);
    if (one_each) return;
    if (threadIdx.x == 0) claimed = gridDim.x + atomicAdd(tile_counter(tile_offsets, num_experts), 1);
    __syncthreads();  // also: every warp is done with this tile's stages before the next one's loads
    work = claimed;
  }
}

// If ``slot`` starts one of ``expert``'s tiles (the expert's slots in slot order, BM per tile, as the
// dispatch groups them), that tile's slots into ``rows``, and returns how many; else 0. Warp 0 only.
template <int BM, class IdT>
__device__ __forceinline__ int tile_slots(const IdT* __restrict__ ids, int num_slots, int num_experts, int expert,
                                          int slot, int* rows) {
  const int lane = threadIdx.x & 31;
  int before = 0;  // the expert's slots before this one
  for (int from = 0; from < slot; from += 32)
    before += __popc(__ballot_sync(~0u, from + lane < slot && expert_of(ids, from + lane, num_experts) == expert));
  if (before % BM) return 0;
  int count = 0;
  for (int from = slot; from < num_slots && count < BM; from += 32) {
    const bool match = from + lane < num_slots && expert_of(ids, from + lane, num_experts) == expert;
    const u32 ballot = __ballot_sync(~0u, match);
    const int rank = count + __popc(ballot & ((1u << lane) - 1));
    if (match && rank < BM) rows[rank] = from + lane;
    count += __popc(ballot);
  }
  return min(count, BM);
}

template <class T, class IdT, int BM, int BN, int WM, int WN, int STAGES, int KG, bool GATED, int ACT, int EPILOGUE>
__global__ void __launch_bounds__(WM * WN * 32, 1)
slot_gemm(const u16* __restrict__ a, const IdT* __restrict__ ids, int num_slots, int top_k,
          const u16* __restrict__ w, int num_experts, int n_out, int k_dim, u16* __restrict__ c,
          int* __restrict__ slot_positions, EpilogueArgs epilogue) {
  const int n_tiles = n_out / BN;
  const int slot = blockIdx.x / n_tiles, n_tile = blockIdx.x % n_tiles;
  const int expert = expert_of(ids, slot, num_experts);
  if (!GATED && n_tile == 0 && threadIdx.x == 0) slot_positions[slot] = expert < 0 ? -1 : slot;
  if (expert < 0) return;
  __shared__ int rows[BM];
  __shared__ int row_count;
  if (threadIdx.x < 32) {
    const int count = tile_slots<BM>(ids, num_slots, num_experts, expert, slot, rows);
    if (threadIdx.x == 0) row_count = count;
  }
  __syncthreads();
  if (row_count == 0) return;
  gemm_tile<T, BM, BN, WM, WN, STAGES, KG, GATED, ACT, EPILOGUE, true, NOT_FP8, false>(
      Tile{expert, 0, row_count, n_tile * BN}, a, rows, top_k, w, n_out, k_dim, c, epilogue, Fp8Scales{});
}
