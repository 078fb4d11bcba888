// Combine: out[t] = sum_{j=0..k-1} weight[t, j] * y[position of slot (t, j)], in that order, in fp32,
// then + addend[t] (a shared expert's output) when given; null weights weigh every slot 1.
// One block per token; each thread owns 8 consecutive columns (16-byte loads and stores). It loads
// its pieces of IN_FLIGHT slots at a time, all before adding any, so that those reads overlap. No
// atomics, so the result is bitwise reproducible.
#include "common.cuh"

constexpr int IN_FLIGHT = 8;

// 16 bytes from global memory if ``valid``, else zeros without a read: a predicated load, so that
// no branch separates a thread's loads.
__device__ __forceinline__ uint4 load_16_if(const void* src, bool valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  asm("{\n .reg .pred p;\n setp.ne.u32 p, %5, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(src), "r"(u32(valid)));
  return v;
}

// acc[i] += weight * value i of the 8 16-bit values in v.
template <class T>
__device__ __forceinline__ void add_scaled(float (&acc)[8], uint4 v, float weight) {
  const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += weight * Float16Traits<T>::to_float(u16(words[i] & 0xffffu));
    acc[2 * i + 1] += weight * Float16Traits<T>::to_float(u16(words[i] >> 16));
  }
}

template <class T>
__global__ void combine(const u16* __restrict__ y, const int* __restrict__ slot_positions,
                        const float* __restrict__ weights, int top_k, int hidden,
                        const u16* __restrict__ addend, u16* __restrict__ out) {
  using F = Float16Traits<T>;
  const long long token = blockIdx.x;
  const int* positions = slot_positions + token * top_k;
  const float* token_weights = weights == nullptr ? nullptr : weights + token * top_k;
  for (int col = threadIdx.x * 8; col < hidden; col += blockDim.x * 8) {
    float acc[8] = {};
    for (int j0 = 0; j0 < top_k; j0 += IN_FLIGHT) {
      int pos[IN_FLIGHT];
      uint4 v[IN_FLIGHT];
#pragma unroll
      for (int j = 0; j < IN_FLIGHT; ++j) pos[j] = j0 + j < top_k ? positions[j0 + j] : -1;
#pragma unroll
      for (int j = 0; j < IN_FLIGHT; ++j)
        v[j] = load_16_if(y + (long long)max(pos[j], 0) * hidden + col, pos[j] >= 0);
#pragma unroll
      for (int j = 0; j < IN_FLIGHT; ++j) {
        if (pos[j] < 0) continue;
        add_scaled<T>(acc, v[j], token_weights == nullptr ? 1.0f : token_weights[j0 + j]);
      }
    }
    if (addend != nullptr) add_scaled<T>(acc, *reinterpret_cast<const uint4*>(addend + token * hidden + col), 1.0f);
    uint4 packed;
    packed.x = F::pack(acc[0], acc[1]);
    packed.y = F::pack(acc[2], acc[3]);
    packed.z = F::pack(acc[4], acc[5]);
    packed.w = F::pack(acc[6], acc[7]);
    *reinterpret_cast<uint4*>(out + token * hidden + col) = packed;
  }
}
