// FP8 activation quantization (cupymoe/fp8.py's numerics), for the FP8 expert GEMMs' inputs: each
// row's groups of FP8_BLOCK columns as float8 e4m3 bytes q = e4m3(v / s), rounded to nearest even,
// and one float32 scale s = max(amax, FP8_AMAX_FLOOR) / E4M3_MAX, NaN where the group holds a NaN.
// One warp per (row, group), four columns per lane (a last group of 64 columns idles half the
// warp). Rows from the row count on (``rows``, or *row_count when given: the dispatch's valid
// slots, so that h's unwritten rows are not read) are skipped. Needs sm_89 (cvt to e4m3).
#include "common.cuh"

// (lo, hi) as two e4m3 bytes, lo in the low one; |value| <= E4M3_MAX here, so satfinite changes
// nothing but keeps NaN a NaN.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

template <class T>
__global__ void __launch_bounds__(QUANTIZE_THREADS)
quantize_groups(const u16* __restrict__ in, int rows, const int* __restrict__ row_count, int cols,
                u32* __restrict__ q, float* __restrict__ scales) {
  const int groups = (cols + FP8_BLOCK - 1) / FP8_BLOCK;
  const long long warp = (blockIdx.x * (long long)QUANTIZE_THREADS + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const long long row = warp / groups;
  const int group = int(warp % groups);
  if (row >= (row_count ? *row_count : rows)) return;  // the whole warp
  const int col = group * FP8_BLOCK + lane * 4;
  const bool in_row = col < cols;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (in_row) {
    const uint2 bits = *reinterpret_cast<const uint2*>(in + row * cols + col);
    v[0] = Float16Traits<T>::to_float(u16(bits.x & 0xffffu));
    v[1] = Float16Traits<T>::to_float(u16(bits.x >> 16));
    v[2] = Float16Traits<T>::to_float(u16(bits.y & 0xffffu));
    v[3] = Float16Traits<T>::to_float(u16(bits.y >> 16));
  }
  float amax = 0.0f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    amax = fmaxf(amax, fabsf(v[i]));  // fmaxf drops NaN: the flag keeps it
    nan |= v[i] != v[i];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, offset));
  const float scale = __any_sync(~0u, nan) ? __int_as_float(0x7fc00000) : fmaxf(amax, FP8_AMAX_FLOOR) / E4M3_MAX;
  if (lane == 0) scales[row * groups + group] = scale;
  if (in_row) q[(row * cols + col) / 4] = e4m3x2(v[0] / scale, v[1] / scale) | e4m3x2(v[2] / scale, v[3] / scale) << 16;
}
