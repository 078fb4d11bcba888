// Hopper warpgroup MMA (wgmma, sm_90a): shared-memory descriptors, fences, and m64n128k16.
#pragma once
#include "common.cuh"

// Descriptor of a K-major tile whose rows are 128 bytes, swizzled in 1024-byte groups of 8 rows
// (the layout of swizzled_offset); addr must be 1024-byte aligned up to the in-row K offset.
__device__ __forceinline__ u64 wgmma_desc(u32 addr) {
  return u64((addr & 0x3FFFF) >> 4)  // start address
         | (u64(1) << 16)            // leading byte offset: unused for swizzled K-major
         | (u64(1024 >> 4) << 32)    // stride byte offset: next group of 8 rows
         | (u64(1) << 62);           // 128-byte swizzle
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes (cp.async, st.shared) before async-proxy reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

template <class T> struct Wgmma;

// PTX wants the operand type inside the instruction string, hence one macro for both types.
#define CUPYMOE_WGMMA_M64N128K16(TYPE, PTX_TYPE) \
  template <> struct Wgmma<TYPE> { \
    /* d[64] += A[64x16] * B[16x128]^T, both K-major in 128B-swizzled shared memory. */ \
    static __device__ __forceinline__ void m64n128k16(float (&d)[64], u64 desc_a, u64 desc_b) { \
      asm volatile( \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE " " \
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
          : \
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
          : "l"(desc_a), "l"(desc_b), "r"(1)); \
    } \
  };

CUPYMOE_WGMMA_M64N128K16(bf16, "bf16")
CUPYMOE_WGMMA_M64N128K16(f16, "f16")
#undef CUPYMOE_WGMMA_M64N128K16
