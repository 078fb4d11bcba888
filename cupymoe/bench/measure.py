"""Timing and the two ceilings of the roofline: streaming-read bandwidth (``stream_read.cu``) and
the bf16 matmul rate (cuBLAS through CuPy), measured in the same run as the cases."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from .._contract import E4M3_MAX, FP8_AMAX_FLOOR, FP8_BLOCK
from ..fp8 import E4M3
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


def fp8_matmul_rate(stream, flush):
    """FP8 (e4m3) matmul rate in FLOP/s through torch._scaled_mm (cuBLASLt), MATMUL_N^3, median of
    MATMUL_REPS on ``stream``; None where torch cannot run it."""
    try:
        import torch

        a = torch.randn(MATMUL_N, MATMUL_N, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(MATMUL_N, MATMUL_N, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
            ms = time_call(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), stream, flush,
                           MATMUL_REPS)
    except Exception as err:  # no torch, no CUDA torch, or no FP8 matmul on this GPU
        print(f"FP8 matmul rate not measured: {type(err).__name__}: {err}", flush=True)
        return None
    return 2 * MATMUL_N**3 / (ms * 1e-3)


class SuiteWeights:
    """The experts a suite runs: the bf16 draw of :func:`expert_weights`, or ("fp8") that draw as
    block-scaled FP8 (:func:`fp8_weights`). ``expert(e)`` gives expert e's real values in float32
    (FP8: dequantized) for the reference; ``layer()`` a fresh cupymoe MoE of them."""

    TOLERANCES = {"bf16": 1e-2, "fp8": 6e-2}  # relative L2 against the reference (FP8: tests/helpers.py's)
    WEIGHT_BYTES = {"bf16": 2, "fp8": 1}

    def __init__(self, model: Model, kind: str):
        self.kind = kind
        self.bf16 = expert_weights(model)
        self.fp8 = fp8_weights(*self.bf16) if kind == "fp8" else None
        self.tolerance = self.TOLERANCES[kind]
        self.weight_bytes = self.WEIGHT_BYTES[kind]
        self._e4m3_values = None  # e4m3 bits -> value, a 256-entry float32 table on the GPU

    def expert(self, e: int):
        import cupy

        if self.fp8 is None:
            return tuple(w[e].astype(cupy.float32) for w in self.bf16)
        q13, s13, q2, s2 = self.fp8
        if self._e4m3_values is None:
            self._e4m3_values = cupy.asarray(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32))
        values = self._e4m3_values
        return tuple(values[q[e]] * cupy.repeat(cupy.repeat(s[e], FP8_BLOCK, 0), FP8_BLOCK, 1)
                     for q, s in ((q13, s13), (q2, s2)))

    def layer(self):
        from .. import MoE

        if self.fp8 is None:
            return MoE(*self.bf16)
        q13, s13, q2, s2 = self.fp8
        return MoE(q13, q2, w13_scale=s13, w2_scale=s2)


def fp8_weights(w13, w2):
    """The bf16 CuPy weights as block-scaled FP8 (cupymoe.fp8, "block"): (q13, s13, q2, s2) with q
    uint8 e4m3 bits, WEIGHT_CHUNK experts at a time on the GPU; sizes in whole 128-blocks."""
    import cupy

    out = []
    for w in (w13, w2):
        e, rows, cols = w.shape
        q = cupy.empty(w.shape, np.uint8)
        scale = cupy.empty((e, rows // FP8_BLOCK, cols // FP8_BLOCK), np.float32)
        for lo in range(0, e, WEIGHT_CHUNK):
            block = w[lo:lo + WEIGHT_CHUNK].astype(cupy.float32)
            n = block.shape[0]
            tiles = block.reshape(n, rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
            amax = cupy.abs(tiles).max(axis=(2, 4))
            scale[lo:lo + n] = cupy.maximum(amax, np.float32(FP8_AMAX_FLOOR)) / np.float32(E4M3_MAX)
            spread = scale[lo:lo + n][:, :, None, :, None]
            q[lo:lo + n] = _e4m3_bits()(tiles / spread).reshape(n, rows, cols)
        out += [q, scale]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _e4m3_bits():
    """float32 -> e4m3 bits (uint8), rounded to nearest even, as ml_dtypes casts."""
    import cupy

    return cupy.ElementwiseKernel(
        "float32 v", "uint8 q",
        'unsigned short r; asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v)); '
        "q = (unsigned char)(r & 0xff);", "cupymoe_bench_e4m3_bits")


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
