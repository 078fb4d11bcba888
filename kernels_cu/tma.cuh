// Bulk tensor copies (TMA, sm_90): 2-D and 4-D tiles from global into shared memory, completing on an mbarrier.
#pragma once
#include "common.cuh"

// A CUtensorMap as the driver encodes it (cupymoe/_tma.py); passed as a __grid_constant__ parameter.
struct alignas(64) TensorMap {
  u64 words[16];
};

// The mbarrier's phase also waits for `bytes` more bytes of bulk copies; counts as one arrival.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// The box at (x, y) (x innermost) of `map` into shared memory at `dst`, completing on mbarrier `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap& map, int x, int y, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// The box at (x, y, z, w) (x innermost) of a 4-D `map` into shared memory at `dst`, completing on mbarrier `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap& map, int x, int y, int z, int w, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(x), "r"(y), "r"(z),
      "r"(w), "r"(bar)
      : "memory");
}
