// Combine: out[t] = sum_{j=0..k-1} weight[t, j] * y[position of slot (t, j)], in that order, in fp32.
// One block per token; each thread owns 8 consecutive columns (16-byte loads and stores). No atomics,
// so the result is bitwise reproducible.
#include "common.cuh"

template <class T>
__global__ void combine(const u16* __restrict__ y, const int* __restrict__ slot_positions,
                        const float* __restrict__ weights, int top_k, int hidden, u16* __restrict__ out) {
  using F = Float16Traits<T>;
  const long long token = blockIdx.x;
  for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
    float acc[8] = {};
    for (int j = 0; j < top_k; ++j) {
      const int pos = slot_positions[token * top_k + j];
      if (pos < 0) continue;
      const float weight = weights[token * top_k + j];
      const uint4 v = *reinterpret_cast<const uint4*>(y + (long long)pos * hidden + col);
      const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] += weight * F::to_float(u16(words[i] & 0xffffu));
        acc[2 * i + 1] += weight * F::to_float(u16(words[i] >> 16));
      }
    }
    uint4 packed;
    packed.x = F::pack(acc[0], acc[1]);
    packed.y = F::pack(acc[2], acc[3]);
    packed.z = F::pack(acc[4], acc[5]);
    packed.w = F::pack(acc[6], acc[7]);
    *reinterpret_cast<uint4*>(out + token * hidden + col) = packed;
  }
}
