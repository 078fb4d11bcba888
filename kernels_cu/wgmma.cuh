// Hopper warpgroup MMA (wgmma, sm_90a): shared-memory descriptors, fences, m64nNk16 and stmatrix.
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

// The descriptor of the tile `bytes` (a multiple of 16) further in: shared addresses stay below
// 256 KiB, so the 14-bit start address field does not carry.
__device__ __forceinline__ u64 wgmma_desc_offset(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// After a wgmma_wait: the compiler keeps every access of accumulator d below it (it sees only the
// MMA's asm write d, not when the values land).
template <int N> __device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int v = 0; v < N; ++v) asm volatile("" : "+f"(d[v])::"memory");
}
// Before MMAs that overwrite d (accumulate false): d's old values are dead, so the compiler carries
// none of them (no copies) into the MMAs' operands.
template <int N> __device__ __forceinline__ void wgmma_discard_operands(float (&d)[N]) {
#pragma unroll
  for (int v = 0; v < N; ++v) asm volatile("" : "=f"(d[v])::"memory");
}
// Orders this thread's generic-proxy shared-memory accesses (cp.async, st.shared) with async-proxy ones.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Four 8x8 16-bit matrices in the mma fragment layout (lane holds row lane / 4, columns 2 (lane % 4)
// + {0, 1} of each): row j of matrix m goes to the 16 bytes lane 8m + j points at.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 m0, u32 m1, u32 m2, u32 m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(addr), "r"(m0), "r"(m1), "r"(m2), "r"(m3) : "memory");
}

// Four 8x8 16-bit matrices in the mma fragment layout (lane holds row lane / 4, columns 2 (lane % 4)
// + {0, 1} of each) stored transposed: row j of matrix m goes to the 16 bytes lane 8m + j points at.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 m0, u32 m1, u32 m2, u32 m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(addr), "r"(m0), "r"(m1), "r"(m2), "r"(m3) : "memory");
}

// Accumulators in blocks of 16 (N / 2 per thread for m64nN, N <= 160): PTX names, asm operands.
#define CUPYMOE_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define CUPYMOE_R1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUPYMOE_R2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define CUPYMOE_R3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUPYMOE_R4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define CUPYMOE_F0 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define CUPYMOE_F1 \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define CUPYMOE_F2 \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define CUPYMOE_F3 \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define CUPYMOE_F4 \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])

// Per N: the accumulators' PTX names and asm operands, then the names of the descriptors and flag.
#define CUPYMOE_REGS_32 CUPYMOE_R0
#define CUPYMOE_OPS_32 CUPYMOE_F0
#define CUPYMOE_DESCS_32 "%16, %17"
#define CUPYMOE_ACC_32 "%18"
#define CUPYMOE_REGS_64 CUPYMOE_R0 ", " CUPYMOE_R1
#define CUPYMOE_OPS_64 CUPYMOE_F0, CUPYMOE_F1
#define CUPYMOE_DESCS_64 "%32, %33"
#define CUPYMOE_ACC_64 "%34"
#define CUPYMOE_REGS_96 CUPYMOE_R0 ", " CUPYMOE_R1 ", " CUPYMOE_R2
#define CUPYMOE_OPS_96 CUPYMOE_F0, CUPYMOE_F1, CUPYMOE_F2
#define CUPYMOE_DESCS_96 "%48, %49"
#define CUPYMOE_ACC_96 "%50"
#define CUPYMOE_REGS_128 CUPYMOE_R0 ", " CUPYMOE_R1 ", " CUPYMOE_R2 ", " CUPYMOE_R3
#define CUPYMOE_OPS_128 CUPYMOE_F0, CUPYMOE_F1, CUPYMOE_F2, CUPYMOE_F3
#define CUPYMOE_DESCS_128 "%64, %65"
#define CUPYMOE_ACC_128 "%66"
#define CUPYMOE_REGS_160 CUPYMOE_REGS_128 ", " CUPYMOE_R4
#define CUPYMOE_OPS_160 CUPYMOE_OPS_128, CUPYMOE_F4
#define CUPYMOE_DESCS_160 "%80, %81"
#define CUPYMOE_ACC_160 "%82"

// The operand tag of FP8 (float8 e4m3) wgmma.
struct e4m3 {};

template <class T, int N> struct Wgmma;

// d[N / 2] = A[64xK] * B[KxN]^T (+ d when accumulate), A and B K-major in 128B-swizzled shared
// memory, K = 32 bytes: k16 of 16-bit values (whose K-major layout is the "not transposed" flag
// pair 0, 0), k32 of e4m3 (which takes no such flags). PTX wants the shape and operand type inside
// the instruction string, hence one macro for all.
#define CUPYMOE_WGMMA(TYPE, SHAPE_TYPES, FLAGS, N) \
  template <> struct Wgmma<TYPE, N> { \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], u64 desc_a, u64 desc_b, bool accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " CUPYMOE_ACC_##N ", 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n" #N SHAPE_TYPES \
                   " {" CUPYMOE_REGS_##N "}, " CUPYMOE_DESCS_##N ", p, 1, 1" FLAGS ";\n}\n" \
                   : CUPYMOE_OPS_##N \
                   : "l"(desc_a), "l"(desc_b), "r"(int(accumulate))); \
    } \
  };
#define CUPYMOE_WGMMA_TYPE(TYPE, SHAPE_TYPES, FLAGS) \
  CUPYMOE_WGMMA(TYPE, SHAPE_TYPES, FLAGS, 32) CUPYMOE_WGMMA(TYPE, SHAPE_TYPES, FLAGS, 64) \
  CUPYMOE_WGMMA(TYPE, SHAPE_TYPES, FLAGS, 96) CUPYMOE_WGMMA(TYPE, SHAPE_TYPES, FLAGS, 128) \
  CUPYMOE_WGMMA(TYPE, SHAPE_TYPES, FLAGS, 160)

CUPYMOE_WGMMA_TYPE(bf16, "k16.f32.bf16.bf16", ", 0, 0")
CUPYMOE_WGMMA_TYPE(f16, "k16.f32.f16.f16", ", 0, 0")
CUPYMOE_WGMMA_TYPE(e4m3, "k32.f32.e4m3.e4m3", "")
#undef CUPYMOE_R0
#undef CUPYMOE_R1
#undef CUPYMOE_R2
#undef CUPYMOE_R3
#undef CUPYMOE_R4
#undef CUPYMOE_F0
#undef CUPYMOE_F1
#undef CUPYMOE_F2
#undef CUPYMOE_F3
#undef CUPYMOE_F4
#undef CUPYMOE_REGS_32
#undef CUPYMOE_OPS_32
#undef CUPYMOE_DESCS_32
#undef CUPYMOE_ACC_32
#undef CUPYMOE_REGS_64
#undef CUPYMOE_OPS_64
#undef CUPYMOE_DESCS_64
#undef CUPYMOE_ACC_64
#undef CUPYMOE_REGS_96
#undef CUPYMOE_OPS_96
#undef CUPYMOE_DESCS_96
#undef CUPYMOE_ACC_96
#undef CUPYMOE_REGS_128
#undef CUPYMOE_OPS_128
#undef CUPYMOE_DESCS_128
#undef CUPYMOE_ACC_128
#undef CUPYMOE_REGS_160
#undef CUPYMOE_OPS_160
#undef CUPYMOE_DESCS_160
#undef CUPYMOE_ACC_160
#undef CUPYMOE_WGMMA
#undef CUPYMOE_WGMMA_TYPE
