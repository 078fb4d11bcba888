"""Launches the router kernel (softmax top-k, one warp per token)."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile

SOURCE = "route.cu"
NAMES = ("route_topk<float>", "route_topk<bf16>", "route_topk<f16>")
TOKENS_PER_BLOCK = 4
_TAGS = {_checks.FLOAT32: "float", _checks.BFLOAT16: "bf16", _checks.FLOAT16: "f16"}


def run(logits, top_k: int, renormalize: bool):
    """(weights float32 [T, k], ids int32 [T, k]) for contiguous CuPy logits [T, E]."""
    import cupy

    tokens, experts = logits.shape
    weights = cupy.empty((tokens, top_k), np.float32)
    ids = cupy.empty((tokens, top_k), np.int32)
    if tokens:
        kernel = _compile.kernel(SOURCE, f"route_topk<{_TAGS[logits.dtype]}>", NAMES, logits.device.id)
        kernel((-(-tokens // TOKENS_PER_BLOCK),), (32 * TOKENS_PER_BLOCK,),
               (logits, np.int32(tokens), np.int32(experts), np.int32(top_k), np.int32(renormalize),
                weights, ids))
    return weights, ids
