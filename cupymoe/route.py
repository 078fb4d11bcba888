"""Router: each token's top-k experts and their weights from its router logits, in a kernel on the GPU."""
from __future__ import annotations

import numpy as np

from . import _checks, reference
from ._contract import ROUTE_MAX_GROUPS
from ._types import Routing

LOGIT_DTYPES = (_checks.FLOAT32, _checks.BFLOAT16, _checks.FLOAT16)
SCORINGS = ("softmax", "sigmoid")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected at least 1, got {value}")
    return int(value)


def route(router_logits, top_k, *, scoring="softmax", renormalize=True, num_groups=1, topk_groups=1,
          correction_bias=None, scaling_factor=1.0):
    """Pick each token's top-k experts and their routing weights.

    Parameters
    ----------
    router_logits : array [T, E], float32, bfloat16 or float16
    top_k : int
        k, with ``1 <= k <= E``.
    scoring : "softmax" or "sigmoid"
        ``"softmax"`` (Mixtral, Qwen2/3-MoE, gpt-oss): the k experts of highest logit, weighted by
        their softmax probability over all E. ``"sigmoid"`` (DeepSeek-V3, GLM-4.5, Llama-4): scores
        ``sigmoid(logit)``; experts are chosen on ``score + correction_bias`` and weighted by the
        unbiased scores.
    renormalize : bool
        Rescale a token's k weights to sum to 1 (sigmoid: divided by their sum plus 1e-20).
    num_groups, topk_groups : int
        Sigmoid only: with ``num_groups > 1`` the E experts form that many (at most 32) equal groups
        of at least two; a group's score is the sum of its two highest biased scores, and only the
        ``topk_groups`` best groups are eligible (``k <= topk_groups * E / num_groups``).
    correction_bias : array [E] float32, optional
        Sigmoid only: added to the scores for choosing, not for weighting.
    scaling_factor : float
        Sigmoid only: multiplies the weights after renormalisation.

    Returns
    -------
    (topk_weights, topk_ids) : (array [T, k] float32, array [T, k] int32)
        Experts in descending (biased) score; ties go to the lower expert id (and group); NaN
        logits rank lowest. CuPy arrays for GPU input, NumPy arrays for NumPy input. Computed in
        float32.
    """
    logits = _checks.as_array(router_logits, "router_logits")
    arrays = {"router_logits": logits}
    if correction_bias is not None:
        arrays["correction_bias"] = correction_bias = _checks.as_array(correction_bias, "correction_bias")
    xp = _checks.array_module(arrays)
    _checks.check_array(logits, "router_logits", 2, LOGIT_DTYPES)
    routing = check_routing(logits.shape[1], top_k, scoring, renormalize, num_groups, topk_groups, correction_bias,
                            scaling_factor)
    return run(xp, logits, routing)


def check_routing(experts: int, top_k, scoring, renormalize, num_groups, topk_groups, correction_bias,
                  scaling_factor) -> Routing:
    """Validate routing options for E experts (``correction_bias`` already an array); return them
    as a Routing."""
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= {experts} (the experts), got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
    num_groups = _positive_int(num_groups, "num_groups")
    topk_groups = _positive_int(topk_groups, "topk_groups")
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float, np.floating, np.integer)):
        raise TypeError(f"scaling_factor: expected a float, got {type(scaling_factor).__name__}")
    if scoring == "softmax":
        given = [name for name, differs in (("num_groups", num_groups != 1), ("topk_groups", topk_groups != 1),
                                            ("correction_bias", correction_bias is not None),
                                            ("scaling_factor", scaling_factor != 1.0)) if differs]
        if given:
            raise ValueError(f"{given[0]}: only for scoring='sigmoid'; softmax routing takes none")
    else:
        if experts % num_groups or (num_groups > 1 and experts // num_groups < 2):
            raise ValueError(f"num_groups: expected a divisor of E = {experts} leaving at least two experts "
                             f"a group, got {num_groups}")
        if num_groups > ROUTE_MAX_GROUPS:
            raise ValueError(f"num_groups: expected at most {ROUTE_MAX_GROUPS}, got {num_groups}")
        if topk_groups > num_groups:
            raise ValueError(f"topk_groups: expected at most num_groups = {num_groups}, got {topk_groups}")
        if top_k > topk_groups * (experts // num_groups):
            raise ValueError(f"top_k: expected at most the {topk_groups * (experts // num_groups)} experts of the "
                             f"topk_groups best groups, got {top_k}")
        if correction_bias is not None:
            _checks.check_array(correction_bias, "correction_bias", 1, (_checks.FLOAT32,))
            if correction_bias.shape[0] != experts:
                raise ValueError(f"correction_bias: expected shape ({experts},), got {tuple(correction_bias.shape)}")
    return Routing(int(top_k), scoring, bool(renormalize), num_groups, topk_groups, correction_bias,
                   float(scaling_factor))


def run(xp, logits, routing: Routing, outputs=None):
    """(weights, ids) of checked ``logits`` [T, E] on ``xp``'s side; on the GPU into ``outputs``
    (weights float32 [T, k], ids int32 [T, k], contiguous) when given."""
    r = routing
    if xp is np:
        if r.scoring == "softmax":
            return reference.route(logits, r.top_k, r.renormalize)
        return reference.route_sigmoid(logits, r.top_k, r.renormalize, r.num_groups, r.topk_groups, r.correction_bias,
                                       r.scaling_factor)
    from . import _gpu_route

    with logits.device:
        logits = xp.ascontiguousarray(logits)
        bias = None if r.correction_bias is None else xp.ascontiguousarray(r.correction_bias)
        return _gpu_route.run(logits, r, bias, outputs)
