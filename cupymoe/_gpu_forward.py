"""The GPU forward: dispatch -> gate/up GEMM (SwiGLU) -> down GEMM -> combine, on the current stream;
for a few slots, the GEMMs by slot without the dispatch. With FP8 weights (w8a8) x is quantized
(_gpu_quantize) before the gate/up GEMM, and h by the gate/up GEMM's epilogue (the persistent
kernel) or apart; weight-only FP8 GEMMs read x and h as they are."""
from __future__ import annotations

import numpy as np

from . import _checks, _compile, _gpu_combine, _gpu_dispatch, _gpu_experts, _gpu_quantize, fp8, plans
from ._types import ExpertOptions, Shape, WeightScales


class Workspace:
    """Everything one forward of a given Shape writes besides ``out``; reusable across calls."""

    def __init__(self, shape: Shape, device_id: int, scales: WeightScales | None = None):
        """``scales``: those of FP8 weights, whose numerics (w8a8 or weight-only) the plan and
        the buffers follow."""
        import cupy

        fp8_weights = scales is not None
        weight_only = fp8_weights and scales.weight_only
        self.plan = plans.plan(shape.tokens, shape.top_k, shape.experts, shape.hidden,
                               shape.intermediate, _compile.compute_capability(device_id),
                               _compile.shared_memory_limit(device_id), fp8_weights, weight_only)
        slots = shape.tokens * shape.top_k
        try:
            if self.plan.by_slot:  # h and y in slot order; the down GEMM writes the positions
                self.dispatch = None
                self.slot_positions = cupy.empty(slots, np.int32)
            else:
                self.dispatch = _gpu_dispatch.DispatchBuffers(slots, shape.experts, self.plan)
                self.slot_positions = self.dispatch.slot_positions
            # The SwiGLU output (None where the gate/up GEMM writes it quantized) and the down
            # projection, in expert order (by slot: slot order).
            self.gate_up_quantizes_h = self.plan.gate_up.quantizes_h(fp8_weights, weight_only)
            self.h = None if self.gate_up_quantizes_h else cupy.empty((slots, shape.intermediate), shape.dtype)
            self.y = cupy.empty((slots, shape.hidden), shape.dtype)
            # w8a8: x and h quantized (e4m3 bits) with their scales, the GEMMs' inputs
            self.quantized = None
            if fp8_weights and not weight_only:
                self.quantized = tuple(
                    (cupy.empty((rows, cols), np.uint8), cupy.empty((rows, fp8.blocks(cols)), np.float32))
                    for rows, cols in ((shape.tokens, shape.hidden), (slots, shape.intermediate)))
        except cupy.cuda.memory.OutOfMemoryError as err:
            need = slots * (shape.intermediate + shape.hidden) * shape.dtype.itemsize
            raise MemoryError(
                f"cupymoe: the workspace for T={shape.tokens}, k={shape.top_k}, H={shape.hidden}, "
                f"I={shape.intermediate} needs about {need / 2**30:.1f} GiB of GPU memory, which "
                f"could not be allocated; nothing was written. Split the batch. ({err})"
            ) from err

    @property
    def nbytes(self) -> int:
        """Bytes of GPU memory held: h and y, and w8a8's quantized x and h (the dispatch's buffers add
        a few bytes per slot)."""
        quantized = sum(a.nbytes for pair in self.quantized or () for a in pair)
        return (0 if self.h is None else self.h.nbytes) + self.y.nbytes + quantized


def forward(a: dict, shape: Shape, workspace: Workspace, out, check_ids: bool, options: ExpertOptions,
            addend=None, scales: WeightScales | None = None):
    """Run the layer on checked CuPy arrays ``a`` (x, w13, w2, topk_ids, topk_weights), with
    ``addend`` [T, H] (contiguous, x's dtype) added in the combine when given; ``scales``: those of
    FP8 weights (the workspace made for them)."""
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
    if scales is not None:
        _fp8_forward(x, ids, weights, a, shape, ws, options, scales)
    else:
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


def kernel_scales(scales: WeightScales, shape_sizes: tuple) -> WeightScales:
    """FP8 weight scales as the GEMMs take them: per-expert scales [E] widened to channels [E, rows]
    (the same value per row, so the same numerics); block and channel scales as they are."""
    import cupy

    experts, inter, hidden = shape_sizes

    def widened(scale, rows):
        return cupy.ascontiguousarray(cupy.broadcast_to(scale[:, None], (experts, rows))) if scale.ndim == 1 else scale

    return WeightScales(widened(scales.w13, 2 * inter), widened(scales.w2, hidden), scales.weight_only)


def _fp8_forward(x, ids, weights, a, shape: Shape, ws: Workspace, options: ExpertOptions,
                 scales: WeightScales) -> None:
    """Dispatch, x quantized, gate/up (h quantized in its epilogue, or after it: its valid rows),
    down: the FP8 GEMMs into ws.y; weight-only, dispatch, gate/up and down."""
    _gpu_dispatch.launch(ids, ws.dispatch)
    if scales.weight_only:
        gate_up = _gpu_experts.gate_up_gemm(x, a["w13"], ws.h, shape, options, weights, (None, scales.w13))
        _gpu_experts.run(gate_up, ws.dispatch, shape, ws.plan)
        down = _gpu_experts.down_gemm(ws.h, a["w2"], ws.y, shape, options, (None, scales.w2))
        _gpu_experts.run(down, ws.dispatch, shape, ws.plan)
        return
    h_q, h_scale = fp8_gate_up(x, weights, a["w13"], scales.w13, shape, ws, options)
    down = _gpu_experts.down_gemm(h_q, a["w2"], ws.y, shape, options, (h_scale, scales.w2))
    _gpu_experts.run(down, ws.dispatch, shape, ws.plan)


def fp8_gate_up(x, weights, w13, w13_scale, shape: Shape, ws: Workspace, options: ExpertOptions) -> tuple:
    """w8a8 after the dispatch: x quantized, the gate/up GEMM, h quantized (by its epilogue, or
    after it: its valid rows). Returns h's e4m3 bytes and scales, the down GEMM's input."""
    (x_q, x_scale), (h_q, h_scale) = ws.quantized
    _gpu_quantize.run(x, x_q, x_scale)
    fused = ws.gate_up_quantizes_h
    gate_up = _gpu_experts.gate_up_gemm(x_q, w13, h_q if fused else ws.h, shape, options, weights,
                                        (x_scale, w13_scale), h_scale if fused else None)
    _gpu_experts.run(gate_up, ws.dispatch, shape, ws.plan)
    if not fused:
        _gpu_quantize.run(ws.h, h_q, h_scale, ws.dispatch.offsets[shape.experts:])
    return h_q, h_scale
