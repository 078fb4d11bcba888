"""Router: softmax top-k over router logits, in a kernel on the GPU."""
from __future__ import annotations

import numpy as np

from . import _checks, reference

LOGIT_DTYPES = (_checks.FLOAT32, _checks.BFLOAT16, _checks.FLOAT16)


def route(router_logits, top_k, *, renormalize=True):
    """Pick each token's top-k experts by softmax probability.

    Parameters
    ----------
    router_logits : array [T, E], float32, bfloat16 or float16
    top_k : int
        k, with ``1 <= k <= E``.
    renormalize : bool
        When True (default) the k weights of a token are rescaled to sum to 1; when False
        they are the softmax probabilities over all E experts.

    Returns
    -------
    (topk_weights, topk_ids) : (array [T, k] float32, array [T, k] int32)
        Experts in descending probability; ties go to the lower expert id; NaN logits
        rank lowest. CuPy arrays for GPU input, NumPy arrays for NumPy input.
    """
    logits = _checks.as_array(router_logits, "router_logits")
    xp = _checks.array_module({"router_logits": logits})
    _checks.check_array(logits, "router_logits", 2, LOGIT_DTYPES)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= {experts} (the experts), got {top_k}")
    if xp is np:
        return reference.route(logits, int(top_k), bool(renormalize))
    from . import _gpu_route

    with logits.device:
        return _gpu_route.run(xp.ascontiguousarray(logits), int(top_k), bool(renormalize))
