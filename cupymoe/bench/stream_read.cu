// Streaming-read bandwidth probe: the memory ceiling of the benchmark roofline (measure.py beside it).
//
// Grid-stride loop, 16 bytes per thread per load, kUnroll independent loads in flight per thread.
// The loaded words are XOR-folded and the result is stored only when it equals kMagic, which
// random data practically never gives, so the loads cannot be optimised away and nothing is
// written in a normal run.

constexpr int kUnroll = 4;
constexpr unsigned int kMagic = 0x9E3779B9u;

__device__ __forceinline__ unsigned int fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

extern "C" __global__ void stream_read(const uint4* __restrict__ src, size_t n_vec,
                                       unsigned long long* sink) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned int acc = 0;
  for (; i + (kUnroll - 1) * stride < n_vec; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= fold(v[u]);
  }
  for (; i < n_vec; i += stride) acc ^= fold(src[i]);
  if (acc == kMagic) *sink = acc;
}
