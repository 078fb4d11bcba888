// Dispatch: group the S = T * k routed slots by expert without timing-dependent order.
//   count:   each warp owns a chunk of slots; it counts them per expert and gives each slot its rank
//            among the chunk's earlier slots of the same expert.
//   scan:    the expert-major [E][chunks] counts become start positions, from which come the
//            per-expert offsets and the GEMMs' m-tile maps.
//   scatter: position = start[expert][chunk] + rank, so slots of one expert keep their order.
// Large S runs three kernels: one warp per expert scans its chunks (dispatch_expert_scan), then
// every block of dispatch_scatter scans the E expert totals itself, and block 0 writes the offsets
// and tile maps. Small S runs all steps in one block (dispatch_fused).
// Ids outside [0, E) are treated as "no expert" and dropped.
#include "common.cuh"
#include "tile_map.cuh"

// One warp counts slots [begin, end), at most DISPATCH_CHUNK of them, into counters[E] (zeroed here)
// and writes each slot's rank. All the chunk's ids are loaded before any is counted.
template <class IdT>
__device__ void count_chunk(const IdT* ids, long long begin, long long end, int num_experts,
                            int* counters, int* rank) {
  constexpr int STEPS = DISPATCH_CHUNK / 32;
  const int lane = threadIdx.x & 31;
  int experts[STEPS];
#pragma unroll
  for (int i = 0; i < STEPS; ++i) {
    const long long slot = begin + 32 * i + lane;
    experts[i] = slot < end ? expert_of(ids, slot, num_experts) : -1;
  }
  for (int e = lane; e < num_experts; e += 32) counters[e] = 0;
  __syncwarp();
  const u32 lanes_below = (1u << lane) - 1;
#pragma unroll
  for (int i = 0; i < STEPS; ++i) {
    if (begin + 32 * i >= end) break;  // the same for the whole warp
    const int e = experts[i];
    const u32 peers = __match_any_sync(0xffffffffu, e);
    int before = 0;
    if (e >= 0) before = counters[e];
    __syncwarp();
    if (e >= 0) {
      if ((peers & lanes_below) == 0) counters[e] = before + __popc(peers);
      rank[begin + 32 * i + lane] = before + __popc(peers & lanes_below);
    }
    __syncwarp();
  }
}

// Inclusive prefix sum of v over the warp's lanes.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x & 31;
  for (int d = 1; d < 32; d <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// One thread's ITEMS consecutive values data[first, first + ITEMS) (zero past n) and their sum.
template <int ITEMS>
struct ValueRun {
  int v[ITEMS];
  int sum = 0;

  __device__ __forceinline__ ValueRun(const int* data, long long first, long long n) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      v[i] = first + i < n ? data[first + i] : 0;
      sum += v[i];
    }
  }

  // Overwrites the values with their exclusive prefix sums, counted from ``start``.
  __device__ __forceinline__ void store_exclusive(int* data, long long first, long long n, int start) const {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (first + i < n) data[first + i] = start;
      start += v[i];
    }
  }
};

// In-place exclusive scan of data[0, n) (global or shared) by the whole block; returns the total.
// Tiles of blockDim * 8 values: each thread scans 8 consecutive values, then the block combines.
__device__ int block_exclusive_scan(int* data, long long n, int* warp_sums) {
  constexpr int ITEMS = 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int carry = 0;
  for (long long tile = 0; tile < n; tile += (long long)blockDim.x * ITEMS) {
    const long long first = tile + (long long)threadIdx.x * ITEMS;
    const ValueRun<ITEMS> run(data, first, n);
    const int inclusive = warp_inclusive_sum(run.sum);
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) warp_sums[lane] = warp_inclusive_sum(lane < warps ? warp_sums[lane] : 0);
    __syncthreads();
    run.store_exclusive(data, first, n, carry + inclusive - run.sum + (warp > 0 ? warp_sums[warp - 1] : 0));
    carry += warp_sums[warps - 1];
    __syncthreads();
  }
  return carry;
}

// Whether the host's skewed plan runs: some expert holds at least skew_rows slots (skew_rows 0:
// the host gave no such plan). The same in every thread of the block.
__device__ bool routing_skewed(const int* offsets, int num_experts, int skew_rows) {
  bool found = false;
  for (int e = threadIdx.x; skew_rows > 0 && e < num_experts; e += blockDim.x)
    found |= offsets[e + 1] - offsets[e] >= skew_rows;
  return __syncthreads_or(found);
}

// Writes one GEMM's m-tile map (tile_map.cuh) for the chosen plan: each expert's m-tile count,
// scanned, the counter zeroed and the plan recorded.
__device__ void tile_map(const int* offsets, int num_experts, const TileMap& map, bool skewed, int* warp_sums) {
  const int block_m = skewed ? map.skewed_block_m : map.block_m;
  for (int e = threadIdx.x; e <= num_experts + TILE_MAP_EXTRA - 1; e += blockDim.x)
    map.tiles[e] = e < num_experts ? (offsets[e + 1] - offsets[e] + block_m - 1) / block_m
                                   : e == num_experts + TILE_MAP_PLAN ? int(skewed) : 0;
  __syncthreads();
  block_exclusive_scan(map.tiles, num_experts + 1, warp_sums);
}

// Both GEMMs' tile maps from the expert offsets; none for the public dispatch (null maps).
__device__ void tile_maps(const int* offsets, int num_experts, int skew_rows, const TileMap& gate_up,
                          const TileMap& down, int* warp_sums) {
  if (gate_up.tiles == nullptr) return;  // the same in every thread
  const bool skewed = routing_skewed(offsets, num_experts, skew_rows);
  tile_map(offsets, num_experts, gate_up, skewed, warp_sums);
  tile_map(offsets, num_experts, down, skewed, warp_sums);
}

// Scans the expert-major counts in starts into start positions and derives offsets, counts, tile maps.
__device__ void scan_starts(int* starts, int num_chunks, int num_experts, int* counts, int* offsets,
                            int skew_rows, const TileMap& gate_up, const TileMap& down, int* warp_sums) {
  const int total = block_exclusive_scan(starts, (long long)num_experts * num_chunks, warp_sums);
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x)
    offsets[e] = e < num_experts ? starts[(long long)e * num_chunks] : total;
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = offsets[e + 1] - offsets[e];
  tile_maps(offsets, num_experts, skew_rows, gate_up, down, warp_sums);
}

// Writes the position of ``slot`` of expert e (-1: none), ``first`` being where its (expert, chunk)
// run starts.
__device__ __forceinline__ void place_slot(long long slot, int e, int first, const int* rank,
                                           int valid_slots, int* sorted_slots, int* slot_positions) {
  int pos = -1;
  if (e >= 0) {
    pos = first + rank[slot];
    sorted_slots[pos] = int(slot);
  }
  slot_positions[slot] = pos;
  if (slot >= valid_slots) sorted_slots[slot] = -1;
}

// Blocks of warps, one chunk each; dynamic shared memory: warps * num_experts ints.
template <class IdT>
__global__ void dispatch_count(const IdT* __restrict__ ids, long long num_slots, int num_experts,
                               int num_chunks, int* __restrict__ chunk_counts, int* __restrict__ rank) {
  extern __shared__ int counters[];
  const int warp = threadIdx.x >> 5;
  const int chunk = blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= num_chunks) return;
  int* mine = counters + warp * num_experts;
  const long long begin = (long long)chunk * DISPATCH_CHUNK;
  count_chunk(ids, begin, min(begin + DISPATCH_CHUNK, num_slots), num_experts, mine, rank);
  for (int e = threadIdx.x & 31; e < num_experts; e += 32)
    chunk_counts[(long long)e * num_chunks + chunk] = mine[e];
}

// One warp per expert: its row of chunk counts becomes start positions within the expert (an
// exclusive scan, in place), and counts[e] its total.
__global__ void __launch_bounds__(EXPERT_SCAN_WARPS * 32)
dispatch_expert_scan(int* __restrict__ chunk_starts, int num_chunks, int num_experts, int* __restrict__ counts) {
  constexpr int ITEMS = 4;  // consecutive chunks per lane
  const int lane = threadIdx.x & 31;
  const int e = blockIdx.x * EXPERT_SCAN_WARPS + (threadIdx.x >> 5);
  if (e >= num_experts) return;
  int* row = chunk_starts + (long long)e * num_chunks;
  int carry = 0;
  for (int base = 0; base < num_chunks; base += 32 * ITEMS) {
    const int first = base + lane * ITEMS;
    const ValueRun<ITEMS> run(row, first, num_chunks);
    const int inclusive = warp_inclusive_sum(run.sum);
    run.store_exclusive(row, first, num_chunks, carry + inclusive - run.sum);
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  if (lane == 0) counts[e] = carry;
}

// Dynamic shared memory: num_experts + 1 ints, the expert offsets each block scans from counts.
template <class IdT>
__global__ void dispatch_scatter(const IdT* __restrict__ ids, long long num_slots, int num_experts,
                                 int num_chunks, const int* __restrict__ chunk_starts,
                                 const int* __restrict__ rank, const int* __restrict__ counts,
                                 int* __restrict__ offsets, int skew_rows, TileMap gate_up, TileMap down,
                                 int* __restrict__ sorted_slots, int* __restrict__ slot_positions) {
  extern __shared__ int expert_offsets[];
  __shared__ int warp_sums[32];
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x)
    expert_offsets[e] = e < num_experts ? counts[e] : 0;
  __syncthreads();
  block_exclusive_scan(expert_offsets, num_experts + 1, warp_sums);
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) offsets[e] = expert_offsets[e];
    tile_maps(expert_offsets, num_experts, skew_rows, gate_up, down, warp_sums);
  }
  const long long slot = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (slot >= num_slots) return;
  const int e = expert_of(ids, slot, num_experts);
  const int first = e < 0 ? 0 : expert_offsets[e] + chunk_starts[(long long)e * num_chunks + slot / DISPATCH_CHUNK];
  place_slot(slot, e, first, rank, expert_offsets[num_experts], sorted_slots, slot_positions);
}

// All three steps in one block of FUSED_WARPS warps, for small S (one launch instead of three).
// Dynamic shared memory: 2 * FUSED_WARPS * num_experts ints (per-warp counters, then starts).
template <class IdT>
__global__ void __launch_bounds__(FUSED_WARPS * 32)
dispatch_fused(const IdT* __restrict__ ids, long long num_slots, int num_experts, int* __restrict__ counts,
               int* __restrict__ offsets, int skew_rows, TileMap gate_up, TileMap down,
               int* __restrict__ rank, int* __restrict__ sorted_slots, int* __restrict__ slot_positions) {
  extern __shared__ int shared[];
  __shared__ int warp_sums[32];
  int* counters = shared;                               // [warp][expert]
  int* starts = shared + FUSED_WARPS * num_experts;     // [expert][warp]
  const int warp = threadIdx.x >> 5;
  // At most DISPATCH_CHUNK slots per warp: the host sends no more than FUSED_WARPS * DISPATCH_CHUNK.
  const long long chunk_size = ((num_slots + FUSED_WARPS * 32 - 1) / (FUSED_WARPS * 32)) * 32;
  const long long begin = warp * chunk_size;
  count_chunk(ids, min(begin, num_slots), min(begin + chunk_size, num_slots), num_experts,
              counters + warp * num_experts, rank);
  __syncthreads();
  for (int i = threadIdx.x; i < FUSED_WARPS * num_experts; i += blockDim.x)
    starts[(i % num_experts) * FUSED_WARPS + i / num_experts] = counters[i];
  __syncthreads();
  scan_starts(starts, FUSED_WARPS, num_experts, counts, offsets, skew_rows, gate_up, down, warp_sums);
  const int valid_slots = offsets[num_experts];
  for (long long slot = threadIdx.x; slot < num_slots; slot += blockDim.x) {
    const int e = expert_of(ids, slot, num_experts);
    const int first = e < 0 ? 0 : starts[e * FUSED_WARPS + slot / chunk_size];
    place_slot(slot, e, first, rank, valid_slots, sorted_slots, slot_positions);
  }
}
