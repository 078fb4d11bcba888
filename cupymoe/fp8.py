"""FP8 (e4m3) expert weights: their scale layouts, quantization, and the numerics of an FP8 GEMM.

A weight matrix [R, C] of an expert holds ``float8_e4m3fn`` values q and float32 scales s; its real
value is ``q * s`` with s, by the shape of the scale array of all E experts:

========== ==================================== ==============================================
layout     scale shape                          one scale for
========== ==================================== ==============================================
block      [E, ceil(R / 128), ceil(C / 128)]    each 128 x 128 block (DeepSeek-V3, Qwen3-FP8)
channel    [E, R]                               each output row
expert     [E]                                  the whole matrix
========== ==================================== ==============================================

By default (``fp8_compute="w8a8"``) the GEMM quantizes its input too (as DeepGEMM and vLLM's block-FP8 path do): per row and
per group of 128 input columns, ``s_a = max(amax, 1e-10) / 448`` and ``q_a = e4m3(a / s_a)``
(round to nearest even; ``|a / s_a| <= 448`` so nothing saturates). Then, for each group g of
128 columns, the products q_a * q_w are exact in float32 and summed in float32; the group's sum
times ``s_a[g] * s_w[g]`` is added to a float32 accumulator, ``s_w[g]`` the weight scale of the
output row in that group (the row's block's, its channel's or the expert's). The gate/up GEMM
quantizes x; the down GEMM quantizes h, rounded to the activation dtype first as in the
bf16 path (vLLM's order). A NaN or infinity in a group of a row makes that row's outputs NaN.

Weight-only (``fp8_compute="w8a16"``, as vLLM's FP8 Marlin path) keeps the input in its 16-bit
dtype: for each group g of 128 input columns the products a * q_w are summed in float32 and that
sum times ``s_w[g]`` is added to a float32 accumulator; h is rounded to the activation dtype as in
the bf16 path. The GPU reads e4m3's NaN code in a weight as 480 (checkpoints hold none)."""
from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

from ._contract import E4M3_MAX, FP8_AMAX_FLOOR, FP8_BLOCK, SCALE_LAYOUTS

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
COMPUTE_MODES = ("w8a8", "w8a16")  # fp8_compute: the input quantized too, or weight-only
FP8_DTYPES = (E4M3, np.dtype(np.uint8))  # uint8: e4m3 bits (CuPy has no float8 dtype)


class ScaleLayout(enum.Enum):
    """How a weight scale array covers its matrix (see the module docstring); ``index`` is the
    kernels' number for it."""

    BLOCK = "block"
    CHANNEL = "channel"
    EXPERT = "expert"

    @property
    def index(self) -> int:
        return SCALE_LAYOUTS.index(self.value)


def blocks(size: int) -> int:
    """The 128-wide groups (scale blocks) that cover ``size`` rows or columns."""
    return -(-size // FP8_BLOCK)


def scale_shape(layout: ScaleLayout, experts: int, rows: int, cols: int) -> tuple:
    """The shape of the scales of E weight matrices [rows, cols] in ``layout``."""
    if layout is ScaleLayout.BLOCK:
        return (experts, blocks(rows), blocks(cols))
    if layout is ScaleLayout.CHANNEL:
        return (experts, rows)
    return (experts,)


def layout_of(scale_ndim: int) -> ScaleLayout:
    """The layout of a scale array of E matrices, from its rank: 3 block, 2 channel, 1 expert."""
    return {3: ScaleLayout.BLOCK, 2: ScaleLayout.CHANNEL, 1: ScaleLayout.EXPERT}[scale_ndim]


def as_e4m3(q: np.ndarray) -> np.ndarray:
    """``q`` (float8_e4m3fn, or uint8 holding its bits) as float8_e4m3fn, without copying."""
    return q if q.dtype == E4M3 else q.view(E4M3)


def _group_amax(a: np.ndarray, axis: int) -> np.ndarray:
    """The amax of each 128-wide group along ``axis`` (the last group may be narrower), NaN kept."""
    size = a.shape[axis]
    starts = np.arange(0, size, FP8_BLOCK)
    return np.maximum.reduceat(np.abs(a), starts, axis=axis)


def _spread(per_group: np.ndarray, size: int, axis: int) -> np.ndarray:
    """Each group's value repeated over its (up to) 128 positions along ``axis``, cut to ``size``."""
    return np.repeat(per_group, FP8_BLOCK, axis=axis).take(np.arange(size), axis=axis)


def _scale_of(amax) -> np.ndarray:
    return (np.maximum(amax, np.float32(FP8_AMAX_FLOOR)) / np.float32(E4M3_MAX)).astype(np.float32)


def quantize_activations(a) -> tuple:
    """``a`` [n, C] (float32, bfloat16 or float16) quantized per row and per 128 columns:
    (q float8_e4m3fn [n, C], s float32 [n, ceil(C / 128)]) with ``a ~= q * s``."""
    a = np.asarray(a).astype(np.float32)
    scale = _scale_of(_group_amax(a, axis=1))
    q = (a / _spread(scale, a.shape[1], axis=1)).astype(E4M3)
    return q, scale


def quantize_weights(w, layout="block") -> tuple:
    """Expert weights ``w`` [E, R, C] (any float dtype) as (q float8_e4m3fn [E, R, C], scale
    float32) with ``q * scale ~= w``: each scale the amax of what it covers over 448 (at least
    1e-10 / 448). ``layout``: "block", "channel" or "expert"."""
    layout = ScaleLayout(layout)
    w = np.asarray(w).astype(np.float32)
    if w.ndim != 3:
        raise ValueError(f"w: expected a 3-d array [E, R, C], got shape {w.shape}")
    if layout is ScaleLayout.BLOCK:
        scale = _scale_of(_group_amax(_group_amax(w, axis=1), axis=2))
    elif layout is ScaleLayout.CHANNEL:
        scale = _scale_of(np.abs(w).max(axis=2))
    else:
        scale = _scale_of(np.abs(w).max(axis=(1, 2)))
    q = (w / expand_scale(scale, w.shape[1], w.shape[2])).astype(E4M3)
    return q, scale


def expand_scale(scale: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The scales of E matrices [rows, cols] broadcastable against [E, rows, cols]."""
    layout = layout_of(scale.ndim)
    if layout is ScaleLayout.BLOCK:
        return _spread(_spread(scale, rows, axis=1), cols, axis=2)
    if layout is ScaleLayout.CHANNEL:
        return scale[:, :, None]
    return scale[:, None, None]


def dequantize_weights(q, scale) -> np.ndarray:
    """float32 [E, R, C]: the real values of FP8 weights ``q`` with their scales."""
    q = as_e4m3(np.asarray(q))
    return q.astype(np.float32) * expand_scale(np.asarray(scale, np.float32), q.shape[1], q.shape[2])


def matmul(a: np.ndarray, q: np.ndarray, scale, weight_only: bool = False) -> np.ndarray:
    """float32 [n, R]: ``a`` [n, C] (float32) times one expert's FP8 matrix ``q`` [R, C] (e4m3) with
    its ``scale`` (that expert's slice: [ceil(R/128), ceil(C/128)], [R] or a scalar), transposed,
    in the w8a8 numerics of the module docstring, or in its weight-only ones."""
    if weight_only:
        qa, sa = np.asarray(a, np.float32), np.ones((a.shape[0], blocks(a.shape[1])), np.float32)
    else:
        qa, sa = quantize_activations(a)
        qa = qa.astype(np.float32)
    qw = q.astype(np.float32)
    scale = np.asarray(scale, np.float32)
    rows, cols = q.shape
    acc = np.zeros((a.shape[0], rows), np.float32)
    for g in range(blocks(cols)):
        span = slice(g * FP8_BLOCK, min(cols, (g + 1) * FP8_BLOCK))
        acc += (qa[:, span] @ qw[:, span].T) * (sa[:, g, None] * _row_scales(scale, g, rows)[None, :])
    return acc


def _row_scales(scale: np.ndarray, group: int, rows: int) -> np.ndarray:
    """float32 [rows]: the weight scale of each output row in column group ``group``, from one
    expert's scale (block [ceil(R/128), ceil(C/128)], channel [R] or expert, a scalar)."""
    if scale.ndim == 2:
        return _spread(scale[:, group], rows, axis=0)
    return np.broadcast_to(scale, (rows,))
