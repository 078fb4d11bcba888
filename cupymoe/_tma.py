"""TMA tensor maps of the expert weights, encoded by the CUDA driver (libcuda) through ctypes.

A map describes a weight array as [rows, K] of 16-bit values, read in boxes of TMA_BOX_ROWS rows
(WGMMA_BLOCK_ROWS for stages of two K-tiles) by K_TILE columns (128 bytes) into 128-byte-swizzled
shared memory: the layout of one stage of the weight tile in ``kernels_cu/expert_gemm_ws.cu``
(the constants come from ``_contract``). It is passed by value as a ``__grid_constant__`` kernel
parameter, so CUDA graphs capture it with the launch.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from ._contract import K_TILE, TMA_BOX_ROWS, WGMMA_BLOCK_ROWS

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


@functools.lru_cache(maxsize=64)  # a map depends only on its arguments, so reuse is always exact
def _rows_map(address: int, rows: int, columns: int, promotion: int = _L2_PROMOTION_256B,
              box_rows: int = TMA_BOX_ROWS) -> np.void:
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    out = np.zeros(1, TENSOR_MAP)
    status = _encode_tiled()(
        out.ctypes.data, _DATA_UINT16, 2, ctypes.c_void_p(address), (u64 * 2)(columns, rows),
        (u64 * 1)(2 * columns), (u32 * 2)(K_TILE, box_rows), (u32 * 2)(1, 1),
        _INTERLEAVE_NONE, _SWIZZLE_128B, promotion, _OOB_FILL_NONE)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for {rows} rows of "
                           f"{columns} 16-bit values at 0x{address:x}")
    return out[0]


def weight_rows_map(w, k_group: int = 1) -> np.void:
    """The tensor map of a C-contiguous 16-bit CuPy array ``w`` [..., K] seen as [rows, K], for
    expert_gemm_ws stages of ``k_group`` K-tiles (2: 64-row boxes, of which a stage reads each
    row's 256 bytes at once, so without L2 promotion)."""
    columns = w.shape[-1]
    if k_group == 1:
        return _rows_map(w.data.ptr, w.size // columns, columns)
    return _rows_map(w.data.ptr, w.size // columns, columns, _L2_PROMOTION_NONE, WGMMA_BLOCK_ROWS)
