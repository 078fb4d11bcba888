// Shared-memory mbarriers (sm_80+; parity waits), named barriers, warpgroup register reallocation,
// and (sm_90) the mbarriers of a thread block cluster's other blocks.
#pragma once
#include "common.cuh"

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival, made when every cp.async this thread issued before it has landed.
__device__ __forceinline__ void mbarrier_arrive_after_cp_async(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Returns once the barrier's phase of the given parity has completed. A fresh barrier counts its
// (nonexistent) phase before the first as completed, so waiting on parity 1 returns at once.
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Barrier `id` (1-15; 0 is __syncthreads) over `threads` threads, whole warps.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Warpgroup-wide register reallocation (sm_90a): producers give registers to the MMA warpgroups.
template <int REGS> __device__ __forceinline__ void warpgroup_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS> __device__ __forceinline__ void warpgroup_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

// Clusters (sm_90): the address of shared-memory location `addr` in block `rank` of this block's cluster.
__device__ __forceinline__ u32 cluster_address(u32 addr, u32 rank) {
  u32 out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
// One arrival on the mbarrier at `cluster_addr` (cluster_address's) in any block of the cluster.
__device__ __forceinline__ void mbarrier_arrive_cluster(u32 cluster_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}
// mbarrier_wait for a barrier that blocks of the cluster arrive on: their accesses before
// arriving are ordered before this thread's after.
__device__ __forceinline__ void mbarrier_wait_cluster(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Every thread of every block of the cluster (the mbarriers this block initialised before it
// are then initialised for the others too).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("fence.mbarrier_init.release.cluster;\n"
               "barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
