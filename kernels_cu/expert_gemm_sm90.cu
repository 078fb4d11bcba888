// Per-expert GEMMs on Hopper warpgroup MMA (wgmma, sm_90a), for tiles with many rows per expert.
// WGS warpgroups each own 64 rows of a BM = 64 * WGS tile and issue m64n128k16 over the whole
// 128-row B tile: gate 64 + up 64 columns when GATED (h = silu(gate) * up), else 128 columns of y.
// Tiles, operands and the cp.async loader are those of expert_tiles.cuh; both wgmma operands are
// read straight from the 128B-swizzled shared stages. A warpgroup whose 64 rows all lie past the
// expert's last slot skips its MMAs. (A persistent variant measured slower: benchmarks/NOTES.md.)
#include "expert_tiles.cuh"
#include "wgmma.cuh"

template <class T, int WGS, int STAGES, bool GATED>
__global__ void __launch_bounds__(WGS * 128)
expert_gemm_sm90(const u16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                 const u16* __restrict__ w, const int* __restrict__ offsets,
                 const int* __restrict__ tile_offsets, int num_experts, int n_out, int k_dim,
                 u16* __restrict__ c) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 64 * WGS, BN = GATED ? 64 : 128, THREADS = WGS * 128;
  using Loader = TileLoader<BM, BN, THREADS, GATED>;
  static_assert(Loader::B_ROWS == 128, "one m64n128 wgmma covers the B tile");

  Tile tile;
  const int m_bound = gridDim.x / (n_out / BN);
  if (!find_tile<BM, BN>(blockIdx.x, m_bound, offsets, tile_offsets, num_experts, n_out, tile)) return;
  const Loader loader(tile, sorted_slots, top_k, w, n_out, k_dim);

  extern __shared__ unsigned char smem[];
  const u32 s_a = (smem_addr(smem) + 1023) & ~1023u;  // the swizzle repeats every 1024 bytes
  const u32 s_b = s_a + STAGES * Loader::A_BYTES;
  const int warpgroup = threadIdx.x >> 7;
  const bool active = warpgroup * 64 < tile.rows;  // else all its rows are past the expert's last slot
  float acc[64] = {};

  constexpr int AHEAD = STAGES - 1;  // k-tiles loaded ahead of the one being multiplied
  const int k_tiles = k_dim / BK;
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < k_tiles) loader.load(s_a + s * Loader::A_BYTES, s_b + s * Loader::B_BYTES, a, n_out, k_dim, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<AHEAD - 1>();
    fence_proxy_async();
    // Stage kt landed for all threads, and every wgmma on the stage refilled below has retired
    // (keeping one wgmma batch in flight across this barrier measured slower: benchmarks/NOTES.md).
    __syncthreads();
    const int next = kt + AHEAD;
    if (next < k_tiles) {
      const int stage = next % STAGES;
      loader.load(s_a + stage * Loader::A_BYTES, s_b + stage * Loader::B_BYTES, a, n_out, k_dim, next);
    }
    cp_async_commit();

    if (active) {
      const u32 sa = s_a + (kt % STAGES) * Loader::A_BYTES + warpgroup * 64 * 128;
      const u32 sb = s_b + (kt % STAGES) * Loader::B_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        Wgmma<T>::m64n128k16(acc, wgmma_desc(sa + kk * 32), wgmma_desc(sb + kk * 32));
      wgmma_commit();
      wgmma_wait<0>();
    }
  }
  cp_async_wait<0>();

  // Accumulator layout: n8 block i holds columns 8i + 2 (lane % 4) + {0, 1} of rows r and r + 8.
  const int lane = threadIdx.x & 31;
  const int r = warpgroup * 64 + ((threadIdx.x >> 5) & 3) * 16 + (lane >> 2);
  const int col = (lane & 3) * 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = r + half * 8;
    if (row >= tile.rows) continue;
    if constexpr (GATED) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float v0 = silu(acc[4 * i + 2 * half]) * acc[4 * (i + 8) + 2 * half];
        const float v1 = silu(acc[4 * i + 2 * half + 1]) * acc[4 * (i + 8) + 2 * half + 1];
        store_pair<T>(c, tile, row, n_out, 8 * i + col, v0, v1);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        store_pair<T>(c, tile, row, n_out, 8 * i + col, acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
    }
  }
#else
  __trap();  // compiled for a GPU without wgmma: the host never launches this
#endif
}
