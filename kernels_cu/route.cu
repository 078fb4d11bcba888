// Router: each token's top-k experts and their weights from its E logits, one warp per token.
//   route_topk:    softmax over all E; the k of highest logit.
//   route_sigmoid: scores sigmoid(logit); the k of highest score + correction bias among the
//                  topk_groups groups (of E / num_groups experts) whose two best biased scores sum
//                  highest; weighted by the unbiased scores.
// Order: descending (biased) value, ties to the lower expert (or group) id; NaN counts as -inf.
// All in fp32, as cupymoe/reference.py's route and route_sigmoid.
#include "common.cuh"

static_assert(ROUTE_MAX_GROUPS <= 32, "a bit per group in a warp-uniform mask, a lane per group");

template <class L> __device__ __forceinline__ float logit_value(L v);
template <> __device__ __forceinline__ float logit_value<float>(float v) { return v; }
template <> __device__ __forceinline__ float logit_value<bf16>(bf16 v) { return Float16Traits<bf16>::to_float(v.bits); }
template <> __device__ __forceinline__ float logit_value<f16>(f16 v) { return Float16Traits<f16>::to_float(v.bits); }

__device__ __forceinline__ float ranked(float v) { return v != v ? -__int_as_float(0x7f800000) : v; }

// (v, i) comes before (bv, bi) in the ranking.
__device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// The warp's best (value, id) among each lane's candidate, ties to the lower id.
__device__ __forceinline__ void warp_best(float& v, int& i) {
  for (int d = 16; d > 0; d >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, d);
    const int oi = __shfl_xor_sync(0xffffffffu, i, d);
    if (ranks_before(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
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
    warp_best(best_v, best_i);
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

template <class L>
__global__ void route_sigmoid(const L* __restrict__ logits, const float* __restrict__ correction_bias, int tokens,
                              int num_experts, int top_k, int num_groups, int topk_groups, int renormalize,
                              float scaling_factor, float* __restrict__ topk_weights, int* __restrict__ topk_ids) {
  const int lane = threadIdx.x & 31;
  const long long token = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (token >= tokens) return;
  const L* row = logits + token * num_experts;
  const float neg_inf = -__int_as_float(0x7f800000);
  auto choice_value = [&](int e) {  // what experts are chosen on: the biased score, NaN as -inf
    const float s = sigmoid(logit_value(row[e]));
    return ranked(correction_bias == nullptr ? s : s + correction_bias[e]);
  };

  // The eligible groups: topk_groups rounds, each picking the best group ranked after the last pick.
  const int group_size = num_experts / num_groups;
  u32 eligible = num_groups == 1 ? 1u : 0u;
  if (num_groups > 1) {
    float group_score = neg_inf;  // lane g's: group g's two best biased scores, summed
    for (int g = 0; g < num_groups; ++g) {
      float first = neg_inf, second = neg_inf;
      for (int e = g * group_size + lane; e < (g + 1) * group_size; e += 32) {
        const float v = choice_value(e);
        second = fmaxf(second, fminf(first, v));
        first = fmaxf(first, v);
      }
      for (int d = 16; d > 0; d >>= 1) {
        const float of = __shfl_xor_sync(0xffffffffu, first, d), os = __shfl_xor_sync(0xffffffffu, second, d);
        second = fmaxf(fmaxf(second, os), fminf(first, of));
        first = fmaxf(first, of);
      }
      if (lane == g) group_score = ranked(first + second);
    }
    float prev_v = -neg_inf;
    int prev_g = -1;
    for (int r = 0; r < topk_groups; ++r) {
      float best_v = neg_inf;
      int best_g = 0x7fffffff;
      if (lane < num_groups && ranks_before(prev_v, prev_g, group_score, lane)) {
        best_v = group_score;
        best_g = lane;
      }
      warp_best(best_v, best_g);
      eligible |= 1u << best_g;
      prev_v = best_v;
      prev_g = best_g;
    }
  }

  float prev_v = -neg_inf;
  int prev_i = -1;
  float picked_sum = 0.f;
  for (int r = 0; r < top_k; ++r) {
    float best_v = neg_inf;
    int best_i = 0x7fffffff;
    for (int e = lane; e < num_experts; e += 32) {
      const float v = eligible >> (num_groups == 1 ? 0 : e / group_size) & 1u ? choice_value(e) : neg_inf;
      if (ranks_before(prev_v, prev_i, v, e) && ranks_before(v, e, best_v, best_i)) {
        best_v = v;
        best_i = e;
      }
    }
    warp_best(best_v, best_i);
    prev_v = best_v;
    prev_i = best_i;
    const float weight = sigmoid(logit_value(row[best_i]));
    picked_sum += weight;
    if (lane == 0) {
      topk_weights[token * top_k + r] = weight;
      topk_ids[token * top_k + r] = best_i;
    }
  }
  if (lane == 0) {
    const float denom = picked_sum + 1e-20f;
    for (int r = 0; r < top_k; ++r) {
      float& weight = topk_weights[token * top_k + r];
      weight = (renormalize ? weight / denom : weight) * scaling_factor;
    }
  }
}
