// Per-expert GEMMs on Hopper (sm_90a): persistent, warp-specialised wgmma kernel. With 16-bit
// operands they are swapped (the weights are the MMA's rows, a tile's slots its columns); FP8 keeps
// the slots as the rows (below).
// Warpgroup 0 produces: it claims tiles from a device-side counter (zeroed by the dispatch scan),
// each while the previous one's last K-tiles load, gathers each tile's SLOTS A rows (slots of x or
// h) with cp.async (expert_tiles.cuh) and loads its 256-row weight tile by TMA (gate/up: 128 gate
// rows then 128 up rows; down: 256 rows), through STAGES shared stages handed over by full and
// empty mbarriers; a tile's first stage carries its coordinates. Warpgroups 1 and 2 consume: each
// owns 128 of the weight rows as two m64 blocks and multiplies them by the tile's slots (m64nNk16,
// N = SLOTS, or less for an expert's last, short chunk: rows rounded up to 32), so an expert's few
// rows do not pad the MMA to all SLOTS. Gate/up pairs each gate block with its up block, so the
// activation has both in one thread.
// A stage holds KG K-tiles. KG = 1: one K-tile of all 256 weight rows, which both consumers read,
// each keeping one stage of MMAs in flight. KG = 2: two K-tiles of one consumer's 128 rows, the
// consumers taking alternate stages of an even ring, each freeing its stage once its MMAs retire
// (the other's keep the tensor cores busy meanwhile). A weight row is then read 256 bytes at a
// time, which DRAM streams faster than 128 (docs/design.md, "Persistent kernel").
// No warp waits on a block-wide barrier, and the producer fills the next tile's stages while the
// consumers run the epilogue. Each tile is computed by one block in a fixed K order, so which
// block claims it does not change a bit of the result.
// FP8 (w8a8, cupymoe/fp8.py; the FP8 argument, as expert_gemm's): A and the weights are e4m3 bytes
// moved as 16-bit pairs, so a 128-byte K-tile row is one scale group of FP8_BLOCK values; the
// producer also copies the group's scale of each slot into the stage. Tiles of 64 slots, stages of
// one K-tile; each consumer multiplies all 64 slots (the MMA's M) by its 128 weight rows (N), in
// m64n128k32 e4m3 MMAs that sum each K-tile afresh (Fp8ConsumerTile, Fp8KTiles): once they retire
// it frees the stage and adds the sums to its totals times (slot scale * weight scale), as
// expert_gemm does. Two plan options, not yet measured: ACCUMULATORS = 2 sums the K-tiles into
// two accumulators by turns, promoting one K-tile's sums while the next one's MMAs run; tiles of
// 128 slots give each consumer 64 of them, multiplied by the two halves of the weight rows in turn
// (TileShape).
// Gate/up's weight rows come in pairs of 8 gate and 8 up rows (a 4-D tensor map), so a thread has
// gate and up of its columns. Its epilogue writes h quantized for the down GEMM (quantize.cuh): a
// tile's 128 columns are one group of h, the consumers' halves of it joined through shared memory.
#include "epilogue.cuh"
#include "expert_tiles.cuh"
#include "mbarrier.cuh"
#include "quantize.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

constexpr int WARPGROUP_THREADS = 128;
static_assert(PRODUCER_THREADS == WARPGROUP_THREADS, "the producer is warpgroup 0");
constexpr int CONSUMERS = 2;                   // warpgroups 1 and 2
constexpr int LAUNCH_REGISTERS = 168;          // per thread of the launch: 65536 / 384, in steps of 8
constexpr int CONSUMER_ROWS = 2 * BLOCK_ROWS;  // the weight rows a consumer multiplies: two m64 blocks (FP8: N)
constexpr int CLAIM_AHEAD = 3;  // stages before a tile's end at which the producer claims the next
constexpr int MBARRIER_BYTES = 8;
constexpr int SWIZZLE_ALIGN = 1024;  // the 128-byte swizzle repeats every 8 rows: stages start on it
constexpr int PRODUCER_BARRIER = 1;        // named barrier of the producer's threads
constexpr int FIRST_CONSUMER_BARRIER = 2;  // consumer c's epilogue uses named barrier 2 + c
constexpr int CONSUMERS_BARRIER = FIRST_CONSUMER_BARRIER + CONSUMERS;  // both consumers' (FP8 gate/up's epilogue)

// How a tile's weight rows (gate/up: the gate and up rows of its BN output columns) are shared
// out. Each consumer multiplies half of them by all the tile's slots, in one pass over K, except in
// FP8's 128-slot tiles, whose consumers take 64 slots each and multiply them by the two halves of
// the rows in turn, a pass over K each: a weight row is then read from L2 once per 128 slots.
template <int SLOTS, bool GATED, bool SCALED>
struct TileShape {
  static constexpr bool SPLITS_SLOTS = SCALED && SLOTS == 2 * BLOCK_ROWS;
  static constexpr int PASSES = SPLITS_SLOTS ? 2 : 1;  // over K, each multiplying CONSUMER_ROWS weight rows
  static constexpr int WEIGHT_ROWS = CONSUMERS * CONSUMER_ROWS;
  static constexpr int BN = GATED ? WEIGHT_ROWS / 2 : WEIGHT_ROWS;  // output columns
  static constexpr int COLUMNS = BN / CONSUMERS;  // of CONSUMER_ROWS weight rows: a consumer's, or a pass's
  // A consumer's epilogue staging rows: its columns; a split gate/up's, both passes' (one group of h).
  static constexpr int STAGED_COLUMNS = SPLITS_SLOTS && GATED ? BN : COLUMNS;
};

// Registers per thread of the producer and of each consumer once reallocated, within what the
// launch holds: 88 keeps the 16-bit loader of 160-slot tiles unspilled, FP8's of 128-slot tiles
// needs 104; FP8's consumers with two accumulators beside the totals hold 192 values, and their
// loader (64 slots) needs 64.
template <class Shape, int ACCUMULATORS>
struct WarpgroupRegisters {
  static constexpr int PRODUCER = ACCUMULATORS == 2 ? 64 : Shape::SPLITS_SLOTS ? 104 : 88;
  static constexpr int CONSUMER = ACCUMULATORS == 2 ? 216 : Shape::SPLITS_SLOTS ? 200 : 208;
  static_assert(!(Shape::SPLITS_SLOTS && ACCUMULATORS == 2), "no registers for two accumulators beside a 128-slot loader");
  static_assert(PRODUCER_THREADS * PRODUCER + CONSUMERS * WARPGROUP_THREADS * CONSUMER <=
                    (PRODUCER_THREADS + CONSUMERS * WARPGROUP_THREADS) * LAUNCH_REGISTERS, "within the launch's");
};

// A consumer's epilogue staging: STAGED_SLOTS slot rows of its COLUMNS output columns (16-bit), which
// its warpgroup then writes out in 16-byte pieces; FP8 gate/up writes them quantized.
template <class T, int COLUMNS>
struct EpilogueStaging {
  static constexpr int PITCH = 2 * COLUMNS + 16;  // bytes per staged slot row; the 16 spreads the banks
  static constexpr int BYTES = STAGED_SLOTS * PITCH;
  static constexpr int CHUNKS = COLUMNS / 8;  // 16-byte pieces per slot row

  // Pass ``pass``'s staged rows into C [slots, n_out] at the tile's columns of this consumer.
  static __device__ __forceinline__ void write(u16* c, const Tile& tile, int consumer, int n_out,
                                               const unsigned char* staging, int pass) {
    for (int piece = threadIdx.x % WARPGROUP_THREADS; piece < STAGED_SLOTS * CHUNKS; piece += WARPGROUP_THREADS) {
      const int row = piece / CHUNKS, chunk = piece % CHUNKS, slot = pass * STAGED_SLOTS + row;
      if (slot < tile.rows)
        *reinterpret_cast<uint4*>(c + (long long)(tile.slot_base + slot) * n_out + tile.n0 + consumer * COLUMNS + 8 * chunk) =
            *reinterpret_cast<const uint4*>(staging + row * PITCH + 16 * chunk);
    }
  }

  // FP8 gate/up: pass ``pass``'s staged rows of h as e4m3 bytes into ``q`` [slots, n_out], and each
  // slot's scale (consumer 0) into ``h_scales``; the two consumers' COLUMNS make one quantization
  // group. A slot's 16-byte pieces are adjacent lanes' (CHUNKS of them); its amax over this
  // consumer's columns goes to the spare bytes of its staging row, where the other consumer reads it.
  static __device__ __forceinline__ void write_quantized(unsigned char* q, const Tile& tile, int consumer, int n_out,
                                                         unsigned char* staging, int pass, float* h_scales) {
    constexpr int PIECES = STAGED_SLOTS * CHUNKS / WARPGROUP_THREADS;  // per thread
    static_assert(PIECES * WARPGROUP_THREADS == STAGED_SLOTS * CHUNKS, "whole slots in CHUNKS lanes");
    static_assert(PITCH - 2 * COLUMNS >= 4 && CONSUMERS * COLUMNS == FP8_BLOCK, "a staging row's spare bytes hold its amax");
    const int thread = threadIdx.x % WARPGROUP_THREADS;
    uint4 bits[PIECES];
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
      const int piece = thread + p * WARPGROUP_THREADS, row = piece / CHUNKS;
      bits[p] = *reinterpret_cast<const uint4*>(staging + row * PITCH + 16 * (piece % CHUNKS));
      const float amax = row_amax(bits[p]);
      if (piece % CHUNKS == 0) *reinterpret_cast<float*>(staging + row * PITCH + 2 * COLUMNS) = amax;
    }
    named_barrier_sync(CONSUMERS_BARRIER, CONSUMERS * WARPGROUP_THREADS);
    const unsigned char* other = consumer == 0 ? staging + BYTES : staging - BYTES;
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
      const int piece = thread + p * WARPGROUP_THREADS, row = piece / CHUNKS, chunk = piece % CHUNKS;
      const int slot = pass * STAGED_SLOTS + row;
      const float scale = group_scale(amax_keeping_nan(*reinterpret_cast<const float*>(staging + row * PITCH + 2 * COLUMNS),
                                                       *reinterpret_cast<const float*>(other + row * PITCH + 2 * COLUMNS)));
      if (slot >= tile.rows) continue;
      const long long row_of_h = tile.slot_base + slot;
      write_e4m3(q + row_of_h * n_out + tile.n0 + consumer * COLUMNS + 8 * chunk, bits[p], scale);
      if (consumer == 0 && chunk == 0) h_scales[row_of_h * (n_out / FP8_BLOCK) + tile.n0 / FP8_BLOCK] = scale;
    }
  }

  // FP8 gate/up in a split tile: as write_quantized, each staged row one whole group of h.
  static __device__ __forceinline__ void write_quantized_group(unsigned char* q, const Tile& tile, int n_out,
                                                               const unsigned char* staging, int pass, float* h_scales) {
    constexpr int PIECES = STAGED_SLOTS * CHUNKS / WARPGROUP_THREADS;  // per thread
    static_assert(PIECES * WARPGROUP_THREADS == STAGED_SLOTS * CHUNKS && COLUMNS == FP8_BLOCK, "whole groups");
    const int thread = threadIdx.x % WARPGROUP_THREADS;
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
      const int piece = thread + p * WARPGROUP_THREADS, row = piece / CHUNKS, chunk = piece % CHUNKS;
      const uint4 bits = *reinterpret_cast<const uint4*>(staging + row * PITCH + 16 * chunk);
      const float scale = group_scale(row_amax(bits));
      const int slot = pass * STAGED_SLOTS + row;
      if (slot >= tile.rows) continue;
      const long long row_of_h = tile.slot_base + slot;
      write_e4m3(q + row_of_h * n_out + tile.n0 + 8 * chunk, bits, scale);
      if (chunk == 0) h_scales[row_of_h * (n_out / FP8_BLOCK) + tile.n0 / FP8_BLOCK] = scale;
    }
  }

  // The amax of a staged row's values over the CHUNKS adjacent lanes that hold its pieces (this
  // lane's: ``bits``), NaN if one is.
  static __device__ __forceinline__ float row_amax(const uint4& bits) {
    float amax = 0.0f;
    const u32 words[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int w = 0; w < 4; ++w)
      amax = amax_keeping_nan(amax_keeping_nan(amax, fabsf(unpacked(words[w], 0))), fabsf(unpacked(words[w], 1)));
#pragma unroll
    for (int offset = 1; offset < CHUNKS; offset <<= 1) amax = amax_keeping_nan(amax, __shfl_xor_sync(~0u, amax, offset));
    return amax;
  }

  // A 16-byte piece's eight values divided by ``scale``, as e4m3 bytes at ``dst``.
  static __device__ __forceinline__ void write_e4m3(unsigned char* dst, const uint4& bits, float scale) {
    const float lo[4] = {unpacked(bits.x, 0), unpacked(bits.x, 1), unpacked(bits.y, 0), unpacked(bits.y, 1)};
    const float hi[4] = {unpacked(bits.z, 0), unpacked(bits.z, 1), unpacked(bits.w, 0), unpacked(bits.w, 1)};
    *reinterpret_cast<uint2*>(dst) = make_uint2(e4m3x4(lo, scale), e4m3x4(hi, scale));
  }

  // The value ``half`` (0 the low one) of a pair of T's.
  static __device__ __forceinline__ float unpacked(u32 pair, int half) {
    return Float16Traits<T>::to_float(u16(half ? pair >> 16 : pair & 0xffffu));
  }
};

// The routing weight of the tile's slot ``slot`` (EPILOGUE_INPUT_WEIGHT; 0 past its rows).
__device__ __forceinline__ float slot_weight(int slot, const Tile& tile, const EpilogueArgs& epilogue, const int* order) {
  return slot < tile.rows ? epilogue.slot_weights[order[tile.slot_base + slot]] : 0.0f;
}

// One consumer's share of a tile of 16-bit operands, the weights as the MMA's rows: accumulators,
// MMAs and epilogue (epilogue.cuh's, for ACT and EPILOGUE).
template <class T, int SLOTS, int KG, bool GATED, int ACT = ACT_SILU, int EPILOGUE = 0>
struct ConsumerTile {
  static constexpr bool SCALED = false;
  static constexpr int BN = TileShape<SLOTS, GATED, false>::BN;            // output columns per tile
  static constexpr int COLUMNS = TileShape<SLOTS, GATED, false>::COLUMNS;  // ... per consumer
  // Shared rows from a consumer's first m64 block to its second: gate/up pairs gate rows with the
  // up rows BN further; down's blocks are adjacent.
  static constexpr int SECOND_BLOCK = GATED ? BN : BLOCK_ROWS;
  using Staging = EpilogueStaging<T, COLUMNS>;
  static constexpr int STAGING_BYTES = Staging::BYTES;
  static_assert(SLOTS % STAGED_SLOTS == 0 && SLOTS <= 5 * STAGED_SLOTS, "whole passes, at most five");
  float acc[2][SLOTS / 2];  // m64nSLOTS, twice: weight rows r and r + 8 of 8-slot block i at 4i + {0, 1} and 4i + {2, 3}

  // One stage's MMAs over its `k_tiles` K-tiles (KG or, at the end of an odd K, fewer). Only the
  // tile's first `passes` groups of STAGED_SLOTS slots hold rows: N covers just those.
  __device__ __forceinline__ void mma(u32 s_a, u32 s_b, int consumer, bool accumulate, int passes, int k_tiles) {
    if constexpr (KG == 1) {
      const u32 w0 = s_b + consumer * COLUMNS * ROW_BYTES;
      mma_passes<1>(w0, w0 + SECOND_BLOCK * ROW_BYTES, s_a, accumulate, passes);
    } else {  // K-tile j: this consumer's two blocks, then the slots
#pragma unroll
      for (int j = 0; j < KG; ++j) {
        if (j < k_tiles) {
          const u32 w0 = s_b + j * 2 * BLOCK_ROWS * ROW_BYTES;
          mma_passes<1>(w0, w0 + BLOCK_ROWS * ROW_BYTES, s_a + j * SLOTS * ROW_BYTES, accumulate || j > 0, passes);
        }
      }
    }
  }

  // The accumulators' rows are output columns: stmatrix transposes them into this consumer's
  // staging rows, STAGED_SLOTS slots at a time. ``order``: the sorted slots (gate/up's row r of the
  // tile is slot order[slot_base + r]).
  __device__ __forceinline__ void store(u16* c, const Tile& tile, int consumer, int n_out, unsigned char* staging,
                                        const EpilogueArgs& epilogue, const int* order, float*) const {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, m = lane >> 3;
    // Matrix m of each stmatrix: (8-slot step, half) for gate/up, (block, half) for down.
    const int half = m & 1, step = GATED ? m >> 1 : 0, block = GATED ? 0 : m >> 1;
    const u32 lane_row =
        smem_addr(staging) + (8 * step + (lane & 7)) * Staging::PITCH + (block * 64 + 16 * warp + 8 * half) * 2;
    const int barrier = FIRST_CONSUMER_BARRIER + consumer;
    // The biases of this thread's accumulator rows, as 16-bit pairs (half 0 low, half 1 high) to
    // spare registers: gate/up [gate, up], down [block].
    u32 bias[2] = {};
    if constexpr (EPILOGUE & EPILOGUE_BIAS) {
      const int first = tile.n0 + consumer * COLUMNS + 16 * warp + (lane >> 2);  // the column of row 0 of block 0
      const int width = GATED ? 2 * n_out : n_out;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const u16* row = epilogue.bias + (long long)tile.expert * width + first + (GATED ? b * n_out : BLOCK_ROWS * b);
        bias[b] = u32(row[0]) | (u32(row[8]) << 16);
      }
    }
#pragma unroll
    for (int pass = 0; pass < SLOTS / STAGED_SLOTS; ++pass) {
      if (pass * STAGED_SLOTS >= tile.rows) break;
#pragma unroll
      for (int j = 0; j < STAGED_SLOTS / 8; j += GATED ? 2 : 1) {
        const int i = pass * STAGED_SLOTS / 8 + j;
        if constexpr (GATED) {
          const float2 w0 = slot_weights(i, tile, epilogue, order), w1 = slot_weights(i + 1, tile, epilogue, order);
          stmatrix_x4_trans(lane_row + 8 * j * Staging::PITCH, activated(i, 0, w0, bias), activated(i, 1, w0, bias),
                            activated(i + 1, 0, w1, bias), activated(i + 1, 1, w1, bias));
        } else {
          stmatrix_x4_trans(lane_row + 8 * j * Staging::PITCH, pair(0, i, 0, bias), pair(0, i, 1, bias),
                            pair(1, i, 0, bias), pair(1, i, 1, bias));
        }
      }
      named_barrier_sync(barrier, WARPGROUP_THREADS);
      Staging::write(c, tile, consumer, n_out, staging, pass);
      named_barrier_sync(barrier, WARPGROUP_THREADS);  // the staging rows are free again
    }
  }

 private:
  // The MMAs at N = P * STAGED_SLOTS for the first P that covers ``passes``.
  template <int P>
  __device__ __forceinline__ void mma_passes(u32 w0, u32 w1, u32 s_a, bool accumulate, int passes) {
    if constexpr (P * STAGED_SLOTS >= SLOTS) {
      mma_n<SLOTS>(w0, w1, s_a, accumulate);
    } else {
      if (passes <= P) mma_n<P * STAGED_SLOTS>(w0, w1, s_a, accumulate);
      else mma_passes<P + 1>(w0, w1, s_a, accumulate, passes);
    }
  }

  template <int N>
  __device__ __forceinline__ void mma_n(u32 w0, u32 w1, u32 s_a, bool accumulate) {
    const u64 slots = wgmma_desc(s_a), block0 = wgmma_desc(w0), block1 = wgmma_desc(w1);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      Wgmma<T, N>::mma(reinterpret_cast<float(&)[N / 2]>(acc[0]), wgmma_desc_offset(block0, kk * 32),
                       wgmma_desc_offset(slots, kk * 32), accumulate || kk > 0);
      Wgmma<T, N>::mma(reinterpret_cast<float(&)[N / 2]>(acc[1]), wgmma_desc_offset(block1, kk * 32),
                       wgmma_desc_offset(slots, kk * 32), accumulate || kk > 0);
    }
  }

  static __device__ __forceinline__ float unpacked(u32 pair, int half) { return Staging::unpacked(pair, half); }
  // Slots 8i + 2 (lane % 4) + {0, 1} of weight row r + 8 half of an accumulator, with its bias, packed.
  __device__ __forceinline__ u32 pair(int block, int i, int half, const u32 (&bias)[2]) const {
    float v0 = acc[block][4 * i + 2 * half], v1 = acc[block][4 * i + 2 * half + 1];
    if constexpr (EPILOGUE & EPILOGUE_BIAS) v0 += unpacked(bias[block], half), v1 += unpacked(bias[block], half);
    return Float16Traits<T>::pack(v0, v1);
  }
  // The same slots of gate/up row r + 8 half through the activation, their weights on the input.
  __device__ __forceinline__ u32 activated(int i, int half, float2 weights, const u32 (&bias)[2]) const {
    const int v = 4 * i + 2 * half;
    float g0 = acc[0][v], g1 = acc[0][v + 1], u0 = acc[1][v], u1 = acc[1][v + 1];
    if constexpr (EPILOGUE & EPILOGUE_INPUT_WEIGHT) g0 *= weights.x, u0 *= weights.x, g1 *= weights.y, u1 *= weights.y;
    if constexpr (EPILOGUE & EPILOGUE_BIAS) {
      const float gate = unpacked(bias[0], half), up = unpacked(bias[1], half);
      g0 += gate, g1 += gate, u0 += up, u1 += up;
    }
    return Float16Traits<T>::pack(activate<ACT>(g0, u0), activate<ACT>(g1, u1));
  }
  // The routing weights of slots 8i + 2 (lane % 4) + {0, 1} of the tile (EPILOGUE_INPUT_WEIGHT).
  __device__ __forceinline__ float2 slot_weights(int i, const Tile& tile, const EpilogueArgs& epilogue,
                                                 const int* order) const {
    float2 weights = make_float2(1.0f, 1.0f);
    if constexpr (EPILOGUE & EPILOGUE_INPUT_WEIGHT) {
      const int slot = 8 * i + 2 * (threadIdx.x & 3);
      weights = make_float2(slot_weight(slot, tile, epilogue, order), slot_weight(slot + 1, tile, epilogue, order));
    }
    return weights;
  }
};

// One consumer's share of a tile of FP8 (e4m3) operands, the slots as the MMA's rows: m64 (the
// tile's SLOTS slots) by n128 (this consumer's weight rows), so a K-tile reads each slot row
// and each weight row once: 24 KiB of shared memory per consumer, against 32 with the weights as
// rows (two m64 blocks that each read the slots), which capped the MMAs near 60% of the e4m3
// rate (benchmarks/PERF.md). Gate/up's stage holds w13's rows in pairs (the pairs map of
// cupymoe/_tma.py): GATE_UP_PAIR_ROWS gate rows, then the up rows of the same columns, so
// accumulator piece 2p (8 columns) is gate and 2p + 1 up of one thread's columns of h.
// Each K-tile's MMAs sum afresh into one of ACCUMULATORS accumulators (Fp8KTiles takes them by
// turns); once they retire, promote() adds the sums to the totals times (slot scale * weight
// scale), as expert_gemm does.
// In a 128-slot tile each consumer takes 64 of the slots and multiplies them by the two halves of
// the weight rows in turn (TileShape's passes): which part of the tile's columns it computes is
// then the pass's, not the consumer's. A split gate/up keeps pass 0's h in its staging until pass 1
// completes the slots' 128 columns, one group of h.
template <class T, int TILE_SLOTS, bool GATED, int ACT, int EPILOGUE, int FP8, int ACCUMULATORS>
struct Fp8ConsumerTile {
  static constexpr bool SCALED = true;
  static constexpr int ACCUMULATOR_SETS = ACCUMULATORS;
  static_assert(ACCUMULATORS == 1 || ACCUMULATORS == 2, "one accumulator, or two by turns");
  using Shape = TileShape<TILE_SLOTS, GATED, true>;
  static constexpr int SLOTS = BLOCK_ROWS;          // a consumer's slots: the MMA's M
  static_assert(TILE_SLOTS == (Shape::SPLITS_SLOTS ? CONSUMERS : 1) * SLOTS, "64 slots, or 64 a consumer");
  static constexpr int N = CONSUMER_ROWS;           // weight rows per consumer: the MMA's N
  static constexpr int BN = Shape::BN;              // output columns per tile
  static constexpr int COLUMNS = Shape::COLUMNS;    // ... per part (a consumer's or a pass's)
  static constexpr int PASSES = Shape::PASSES;
  static constexpr int PIECES = N / 8;              // 8-column pieces of the accumulators
  using Staging = EpilogueStaging<T, Shape::STAGED_COLUMNS>;
  static constexpr int STAGING_BYTES = Staging::BYTES;
  static_assert(!GATED || (BN == FP8_BLOCK && GATE_UP_PAIR_ROWS == 8), "a tile's columns are one group of h; pieces pair");
  static_assert(SLOTS == 2 * STAGED_SLOTS, "two passes of the epilogue");
  // Slot rows r and r + 8 (r = 16 warp + lane / 4) of piece p at 4p + {0, 1} and 4p + {2, 3},
  // columns 8p + 2 (lane % 4) + {0, 1}.
  float acc[ACCUMULATORS][N / 2];
  float total[N / 2];  // the scaled sums of the K-tiles so far, as acc
  // A split gate/up keeps pass 0's h (pairs of T, as many a thread) in its staging until pass 1's epilogue.
  static constexpr int FIRST_PASS_PAIRS = COLUMNS / 4;
  static_assert(!(Shape::SPLITS_SLOTS && GATED) || FIRST_PASS_PAIRS * WARPGROUP_THREADS * 4 <= STAGING_BYTES, "room");

  // One K-tile's weight scales of this thread's columns: SCALE_BLOCK's of the gate and up block
  // (down: one); SCALE_CHANNEL's come through TileWeightScales.
  struct WeightScales {
    float w[2];
  };
  // Where a tile's weight scales are for this thread: a consumer's gate rows, its up rows and its
  // down rows each lie in one 128-row scale block (n-tiles divide H and I, multiples of 128), so
  // SCALE_BLOCK keeps a pointer to each one's K-tile scales; SCALE_CHANNEL to the scales of its
  // columns of piece 0 and (gate/up) piece 1, those of piece p lying 8 * (p / 2) further (down: 8p),
  // and in 64-slot tiles with one accumulator the scales themselves (elsewhere no registers are
  // left for them: promote() reads them each K-tile).
  static constexpr bool HOLDS_CHANNEL_SCALES = FP8 == SCALE_CHANNEL && ACCUMULATORS == 1 && !Shape::SPLITS_SLOTS;
  struct TileWeightScales {
    const float* rows[2];
    float channel[HOLDS_CHANNEL_SCALES ? PIECES : 1][2];
  };

  // This consumer's first slot of the tile, and which COLUMNS-wide part of the tile's columns it
  // computes in pass ``pass``.
  static __device__ __forceinline__ int first_slot(int consumer) { return Shape::SPLITS_SLOTS ? consumer * SLOTS : 0; }
  static __device__ __forceinline__ int part(int consumer, int pass) { return Shape::SPLITS_SLOTS ? pass : consumer; }
  // This consumer's slots of the tile (rows <= 0: none).
  static __device__ __forceinline__ Tile own_slots(const Tile& tile, int consumer) {
    return Tile{tile.expert, tile.slot_base + first_slot(consumer), tile.rows - first_slot(consumer), tile.n0};
  }

  // K-tile MMAs into accumulator B.
  template <int B>
  __device__ __forceinline__ void mma(u32 s_a, u32 s_b, int consumer) {
    const u64 slots = wgmma_desc(s_a + first_slot(consumer) * ROW_BYTES);
    const u64 rows = wgmma_desc(s_b + (Shape::SPLITS_SLOTS ? 0 : consumer) * N * ROW_BYTES);  // a stage holds a pass's
    wgmma_discard_operands(acc[B]);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      Wgmma<e4m3, N>::mma(acc[B], wgmma_desc_offset(slots, kk * 32), wgmma_desc_offset(rows, kk * 32), kk > 0);
  }

  __device__ __forceinline__ void clear_totals() {
#pragma unroll
    for (int v = 0; v < N / 2; ++v) total[v] = 0.0f;
  }

  // The weight row of this thread's column ``half`` of piece p of part ``part``.
  __device__ __forceinline__ int weight_row(const Tile& tile, int part, int n_out, int p, int half) const {
    const int column = 8 * (GATED ? p / 2 : p) + 2 * (threadIdx.x & 3) + half;
    return tile.n0 + part * COLUMNS + column + (GATED && (p & 1) ? n_out : 0);
  }

  // The tile's weight scales of this thread's columns of part ``part``, from ``scales.w`` (of the tile's expert).
  __device__ __forceinline__ TileWeightScales tile_weight_scales(const Fp8Scales& scales, const Tile& tile,
                                                                 int part, int n_out, int k_tiles) const {
    const int w_rows = GATED ? 2 * n_out : n_out;
    TileWeightScales s;
#pragma unroll
    for (int b = 0; b < 2; ++b) {  // gate/up: the gate rows, the up rows; down: its rows, twice
      const int row = weight_row(tile, part, n_out, b, 0);
      s.rows[b] = FP8 == SCALE_BLOCK
                      ? scales.w + ((long long)tile.expert * (w_rows / FP8_BLOCK) + row / FP8_BLOCK) * k_tiles
                      : scales.w + (long long)tile.expert * w_rows + row;
    }
    if constexpr (HOLDS_CHANNEL_SCALES) {
#pragma unroll
      for (int p = 0; p < PIECES; ++p)
#pragma unroll
        for (int half = 0; half < 2; ++half) s.channel[p][half] = channel_scales(s, p)[half];
    }
    return s;
  }

  // K-tile kt's block scales (SCALE_BLOCK; SCALE_CHANNEL's come through TileWeightScales).
  __device__ __forceinline__ WeightScales weight_scales(const TileWeightScales& tile_scales, int kt) const {
    WeightScales s{};
    if constexpr (FP8 == SCALE_BLOCK) {
      s.w[0] = __ldg(tile_scales.rows[0] + kt);
      s.w[1] = GATED ? __ldg(tile_scales.rows[1] + kt) : s.w[0];
    }
    return s;
  }

  // total += acc[B] * (slot scale * weight scale) for one retired K-tile, the slots' scales from
  // its stage's ``slot_scales``.
  template <int B>
  __device__ __forceinline__ void promote(const float* slot_scales, const TileWeightScales& tile_scales,
                                          const WeightScales& s) {
    wgmma_fence_operands(acc[B]);  // its MMAs have retired: no read of it moves above that wait
    const int row = 16 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2);
    const float slot[2] = {slot_scales[row], slot_scales[row + 8]};
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
      float channel[2] = {};  // SCALE_CHANNEL: this thread's two columns' scales
      if constexpr (HOLDS_CHANNEL_SCALES) {
        channel[0] = tile_scales.channel[p][0], channel[1] = tile_scales.channel[p][1];
      } else if constexpr (FP8 == SCALE_CHANNEL) {
        const float* columns = channel_scales(tile_scales, p);
        channel[0] = columns[0], channel[1] = columns[1];  // not __ldg, which the compiler would hoist out of the K loop
      }
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float w = FP8 == SCALE_BLOCK ? s.w[p & 1] : channel[v & 1];
        total[4 * p + v] = fmaf(acc[B][4 * p + v], slot[v >> 1] * w, total[4 * p + v]);
      }
    }
  }

  // After pass ``pass``'s K-tiles, the consumer's slots of its part of the tile's columns into C,
  // through the epilogue (store()); a split gate/up keeps pass 0's h in its staging instead, value
  // i of thread t at word i * 128 + t.
  __device__ __forceinline__ void finish_pass(int pass, u16* c, const Tile& tile, int consumer, int n_out,
                                              unsigned char* staging, const EpilogueArgs& epilogue, const int* order,
                                              float* h_scales) const {
    const Tile own = own_slots(tile, consumer);
    if constexpr (Shape::SPLITS_SLOTS && GATED) {
      if (pass == 0) {
        const float2 weights = row_weights(own, epilogue, order);
        u32* kept = reinterpret_cast<u32*>(staging) + threadIdx.x % WARPGROUP_THREADS;
#pragma unroll
        for (int j = 0; j < COLUMNS / 8; ++j)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            kept[(2 * j + half) * WARPGROUP_THREADS] = activated(j, half, half ? weights.y : weights.x, own, 0, n_out,
                                                                 epilogue);
        return;
      }
    }
    store(c, own, consumer, part(consumer, pass), n_out, staging, epilogue, order, h_scales);
  }

 private:
  // The totals' rows are slots: stmatrix stores them (as the mma fragment they are) into this
  // consumer's staging rows, a pass of STAGED_SLOTS of ``tile``'s slots (the consumer's) by the two
  // warps that hold them; then gate/up writes them quantized (h's scales into ``h_scales``; a split
  // one with pass 0's h beside them), down as they are.
  __device__ __forceinline__ void store(u16* c, const Tile& tile, int consumer, int part, int n_out,
                                        unsigned char* staging, const EpilogueArgs& epilogue, const int* order,
                                        float* h_scales) const {
    constexpr bool WHOLE_GROUP = Shape::SPLITS_SLOTS && GATED;  // both passes' columns staged
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, m = lane >> 3;
    // Matrix m of each stmatrix: slot rows + 8 (m & 1), the next 8 columns (m >> 1).
    const u32 lane_row = smem_addr(staging) + (16 * (warp & 1) + 8 * (m & 1) + (lane & 7)) * Staging::PITCH + 16 * (m >> 1);
    const u32 part_row = lane_row + (WHOLE_GROUP ? 2 * COLUMNS : 0);  // where this part's columns are staged
    const int barrier = FIRST_CONSUMER_BARRIER + consumer;
    u32 first_pass_h[WHOLE_GROUP ? FIRST_PASS_PAIRS : 1];  // pass 0's h, kept in the staging by finish_pass()
    if constexpr (WHOLE_GROUP) {
#pragma unroll
      for (int i = 0; i < FIRST_PASS_PAIRS; ++i)
        first_pass_h[i] = reinterpret_cast<const u32*>(staging)[i * WARPGROUP_THREADS + threadIdx.x % WARPGROUP_THREADS];
      named_barrier_sync(barrier, WARPGROUP_THREADS);  // every thread's read, before the staging is written
    }
#pragma unroll
    for (int pass = 0; pass < SLOTS / STAGED_SLOTS; ++pass) {
      if (pass * STAGED_SLOTS >= tile.rows) break;
      if ((warp >> 1) == pass) {
        const float2 weights = row_weights(tile, epilogue, order);
#pragma unroll
        for (int q = 0; q < COLUMNS / 16; ++q) {  // columns 16q..16q + 15 of this part's
          if constexpr (WHOLE_GROUP)
            stmatrix_x4(lane_row + 32 * q, first_pass_h[4 * q], first_pass_h[4 * q + 1], first_pass_h[4 * q + 2],
                        first_pass_h[4 * q + 3]);
          if constexpr (GATED) {
            stmatrix_x4(part_row + 32 * q, activated(2 * q, 0, weights.x, tile, part, n_out, epilogue),
                        activated(2 * q, 1, weights.y, tile, part, n_out, epilogue),
                        activated(2 * q + 1, 0, weights.x, tile, part, n_out, epilogue),
                        activated(2 * q + 1, 1, weights.y, tile, part, n_out, epilogue));
          } else {
            stmatrix_x4(part_row + 32 * q, biased(2 * q, 0, tile, part, n_out, epilogue),
                        biased(2 * q, 1, tile, part, n_out, epilogue), biased(2 * q + 1, 0, tile, part, n_out, epilogue),
                        biased(2 * q + 1, 1, tile, part, n_out, epilogue));
          }
        }
      }
      named_barrier_sync(barrier, WARPGROUP_THREADS);
      if constexpr (WHOLE_GROUP) {
        Staging::write_quantized_group(reinterpret_cast<unsigned char*>(c), tile, n_out, staging, pass, h_scales);
        named_barrier_sync(barrier, WARPGROUP_THREADS);  // the staging rows are free again
      } else if constexpr (GATED) {
        Staging::write_quantized(reinterpret_cast<unsigned char*>(c), tile, consumer, n_out, staging, pass, h_scales);
        // Both consumers' staging rows are free again (each read the other's amaxes).
        named_barrier_sync(CONSUMERS_BARRIER, CONSUMERS * WARPGROUP_THREADS);
      } else {
        Staging::write(c, tile, part, n_out, staging, pass);
        named_barrier_sync(barrier, WARPGROUP_THREADS);  // the staging rows are free again
      }
    }
  }

  // The routing weights of this thread's slot rows r and r + 8 of ``tile`` (EPILOGUE_INPUT_WEIGHT; else 1).
  __device__ __forceinline__ float2 row_weights(const Tile& tile, const EpilogueArgs& epilogue, const int* order) const {
    float2 weights = make_float2(1.0f, 1.0f);
    if constexpr (EPILOGUE & EPILOGUE_INPUT_WEIGHT) {
      const int row = 16 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2);
      weights = make_float2(slot_weight(row, tile, epilogue, order), slot_weight(row + 8, tile, epilogue, order));
    }
    return weights;
  }
  // SCALE_CHANNEL: where the scales of this thread's two columns of piece p are.
  static __device__ __forceinline__ const float* channel_scales(const TileWeightScales& s, int p) {
    return GATED ? s.rows[p & 1] + 8 * (p / 2) : s.rows[0] + 8 * p;
  }
  // Down: this thread's two columns of piece p in slot row r + 8 half, with their bias, packed.
  __device__ __forceinline__ u32 biased(int p, int half, const Tile& tile, int part, int n_out,
                                        const EpilogueArgs& epilogue) const {
    float v0 = total[4 * p + 2 * half], v1 = total[4 * p + 2 * half + 1];
    if constexpr (EPILOGUE & EPILOGUE_BIAS) {
      const float2 b = bias_pair<T>(epilogue.bias, tile.expert, n_out, weight_row(tile, part, n_out, p, 0));
      v0 += b.x, v1 += b.y;
    }
    return Float16Traits<T>::pack(v0, v1);
  }
  // Gate/up: this thread's two columns of h of gate piece 2j and up piece 2j + 1 in slot row r + 8
  // half, the slot's routing weight on the input, through the activation, packed.
  __device__ __forceinline__ u32 activated(int j, int half, float weight, const Tile& tile, int part, int n_out,
                                           const EpilogueArgs& epilogue) const {
    const int g = 8 * j + 2 * half, u = g + 4;  // piece 2j's entries, then piece 2j + 1's
    float g0 = total[g], g1 = total[g + 1], u0 = total[u], u1 = total[u + 1];
    if constexpr (EPILOGUE & EPILOGUE_INPUT_WEIGHT) g0 *= weight, g1 *= weight, u0 *= weight, u1 *= weight;
    if constexpr (EPILOGUE & EPILOGUE_BIAS) {
      const float2 gate = bias_pair<T>(epilogue.bias, tile.expert, 2 * n_out, weight_row(tile, part, n_out, 2 * j, 0));
      const float2 up = bias_pair<T>(epilogue.bias, tile.expert, 2 * n_out, weight_row(tile, part, n_out, 2 * j + 1, 0));
      g0 += gate.x, g1 += gate.y, u0 += up.x, u1 += up.y;
    }
    return Float16Traits<T>::pack(activate<ACT>(g0, u0), activate<ACT>(g1, u1));
  }
};

// The consumer of a tile: FP8's slots as the MMA's rows, 16-bit operands' weights.
template <class T, int SLOTS, int KG, bool GATED, int ACT, int EPILOGUE, int FP8, int ACCUMULATORS,
          bool SCALED = FP8 != NOT_FP8>
struct ConsumerOf {
  static_assert(ACCUMULATORS == 1, "16-bit operands: one accumulator set");
  using type = ConsumerTile<T, SLOTS, KG, GATED, ACT, EPILOGUE>;
};
template <class T, int SLOTS, int KG, bool GATED, int ACT, int EPILOGUE, int FP8, int ACCUMULATORS>
struct ConsumerOf<T, SLOTS, KG, GATED, ACT, EPILOGUE, FP8, ACCUMULATORS, true> {
  static_assert(KG == 1, "FP8: stages of one K-tile");
  using type = Fp8ConsumerTile<T, SLOTS, GATED, ACT, EPILOGUE, FP8, ACCUMULATORS>;
};

// The kernel's dynamic shared memory, from its 1024-byte-aligned start: STAGES stages of the
// slots' rows (A), then of the weight rows (B), then (SCALED: FP8) of the slots' scales, then the
// full and the empty mbarrier of each stage, then each consumer's epilogue staging.
// cupymoe/plans.py's GemmConfig.shared_bytes is the same sum, with the alignment's slack
// (tests/test_contract.py holds them equal).
template <int SLOTS, int STAGES, int KG, bool GATED, bool SCALED = false>
struct WsLayout {
  using Shape = TileShape<SLOTS, GATED, SCALED>;
  static constexpr int STAGE_ROWS = Shape::WEIGHT_ROWS / Shape::PASSES / KG;  // weight rows per stage
  static constexpr int A_BYTES = KG * SLOTS * ROW_BYTES, B_BYTES = KG * STAGE_ROWS * ROW_BYTES;  // one stage
  static constexpr int SCALE_BYTES = SCALED ? SLOTS * 4 : 0;                                     // ... FP8
  static constexpr int BARRIER_BYTES = 2 * STAGES * MBARRIER_BYTES;
  static constexpr int STAGING_BYTES = CONSUMERS * EpilogueStaging<bf16, Shape::STAGED_COLUMNS>::BYTES;
  static constexpr int BYTES =
      SWIZZLE_ALIGN + STAGES * (A_BYTES + B_BYTES + SCALE_BYTES) + BARRIER_BYTES + STAGING_BYTES;
};

// A warpgroup's place in the ring of stages: the stage, and the parity of its current round.
template <int STAGES>
struct StageRing {
  int stage = 0;
  u32 phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) stage = 0, phase ^= 1;
  }
};

// Warpgroup 0: claims tiles, and for each fills the stages: the slots' rows (and FP8's scales,
// ``a_scales``) by cp.async, the weight rows by TMA; at the end, a stage with rows -1 for each
// consumer that takes stages.
template <class T, int SLOTS, int STAGES, int KG, bool GATED, bool SCALED>
__device__ __forceinline__ void produce(const u16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
                                        const TensorMap& w_map, const int* __restrict__ offsets,
                                        int* __restrict__ tile_offsets, int num_experts, int n_out, int k_dim,
                                        int k_tiles, int k_steps, u32 s_a, u32 s_b, u32 s_scale,
                                        const float* __restrict__ a_scales, u32 full, u32 empty, Tile* stage_tile,
                                        int* claimed) {
  using Consumer = ConsumerTile<T, SLOTS, KG, GATED>;  // whose rows KG = 2 (16-bit only) loads apart
  using Layout = WsLayout<SLOTS, STAGES, KG, GATED, SCALED>;
  using Gather = RowGather<SLOTS, WARPGROUP_THREADS, GATED>;
  constexpr int BN = Layout::Shape::BN;
  constexpr int BOX_ROWS = KG == 1 ? TMA_BOX_ROWS : BLOCK_ROWS;  // weight rows per TMA box (as cupymoe/_tma.py encodes)
  StageRing<STAGES> ring;
  int* next_work = tile_counter(tile_offsets, num_experts);
  // The next tile is claimed while the current one's last K-tiles load, and found and its rows
  // read once the last is issued, so a stage freed at the tile boundary is refilled soon after.
  constexpr int PASSES = Layout::Shape::PASSES;  // (KG = 1)
  const int tile_stages = PASSES * KG * k_steps;  // KG = 2: both consumers' stages, alternating
  const int claim_stage = max(tile_stages - CLAIM_AHEAD, 0);
  if (threadIdx.x == 0) claimed[0] = atomicAdd(next_work, 1);
  named_barrier_sync(PRODUCER_BARRIER, WARPGROUP_THREADS);
  Tile tile;
  bool more = find_tile<SLOTS, BN>(claimed[0], offsets, tile_offsets, num_experts, n_out, tile);
  const int* order = GATED ? sorted_slots : nullptr;  // down's rows of h are its tiles' positions
  Gather gather;
  if (more) gather = Gather(tile, order, top_k);
  for (int claim = 1; more; ++claim) {  // claimed[] alternates between tiles
    const int w_row = tile.expert * (GATED ? 2 * n_out : n_out) + tile.n0;  // the tile's first weight row
    int next_claim = 0;
    for (int ts = 0; ts < tile_stages; ++ts) {
      const int pass = PASSES == 1 ? 0 : ts / k_steps, step = ts - pass * k_steps;  // pass: whose weight rows
      const int half = KG == 1 ? 0 : step & 1;  // whose rows: KG = 1 both consumers', else consumer `half`'s
      const int kt0 = step / KG * KG, kts = min(KG, k_tiles - kt0);
      mbarrier_wait(empty + MBARRIER_BYTES * ring.stage, ring.phase ^ 1);
      for (int j = 0; j < kts; ++j)
        gather.load(s_a + ring.stage * Layout::A_BYTES + j * SLOTS * ROW_BYTES, a, k_dim, kt0 + j);
      if constexpr (SCALED) gather.load_scales(s_scale + ring.stage * Layout::SCALE_BYTES, a_scales, k_tiles, kt0);
      mbarrier_arrive_after_cp_async(full + MBARRIER_BYTES * ring.stage);
      if (threadIdx.x == 0) {
        if (ts < KG) stage_tile[ring.stage] = tile;  // each consumer's first stage of the tile
        mbarrier_arrive_expect_tx(full + MBARRIER_BYTES * ring.stage, kts * Layout::STAGE_ROWS * ROW_BYTES);
        for (int j = 0; j < kts; ++j) {
          for (int row = pass * Layout::STAGE_ROWS; row < (pass + 1) * Layout::STAGE_ROWS; row += BOX_ROWS) {
            const int stage_row = j * Layout::STAGE_ROWS + row - pass * Layout::STAGE_ROWS;
            const u32 dst = s_b + ring.stage * Layout::B_BYTES + stage_row * ROW_BYTES;
            if constexpr (SCALED && GATED) {  // w_map is the pairs map: the gate and up rows of row / 2 columns on
              tma_load_4d(dst, w_map, (kt0 + j) * BK, 0, 0, (w_row + row / 2) / GATE_UP_PAIR_ROWS,
                          full + MBARRIER_BYTES * ring.stage);
            } else {
              // Tile row r: KG = 1 `row`; KG = 2 stage row `row` is block row / 64 of consumer `half`,
              // where its MMAs read it with KG = 1. Gate/up's rows from BN on are the up projection's, n_out on.
              const int r = KG == 1 ? row : half * Consumer::COLUMNS + row / BLOCK_ROWS * Consumer::SECOND_BLOCK;
              const int skip = (GATED && r >= BN) ? n_out - BN : 0;
              tma_load_2d(dst, w_map, (kt0 + j) * BK, w_row + r + skip, full + MBARRIER_BYTES * ring.stage);
            }
          }
        }
        if (ts == claim_stage) next_claim = atomicAdd(next_work, 1);
      }
      ring.advance();
    }
    if (threadIdx.x == 0) claimed[claim & 1] = next_claim;
    named_barrier_sync(PRODUCER_BARRIER, WARPGROUP_THREADS);
    more = find_tile<SLOTS, BN>(claimed[claim & 1], offsets, tile_offsets, num_experts, n_out, tile);
    if (more) gather = Gather(tile, order, top_k);
  }
  for (int taker = 0; taker < KG; ++taker) {  // the end, in the next stage of each consumer that takes stages
    mbarrier_wait(empty + MBARRIER_BYTES * ring.stage, ring.phase ^ 1);
    if (threadIdx.x == 0) stage_tile[ring.stage].rows = -1;
    mbarrier_arrive(full + MBARRIER_BYTES * ring.stage);
    if (threadIdx.x == 0) mbarrier_arrive(full + MBARRIER_BYTES * ring.stage);
    ring.advance();
  }
}

// A stage's tile, read by the warp's leader alone and passed to its lanes: the thread that frees
// the stage is then the only one whose read of it the producer's next store must follow.
__device__ __forceinline__ Tile read_by_leader(const Tile& shared, bool warp_leader) {
  Tile t{};
  if (warp_leader) t = shared;
  return Tile{__shfl_sync(~0u, t.expert, 0), __shfl_sync(~0u, t.slot_base, 0), __shfl_sync(~0u, t.rows, 0),
              __shfl_sync(~0u, t.n0, 0)};
}

// FP8: one tile's K-tiles from a consumer's stages, each K-tile's MMAs summing afresh. With one
// accumulator a K-tile's MMAs retire before its sums are promoted and its stage freed; with two by
// turns, once a K-tile's MMAs are issued the one before retires and is promoted and freed, while
// the tensor cores run the new one's.
template <class Consumer, class Layout, int STAGES>
struct Fp8KTiles {
  Consumer& tile_acc;
  StageRing<STAGES>& ring;
  const typename Consumer::TileWeightScales tile_scales;
  const int consumer;
  const u32 s_a, s_b, full, empty;
  const float* slot_scales;
  const bool warp_leader;
  int pending = 0;  // the stage of the K-tile whose sums are to be promoted, and its weight scales
  typename Consumer::WeightScales pending_scales{};

  // The K-tiles from the ring's stage on, whose full barrier the caller waited for unless
  // ``wait_first``. Two accumulators: at each step the MMAs in flight are accumulator 0's,
  // whatever the path, so ptxas can tell that those of accumulator 1 have retired.
  __device__ __forceinline__ void run(int k_tiles, bool wait_first) {
    tile_acc.clear_totals();
    if (wait_first) mbarrier_wait(full + MBARRIER_BYTES * ring.stage, ring.phase);
    if constexpr (Consumer::ACCUMULATOR_SETS == 1) {
      for (int kt = 0; kt < k_tiles; ++kt) k_tile<0>(kt);
    } else {
      k_tile<0>(0);
      int kt = 1;
      for (; kt + 1 < k_tiles; kt += 2) {
        k_tile<1>(kt);
        k_tile<0>(kt + 1);
      }
      if (kt < k_tiles) {
        k_tile<1>(kt);
        wgmma_wait<0>();
        promote_pending<1>();
      } else {
        wgmma_wait<0>();
        promote_pending<0>();
      }
    }
  }

 private:
  // K-tile kt into accumulator B (the caller waited for the tile's first).
  template <int B>
  __device__ __forceinline__ void k_tile(int kt) {
    if (kt > 0) mbarrier_wait(full + MBARRIER_BYTES * ring.stage, ring.phase);
    fence_proxy_async();  // the producer's cp.async writes, seen by wgmma's async proxy
    wgmma_fence();
    tile_acc.template mma<B>(s_a + ring.stage * Layout::A_BYTES, s_b + ring.stage * Layout::B_BYTES, consumer);
    wgmma_commit();
    const typename Consumer::WeightScales w_scales = tile_acc.weight_scales(tile_scales, kt);  // while the MMAs run
    if constexpr (Consumer::ACCUMULATOR_SETS == 1) {
      wgmma_wait<0>();
      pending = ring.stage, pending_scales = w_scales;
      promote_pending<0>();
    } else {
      if (kt > 0) {
        wgmma_wait<1>();
        promote_pending<1 - B>();
      }
      pending = ring.stage, pending_scales = w_scales;
    }
    ring.advance();
  }

  // The pending K-tile, in accumulator B, whose MMAs have retired.
  template <int B>
  __device__ __forceinline__ void promote_pending() {
    const float* stage_scales = slot_scales + pending * Layout::SCALE_BYTES / 4;  // the stage's float scales
    tile_acc.template promote<B>(stage_scales + Consumer::first_slot(consumer), tile_scales, pending_scales);
    __syncwarp();  // every lane's read of the stage's scales, before its leader frees it
    if (warp_leader) mbarrier_arrive(empty + MBARRIER_BYTES * pending);
  }
};

// Warpgroups 1 and 2: for each tile the stages bring, its MMAs stage by stage, each stage freed
// once its MMAs retire (FP8: Fp8KTiles), then the epilogue; until a stage says there are no more
// tiles. ``slot_scales``: FP8's stages of the slots' scales.
template <class T, int SLOTS, int STAGES, int KG, bool GATED, int ACT, int EPILOGUE, int FP8, int ACCUMULATORS>
__device__ __forceinline__ void consume(int consumer, int k_tiles, int k_steps, u16* __restrict__ c, int n_out,
                                        u32 s_a, u32 s_b, const float* slot_scales, u32 full, u32 empty,
                                        const Tile* stage_tile, unsigned char* staging, const EpilogueArgs& epilogue,
                                        const Fp8Scales& scales, const int* __restrict__ sorted_slots) {
  using Consumer = typename ConsumerOf<T, SLOTS, KG, GATED, ACT, EPILOGUE, FP8, ACCUMULATORS>::type;
  using Layout = WsLayout<SLOTS, STAGES, KG, GATED, Consumer::SCALED>;
  StageRing<STAGES> ring;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  Consumer tile_acc;
  if (KG == 2 && consumer == 1) ring.advance();  // consumer c takes stages c, c + 2, ...
  for (;;) {
    mbarrier_wait(full + MBARRIER_BYTES * ring.stage, ring.phase);
    const Tile tile = read_by_leader(stage_tile[ring.stage], warp_leader);
    if (tile.rows < 0) break;
    if constexpr (Consumer::SCALED) {
      for (int pass = 0; pass < Consumer::PASSES; ++pass) {
        const int part = Consumer::part(consumer, pass);
        Fp8KTiles<Consumer, Layout, STAGES>{tile_acc, ring, tile_acc.tile_weight_scales(scales, tile, part, n_out, k_tiles),
                                            consumer, s_a, s_b, full, empty, slot_scales, warp_leader}
            .run(k_tiles, pass > 0);
        tile_acc.finish_pass(pass, c, tile, consumer, n_out, staging + consumer * Consumer::STAGING_BYTES, epilogue,
                             sorted_slots, scales.h);
      }
    } else {
      int previous = -1;
      const int passes = (tile.rows + STAGED_SLOTS - 1) / STAGED_SLOTS;  // of the MMA's N and the epilogue
      for (int step = 0; step < k_steps; ++step) {
        if (step > 0) mbarrier_wait(full + MBARRIER_BYTES * ring.stage, ring.phase);
        fence_proxy_async();  // the producer's cp.async writes, seen by wgmma's async proxy
        wgmma_fence();
        tile_acc.mma(s_a + ring.stage * Layout::A_BYTES, s_b + ring.stage * Layout::B_BYTES, consumer, step > 0,
                     passes, min(KG, k_tiles - step * KG));
        wgmma_commit();
        // KG = 1 keeps one stage's MMAs in flight, freeing the stage before; KG = 2 frees its own,
        // the other consumer's keeping the tensor cores busy meanwhile.
        if constexpr (KG == 2) wgmma_wait<0>(); else wgmma_wait<1>();
        const int retired = KG == 2 ? ring.stage : previous;
        if (retired >= 0 && warp_leader) mbarrier_arrive(empty + MBARRIER_BYTES * retired);
        previous = ring.stage;
        for (int s = 0; s < KG; ++s) ring.advance();  // KG = 2: past the other consumer's stage
      }
      wgmma_wait<0>();
      if (KG == 1 && warp_leader) mbarrier_arrive(empty + MBARRIER_BYTES * previous);
      tile_acc.store(c, tile, consumer, n_out, staging + consumer * Consumer::STAGING_BYTES, epilogue, sorted_slots,
                     scales.h);
    }
  }
}

// ACCUMULATORS: FP8's accumulators per consumer (Fp8KTiles); 1 for 16-bit operands.
template <class T, int SLOTS, int STAGES, int KG, bool GATED, int ACT, int EPILOGUE, int FP8, int ACCUMULATORS>
__global__ void __launch_bounds__(PRODUCER_THREADS + CONSUMERS * WARPGROUP_THREADS, 1)
expert_gemm_ws(const u16* __restrict__ a, const int* __restrict__ sorted_slots, int top_k,
               const __grid_constant__ TensorMap w_map, const int* __restrict__ offsets,
               int* __restrict__ tile_offsets, int plan, int num_experts, int n_out, int k_dim,
               u16* __restrict__ c, EpilogueArgs epilogue, Fp8Scales scales) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (!plan_chosen(tile_offsets, num_experts, plan)) return;
  static_assert(KG == 1 || KG == 2, "a stage holds all weight rows of one K-tile or a consumer's of two");
  // With an odd ring a stage would pass between the consumers, and one could wait on a phase parity
  // the stage had reached a round earlier.
  static_assert(KG == 1 || STAGES % 2 == 0, "KG = 2: each consumer keeps its own stages");
  constexpr bool SCALED = FP8 != NOT_FP8;
  using Layout = WsLayout<SLOTS, STAGES, KG, GATED, SCALED>;
  using Registers = WarpgroupRegisters<typename Layout::Shape, ACCUMULATORS>;
  constexpr int STAGE_TAKERS = KG == 1 ? CONSUMERS : 1;  // consumers that read each stage

  extern __shared__ unsigned char smem[];
  __shared__ Tile stage_tile[STAGES];  // the tile whose first K-tiles a stage holds; rows -1: no more tiles
  __shared__ int claimed[2];           // the producer's last two claims, for its threads
  const u32 s_a = (smem_addr(smem) + SWIZZLE_ALIGN - 1) & ~u32(SWIZZLE_ALIGN - 1);
  const u32 s_b = s_a + STAGES * Layout::A_BYTES;
  const u32 s_scale = s_b + STAGES * Layout::B_BYTES;       // FP8's slot scales
  const u32 full = s_scale + STAGES * Layout::SCALE_BYTES;  // STAGES mbarriers, then STAGES "empty"
  const u32 empty = full + MBARRIER_BYTES * STAGES;
  unsigned char* staging = smem + (empty + MBARRIER_BYTES * STAGES - smem_addr(smem));  // the epilogue's, per consumer
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(full + MBARRIER_BYTES * s, PRODUCER_THREADS + 1);  // each producer thread's copies, and the TMA
      mbarrier_init(empty + MBARRIER_BYTES * s, STAGE_TAKERS * 4);      // one arrival per warp of its consumers
    }
  }
  __syncthreads();

  const int k_tiles = k_dim / BK;
  const int k_steps = (k_tiles + KG - 1) / KG;  // a consumer's stages per tile
  if (threadIdx.x < PRODUCER_THREADS) {
    warpgroup_registers_dec<Registers::PRODUCER>();
    produce<T, SLOTS, STAGES, KG, GATED, SCALED>(a, sorted_slots, top_k, w_map, offsets, tile_offsets, num_experts,
                                                 n_out, k_dim, k_tiles, k_steps, s_a, s_b, s_scale, scales.a, full,
                                                 empty, stage_tile, claimed);
    return;
  }
  warpgroup_registers_inc<Registers::CONSUMER>();
  const float* slot_scales = reinterpret_cast<const float*>(smem + (s_scale - smem_addr(smem)));
  // Lane 0's consumer index, which ptxas then knows to be warp-uniform: the MMAs' shared addresses
  // stay in uniform registers.
  const int consumer = __shfl_sync(~0u, (threadIdx.x >> 7) - 1, 0);
  consume<T, SLOTS, STAGES, KG, GATED, ACT, EPILOGUE, FP8, ACCUMULATORS>(consumer, k_tiles, k_steps, c, n_out, s_a,
                                                                         s_b, slot_scales, full, empty, stage_tile,
                                                                         staging, epilogue, scales, sorted_slots);
#else
  __trap();  // compiled for a GPU without wgmma: the host never launches this
#endif
}
