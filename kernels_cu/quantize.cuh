// The FP8 activation quantization's numerics (cupymoe/fp8.py's quantize_activations), shared by
// quantize.cu and the persistent gate/up epilogue that quantizes h: a group of FP8_BLOCK values v
// of one row becomes e4m3 bytes q = e4m3(v / s), rounded to nearest even, with one float32 scale
// s = max(amax, FP8_AMAX_FLOOR) / E4M3_MAX, NaN where the group holds a NaN. Needs sm_89 (cvt to e4m3).
#pragma once
#include "common.cuh"

// (lo, hi) as two e4m3 bytes, lo in the low one; |value| <= E4M3_MAX here, so satfinite changes
// nothing but keeps NaN a NaN.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// The larger magnitude of two partial amaxes, NaN if either is (fmaxf would drop it).
__device__ __forceinline__ float amax_keeping_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// A group's scale from its amax (NaN: the group holds a NaN).
__device__ __forceinline__ float group_scale(float amax) {
  return amax != amax ? amax : fmaxf(amax, FP8_AMAX_FLOOR) / E4M3_MAX;
}

// Four values v / scale as four e4m3 bytes, v[0] in the lowest.
__device__ __forceinline__ u32 e4m3x4(const float (&v)[4], float scale) {
  return e4m3x2(v[0] / scale, v[1] / scale) | e4m3x2(v[2] / scale, v[3] / scale) << 16;
}
