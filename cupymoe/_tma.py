"""TMA tensor maps of the expert weights, encoded by the CUDA driver (libcuda) through ctypes.

A map describes a weight array as [rows, K] of 16-bit values, read in boxes of TMA_BOX_ROWS rows
(WGMMA_BLOCK_ROWS for stages of two K-tiles) by K_TILE columns (128 bytes) into 128-byte-swizzled
shared memory: the layout of one stage of the weight tile in ``kernels_cu/expert_gemm_ws.cu``
(the constants come from ``_contract``). The FP8 gate/up stages take w13's rows in pairs, as a
4-D map: GATE_UP_PAIR_ROWS gate rows, then the up rows of the same columns, and so on. A map is
passed by value as a ``__grid_constant__`` kernel parameter, so CUDA graphs capture it with the
launch.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from ._contract import GATE_UP_PAIR_ROWS, K_TILE, TMA_BOX_ROWS, WGMMA_BLOCK_ROWS

# Enumerators of cuda.h's CUtensorMap* types.
_DATA_UINT16 = 1  # bf16 and fp16 are copied as bits
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3  # each box row's L2 fetch widened to 256 bytes (128 measured: as much faster as slower, by H200)
_L2_PROMOTION_NONE = 0
_OOB_FILL_NONE = 0
# CUtensorMap: 128 opaque bytes; a struct dtype so CuPy passes it by value.
TENSOR_MAP = np.dtype({"names": [f"w{i}" for i in range(16)], "formats": [np.uint64] * 16,
                       "itemsize": 128, "aligned": True})


@functools.lru_cache(maxsize=None)
def _encode_tiled():
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64),
                       ctypes.POINTER(u64), ctypes.POINTER(u32), ctypes.POINTER(u32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return encode


def _encoded(address: int, dims: tuple, strides: tuple, box: tuple, promotion: int, what: str) -> np.void:
    """A tiled map of 16-bit values at ``address``: ``dims`` and ``box`` innermost first, the byte
    ``strides`` of every dimension but the first."""
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    out = np.zeros(1, TENSOR_MAP)
    rank = len(dims)
    status = _encode_tiled()(
        out.ctypes.data, _DATA_UINT16, rank, ctypes.c_void_p(address), (u64 * rank)(*dims),
        (u64 * (rank - 1))(*strides), (u32 * rank)(*box), (u32 * rank)(*[1] * rank),
        _INTERLEAVE_NONE, _SWIZZLE_128B, promotion, _OOB_FILL_NONE)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for {what} at 0x{address:x}")
    return out[0]


@functools.lru_cache(maxsize=64)  # a map depends only on its arguments, so reuse is always exact
def _rows_map(address: int, rows: int, columns: int, promotion: int = _L2_PROMOTION_256B,
              box_rows: int = TMA_BOX_ROWS) -> np.void:
    return _encoded(address, (columns, rows), (2 * columns,), (K_TILE, box_rows), promotion,
                    f"{rows} rows of {columns} 16-bit values")


@functools.lru_cache(maxsize=64)
def _pairs_map(address: int, rows: int, columns: int, intermediate: int) -> np.void:
    # (K, a row of the pair, gate or up: I rows further, the pair: GATE_UP_PAIR_ROWS rows further);
    # a box is TMA_BOX_ROWS rows: the pairs of TMA_BOX_ROWS / 2 columns.
    row = 2 * columns
    return _encoded(address, (columns, GATE_UP_PAIR_ROWS, 2, rows // GATE_UP_PAIR_ROWS),
                    (row, intermediate * row, GATE_UP_PAIR_ROWS * row),
                    (K_TILE, GATE_UP_PAIR_ROWS, 2, TMA_BOX_ROWS // (2 * GATE_UP_PAIR_ROWS)), _L2_PROMOTION_256B,
                    f"{rows} gate/up rows of {columns} 16-bit values in pairs of {GATE_UP_PAIR_ROWS}")


def weight_rows_map(w, k_group: int = 1) -> np.void:
    """The tensor map of a C-contiguous 16-bit CuPy array ``w`` [..., K] seen as [rows, K], for
    expert_gemm_ws stages of ``k_group`` K-tiles (2: 64-row boxes, of which a stage reads each
    row's 256 bytes at once, so without L2 promotion)."""
    columns = w.shape[-1]
    if k_group == 1:
        return _rows_map(w.data.ptr, w.size // columns, columns)
    return _rows_map(w.data.ptr, w.size // columns, columns, _L2_PROMOTION_NONE, WGMMA_BLOCK_ROWS)


def gate_up_pairs_map(w13, intermediate: int) -> np.void:
    """The tensor map of a C-contiguous 16-bit CuPy array ``w13`` [E, 2 I, K] (e4m3 byte pairs) for
    the FP8 gate/up stages of expert_gemm_ws: each box the TMA_BOX_ROWS / 2 gate rows of its
    columns and their up rows, in alternating groups of GATE_UP_PAIR_ROWS."""
    columns = w13.shape[-1]
    return _pairs_map(w13.data.ptr, w13.size // columns, columns, intermediate)
