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


WARP_PER_LOGIT = RouterTile(1, 1, 8, 1)  # a block: 8 tokens of one output, w's row read once for them
REGISTER_TILE = RouterTile(4, 8, 2, 4)   # a block: 8 tokens x 32 outputs; x rows from L2, w rows T/8 times
TILES = (WARP_PER_LOGIT, REGISTER_TILE)
# E = 256, H = 7168, bf16 x on an H100 (benchmarks/PERF.md): at T = 64 0.027 ms against 0.052, at
# T = 256 0.089 against 0.054; the register tile's 100-122 registers leave 16 warps per SM.
WARP_PER_LOGIT_MAX_TOKENS = 64


def tile_for(tokens: int, outputs: int) -> RouterTile:
    """The tile for a T x N problem (any choice gives the same bits)."""
    if tokens <= WARP_PER_LOGIT_MAX_TOKENS or outputs < REGISTER_TILE.block[1]:
        return WARP_PER_LOGIT
    return REGISTER_TILE


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
