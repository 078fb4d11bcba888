"""How fast an H200 streams the expert weights by TMA in the persistent GEMM's pattern: 132 blocks,
each taking 256-row tiles of w13 (128 gate rows and 128 up rows) or w2 (256 rows) stage by stage
(benchmarks/tma_read.cu), L2 flushed, for each stage layout, depth and L2 promotion of the tensor
map. docs/notes-archive.md (v22) has the results.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # run from a checkout without installing

from cupymoe import _compile, _tma  # noqa: E402
from cupymoe.bench import measure  # noqa: E402

VARIANTS = [(0, 4), (0, 5), (1, 2), (1, 3), (2, 4), (2, 5), (3, 4), (3, 5)]  # (MODE, STAGES)
PROMOTIONS = {"none": 0, "128B": 2, "256B": 3}  # CUtensorMapL2promotion enumerators
E, H, I = 256, 4096, 1024
SHARED = 200 * 1024  # every variant's stages fit; one block per SM
REPS = 10


def main() -> int:
    import cupy

    names = [f"tma_read<{m},{s}>" for m, s in VARIANTS]
    here = Path(__file__).resolve().parent
    module = cupy.RawModule(code=(here / "tma_read.cu").read_text(), name_expressions=names,
                            options=(*_compile.BASE_OPTIONS, "-arch=sm_90a", f"-I{_compile.kernel_dir()}"))
    rng = cupy.random.default_rng(0)
    w13 = rng.integers(0, 2**15, size=(E, 2 * I, H), dtype=cupy.int16)
    w2 = rng.integers(0, 2**15, size=(E, H, I), dtype=cupy.int16)
    sink = cupy.zeros(1, cupy.uint64)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        flush = cupy.empty(measure.FLUSH_BYTES // 4, cupy.int32)
        print(f"linear read: {measure.read_bandwidth(stream, flush, 0) / 1e12:.2f} TB/s")
        # (name, weights, tiles, K-chunks, tiles per expert, rows per expert, tile step, second half's offset)
        gemms = [("gate/up", w13, E * 8, H // 64, 8, 2 * I, 128, I), ("down", w2, E * 16, I // 64, 16, H, 256, 128)]
        for gemm, w, *shape in gemms:
            for promotion, value in PROMOTIONS.items():
                tensor_map = _tma._rows_map(w.data.ptr, w.size // w.shape[-1], w.shape[-1], value)
                for (mode, stages), name in zip(VARIANTS, names):
                    kernel = module.get_function(name)
                    kernel.max_dynamic_shared_size_bytes = SHARED

                    def run():
                        kernel((sms,), (64,), (tensor_map, *map(np.int32, shape), sink), shared_mem=SHARED)

                    ms = measure.time_call(run, stream, flush, REPS)
                    print(f"{gemm:7s} promotion {promotion:4s} mode {mode} stages {stages}: "
                          f"{w.nbytes / ms / 1e9:.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
