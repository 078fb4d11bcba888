// A GEMM's m-tile map, int tiles[E + TILE_MAP_EXTRA]: which m-tiles (chunks of an expert's sorted
// slots, block_m rows each) the GEMM's work items are. The dispatch writes it (dispatch.cu), the
// expert GEMMs read it (expert_tiles.cuh); cupymoe/_contract.py holds the field indices.
//   tiles[e], e < E              the first m-tile of expert e (an exclusive scan of the m-tile counts)
//   tiles[E + TILE_MAP_TOTAL]    every expert's m-tiles
//   tiles[E + TILE_MAP_COUNTER]  the counter from which blocks claim tiles (zeroed by the dispatch)
//   tiles[E + TILE_MAP_PLAN]     the plan whose kernels work: 0 the host's own, 1 its skewed plan
#pragma once
#include "contract.cuh"

static_assert(TILE_MAP_TOTAL == 0, "the scan of the E m-tile counts and a zero leaves the total at E");

// A GEMM's map as the dispatch gets it, by value (cupymoe/_gpu_dispatch.py's TILE_MAP): the rows
// per m-tile of the host's plan and of its skewed plan, and the map's ints.
struct TileMap {
  int block_m;
  int skewed_block_m;
  int* tiles;
};

__device__ __forceinline__ int tile_total(const int* tiles, int num_experts) {
  return tiles[num_experts + TILE_MAP_TOTAL];
}
__device__ __forceinline__ int* tile_counter(int* tiles, int num_experts) {
  return tiles + num_experts + TILE_MAP_COUNTER;
}
__device__ __forceinline__ int chosen_plan(const int* tiles, int num_experts) {
  return tiles[num_experts + TILE_MAP_PLAN];
}
