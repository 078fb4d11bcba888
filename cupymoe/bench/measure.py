"""Timing and the two ceilings of the roofline: streaming-read bandwidth (``stream_read.cu``) and
the bf16 matmul rate (cuBLAS through CuPy), measured in the same run as the cases."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from .cases import BF16, Model

WARMUP = 3  # untimed reps before every timing
FLUSH_BYTES = 256 << 20  # written before every rep to evict the L2 cache
READ_BYTES = 4 << 30  # buffer of the streaming-read probe
READ_BLOCK = 512  # threads per block of the probe
READ_BLOCKS_PER_SM = (4, 8, 16)  # grid sizes tried; the best one counts
READ_REPS = 20
MATMUL_N = 8192  # the matmul probe is N x N x N in bf16
MATMUL_REPS = 10
WEIGHT_CHUNK = 16  # experts drawn at once: bounds the float32 scratch to 512 MiB
STREAM_READ = Path(__file__).with_name("stream_read.cu")


def time_call(run, stream, flush, reps) -> float:
    """Median ms of ``run()`` over ``reps`` reps after WARMUP untimed ones.

    Each rep writes ``flush`` (evicting L2), synchronises the device, then records CUDA
    events on ``stream`` around one ``run()``. ``stream`` is CuPy's current stream meanwhile;
    work that ``run`` sends elsewhere (a torch stream) must go to the same CUDA stream.
    """
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    with stream:
        for rep in range(WARMUP + reps):
            flush.fill(rep)
            cupy.cuda.runtime.deviceSynchronize()
            start.record(stream)
            run()
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times[WARMUP:]))


def streaming_reads(device_id) -> dict:
    """For each grid size of READ_BLOCKS_PER_SM (blocks per SM), a callable that enqueues one
    streaming read of a READ_BYTES buffer."""
    import cupy

    with cupy.cuda.Device(device_id):
        kernel = cupy.RawModule(code=STREAM_READ.read_text()).get_function("stream_read")
    src = cupy.random.default_rng(1).random(READ_BYTES // 4, dtype=cupy.float32)
    sink = cupy.zeros(1, cupy.uint64)
    sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    args = (src, np.uint64(READ_BYTES // 16), sink)
    return {per_sm: functools.partial(kernel, (sms * per_sm,), (READ_BLOCK,), args) for per_sm in READ_BLOCKS_PER_SM}


def read_bandwidth(stream, flush, device_id) -> float:
    """Streaming-read bandwidth in bytes/s: the best grid size, median of READ_REPS reads of 4 GiB."""
    reads = streaming_reads(device_id).values()
    best_ms = min(time_call(read, stream, flush, READ_REPS) for read in reads)
    return READ_BYTES / (best_ms * 1e-3)


def matmul_rate(stream, flush) -> float:
    """bf16 matmul rate in FLOP/s: MATMUL_N^3 through cupy.matmul (cuBLAS), median of MATMUL_REPS."""
    import cupy

    rng = cupy.random.default_rng(2)
    a, b = (rng.standard_normal((MATMUL_N, MATMUL_N), dtype=cupy.float32).astype(BF16) for _ in range(2))
    ms = time_call(lambda: cupy.matmul(a, b), stream, flush, MATMUL_REPS)
    return 2 * MATMUL_N**3 / (ms * 1e-3)


def expert_weights(model: Model, seed: int = 0):
    """w13 ~ N(0,1)/sqrt(H) [E, 2I, H] and w2 ~ N(0,1)/sqrt(I) [E, H, I], bf16 CuPy arrays.

    Drawn with ``cupy.random.default_rng(seed)`` in float32, WEIGHT_CHUNK experts at a time.
    """
    import cupy

    rng = cupy.random.default_rng(seed)
    e, h, i = model.experts, model.hidden, model.intermediate
    w13 = cupy.empty((e, 2 * i, h), BF16)
    w2 = cupy.empty((e, h, i), BF16)
    for w, fan_in in ((w13, h), (w2, i)):
        for lo in range(0, e, WEIGHT_CHUNK):
            block = rng.standard_normal((min(WEIGHT_CHUNK, e - lo),) + w.shape[1:], dtype=cupy.float32)
            block *= np.float32(1 / np.sqrt(fan_in))
            w[lo:lo + block.shape[0]] = block.astype(BF16)
    return w13, w2
