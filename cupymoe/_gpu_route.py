"""Launches the router kernels (kernels_cu/route.cu: softmax or sigmoid top-k, one warp per token)."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile
from ._types import Routing

SOURCE = "route.cu"
_TAGS = {_checks.FLOAT32: "float", _checks.BFLOAT16: "bf16", _checks.FLOAT16: "f16"}
NAMES = tuple(f"{kernel}<{tag}>" for kernel in ("route_topk", "route_sigmoid") for tag in _TAGS.values()) + tuple(
    f"{kernel}<{tag}>" for kernel in ("widen", "finish_logits") for tag in ("bf16", "f16")) + ("sigmoid_in_place",)
TOKENS_PER_BLOCK = 4
ELEMENTWISE_THREADS = 256
ELEMENTWISE_BLOCKS = 1024  # grid-stride loops: a few waves of blocks, whatever the size


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
    tag = _TAGS[logits.dtype]
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


def _elementwise(name: str, n: int, args: tuple, device_id: int) -> None:
    if n:
        kernel = _compile.kernel(SOURCE, name, NAMES, device_id)
        kernel((min(ELEMENTWISE_BLOCKS, -(-n // ELEMENTWISE_THREADS)),), (ELEMENTWISE_THREADS,), args)


def widen(x, out) -> None:
    """out (float32, contiguous) = x (bfloat16 or float16, contiguous, same shape), exactly."""
    tag = "bf16" if x.dtype == _checks.BFLOAT16 else "f16"
    _elementwise(f"widen<{tag}>", x.size, (x, out, np.int64(x.size)), x.device.id)


def finish_logits(logits, bias, round_to) -> None:
    """logits [T, E] float32 += bias [E] (or None), then rounded to ``round_to`` (a 16-bit dtype) or not (None)."""
    tag = "bf16" if round_to in (None, _checks.BFLOAT16) else "f16"
    _elementwise(f"finish_logits<{tag}>", logits.size,
                 (logits, bias, np.int64(logits.size), np.int32(logits.shape[1]), np.int32(round_to is not None)),
                 logits.device.id)


def sigmoid_in_place(v) -> None:
    """v (float32, contiguous) = sigmoid(v)."""
    _elementwise("sigmoid_in_place", v.size, (v, np.int64(v.size)), v.device.id)
