// Router: softmax over E logits and the top-k experts of each token, one warp per token.
// Order: descending logit, ties to the lower expert id; NaN counts as -inf.
#include "common.cuh"

template <class L> __device__ __forceinline__ float logit_value(L v);
template <> __device__ __forceinline__ float logit_value<float>(float v) { return v; }
template <> __device__ __forceinline__ float logit_value<bf16>(bf16 v) { return Float16Traits<bf16>::to_float(v.bits); }
template <> __device__ __forceinline__ float logit_value<f16>(f16 v) { return Float16Traits<f16>::to_float(v.bits); }

__device__ __forceinline__ float ranked(float v) { return v != v ? -__int_as_float(0x7f800000) : v; }

// (v, i) comes before (bv, bi) in the ranking.
__device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

template <class L>
__global__ void route_topk(const L* __restrict__ logits, int tokens, int num_experts, int top_k,
                           int renormalize, float* __restrict__ topk_weights, int* __restrict__ topk_ids) {
  const int lane = threadIdx.x & 31;
  const long long token = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (token >= tokens) return;
  const L* row = logits + token * num_experts;
  const float neg_inf = -__int_as_float(0x7f800000);

  float row_max = neg_inf;
  for (int e = lane; e < num_experts; e += 32) row_max = fmaxf(row_max, ranked(logit_value(row[e])));
  for (int d = 16; d > 0; d >>= 1) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, d));
  float denom = 0.f;
  for (int e = lane; e < num_experts; e += 32) denom += expf(ranked(logit_value(row[e])) - row_max);
  for (int d = 16; d > 0; d >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, d);

  // Round r picks the best (value, id) ranked after round r-1's pick.
  float prev_v = -neg_inf;
  int prev_i = -1;
  float picked_sum = 0.f;
  for (int r = 0; r < top_k; ++r) {
    float best_v = neg_inf;
    int best_i = 0x7fffffff;
    for (int e = lane; e < num_experts; e += 32) {
      const float v = ranked(logit_value(row[e]));
      if (ranks_before(prev_v, prev_i, v, e) && ranks_before(v, e, best_v, best_i)) {
        best_v = v;
        best_i = e;
      }
    }
    for (int d = 16; d > 0; d >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, d);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, d);
      if (ranks_before(ov, oi, best_v, best_i)) {
        best_v = ov;
        best_i = oi;
      }
    }
    prev_v = best_v;
    prev_i = best_i;
    const float p = expf(best_v - row_max) / denom;
    picked_sum += p;
    if (lane == 0) {
      topk_weights[token * top_k + r] = p;
      topk_ids[token * top_k + r] = best_i;
    }
  }
  if (renormalize && lane == 0)
    for (int r = 0; r < top_k; ++r) topk_weights[token * top_k + r] /= picked_sum;
}
