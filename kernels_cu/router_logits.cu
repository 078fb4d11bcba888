// Router logits: out[t, n] = sum_h x[t, h] * w[n, h] in fp32, plus bias[n]; then, if asked,
// rounded to X's precision (a 16-bit nn.Linear's output) and/or passed through a sigmoid (the
// shared expert's gate). The MoE block's router GEMM (n < E) and its shared gate (n < 1).
//
// One summation order for every T and every tile shape, so a token's logits do not depend on the
// batch: lane l of a warp owns h = 128 j + 4 l + {0, 1, 2, 3}, j = 0, 1, ..., and sums them in that
// order with one fma each; the 32 lane sums are then added by a butterfly over lane distances
// 16, 8, 4, 2, 1. A tile shape only changes how many (t, n) a warp carries at once.
#include "common.cuh"

constexpr int ROUTER_LANE_ELEMENTS = 4;                           // consecutive h per lane per step
constexpr int ROUTER_WARP_STEP = 32 * ROUTER_LANE_ELEMENTS;       // h per warp per step

template <class T> struct Operand;  // four consecutive elements: loaded raw, used as float
template <> struct Operand<float> {
  using Raw = float4;
  static __device__ __forceinline__ Raw load(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
  static __device__ __forceinline__ float4 widen(Raw v) { return v; }
};
template <class T> struct Operand16 {
  using Raw = uint2;
  static __device__ __forceinline__ Raw load(const T* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
  static __device__ __forceinline__ float4 widen(Raw v) {
    return make_float4(Float16Traits<T>::to_float(u16(v.x)), Float16Traits<T>::to_float(u16(v.x >> 16)),
                       Float16Traits<T>::to_float(u16(v.y)), Float16Traits<T>::to_float(u16(v.y >> 16)));
  }
};
template <> struct Operand<bf16> : Operand16<bf16> {};
template <> struct Operand<f16> : Operand16<f16> {};

__device__ __forceinline__ float fma4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// A lane's operands for STEPS consecutive steps from h on: loaded together (the bytes in flight
// that a thin tile needs to stream w), then summed in the order of the sum.
template <class X, class W, int TILE_T, int TILE_N, int STEPS>
struct LaneSteps {
  typename Operand<X>::Raw xv[STEPS][TILE_T];
  typename Operand<W>::Raw wv[STEPS][TILE_N];

  __device__ __forceinline__ void load(const X* const (&x_rows)[TILE_T], const W* const (&w_rows)[TILE_N], int h) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
#pragma unroll
      for (int i = 0; i < TILE_T; ++i) xv[s][i] = Operand<X>::load(x_rows[i] + h + s * ROUTER_WARP_STEP);
#pragma unroll
      for (int j = 0; j < TILE_N; ++j) wv[s][j] = Operand<W>::load(w_rows[j] + h + s * ROUTER_WARP_STEP);
    }
  }

  __device__ __forceinline__ void accumulate(float (&acc)[TILE_T][TILE_N]) const {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      float4 xf[TILE_T];
#pragma unroll
      for (int i = 0; i < TILE_T; ++i) xf[i] = Operand<X>::widen(xv[s][i]);
#pragma unroll
      for (int j = 0; j < TILE_N; ++j) {
        const float4 wf = Operand<W>::widen(wv[s][j]);
#pragma unroll
        for (int i = 0; i < TILE_T; ++i) acc[i][j] = fma4(xf[i], wf, acc[i][j]);
      }
    }
  }
};

// A block of WARPS_T x WARPS_N warps covers (WARPS_T * TILE_T) tokens x (WARPS_N * TILE_N)
// outputs; each warp TILE_T x TILE_N of them. X: bf16 or f16 (x is [tokens, hidden]); W: X's
// type or float (w is [outputs, hidden]); hidden is a multiple of 4.
template <class X, class W, int TILE_T, int TILE_N, int WARPS_T, int WARPS_N>
__global__ void __launch_bounds__(32 * WARPS_T * WARPS_N)
router_logits(const X* __restrict__ x, const W* __restrict__ w, const float* __restrict__ bias, int tokens,
              int outputs, int hidden, int round, int apply_sigmoid, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int column_blocks = (outputs + WARPS_N * TILE_N - 1) / (WARPS_N * TILE_N);
  // Blocks along the outputs first: those running together read the same x rows, from L2.
  const int t0 = (blockIdx.x / column_blocks * WARPS_T + warp / WARPS_N) * TILE_T;
  const int n0 = (blockIdx.x % column_blocks * WARPS_N + warp % WARPS_N) * TILE_N;
  if (t0 >= tokens || n0 >= outputs) return;
  constexpr int UNROLL = TILE_T * TILE_N >= 16 ? 1 : 8 / (TILE_T * TILE_N);  // steps whose loads fly at once
  const X* x_rows[TILE_T];
  const W* w_rows[TILE_N];
#pragma unroll
  for (int i = 0; i < TILE_T; ++i) x_rows[i] = x + (long long)min(t0 + i, tokens - 1) * hidden;  // rows past the end: repeats, never stored
#pragma unroll
  for (int j = 0; j < TILE_N; ++j) w_rows[j] = w + (long long)min(n0 + j, outputs - 1) * hidden;
  float acc[TILE_T][TILE_N] = {};
  constexpr int BATCH = UNROLL * ROUTER_WARP_STEP;  // h per batch of steps
  int h = lane * ROUTER_LANE_ELEMENTS;
  if (h + BATCH - ROUTER_WARP_STEP < hidden) {  // whole batches, the next one's loads in flight while this one sums
    LaneSteps<X, W, TILE_T, TILE_N, UNROLL> batch, next;
    batch.load(x_rows, w_rows, h);
    for (;;) {
      const bool more = h + 2 * BATCH - ROUTER_WARP_STEP < hidden;
      if (more) next.load(x_rows, w_rows, h + BATCH);
      batch.accumulate(acc);
      h += BATCH;
      if (!more) break;
      batch = next;
    }
  }
  for (; h < hidden; h += ROUTER_WARP_STEP) {
    LaneSteps<X, W, TILE_T, TILE_N, 1> step;
    step.load(x_rows, w_rows, h);
    step.accumulate(acc);
  }
#pragma unroll
  for (int i = 0; i < TILE_T; ++i)
#pragma unroll
    for (int j = 0; j < TILE_N; ++j) {
      float v = acc[i][j];
      for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
      const int t = t0 + i, n = n0 + j;
      if (lane == 0 && t < tokens && n < outputs) {
        if (bias != nullptr) v += bias[n];
        if (round) v = Float16Traits<X>::to_float(u16(Float16Traits<X>::pack(v, 0.0f) & 0xffffu));
        if (apply_sigmoid) v = sigmoid(v);
        out[(long long)t * outputs + n] = v;
      }
    }
}
