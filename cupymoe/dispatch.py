"""Dispatch: group the (token, k) slots by expert with a histogram, a scan and a stable scatter."""
from __future__ import annotations

import numpy as np

from . import _checks, reference
from ._types import Dispatch


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
        buffers = _gpu_dispatch.DispatchBuffers(ids.size, int(num_experts))
        _gpu_dispatch.launch(xp.ascontiguousarray(ids), buffers)
        return Dispatch(int(num_experts), top_k, buffers.counts, buffers.offsets, buffers.sorted_slots,
                        buffers.slot_positions)
