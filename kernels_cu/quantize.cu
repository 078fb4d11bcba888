// FP8 activation quantization (quantize.cuh's numerics), for the FP8 expert GEMMs' inputs that no
// GEMM epilogue quantizes: x before gate/up, and h where the gate/up GEMM writes it in 16 bits.
// One warp per (row, group of FP8_BLOCK columns), four columns per lane (a last group of 64
// columns idles half the warp). Rows from the row count on (``rows``, or *row_count when given:
// the dispatch's valid slots, so that h's unwritten rows are not read) are skipped.
#include "quantize.cuh"

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
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = amax_keeping_nan(amax, fabsf(v[i]));
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = amax_keeping_nan(amax, __shfl_xor_sync(~0u, amax, offset));
  const float scale = group_scale(amax);
  if (lane == 0) scales[row * groups + group] = scale;
  if (in_row) q[(row * cols + col) / 4] = e4m3x4(v, scale);
}
