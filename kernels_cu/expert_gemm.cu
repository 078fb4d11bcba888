// Per-expert GEMMs on mma.sync m16n8k16 tensor cores (fp32 accumulation): the portable path, sm_80+.
// A block of WM x WN warps computes a BM x BN tile (expert_tiles.cuh says which, and what A, B, C are);
// K streams through a STAGES-deep cp.async pipeline whose stages hold KG consecutive K-tiles each, so
// a weight row is read KG * 128 contiguous bytes at a time (DRAM streams 128-byte pieces of many rows
// a few percent slower); fragments come from shared memory by ldmatrix.
// GATED blocks keep gate and up accumulators for the same columns and write h = silu(gate) * up.
// Two kernels compute such tiles:
//   expert_gemm: one tile of the dispatch's m-tile map per block.
//   slot_gemm:   one routed slot per block, a tile of its own, so a single token needs no dispatch;
//                A and C rows are in slot order (h and y [T * k, N]). Its down GEMM (!GATED) also
//                writes the combine's slot_positions: the slot, or -1 where the id is outside
//                [0, E). The tiles are expert_gemm's, so are the bits.
#include "expert_tiles.cuh"

template <class T, int BM, int BN, int WM, int WN, int STAGES, int KG, bool GATED>
__device__ __forceinline__ void gemm_tile(const Tile& tile, const u16* __restrict__ a,
                                          const int* __restrict__ sorted_slots, int top_k,
                                          const u16* __restrict__ w, int n_out, int k_dim,
                                          u16* __restrict__ c) {
  constexpr int THREADS = WM * WN * 32;
  constexpr int WTM = BM / WM, WTN = BN / WN;
  constexpr int MI = WTM / 16, NI = WTN / 8;
  static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0 && WTM % 16 == 0, "warp tile shape");
  using F = Float16Traits<T>;
  using Loader = TileLoader<BM, BN, THREADS, GATED>;

  const Loader loader(tile, sorted_slots, top_k, w, n_out, k_dim);

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 s_a = smem_addr(smem);
  const u32 s_b = s_a + STAGES * KG * Loader::A_BYTES;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_m = warp % WM, warp_n = warp / WM;
  float acc[MI][NI][4] = {};
  float acc_up[GATED ? MI : 1][GATED ? NI : 1][4] = {};

  const int k_tiles = k_dim / BK;
  const int k_groups = (k_tiles + KG - 1) / KG;  // the last group may be short
  const auto load_group = [&](int g) {
#pragma unroll
    for (int j = 0; j < KG; ++j) {
      const int sub = (g % STAGES) * KG + j;
      if (g * KG + j < k_tiles)
        loader.load(s_a + sub * Loader::A_BYTES, s_b + sub * Loader::B_BYTES, a, n_out, k_dim, g * KG + j);
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
      if (g * KG + j == k_tiles) break;
      const u32 sa = s_a + ((g % STAGES) * KG + j) * Loader::A_BYTES;
      const u32 sb = s_b + ((g % STAGES) * KG + j) * Loader::B_BYTES;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        u32 af[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          ldmatrix_x4(af[mi], sa + swizzled_offset(warp_m * WTM + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int nj = 0; nj < NI / 2; ++nj) {
          const int n_row = warp_n * WTN + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int chunk = kk * 2 + ((lane >> 3) & 1);
          u32 bf[4];
          ldmatrix_x4(bf, sb + swizzled_offset(n_row, chunk));
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            F::mma(acc[mi][2 * nj], af[mi], bf[0], bf[1]);
            F::mma(acc[mi][2 * nj + 1], af[mi], bf[2], bf[3]);
          }
          if constexpr (GATED) {
            ldmatrix_x4(bf, sb + swizzled_offset(BN + n_row, chunk));
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              F::mma(acc_up[mi][2 * nj], af[mi], bf[0], bf[1]);
              F::mma(acc_up[mi][2 * nj + 1], af[mi], bf[2], bf[3]);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * WTM + mi * 16 + (lane >> 2) + half * 8;
      if (r >= tile.rows) continue;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        float v0 = acc[mi][ni][2 * half], v1 = acc[mi][ni][2 * half + 1];
        if constexpr (GATED) {
          v0 = silu(v0) * acc_up[mi][ni][2 * half];
          v1 = silu(v1) * acc_up[mi][ni][2 * half + 1];
        }
        store_pair<T>(c, tile, r, n_out, warp_n * WTN + ni * 8 + (lane & 3) * 2, v0, v1);
      }
    }
  }
}

template <class T, int BM, int BN, int WM, int WN, int STAGES, int KG, bool GATED>
__global__ void __launch_bounds__(WM * WN * 32)
expert_gemm(const u16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
            const u16* __restrict__ w, const int* __restrict__ offsets,
            const int* __restrict__ tile_offsets, int plan, int num_experts, int n_out, int k_dim,
            u16* __restrict__ c) {
  Tile tile;
  if (!plan_chosen(tile_offsets, num_experts, plan)) return;
  if (!find_tile<BM, BN>(blockIdx.x, offsets, tile_offsets, num_experts, n_out, tile)) return;
  gemm_tile<T, BM, BN, WM, WN, STAGES, KG, GATED>(tile, a, sorted_slots, top_k, w, n_out, k_dim, c);
}

template <class T, class IdT, int BM, int BN, int WM, int WN, int STAGES, int KG, bool GATED>
__global__ void __launch_bounds__(WM * WN * 32)
slot_gemm(const u16* __restrict__ a, const IdT* __restrict__ ids, int top_k, const u16* __restrict__ w,
          int num_experts, int n_out, int k_dim, u16* __restrict__ c, int* __restrict__ slot_positions) {
  const int n_tiles = n_out / BN;
  const int slot = blockIdx.x / n_tiles, n_tile = blockIdx.x % n_tiles;
  const int expert = expert_of(ids, slot, num_experts);
  if (!GATED && n_tile == 0 && threadIdx.x == 0) slot_positions[slot] = expert < 0 ? -1 : slot;
  if (expert < 0) return;
  gemm_tile<T, BM, BN, WM, WN, STAGES, KG, GATED>(Tile{expert, slot, 1, n_tile * BN}, a, nullptr, top_k, w,
                                                  n_out, k_dim, c);
}
