"""NumPy implementation of every stage: the reference for the kernels and the CPU backend.

It follows the kernels' numerics: float32 accumulation, the intermediate ``h`` and each
expert's output rounded to the activation dtype, the combine summed in float32 over
j = 0..k-1 in order.
"""
from __future__ import annotations

import numpy as np


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


def expert_outputs(x, w13, w2, top_k, offsets, sorted_slots) -> np.ndarray:
    """The expert GEMMs: y [T * k, H] in the dispatch's order, row p = w2[e] @ h[p] with
    h[p] = silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]) for sorted slot p = (t, j) of expert e;
    h and y rounded to x's dtype. Rows past the valid slots are left unwritten."""
    experts, two_i, _ = w13.shape
    inter = two_i // 2
    y = np.empty((sorted_slots.size, x.shape[1]), x.dtype)
    for e in range(experts):
        slots = sorted_slots[offsets[e]:offsets[e + 1]]
        if slots.size == 0:
            continue
        xs = x[slots // top_k].astype(np.float32)
        w = w13[e].astype(np.float32)
        h = (silu(xs @ w[:inter].T) * (xs @ w[inter:].T)).astype(x.dtype)
        y[offsets[e]:offsets[e + 1]] = (h.astype(np.float32) @ w2[e].astype(np.float32).T).astype(x.dtype)
    return y


def combine(y, slot_positions, topk_weights, out) -> np.ndarray:
    """out[t] = sum_j topk_weights[t, j] * y[slot_positions[t * k + j]] in float32, j ascending,
    skipping slots at position -1; rounded into ``out`` [T, H] and returned."""
    tokens, top_k = topk_weights.shape
    acc = np.zeros((tokens, y.shape[1]), np.float32)
    positions = slot_positions.reshape(tokens, top_k)
    for j in range(top_k):
        pos = positions[:, j]
        hit = pos >= 0
        acc[hit] += topk_weights[hit, j, None] * y[pos[hit]].astype(np.float32)
    out[...] = acc.astype(out.dtype)
    return out


def fused_experts(x, w13, w2, topk_ids, topk_weights, out) -> np.ndarray:
    """The layer, stage by stage: dispatch, expert GEMMs, combine; into ``out`` [T, H] (arguments
    pre-checked)."""
    _, offsets, sorted_slots, slot_positions = dispatch_arrays(topk_ids, w13.shape[0])
    y = expert_outputs(x, w13, w2, topk_ids.shape[1], offsets, sorted_slots)
    return combine(y, slot_positions, topk_weights, out)


def route(router_logits: np.ndarray, top_k: int, renormalize: bool):
    """Softmax top-k: (weights float32 [T, k], ids int32 [T, k]); ties go to the lower id."""
    logits = router_logits.astype(np.float32)
    logits = np.where(np.isnan(logits), -np.inf, logits)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    weights = np.take_along_axis(probs, ids.astype(np.int64), axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return weights.astype(np.float32), ids
