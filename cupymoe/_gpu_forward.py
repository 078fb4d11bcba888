"""The GPU forward: dispatch -> gate/up GEMM (SwiGLU) -> down GEMM -> combine, on the current stream;
for a few slots, the GEMMs by slot without the dispatch."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile, combine, experts
from ._gpu_dispatch import DispatchBuffers, launch as launch_dispatch


class Workspace:
    """Everything one forward of a given Shape writes besides ``out``; reusable across calls."""

    def __init__(self, shape: _checks.Shape, device_id: int):
        import cupy

        self.plan = experts.plan(shape.tokens, shape.top_k, shape.experts, shape.hidden,
                                 shape.intermediate, _compile.compute_capability(device_id),
                                 _compile.shared_memory_limit(device_id))
        slots = shape.tokens * shape.top_k
        try:
            if self.plan.by_slot:  # h and y in slot order; the down GEMM writes the positions
                self.dispatch = None
                self.slot_positions = cupy.empty(slots, np.int32)
            else:
                self.dispatch = DispatchBuffers(slots, shape.experts, self.plan)
                self.slot_positions = self.dispatch.slot_positions
            # The SwiGLU output and the down projection, in expert order (by slot: slot order).
            self.h = cupy.empty((slots, shape.intermediate), shape.dtype)
            self.y = cupy.empty((slots, shape.hidden), shape.dtype)
        except cupy.cuda.memory.OutOfMemoryError as err:
            need = slots * (shape.intermediate + shape.hidden) * shape.dtype.itemsize
            raise MemoryError(
                f"cupymoe: the workspace for T={shape.tokens}, k={shape.top_k}, H={shape.hidden}, "
                f"I={shape.intermediate} needs about {need / 2**30:.1f} GiB of GPU memory, which "
                f"could not be allocated; nothing was written. Split the batch. ({err})"
            ) from err

    @property
    def nbytes(self) -> int:
        """Bytes of GPU memory held: h and y (the dispatch's buffers add a few bytes per slot)."""
        return self.h.nbytes + self.y.nbytes


def forward(a: dict, shape: _checks.Shape, workspace: Workspace, out, check_ids: bool):
    """Run the layer on checked CuPy arrays ``a`` (x, w13, w2, topk_ids, topk_weights)."""
    import cupy

    if check_ids:
        if cupy.cuda.get_current_stream().is_capturing():
            raise ValueError("check_ids=True synchronises and cannot run in CUDA graph capture; "
                             "pass check_ids=False")
        _checks.check_ids_in_range(a["topk_ids"], shape.experts)
    if out is None:
        out = cupy.empty((shape.tokens, shape.hidden), shape.dtype)
    if shape.tokens == 0:
        return out
    ids = cupy.ascontiguousarray(a["topk_ids"])
    weights = cupy.ascontiguousarray(a["topk_weights"])
    x = cupy.ascontiguousarray(a["x"])
    if x.data.ptr % _checks.GPU_ALIGNMENT:  # a contiguous view off the 16-byte grid
        x = x.copy()
    ws = workspace
    if ws.dispatch is None:
        experts.by_slot(x, ids, a["w13"], a["w2"], ws.h, ws.y, ws.slot_positions, shape, ws.plan)
    else:
        launch_dispatch(ids, ws.dispatch)
        experts.gate_up(x, a["w13"], ws.dispatch, ws.h, shape, ws.plan)
        experts.down(ws.h, a["w2"], ws.dispatch, ws.y, shape, ws.plan)
    combine.run(ws.y, ws.slot_positions, weights, out, shape)
    return out
