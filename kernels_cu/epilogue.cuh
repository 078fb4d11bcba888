// What an expert GEMM's epilogue adds to its accumulators before it rounds and stores them: the
// routing weight of a slot (gate/up, EPILOGUE_INPUT_WEIGHT), a bias per expert and output column
// (EPILOGUE_BIAS), and for gate/up the activation of (gate, up). All in fp32, in that order, as
// cupymoe/reference.py's expert_outputs.
#pragma once
#include "common.cuh"

// Passed by value to every expert GEMM (cupymoe/_gpu_experts.py's EPILOGUE_ARGS); unused fields null.
struct EpilogueArgs {
  const u16* bias;            // gate/up: [E, 2 * n_out] (gate columns, then up); down: [E, n_out]
  const float* slot_weights;  // [T * k], the routing weight of each slot
};

// h = act(gate, up). NaN passes through every activation (swigluoai's clamps too).
template <int ACT>
__device__ __forceinline__ float activate(float gate, float up) {
  if constexpr (ACT == ACT_SILU) {
    return silu(gate) * up;
  } else if constexpr (ACT == ACT_GELU) {
    return gate * normcdff(gate) * up;  // gelu(gate) = gate * Phi(gate), Phi the normal CDF (erf-based)
  } else if constexpr (ACT == ACT_GELU_TANH) {
    return 0.5f * gate * (1.0f + tanhf(0.79788456080286536f * (gate + 0.044715f * gate * gate * gate))) * up;
  } else {
    static_assert(ACT == ACT_SWIGLUOAI, "an activation of cupymoe/_contract.py");
    gate = gate > SWIGLUOAI_LIMIT ? SWIGLUOAI_LIMIT : gate;
    up = up > SWIGLUOAI_LIMIT ? SWIGLUOAI_LIMIT : up < -SWIGLUOAI_LIMIT ? -SWIGLUOAI_LIMIT : up;
    return gate * reciprocal_approx(1.0f + __expf(-SWIGLUOAI_ALPHA * gate)) * (up + 1.0f);
  }
}

// The bias of output columns col and col + 1 (col even) of expert e, from a row of `width`.
template <class T>
__device__ __forceinline__ float2 bias_pair(const u16* bias, int expert, int width, int col) {
  const u32 bits = *reinterpret_cast<const u32*>(bias + (long long)expert * width + col);
  return make_float2(Float16Traits<T>::to_float(u16(bits & 0xffffu)), Float16Traits<T>::to_float(u16(bits >> 16)));
}

// The bias of one output column.
template <class T>
__device__ __forceinline__ float bias_one(const u16* bias, int expert, int width, int col) {
  return Float16Traits<T>::to_float(bias[(long long)expert * width + col]);
}
