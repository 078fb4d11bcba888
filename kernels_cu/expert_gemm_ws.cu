// Per-expert GEMMs on Hopper (sm_90a): persistent, warp-specialised wgmma kernel for large tiles.
// Warpgroup 0 produces: it claims tiles from a device-side counter (zeroed by the dispatch scan),
// gathers each tile's A rows with cp.async (expert_tiles.cuh) and loads its weight tile by TMA,
// through STAGES shared stages handed over by full and empty mbarriers. Warpgroups 1..CONSUMERS
// consume: each owns 64 rows of the BM-row tile and multiplies them by the whole 256-row weight
// tile with m64n256k16 (gate/up: BN = 128 gate rows then 128 up rows; down: BN = 256), keeping one
// K-tile of MMAs in flight. No warp waits on a block-wide barrier, and the producer fills the next
// tile's stages while the consumers run the epilogue. Each tile is computed by one warpgroup pair
// in a fixed K order, so which block claims it does not change a bit of the result.
#include "expert_tiles.cuh"
#include "mbarrier.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// 128 * 88 + 256 * 208 = 384 * 168, what two consumers' launch holds; 88 keeps the loader unspilled.
constexpr int PRODUCER_REGISTERS = 88;
constexpr int CONSUMER_REGISTERS = 208;
constexpr int BOX_ROWS = 128;  // weight rows per TMA box (cupymoe/_tma.py encodes the same)

template <class T, int CONSUMERS, int BN, int STAGES, bool GATED>
__global__ void __launch_bounds__((CONSUMERS + 1) * 128, 1)
expert_gemm_ws(const u16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
               const __grid_constant__ TensorMap w_map, const int* __restrict__ offsets,
               int* __restrict__ tile_offsets, int num_experts, int n_out, int k_dim, u16* __restrict__ c) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 64 * CONSUMERS, B_ROWS = GATED ? 2 * BN : BN;
  constexpr int A_BYTES = BM * 128, B_BYTES = B_ROWS * 128;  // one stage
  using Gather = RowGather<BM, 128, GATED>;
  static_assert(B_ROWS == 256, "one m64n256k16 wgmma covers the weight tile");

  extern __shared__ unsigned char smem[];
  __shared__ int stage_work[STAGES];  // the tile whose first K-tile a stage holds; -1: no more tiles
  __shared__ int claimed[2];          // the producer's last two claims, for its 128 threads
  const u32 s_a = (smem_addr(smem) + 1023) & ~1023u;  // the swizzle repeats every 1024 bytes
  const u32 s_b = s_a + STAGES * A_BYTES;
  const u32 full = s_b + STAGES * B_BYTES;  // STAGES mbarriers of 8 bytes, then STAGES "empty"
  const u32 empty = full + 8 * STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(full + 8 * s, 128 + 1);        // each producer thread's copies, and the TMA
      mbarrier_init(empty + 8 * s, CONSUMERS * 4);  // one arrival per consumer warp
    }
  }
  __syncthreads();

  const int n_tiles = n_out / BN;
  const int m_tiles = tile_offsets[num_experts];
  const int k_tiles = k_dim / BK;
  int stage = 0;
  u32 phase = 0;  // parity of the stage's current round
  const auto advance = [&] {
    if (++stage == STAGES) { stage = 0; phase ^= 1; }
  };

  if (threadIdx.x < 128) {
    warpgroup_registers_dec<PRODUCER_REGISTERS>();
    int* next_work = tile_offsets + num_experts + 1;
    for (int claim = 0;; ++claim) {
      if (threadIdx.x == 0) claimed[claim & 1] = atomicAdd(next_work, 1);
      named_barrier_sync(1, 128);
      const int work = claimed[claim & 1];
      if (work >= m_tiles * n_tiles) {
        mbarrier_wait(empty + 8 * stage, phase ^ 1);
        if (threadIdx.x == 0) stage_work[stage] = -1;
        mbarrier_arrive(full + 8 * stage);
        if (threadIdx.x == 0) mbarrier_arrive(full + 8 * stage);
        break;
      }
      Tile tile;
      find_tile<BM, BN>(work, m_tiles, offsets, tile_offsets, num_experts, n_out, tile);
      const Gather gather(tile, sorted_slots, top_k);
      const int w_row = tile.expert * (GATED ? 2 * n_out : n_out) + tile.n0;  // the tile's first weight row
      for (int kt = 0; kt < k_tiles; ++kt) {
        mbarrier_wait(empty + 8 * stage, phase ^ 1);
        gather.load(s_a + stage * A_BYTES, a, k_dim, kt);
        mbarrier_arrive_after_cp_async(full + 8 * stage);
        if (threadIdx.x == 0) {
          if (kt == 0) stage_work[stage] = work;
          mbarrier_arrive_expect_tx(full + 8 * stage, B_BYTES);
          for (int row = 0; row < B_ROWS; row += BOX_ROWS) {
            const int skip = (GATED && row >= BN) ? n_out - BN : 0;  // rows from BN on: the up projection
            tma_load_2d(s_b + stage * B_BYTES + row * 128, w_map, kt * BK, w_row + row + skip, full + 8 * stage);
          }
        }
        advance();
      }
    }
    return;
  }

  warpgroup_registers_inc<CONSUMER_REGISTERS>();
  const int consumer = (threadIdx.x >> 7) - 1;  // rows 64 * consumer .. of each tile
  const bool warp_leader = (threadIdx.x & 31) == 0;
  float acc[128];  // m64n256: rows r, r + 8 of 256 columns
  for (;;) {
    mbarrier_wait(full + 8 * stage, phase);
    const int work = stage_work[stage];
    if (work < 0) break;
    Tile tile;
    find_tile<BM, BN>(work, m_tiles, offsets, tile_offsets, num_experts, n_out, tile);
    const bool active = consumer * 64 < tile.rows;  // else all its rows are past the expert's last slot
    int previous = -1;
    for (int kt = 0; kt < k_tiles; ++kt) {
      if (kt > 0) mbarrier_wait(full + 8 * stage, phase);
      if (active) {
        fence_proxy_async();  // the producer's cp.async writes, seen by wgmma's async proxy
        const u32 sa = s_a + stage * A_BYTES + consumer * 64 * 128;
        const u32 sb = s_b + stage * B_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          Wgmma<T>::m64n256k16(acc, wgmma_desc(sa + kk * 32), wgmma_desc(sb + kk * 32), kt > 0 || kk > 0);
        wgmma_commit();
        wgmma_wait<1>();  // the previous K-tile's MMAs have retired: its stage can be refilled
      }
      if (previous >= 0 && warp_leader) mbarrier_arrive(empty + 8 * previous);
      previous = stage;
      advance();
    }
    if (active) wgmma_wait<0>();
    if (warp_leader) mbarrier_arrive(empty + 8 * previous);
    if (!active) continue;

    // Accumulator layout: n8 block i holds columns 8i + 2 (lane % 4) + {0, 1} of rows r and r + 8.
    const int r = consumer * 64 + ((threadIdx.x >> 5) & 3) * 16 + ((threadIdx.x & 31) >> 2);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      u32 packed[BN / 8];
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        const float* v = acc + 4 * i + 2 * half;
        if constexpr (GATED)  // gate column j is acc block j, its up column is BN / 8 blocks later
          packed[i] = Float16Traits<T>::pack(silu(v[0]) * v[BN / 2], silu(v[1]) * v[BN / 2 + 1]);
        else
          packed[i] = Float16Traits<T>::pack(v[0], v[1]);
      }
      store_row(c, tile, r + half * 8, n_out, packed, r + half * 8 < tile.rows);
    }
  }
#else
  __trap();  // compiled for a GPU without wgmma: the host never launches this
#endif
}
