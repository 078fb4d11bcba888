"""Launches the router GEMM (kernels_cu/router_logits.cu): float32 logits [T, N] = x @ w.T (+ bias),
summed in one order for every T, so that a token's logits are batch-invariant."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _checks, _compile

SOURCE = "router_logits.cu"


@dataclass(frozen=True)
class RouterTile:
    """A warp's (tokens, outputs) and a block's warps along each; the sum's order is the same in all."""

    tile_t: int
    tile_n: int
    warps_t: int
    warps_n: int

    @property
    def block(self) -> tuple[int, int]:
        """(tokens, outputs) per block."""
        return self.tile_t * self.warps_t, self.tile_n * self.warps_n

    def name_expression(self, x_dtype, w_dtype) -> str:
        types = _checks.CUDA_TYPES
        return (f"router_logits<{types[x_dtype]}, {types[w_dtype]}, "
                f"{self.tile_t}, {self.tile_n}, {self.warps_t}, {self.warps_n}>")


ROW = RouterTile(1, 1, 1, 8)       # a warp per logit: the most warps streaming w at small T
COLUMN = RouterTile(1, 1, 8, 1)    # a warp per token: N below a block's width (the shared gate, N = 1)
HALF = RouterTile(4, 8, 2, 4)      # 8 x 32 per block, half LARGE's registers: twice the warps per SM
LARGE = RouterTile(8, 8, 2, 4)     # 16 x 32 per block: x rows read N/32 times (from L2), w rows T/16 times
TILES = (ROW, COLUMN, HALF, LARGE)
ROW_MAX_TOKENS = 64  # E = 256, H = 7168 on an H100: ROW 0.027 ms at T = 64, the next best 0.070 (PERF.md)


def tile_for(tokens: int, outputs: int) -> RouterTile:
    """The tile for a T x N problem (any choice gives the same bits)."""
    if outputs < ROW.block[1]:
        return COLUMN
    return ROW if tokens <= ROW_MAX_TOKENS else LARGE


def name_expressions(x_dtype) -> tuple:
    """The module's kernels for x of ``x_dtype``: every tile, with w of x's dtype or float32."""
    return tuple(tile.name_expression(x_dtype, w_dtype) for w_dtype in (x_dtype, _checks.FLOAT32) for tile in TILES)


def run(x, w, bias, out, *, round_to_x: bool = False, apply_sigmoid: bool = False, tile: RouterTile = None) -> None:
    """out [T, N] float32 = x [T, H] @ w[N, H].T + bias [N] (or None); rounded to x's dtype when
    ``round_to_x``, then sigmoid when ``apply_sigmoid``. All contiguous and pre-checked; H a multiple
    of 4. ``tile``: one of TILES instead of tile_for's (the tests')."""
    tokens, hidden = x.shape
    outputs = w.shape[0]
    if tokens == 0:
        return
    tile = tile or tile_for(tokens, outputs)
    block_t, block_n = tile.block
    names = name_expressions(x.dtype)
    kernel = _compile.kernel(SOURCE, tile.name_expression(x.dtype, w.dtype), names, x.device.id)
    kernel((-(-tokens // block_t) * -(-outputs // block_n),), (32 * tile.warps_t * tile.warps_n,),
           (x, w, bias, np.int32(tokens), np.int32(outputs), np.int32(hidden), np.int32(round_to_x),
            np.int32(apply_sigmoid), out))
