// Shared device helpers: 16-bit float traits, cp.async, ldmatrix, mma.sync, swizzled shared tiles.
// No CUDA headers are included, so NVRTC needs nothing beyond its built-ins.
#pragma once
#include "contract.cuh"

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// 16-bit storage types: distinct tags so templates can pick the right PTX.
struct bf16 { u16 bits; };
struct f16 { u16 bits; };

template <class T> struct Float16Traits;

// d += a * b on tensor cores (m16n8k16, fp32 accumulation); PTX wants the type in the string.
#define CUPYMOE_MMA_M16N8K16(PTX_TYPE)                                                             \
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) { \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "          \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                 \
  }

template <> struct Float16Traits<bf16> {
  static __device__ __forceinline__ float to_float(u16 v) { return __uint_as_float(u32(v) << 16); }
  // Packs (lo, hi) rounded to nearest even into one register.
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  CUPYMOE_MMA_M16N8K16("bf16")
  // Two e4m3 bytes, each in the high byte of a 16-bit half (``t``), as bf16 values: the exponent
  // and mantissa shifted under the sign read the value times 2^-120 (subnormals too), the fma
  // scales it back. Exact; the e4m3fn NaN code reads as 480.
  static __device__ __forceinline__ u32 from_e4m3_pair(u32 t) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;"
        : "=r"(r) : "r"((t & 0x80008000u) | ((t >> 4) & 0x07f007f0u)), "r"(0x7b807b80u), "r"(0x80008000u));
    return r;
  }
};

template <> struct Float16Traits<f16> {
  static __device__ __forceinline__ float to_float(u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  CUPYMOE_MMA_M16N8K16("f16")
  // As bf16's, times 2^-8 before the fma.
  static __device__ __forceinline__ u32 from_e4m3_pair(u32 t) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;"
        : "=r"(r) : "r"((t & 0x80008000u) | ((t >> 1) & 0x3f803f80u)), "r"(0x5c005c00u), "r"(0x80008000u));
    return r;
  }
};

#undef CUPYMOE_MMA_M16N8K16

// d += a * b on FP8 tensor cores (m16n8k32, e4m3, fp32 accumulation; sm_89+). In units of byte
// pairs its fragments are those of m16n8k16 above, so the same ldmatrix loads feed it.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four e4m3 values (the bytes of ``x``) widened exactly to T: lo holds bytes 0 and 1, hi bytes 2 and 3.
template <class T>
__device__ __forceinline__ void widen_e4m3(u32 x, u32& lo, u32& hi) {
  lo = Float16Traits<T>::from_e4m3_pair(__byte_perm(x, 0, 0x1404));
  hi = Float16Traits<T>::from_e4m3_pair(__byte_perm(x, 0, 0x3424));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; when !valid the destination is zero-filled and src is not read.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// 4-byte global->shared copy (cached in L1), zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void lds_64(u32& lo, u32& hi, u32 addr) {
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(lo), "=r"(hi) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// A shared tile of ROWS x BK 16-bit values: rows of ROW_BYTES split into 8 chunks of 16 bytes.
// Chunk c of row r is stored at chunk c ^ (r & 7), so ldmatrix and cp.async are conflict-free;
// it is the 128-byte swizzle of wgmma and TMA.
constexpr int ROW_BYTES = BK * 2;
static_assert(ROW_BYTES == 128, "a K-tile row is one 128-byte swizzle row");
__device__ __forceinline__ u32 swizzled_offset(int row, int chunk) {
  return u32(row * ROW_BYTES + ((chunk ^ (row & 7)) << 4));
}

// 1/x from the SFU (rcp.approx, about 1 ulp): no IEEE division slow path, so no branches that
// serialise an epilogue's silu chains.
__device__ __forceinline__ float reciprocal_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float silu(float v) { return v * reciprocal_approx(1.0f + __expf(-v)); }
// The routers' sigmoid, exact to expf (route_sigmoid's scores, the shared expert's gate).
__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// The expert of routed slot ``slot``; -1 for an id outside [0, num_experts) ("no expert").
template <class IdT>
__device__ __forceinline__ int expert_of(const IdT* ids, long long slot, int num_experts) {
  const IdT id = ids[slot];
  return (id >= 0 && id < num_experts) ? int(id) : -1;
}
