"""Launches the router kernels (kernels_cu/route.cu: softmax or sigmoid top-k, one warp per token)."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile
from ._types import Routing

SOURCE = "route.cu"
NAMES = tuple(f"{kernel}<{tag}>" for kernel in ("route_topk", "route_sigmoid") for tag in _checks.CUDA_TYPES.values())
TOKENS_PER_BLOCK = 4


def run(logits, routing: Routing, correction_bias, outputs=None):
    """(weights float32 [T, k], ids int32 [T, k]) for contiguous CuPy logits [T, E] and the
    contiguous float32 ``correction_bias`` [E] or None (arguments pre-checked); written into
    ``outputs`` when given, else new arrays."""
    import cupy

    tokens, experts = logits.shape
    r = routing
    if outputs is None:
        outputs = cupy.empty((tokens, r.top_k), np.float32), cupy.empty((tokens, r.top_k), np.int32)
    weights, ids = outputs
    if tokens == 0:
        return weights, ids
    tag = _checks.CUDA_TYPES[logits.dtype]
    grid, block = (-(-tokens // TOKENS_PER_BLOCK),), (32 * TOKENS_PER_BLOCK,)
    if r.scoring == "softmax":
        kernel = _compile.kernel(SOURCE, f"route_topk<{tag}>", NAMES, logits.device.id)
        kernel(grid, block, (logits, np.int32(tokens), np.int32(experts), np.int32(r.top_k),
                             np.int32(r.renormalize), weights, ids))
    else:
        kernel = _compile.kernel(SOURCE, f"route_sigmoid<{tag}>", NAMES, logits.device.id)
        kernel(grid, block, (logits, correction_bias, np.int32(tokens), np.int32(experts), np.int32(r.top_k),
                             np.int32(r.num_groups), np.int32(r.topk_groups), np.int32(r.renormalize),
                             np.float32(r.scaling_factor), weights, ids))
    return weights, ids
