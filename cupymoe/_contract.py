"""The numbers that the host code and the CUDA kernels must agree on, defined here once.

``_compile`` passes each entry of :data:`DEFINES` to NVRTC as ``-DCUPYMOE_<NAME>=<value>``, and
``kernels_cu/contract.cuh`` gives them their CUDA names; a kernel compiled without them stops at
an ``#error``. What cannot travel as a number (the layout of a struct passed by value, the
persistent kernel's shared-memory layout) is held to the host's by ``tests/test_contract.py``,
which compiles ``static_assert``s of the host's values against the kernels' own.
"""
from __future__ import annotations

# The GEMMs' K tile (their BK): 64 16-bit values, one 128-byte row of a 128-byte-swizzled shared
# tile. H and I must be multiples of it.
K_TILE = 64
# dispatch.cu: slots per warp of dispatch_count, experts per block of dispatch_expert_scan, warps of
# the one-block dispatch_fused.
DISPATCH_CHUNK = 512
DISPATCH_EXPERT_SCAN_WARPS = 8
DISPATCH_FUSED_WARPS = 8
# expert_gemm_ws.cu: the loading warpgroup's threads, the weight rows of one m64 wgmma block, the
# rows of a TMA box of weights in stages of one K-tile (stages of two take one m64 block a box),
# the slots per pass of the epilogue, and (FP8 gate/up) the rows of gate, then of up, that alternate
# in a stage's weight rows: an 8-column piece of the MMA's output.
PRODUCER_THREADS = 128
WGMMA_BLOCK_ROWS = 64
TMA_BOX_ROWS = 128
STAGED_SLOTS = 32
GATE_UP_PAIR_ROWS = 8
# A GEMM's m-tile map (kernels_cu/tile_map.cuh): int tiles[E + TILE_MAP_EXTRA]. tiles[e] for e < E is
# the first m-tile of expert e; the fields after them, at E + the index below:
TILE_MAP_TOTAL = 0  # every expert's m-tiles
TILE_MAP_COUNTER = 1  # the counter from which blocks claim tiles (zeroed by the dispatch)
TILE_MAP_PLAN = 2  # which plan the dispatch chose: 0 the host's own, 1 its plan for skewed routing
TILE_MAP_EXTRA = 3

# route.cu's sigmoid routing: the most expert groups (a bit of a 32-bit mask each).
ROUTE_MAX_GROUPS = 32

# The activations of the gate/up epilogue, by their API names; a kernel takes the index as its ACT.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
# swigluoai (gpt-oss): gate clamped above at the limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)
SWIGLUOAI_LIMIT = 7.0
SWIGLUOAI_ALPHA = 1.702

# FP8 weights (cupymoe/fp8.py): the side of a scale block and of an activation quantization group,
# the largest float8 e4m3 value, and the amax below which a group's scale stops shrinking.
FP8_BLOCK = 128
E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-10
# quantize.cu's threads per block (a warp per row and group of 128 columns).
QUANTIZE_THREADS = 256
# The layouts of an FP8 weight's scales (cupymoe.fp8.ScaleLayout's values). expert_gemm's FP8
# template argument is the index of its weights' (block or channel: the host widens per-expert
# scales to channels), or NOT_FP8 for bf16/fp16 operands.
SCALE_LAYOUTS = ("block", "channel", "expert")
NOT_FP8 = -1

# Flags of an expert GEMM's EPILOGUE template argument: what it adds to a plain SwiGLU.
EPILOGUE_BIAS = 1  # a bias per expert and output column (w13_bias for gate/up, w2_bias for down)
EPILOGUE_INPUT_WEIGHT = 2  # gate/up only: the routing weight of each slot scales its projections

DEFINES = {
    "K_TILE": K_TILE,
    "DISPATCH_CHUNK": DISPATCH_CHUNK,
    "DISPATCH_EXPERT_SCAN_WARPS": DISPATCH_EXPERT_SCAN_WARPS,
    "DISPATCH_FUSED_WARPS": DISPATCH_FUSED_WARPS,
    "PRODUCER_THREADS": PRODUCER_THREADS,
    "WGMMA_BLOCK_ROWS": WGMMA_BLOCK_ROWS,
    "TMA_BOX_ROWS": TMA_BOX_ROWS,
    "STAGED_SLOTS": STAGED_SLOTS,
    "GATE_UP_PAIR_ROWS": GATE_UP_PAIR_ROWS,
    "TILE_MAP_TOTAL": TILE_MAP_TOTAL,
    "TILE_MAP_COUNTER": TILE_MAP_COUNTER,
    "TILE_MAP_PLAN": TILE_MAP_PLAN,
    "TILE_MAP_EXTRA": TILE_MAP_EXTRA,
    "ROUTE_MAX_GROUPS": ROUTE_MAX_GROUPS,
    **{f"ACT_{name.upper()}": index for index, name in enumerate(ACTIVATIONS)},
    "EPILOGUE_BIAS": EPILOGUE_BIAS,
    "EPILOGUE_INPUT_WEIGHT": EPILOGUE_INPUT_WEIGHT,
    "FP8_BLOCK": FP8_BLOCK,
    "QUANTIZE_THREADS": QUANTIZE_THREADS,
    "E4M3_MAX": f"{E4M3_MAX!r}f",
    "FP8_AMAX_FLOOR": f"{FP8_AMAX_FLOOR!r}f",
    **{f"SCALE_{name.upper()}": index for index, name in enumerate(SCALE_LAYOUTS)},
    "NOT_FP8": NOT_FP8,
    "SWIGLUOAI_LIMIT": f"{SWIGLUOAI_LIMIT!r}f",
    "SWIGLUOAI_ALPHA": f"{SWIGLUOAI_ALPHA!r}f",
}


def compile_options() -> tuple:
    """The ``-D`` options that carry :data:`DEFINES` to the kernels."""
    return tuple(f"-DCUPYMOE_{name}={value}" for name, value in DEFINES.items())


def tile_map_size(experts: int) -> int:
    """The ints of one GEMM's m-tile map for E experts."""
    return experts + TILE_MAP_EXTRA
