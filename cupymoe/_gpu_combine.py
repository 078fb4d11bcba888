"""Launches the atomic-free combine (kernels_cu/combine.cu): each token's k expert outputs summed in a fixed order."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile

SOURCE = "combine.cu"
NAMES = ("combine<bf16>", "combine<f16>")
MAX_THREADS = 512


def run(y, slot_positions, topk_weights, out, shape, addend=None) -> None:
    """out[t] = sum_j topk_weights[t, j] * y[slot_positions[t * k + j]] (j ascending, fp32), plus
    addend[t] when given; ``topk_weights`` None weighs every slot 1."""
    tag = _checks.CUDA_TYPES[shape.dtype]
    kernel = _compile.kernel(SOURCE, f"combine<{tag}>", NAMES, out.device.id)
    threads = min(MAX_THREADS, shape.hidden // 8)
    kernel((shape.tokens,), (threads,),
           (y, slot_positions, topk_weights, np.int32(shape.top_k), np.int32(shape.hidden), addend, out))
