// Dispatch: group the S = T * k routed slots by expert without timing-dependent order.
//   1. count:   each warp owns a chunk of slots; it counts them per expert and gives each slot
//               its rank among the chunk's earlier slots of the same expert.
//   2. scan:    one block turns the expert-major [E][chunks] counts into start positions, and
//               derives per-expert offsets and the GEMMs' m-tile maps.
//   3. scatter: position = start[expert][chunk] + rank, so equal experts keep slot order.
// Ids outside [0, E) are treated as "no expert" and dropped.
#include "common.cuh"

constexpr int DISPATCH_CHUNK = 256;  // slots per warp in count
constexpr int SCAN_THREADS = 1024;

template <class IdT>
__device__ __forceinline__ int expert_of(const IdT* ids, long long slot, int num_experts) {
  const IdT id = ids[slot];
  return (id >= 0 && id < num_experts) ? int(id) : -1;
}

// Block of COUNT_WARPS warps; dynamic shared memory: COUNT_WARPS * num_experts ints.
template <class IdT>
__global__ void dispatch_count(const IdT* __restrict__ ids, long long num_slots, int num_experts,
                               int num_chunks, int* __restrict__ chunk_counts, int* __restrict__ rank) {
  extern __shared__ int counters[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int* mine = counters + warp * num_experts;
  for (int e = lane; e < num_experts; e += 32) mine[e] = 0;
  __syncwarp();
  const int chunk = blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= num_chunks) return;
  const long long begin = (long long)chunk * DISPATCH_CHUNK;
  const long long end = min(begin + DISPATCH_CHUNK, num_slots);
  const u32 lanes_below = (1u << lane) - 1;
  for (long long base = begin; base < end; base += 32) {
    const long long slot = base + lane;
    const int e = slot < end ? expert_of(ids, slot, num_experts) : -1;
    const u32 peers = __match_any_sync(0xffffffffu, e);
    int before = 0;
    if (e >= 0) before = mine[e];
    __syncwarp();
    if (e >= 0) {
      if ((peers & lanes_below) == 0) mine[e] = before + __popc(peers);
      rank[slot] = before + __popc(peers & lanes_below);
    }
    __syncwarp();
  }
  for (int e = lane; e < num_experts; e += 32) chunk_counts[(long long)e * num_chunks + chunk] = mine[e];
}

// In-place exclusive scan of data[0, n) by the whole block; returns the total to every thread.
__device__ int block_exclusive_scan(int* data, long long n, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const long long per = (n + blockDim.x - 1) / blockDim.x;
  const long long begin = min(n, (long long)threadIdx.x * per);
  const long long end = min(n, begin + per);
  int own = 0;
  for (long long i = begin; i < end; ++i) own += data[i];
  int inclusive = own;
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  int running = inclusive - own + (warp > 0 ? warp_sums[warp - 1] : 0);
  const int total = warp_sums[warps - 1];
  for (long long i = begin; i < end; ++i) {
    const int v = data[i];
    data[i] = running;
    running += v;
  }
  __syncthreads();
  return total;
}

// Writes m-tile counts of block_m rows per expert, then scans them: tiles[e] = first tile of e.
__device__ void tile_map(const int* offsets, int num_experts, int block_m, int* tiles, int* warp_sums) {
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x)
    tiles[e] = e < num_experts ? (offsets[e + 1] - offsets[e] + block_m - 1) / block_m : 0;
  __syncthreads();
  block_exclusive_scan(tiles, num_experts + 1, warp_sums);
}

// One block of SCAN_THREADS. chunk_starts holds the counts on entry and the start positions on exit.
__global__ void __launch_bounds__(SCAN_THREADS)
dispatch_scan(int* __restrict__ chunk_starts, int num_chunks, int num_experts, int* __restrict__ counts,
              int* __restrict__ offsets, int block_m_a, int* __restrict__ tiles_a, int block_m_b,
              int* __restrict__ tiles_b) {
  __shared__ int warp_sums[32];
  const int total = block_exclusive_scan(chunk_starts, (long long)num_experts * num_chunks, warp_sums);
  for (int e = threadIdx.x; e <= num_experts; e += blockDim.x)
    offsets[e] = e < num_experts ? chunk_starts[(long long)e * num_chunks] : total;
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = offsets[e + 1] - offsets[e];
  tile_map(offsets, num_experts, block_m_a, tiles_a, warp_sums);
  tile_map(offsets, num_experts, block_m_b, tiles_b, warp_sums);
}

template <class IdT>
__global__ void dispatch_scatter(const IdT* __restrict__ ids, long long num_slots, int num_experts,
                                 int num_chunks, const int* __restrict__ chunk_starts,
                                 const int* __restrict__ rank, const int* __restrict__ offsets,
                                 int* __restrict__ sorted_slots, int* __restrict__ slot_positions) {
  const long long slot = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (slot >= num_slots) return;
  const int e = expert_of(ids, slot, num_experts);
  int pos = -1;
  if (e >= 0) {
    pos = chunk_starts[(long long)e * num_chunks + slot / DISPATCH_CHUNK] + rank[slot];
    sorted_slots[pos] = int(slot);
  }
  slot_positions[slot] = pos;
  if (slot >= offsets[num_experts]) sorted_slots[slot] = -1;
}
