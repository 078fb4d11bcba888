"""How fast an H200 streams rows in the expert GEMMs' pattern: blocks reading ROWS rows CHUNK bytes
at a time through a cp.async pipeline (benchmarks/tiled_read.cu), from DRAM (an [E*2I, H] bf16
array, L2 flushed) and from L2 (a 24 MiB region read over and over). docs/notes-archive.md (v12) has the results.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # run from a checkout without installing

from cupymoe.bench import measure  # noqa: E402

# (rows per block, bytes per row per stage, stages)
SHAPES = [(16, 128, 8), (16, 256, 6), (64, 128, 6), (64, 256, 4), (64, 512, 3), (128, 128, 6),
          (128, 256, 3), (128, 256, 4), (128, 512, 3), (256, 128, 4), (256, 256, 3)]
ROW_BYTES = 8192  # H = 4096 bf16
ROWS = 256 * 2048  # w13 of E = 256, I = 1024: 4.3 GB
L2_ROWS = 3072  # 24 MiB


def main() -> int:
    import cupy

    names = [f"tiled_read<{r},{c},{s}>" for r, c, s in SHAPES]
    code = (Path(__file__).resolve().parent / "tiled_read.cu").read_text()
    module = cupy.RawModule(code=code, options=("-std=c++17",), name_expressions=names)
    src = cupy.random.default_rng(0).integers(0, 2**31, size=ROWS * ROW_BYTES // 4, dtype=cupy.int32)
    sink = cupy.zeros(1, cupy.uint64)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        flush = cupy.empty(measure.FLUSH_BYTES // 4, cupy.int32)
        print(f"linear read: {measure.read_bandwidth(stream, flush, 0) / 1e12:.2f} TB/s")
        for (rows, chunk, stages), name in zip(SHAPES, names):
            kernel = module.get_function(name)
            smem = rows * chunk * stages
            kernel.max_dynamic_shared_size_bytes = smem
            blocks = ROWS // rows

            def run(tiles):
                kernel((blocks,), (128,), (src, np.int64(ROW_BYTES), np.int32(tiles), sink), shared_mem=smem)

            dram_ms = measure.time_call(lambda: run(blocks), stream, flush, 10)
            run(L2_ROWS // rows)  # warm L2
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(5):
                run(L2_ROWS // rows)
            end.record(stream)
            end.synchronize()
            l2_ms = cupy.cuda.get_elapsed_time(start, end) / 5
            gb = blocks * rows * ROW_BYTES / 1e9
            print(f"{rows:3d} rows x {chunk:3d} bytes, {stages} stages: DRAM {gb / dram_ms:.2f} TB/s, "
                  f"L2 {gb / l2_ms:.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
