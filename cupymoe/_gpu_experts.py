"""Launches the expert GEMMs (kernels_cu/expert_gemm.cu, expert_gemm_ws.cu) of a tile plan.

gate/up: h[p] = act(x[t] @ w13[e, :I].T, x[t] @ w13[e, I:].T) for each sorted slot p = (t, e);
down:    y[p] = h[p] @ w2[e].T; each with the epilogue of the forward's ExpertOptions (biases, the
routing weight on the input; kernels_cu/epilogue.cuh). With the BY_SLOT plan both run in slot
order without a dispatch. FP8 GEMMs take e4m3 x (or h) and weights, as 16-bit pairs, with their
scales (cupymoe/fp8.py; _gpu_quantize quantizes x, and h where the gate/up GEMM does not write it
quantized: plans.GemmConfig.quantizes_h); weight-only ones 16-bit x (or h) and e4m3 weights with theirs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import _compile, _tma, fp8, plans
from ._contract import NOT_FP8
from ._types import ExpertOptions, Shape

# epilogue.cuh's EpilogueArgs, passed by value: the bias and the slots' routing weights (0: none).
EPILOGUE_ARGS = np.dtype({"names": ["bias", "slot_weights"], "formats": [np.uint64, np.uint64],
                          "offsets": [0, 8], "itemsize": 16, "aligned": True})
# expert_tiles.cuh's Fp8Scales, passed by value: A's and the weights' scales, and those of the
# quantized h that a gate/up GEMM writes (0: not FP8, or h in 16 bits).
FP8_SCALES = np.dtype({"names": ["a", "w", "h"], "formats": [np.uint64] * 3, "offsets": [0, 8, 16], "itemsize": 24,
                       "aligned": True})
NO_SCALES = np.zeros(1, FP8_SCALES)[0]


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the layer: C [rows, n_out] = A [rows, k_dim] times expert weights W^T, then its epilogue."""

    gated: bool  # gate/up (W = w13, its gate and up rows paired, the activation fused) or down (W = w2)
    a: object  # x (gate/up, rows gathered by slot) or h (down)
    w: object  # w13 [E, 2 * n_out, k_dim] or w2 [E, n_out, k_dim]
    c: object  # h or y
    n_out: int
    k_dim: int
    epilogue: plans.Epilogue
    epilogue_args: np.void  # EPILOGUE_ARGS
    scales: np.void = NO_SCALES  # FP8_SCALES
    fp8: int = NOT_FP8  # FP8 operands: the layout index of the weight scales (block or channel)
    weight_only: bool = False  # FP8 weights beside 16-bit A (w8a16)


def _epilogue_args(bias, slot_weights) -> np.void:
    out = np.zeros(1, EPILOGUE_ARGS)
    out[0] = tuple(0 if a is None else a.data.ptr for a in (bias, slot_weights))
    return out[0]


def _fp8(scales, h_scale=None) -> tuple:
    """(FP8_SCALES, template argument, weight-only) of a GEMM: NOT_FP8 for None, else FP8 operands
    whose ``scales`` are (A's [rows, K / 128], or None for 16-bit A; the weights' in block or
    channel layout), and ``h_scale`` the scales of the e4m3 h that a gate/up GEMM writes."""
    if scales is None:
        return NO_SCALES, NOT_FP8, False
    a_scale, w_scale = scales
    out = np.zeros(1, FP8_SCALES)
    out[0] = tuple(0 if a is None else a.data.ptr for a in (a_scale, w_scale, h_scale))
    return out[0], fp8.layout_of(w_scale.ndim).index, a_scale is None


def _pairs(a):
    """An array of e4m3 bytes (uint8) as the 16-bit pairs that the GEMMs' loaders move."""
    return a.view(np.uint16) if a.dtype == np.uint8 else a


def gate_up_gemm(x, w13, h, shape: Shape, options: ExpertOptions, topk_weights, scales=None, h_scale=None) -> Gemm:
    """``topk_weights`` [T, k] contiguous: read by slot when the weights go on the input. FP8: w13
    e4m3 (uint8) with ``scales`` (x's, w13's; see _fp8), x e4m3 too (K then counts byte pairs)
    unless weight-only; with ``h_scale`` [S, I / 128] (for a config that quantizes_h) h is its e4m3
    bytes (uint8)."""
    args = _epilogue_args(options.w13_bias, topk_weights if options.weight_on_input else None)
    return Gemm(True, _pairs(x), _pairs(w13), h, shape.intermediate, _pairs(x).shape[1],
                plans.Epilogue.of(options, True), args, *_fp8(scales, h_scale))


def down_gemm(h, w2, y, shape: Shape, options: ExpertOptions, scales=None) -> Gemm:
    """FP8: w2 e4m3 (uint8) with ``scales`` (h's, w2's), h e4m3 too unless weight-only."""
    args = _epilogue_args(options.w2_bias, None)
    return Gemm(False, _pairs(h), _pairs(w2), y, shape.hidden, _pairs(h).shape[1], plans.Epilogue.of(options, False),
                args, *_fp8(scales))


def _compiled(cfg: plans.GemmConfig, gemm: Gemm, dtype, device_id: int, id_type: str = "int"):
    """The kernel of ``cfg`` for ``gemm``'s epilogue, allowed its shared memory."""
    gated = gemm.gated
    name = cfg.name_expression(dtype, gated, id_type, gemm.epilogue, gemm.fp8, gemm.weight_only)
    names = plans.name_expressions(cfg.source, dtype, gated, gemm.epilogue, gemm.fp8, gemm.weight_only)
    if name not in names:  # stages cut for a GPU with less shared memory: a module of its own
        names = (name,)
    kernel = _compile.kernel(cfg.source, name, names, device_id)
    smem = cfg.shared_bytes(gated, gemm.fp8 != NOT_FP8, gemm.weight_only)
    if kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel


@functools.lru_cache(maxsize=None)
def _one_wave(kernel, threads: int, shared_bytes: int, device_id: int) -> int:
    """How many blocks of an expert_gemm kernel the GPU runs at once. A plan that stands by is
    launched with no more, so when the dispatch takes the other one, about 30,000 fewer blocks
    start only to exit (docs/design.md, "Skewed routing")."""
    per_sm = _compile.resident_blocks(kernel, threads, shared_bytes)
    return max(1, per_sm) * _compile.multiprocessors(device_id)


def run(gemm: Gemm, dispatch, shape: Shape, chosen: plans.Plan) -> None:
    """One GEMM over the dispatch's sorted slots (``dispatch``: a _gpu_dispatch.DispatchBuffers),
    each launch of the plan (and of its skewed plan) on the current stream."""
    device_id = gemm.a.device.id
    slots = shape.tokens * shape.top_k
    tile_map = dispatch.tiles_gate_up if gemm.gated else dispatch.tiles_down
    for cfg, plan_index in chosen.launches(gemm.gated):
        kernel = _compiled(cfg, gemm, shape.dtype, device_id)
        smem = cfg.shared_bytes(gemm.gated, gemm.fp8 != NOT_FP8, gemm.weight_only)
        grid = plans.max_m_tiles(slots, shape.experts, cfg.block_m) * (gemm.n_out // cfg.block_n)
        w = gemm.w
        if cfg.kernel == plans.PERSISTENT:
            grid = min(grid, _compile.multiprocessors(device_id))  # one block per SM claims tiles
            # the weight tiles come by TMA; FP8 gate/up's rows in pairs of gate and up rows
            fp8_gate_up = gemm.gated and gemm.fp8 != NOT_FP8
            w = _tma.gate_up_pairs_map(w, gemm.n_out) if fp8_gate_up else _tma.weight_rows_map(w, cfg.k_group)
        elif plan_index >= 0:  # the dispatch may choose the other plan: a grid claiming the tiles
            grid = min(grid, chosen.standby_blocks or _one_wave(kernel, cfg.threads, smem, device_id))
        args = (gemm.a, dispatch.sorted_slots, np.int32(shape.top_k), w, dispatch.offsets, tile_map,
                np.int32(plan_index), np.int32(shape.experts), np.int32(gemm.n_out), np.int32(gemm.k_dim),
                gemm.c, gemm.epilogue_args, gemm.scales)
        kernel((grid,), (cfg.threads,), args, shared_mem=smem)


def run_by_slot(gemms: tuple, ids, slot_positions, shape: Shape, chosen: plans.Plan) -> None:
    """Both GEMMs (gate/up, then down) without a dispatch, in slot order: routed slot s = (t, j)
    goes through expert e = ids[t, j] into row s of h and y. An expert's slots go block_m at a
    time to the blocks of its first slot and of every block_m-th after it. The down GEMM also
    writes the combine's slot_positions, which the dispatch writes otherwise: s, or -1 where the
    id is outside [0, E) (then rows s of h and y are not written). Contiguous ids."""
    slots = shape.tokens * shape.top_k
    id_type = plans.ID_TYPES[ids.dtype.name]
    for gemm, cfg in zip(gemms, (chosen.gate_up, chosen.down)):
        kernel = _compiled(cfg, gemm, shape.dtype, gemm.a.device.id, id_type)
        kernel((slots * (gemm.n_out // cfg.block_n),), (cfg.threads,),
               (gemm.a, ids, np.int32(slots), np.int32(shape.top_k), gemm.w, np.int32(shape.experts),
                np.int32(gemm.n_out), np.int32(gemm.k_dim), gemm.c, slot_positions, gemm.epilogue_args),
               shared_mem=cfg.shared_bytes(gemm.gated))
