"""The router GEMM's time per tile (kernels_cu/router_logits.cu) at E = 256, H = 7168 (DeepSeek-V3)
for several T, with bf16 and float32 router weights, each a CUDA graph of one launch (L2 flushed,
median of --reps), beside CuPy's float32 matmul (cuBLAS, eager) on the widened x as a yardstick.
Marks the tile that tile_for picks. --out writes JSON.

    python benchmarks/router_tiles.py [--reps 20] [--out router.json]
"""
import argparse
import json
from pathlib import Path

import cupy
import numpy as np

from cupymoe import _checks, _gpu_router_logits
from cupymoe.bench.measure import FLUSH_BYTES, time_call

TOKENS = (1, 4, 16, 64, 256, 1024, 8192)


def graph_of(launch, stream):
    launch()  # compiles and warms outside the capture
    stream.begin_capture()
    launch()
    return stream.end_capture()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    hidden, experts = 7168, 256
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        flush = cupy.empty(FLUSH_BYTES // 4, cupy.int32)
        rng = cupy.random.default_rng(0)
        w32 = rng.standard_normal((experts, hidden), dtype=cupy.float32) / hidden**0.5
        weights = {"bf16": w32.astype(_checks.BFLOAT16), "float32": w32}
        names = [f"{t.tile_t}x{t.tile_n}/{t.warps_t}x{t.warps_n}" for t in _gpu_router_logits.TILES]
        print("| w | T | " + " | ".join(f"{n} ms" for n in names) + " | cuBLAS fp32 ms |")
        print("|---|---|" + "---|" * (len(names) + 1))
        for w_name, w in weights.items():
            w32_t = cupy.ascontiguousarray(w.astype(cupy.float32).T)
            for tokens in TOKENS:
                x = rng.standard_normal((tokens, hidden), dtype=cupy.float32).astype(_checks.BFLOAT16)
                out = cupy.empty((tokens, experts), cupy.float32)
                row = {"w": w_name, "tokens": tokens, "tiles_ms": {}}
                for name, tile in zip(names, _gpu_router_logits.TILES):
                    g = graph_of(lambda: _gpu_router_logits.run(x, w, None, out, tile=tile), stream)
                    row["tiles_ms"][name] = time_call(lambda: g.launch(stream), stream, flush, args.reps)
                x32 = x.astype(cupy.float32)
                row["cublas_ms"] = time_call(lambda: cupy.matmul(x32, w32_t, out=out), stream, flush, args.reps)
                chosen = _gpu_router_logits.tile_for(tokens, experts)
                row["chosen"] = names[_gpu_router_logits.TILES.index(chosen)]
                rows.append(row)
                cells = [f"**{row['tiles_ms'][n]:.4f}**" if n == row["chosen"] else f"{row['tiles_ms'][n]:.4f}"
                         for n in names]
                print(f"| {w_name} | {tokens} | " + " | ".join(cells) + f" | {row['cublas_ms']:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
