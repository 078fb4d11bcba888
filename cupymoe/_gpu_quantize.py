"""Launches the FP8 activation quantization (kernels_cu/quantize.cu) of the FP8 expert GEMMs' inputs:
x before gate/up, h before down; per row and 128 columns, as cupymoe.fp8.quantize_activations."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile
from ._contract import FP8_BLOCK, QUANTIZE_THREADS

SOURCE = "quantize.cu"
NAMES = ("quantize_groups<bf16>", "quantize_groups<f16>")


def run(a, q, scales, row_count=None) -> None:
    """q [R, C] (uint8, e4m3 bits) and scales [R, ceil(C / 128)] (float32) of ``a`` [R, C]
    (bf16/fp16, contiguous); with ``row_count`` (a one-int GPU array) only its first rows."""
    rows, cols = a.shape
    if rows == 0:
        return
    tag = _checks.CUDA_TYPES[a.dtype]
    kernel = _compile.kernel(SOURCE, f"quantize_groups<{tag}>", NAMES, a.device.id)
    warps = rows * -(-cols // FP8_BLOCK)
    blocks = -(-warps * 32 // QUANTIZE_THREADS)
    kernel((blocks,), (QUANTIZE_THREADS,), (a, np.int32(rows), row_count, np.int32(cols), q, scales))
