"""Dispatch: group the (token, k) slots by expert with a histogram, a scan and a stable scatter."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _checks, reference


@dataclass(frozen=True)
class Dispatch:
    """Where each routed slot goes. Slot ``s = t * k + j`` is token t's j-th expert choice.

    Arrays are int32 and live where the ids came from (NumPy or CuPy).
    """

    num_experts: int  # E
    top_k: int  # k
    counts: object  # [E]: valid slots routed to each expert
    offsets: object  # [E + 1]: exclusive prefix sum of counts; offsets[E] = valid slots
    sorted_slots: object  # [T * k]: valid slots by expert, ascending inside each; then -1
    slot_positions: object  # [T * k]: index of each slot in sorted_slots; -1 for ids not in [0, E)


def dispatch(topk_ids, num_experts, *, check_ids=True):
    """Group the slots of ``topk_ids`` by expert, the way :func:`fused_experts` does.

    Parameters
    ----------
    topk_ids : array [T, k], int32 or int64 (NumPy, CuPy, or a DLPack/CUDA array)
    num_experts : int
        E, at least 1 and at least k.
    check_ids : bool
        Raise ValueError for ids outside [-1, E) (synchronises on the GPU); when False
        such ids count as -1.

    Returns
    -------
    Dispatch
        On the GPU the arrays are computed by the dispatch kernels (histogram, exclusive
        scan, stable scatter), so the order never depends on thread timing.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    if num_experts < 1:
        raise ValueError(f"num_experts: expected at least 1, got {num_experts}")
    ids = _checks.as_array(topk_ids, "topk_ids")
    xp = _checks.array_module({"topk_ids": ids})
    top_k = _checks.check_routing(ids, None, ids.shape[0] if ids.ndim == 2 else 0, int(num_experts))
    if check_ids:
        _checks.check_ids_in_range(ids, int(num_experts))
    if xp is np:
        return Dispatch(int(num_experts), top_k, *reference.dispatch_arrays(ids, int(num_experts)))
    from . import _gpu_dispatch

    with ids.device:
        return _gpu_dispatch.run(xp.ascontiguousarray(ids), int(num_experts)).public(top_k)
