// How fast the GPU streams the expert weights in the GEMMs' access pattern (benchmarks/tiled_read.py).
// Each block of 128 threads reads ROWS rows of a [rows, row_bytes] array, CHUNK bytes of every row
// per stage, through a STAGES-deep cp.async pipeline into shared memory, and folds one word per
// thread per stage so that nothing is optimised away. Block b reads row tile b % tiles: with few
// tiles the rows stay in L2.
typedef unsigned int u32;

template <int ROWS, int CHUNK, int STAGES>
__global__ void __launch_bounds__(128)
tiled_read(const char* __restrict__ src, long long row_bytes, int tiles, unsigned long long* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int STAGE = ROWS * CHUNK, PIECES = STAGE / 16 / 128, PIECES_PER_ROW = CHUNK / 16;
  const char* rows = src + (long long)(blockIdx.x % tiles) * ROWS * row_bytes;
  const u32 base = (u32)__cvta_generic_to_shared(smem);
  const int steps = row_bytes / CHUNK;
  const auto load = [&](int step) {
    const u32 dst = base + (step % STAGES) * STAGE;
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
      const int piece = threadIdx.x + i * 128, row = piece / PIECES_PER_ROW, column = piece % PIECES_PER_ROW;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + piece * 16),
                   "l"(rows + row * row_bytes + (long long)step * CHUNK + column * 16));
    }
  };
#pragma unroll
  for (int step = 0; step < STAGES - 1; ++step) {
    if (step < steps) load(step);
    asm volatile("cp.async.commit_group;");
  }
  u32 fold = 0;
  for (int step = 0; step < steps; ++step) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
    __syncthreads();
    if (step + STAGES - 1 < steps) load(step + STAGES - 1);
    asm volatile("cp.async.commit_group;");
    fold ^= reinterpret_cast<const u32*>(smem + (step % STAGES) * STAGE)[threadIdx.x];
  }
  if (fold == 0x9E3779B9u) *sink = fold;  // random data practically never gives this
}
