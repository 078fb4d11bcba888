"""The GPU forward: dispatch -> gate/up GEMM (SwiGLU) -> down GEMM -> combine, on the current stream;
for a few slots, the GEMMs by slot without the dispatch."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile, _gpu_combine, _gpu_dispatch, _gpu_experts, plans
from ._types import ExpertOptions, Shape


class Workspace:
    """Everything one forward of a given Shape writes besides ``out``; reusable across calls."""

    def __init__(self, shape: Shape, device_id: int):
        import cupy

        self.plan = plans.plan(shape.tokens, shape.top_k, shape.experts, shape.hidden,
                               shape.intermediate, _compile.compute_capability(device_id),
                               _compile.shared_memory_limit(device_id))
        slots = shape.tokens * shape.top_k
        try:
            if self.plan.by_slot:  # h and y in slot order; the down GEMM writes the positions
                self.dispatch = None
                self.slot_positions = cupy.empty(slots, np.int32)
            else:
                self.dispatch = _gpu_dispatch.DispatchBuffers(slots, shape.experts, self.plan)
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


def forward(a: dict, shape: Shape, workspace: Workspace, out, check_ids: bool, options: ExpertOptions,
            addend=None):
    """Run the layer on checked CuPy arrays ``a`` (x, w13, w2, topk_ids, topk_weights), with
    ``addend`` [T, H] (contiguous, x's dtype) added in the combine when given."""
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
    x = _checks.on_gpu_grid(a["x"])
    ws = workspace
    gate_up = _gpu_experts.gate_up_gemm(x, a["w13"], ws.h, shape, options, weights)
    down = _gpu_experts.down_gemm(ws.h, a["w2"], ws.y, shape, options)
    if ws.dispatch is None:
        _gpu_experts.run_by_slot((gate_up, down), ids, ws.slot_positions, shape, ws.plan)
    else:
        _gpu_dispatch.launch(ids, ws.dispatch)
        _gpu_experts.run(gate_up, ws.dispatch, shape, ws.plan)
        _gpu_experts.run(down, ws.dispatch, shape, ws.plan)
    _gpu_combine.run(ws.y, ws.slot_positions, None if options.weight_on_input else weights, out, shape, addend)
    return out
