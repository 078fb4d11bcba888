"""NumPy implementation of every stage: the reference for the kernels and the CPU backend.

It follows the kernels' numerics: float32 accumulation; biases, the routing weight on the input and
the activation applied in float32; the intermediate ``h`` and each expert's output rounded to the
activation dtype; the combine summed in float32 over j = 0..k-1 in order. FP8 weights follow
:mod:`cupymoe.fp8` (w8a8: their GEMMs quantize their input, x and h after its rounding; w8a16: not).
"""
from __future__ import annotations

import math

import numpy as np

from . import fp8
from ._contract import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from ._types import ExpertOptions, WeightScales


def valid_ids(topk_ids: np.ndarray, experts: int) -> np.ndarray:
    """The ids with everything outside [0, experts) replaced by -1, as int64."""
    ids = topk_ids.astype(np.int64)
    return np.where((ids >= 0) & (ids < experts), ids, -1)


def dispatch_arrays(topk_ids: np.ndarray, experts: int):
    """Return (counts, offsets, sorted_slots, slot_positions) as int32 arrays.

    Slot s = t * k + j. ``sorted_slots`` lists the valid slots grouped by expert, ascending
    inside each expert, then -1 up to T * k entries; ``slot_positions`` is its inverse,
    -1 for slots whose id is outside [0, experts).
    """
    ids = valid_ids(topk_ids, experts).reshape(-1)
    valid = ids >= 0
    counts = np.bincount(ids[valid], minlength=experts).astype(np.int32)
    offsets = np.zeros(experts + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    order = np.argsort(np.where(valid, ids, experts), kind="stable")
    used = int(offsets[-1])
    sorted_slots = np.full(ids.size, -1, np.int32)
    sorted_slots[:used] = order[:used]
    slot_positions = np.full(ids.size, -1, np.int32)
    slot_positions[order[:used]] = np.arange(used, dtype=np.int32)
    return counts, offsets, sorted_slots, slot_positions


def silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _erf(v: np.ndarray) -> np.ndarray:
    """erf, element by element through math.erf (NumPy has none)."""
    return np.vectorize(math.erf, otypes=[np.float64])(v)


def activate(activation: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """h from the gate and up projections (float32 in, float32 out), as the kernels compute it."""
    gate = gate.astype(np.float32)
    up = up.astype(np.float32)
    if activation == "silu":
        return silu(gate) * up
    if activation == "gelu":
        return (0.5 * gate * (1.0 + _erf(gate / np.sqrt(2.0)))).astype(np.float32) * up
    if activation == "gelu_tanh":
        inner = np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)
        return (0.5 * gate * (1.0 + np.tanh(inner))).astype(np.float32) * up
    if activation == "swigluoai":
        gate = np.minimum(gate, np.float32(SWIGLUOAI_LIMIT))
        up = np.clip(up, np.float32(-SWIGLUOAI_LIMIT), np.float32(SWIGLUOAI_LIMIT))
        return gate / (1.0 + np.exp(-np.float32(SWIGLUOAI_ALPHA) * gate)) * (up + 1.0)
    raise ValueError(f"activation: unknown {activation!r}")


def _projection(a: np.ndarray, w: np.ndarray, scale, expert: int, weight_only: bool = False) -> np.ndarray:
    """float32 ``a @ w[expert].T`` for float32 ``a``: plain, or in FP8 numerics with ``scale``
    (that weight's scale array of all experts; ``weight_only``: w8a16)."""
    if scale is None:
        return a @ w[expert].astype(np.float32).T
    return fp8.matmul(a, fp8.as_e4m3(w[expert]), scale[expert], weight_only)


def expert_outputs(x, w13, w2, top_k, offsets, sorted_slots, options: ExpertOptions = ExpertOptions(),
                   slot_weights=None, scales: WeightScales | None = None) -> np.ndarray:
    """The expert GEMMs: y [T * k, H] in the dispatch's order, row p = w2[e] @ h[p] (+ w2_bias[e])
    with h[p] = act(g, u), g and u the gate and up rows of w13[e] times x[t] (times the slot's
    routing weight with ``options.weight_on_input``), plus w13_bias[e]; for sorted slot p = (t, j)
    of expert e. h and y are rounded to x's dtype. ``slot_weights``
    [T * k] float32: the routing weights by slot, needed with weight_on_input. ``scales``: those of
    FP8 weights. Rows past the valid slots are left unwritten."""
    experts, two_i, _ = w13.shape
    inter = two_i // 2
    y = np.empty((sorted_slots.size, x.shape[1]), x.dtype)
    weight_only = scales is not None and scales.weight_only
    for e in range(experts):
        slots = sorted_slots[offsets[e]:offsets[e + 1]]
        if slots.size == 0:
            continue
        xs = x[slots // top_k].astype(np.float32)
        gate_up = _projection(xs, w13, None if scales is None else scales.w13, e, weight_only)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if options.weight_on_input:
            scale = slot_weights[slots][:, None]
            gate, up = gate * scale, up * scale
        if options.w13_bias is not None:
            bias = options.w13_bias[e].astype(np.float32)
            gate, up = gate + bias[:inter], up + bias[inter:]
        h = activate(options.activation, gate, up).astype(x.dtype).astype(np.float32)
        out = _projection(h, w2, None if scales is None else scales.w2, e, weight_only)
        if options.w2_bias is not None:
            out += options.w2_bias[e].astype(np.float32)
        y[offsets[e]:offsets[e + 1]] = out.astype(x.dtype)
    return y


def combine(y, slot_positions, topk_weights, out, addend=None) -> np.ndarray:
    """out[t] = sum_j topk_weights[t, j] * y[slot_positions[t * k + j]] in float32, j ascending,
    skipping slots at position -1, then + addend[t] (a [T, H] array, e.g. a shared expert's
    output); ``topk_weights`` None weighs every slot 1. Rounded into ``out`` [T, H] and returned."""
    tokens = out.shape[0]
    top_k = slot_positions.size // max(tokens, 1)
    acc = np.zeros((tokens, y.shape[1]), np.float32)
    positions = slot_positions.reshape(tokens, top_k)
    for j in range(top_k):
        pos = positions[:, j]
        hit = pos >= 0
        weight = np.float32(1) if topk_weights is None else topk_weights[hit, j, None]
        acc[hit] += weight * y[pos[hit]].astype(np.float32)
    if addend is not None:
        acc += addend.astype(np.float32)
    out[...] = acc.astype(out.dtype)
    return out


def fused_experts(x, w13, w2, topk_ids, topk_weights, out, options: ExpertOptions = ExpertOptions(),
                  scales: WeightScales | None = None, addend=None) -> np.ndarray:
    """The layer, stage by stage: dispatch, expert GEMMs, combine; into ``out`` [T, H] (arguments
    pre-checked; ``scales`` those of FP8 weights). With ``options.weight_on_input`` the routing
    weights scale the experts' inputs and the combine sums the outputs unweighted."""
    _, offsets, sorted_slots, slot_positions = dispatch_arrays(topk_ids, w13.shape[0])
    y = expert_outputs(x, w13, w2, topk_ids.shape[1], offsets, sorted_slots, options, topk_weights.reshape(-1),
                       scales)
    return combine(y, slot_positions, None if options.weight_on_input else topk_weights, out, addend)


def _top_k(ranked: np.ndarray, top_k: int) -> np.ndarray:
    """The indices of each row's k largest values, ties to the lower index (int32)."""
    return np.argsort(-ranked, axis=1, kind="stable")[:, :top_k].astype(np.int32)


def route(router_logits: np.ndarray, top_k: int, renormalize: bool = True):
    """Softmax top-k: (weights float32 [T, k], ids int32 [T, k]); ties go to the lower id, NaN
    logits rank lowest. Weights are the softmax over all E, renormalised over the k when asked."""
    logits = router_logits.astype(np.float32)
    logits = np.where(np.isnan(logits), -np.inf, logits)
    ids = _top_k(logits, top_k)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    weights = np.take_along_axis(probs, ids.astype(np.int64), axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return weights.astype(np.float32), ids


def route_sigmoid(router_logits: np.ndarray, top_k: int, renormalize: bool, num_groups: int, topk_groups: int,
                  correction_bias, scaling_factor: float):
    """Sigmoid top-k (DeepSeek-V3, GLM-4.5, Llama-4): experts are chosen on sigmoid(logit) +
    correction_bias, within the topk_groups groups of the highest sums of their two best biased
    scores when num_groups > 1, and weighted by the unbiased scores, renormalised to sum to 1
    (plus 1e-20) when asked, then times scaling_factor. All in float32; ties to the lower id (and
    group); NaN ranks lowest."""
    logits = router_logits.astype(np.float32)
    scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    biased = scores if correction_bias is None else scores + correction_bias.astype(np.float32)
    ranked = np.where(np.isnan(biased), -np.inf, biased).astype(np.float32)
    tokens, experts = ranked.shape
    if num_groups > 1:
        grouped = ranked.reshape(tokens, num_groups, experts // num_groups)
        best_two = -np.sort(-grouped, axis=2)[:, :, :2]
        group_scores = (best_two[:, :, 0] + best_two[:, :, 1]).astype(np.float32)
        kept = _top_k(np.where(np.isnan(group_scores), -np.inf, group_scores), topk_groups)
        eligible = np.zeros((tokens, num_groups), bool)
        np.put_along_axis(eligible, kept.astype(np.int64), True, axis=1)
        ranked = np.where(np.repeat(eligible, experts // num_groups, axis=1), ranked, -np.inf)
    ids = _top_k(ranked, top_k)
    weights = np.take_along_axis(scores, ids.astype(np.int64), axis=1)
    if renormalize:
        weights = weights / (weights.sum(axis=1, keepdims=True) + np.float32(1e-20))
    return (weights * np.float32(scaling_factor)).astype(np.float32), ids
