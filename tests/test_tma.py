"""The TMA tensor maps of the weights (host side): what is asked of the driver, and its errors."""
import ctypes

import numpy as np
import pytest

from cupymoe import _tma


class FakeEncode:
    """Stands in for cuTensorMapEncodeTiled: records the request, returns ``status``."""

    def __init__(self, status=0):
        self.status, self.calls = status, []

    def __call__(self, out, dtype, rank, address, dims, strides, box, element_strides, *modes):
        self.calls.append(dict(dtype=dtype, rank=rank, address=address.value, dims=list(dims[:rank]),
                               strides=list(strides[:rank - 1]), box=list(box[:rank]), modes=modes))
        ctypes.memset(out, 0xAB, 128)
        return self.status


@pytest.fixture
def fake(monkeypatch):
    encode = FakeEncode()
    monkeypatch.setattr(_tma, "_encode_tiled", lambda: encode)
    _tma._rows_map.cache_clear()
    _tma._pairs_map.cache_clear()
    yield encode
    _tma._rows_map.cache_clear()
    _tma._pairs_map.cache_clear()


def test_map_is_a_128_byte_struct():
    assert _tma.TENSOR_MAP.itemsize == 128 and len(_tma.TENSOR_MAP.names) == 16


def test_weights_are_rows_of_k_in_128_row_boxes_with_128_byte_swizzle(fake):
    got = _tma._rows_map(0x10000, 256 * 2048, 4096)
    call, = fake.calls
    assert call["dims"] == [4096, 256 * 2048]  # innermost first: K, then every expert's rows
    assert call["strides"] == [4096 * 2]
    assert call["box"] == [64, 128]  # 64 values = 128 bytes, the kernels' BK and BOX_ROWS
    assert call["modes"] == (_tma._INTERLEAVE_NONE, _tma._SWIZZLE_128B, _tma._L2_PROMOTION_256B,
                             _tma._OOB_FILL_NONE)
    assert call["address"] == 0x10000 and call["rank"] == 2
    assert got.tobytes() == b"\xab" * 128


def test_fp8_gate_up_rows_come_in_pairs_of_gate_and_up_rows(fake):
    # w13 [E = 4, 2 I = 2048, H = 4096 bytes] of e4m3, moved as 2048 16-bit pairs a row
    _tma._pairs_map(0x10000, 4 * 2048, 2048, 1024)
    call, = fake.calls
    row = 2048 * 2
    assert call["rank"] == 4
    assert call["dims"] == [2048, 8, 2, 4 * 2048 // 8]  # K, a row of the pair, gate or up, the pair
    assert call["strides"] == [row, 1024 * row, 8 * row]  # up rows are I rows below their gate rows
    assert call["box"] == [64, 8, 2, 8]  # 128 bytes of K, 8 pairs: 64 columns' gate and up rows
    assert call["modes"][1] == _tma._SWIZZLE_128B


def test_same_array_reuses_the_map(fake):
    _tma._rows_map(0x10000, 512, 256)
    _tma._rows_map(0x10000, 512, 256)
    _tma._rows_map(0x20000, 512, 256)
    assert len(fake.calls) == 2


def test_promotion_is_asked_for_and_keys_the_cache(fake):
    _tma._rows_map(0x10000, 512, 256)
    _tma._rows_map(0x10000, 512, 256, 0)  # no promotion, as benchmarks/tma_read.py asks for
    assert [call["modes"][2] for call in fake.calls] == [_tma._L2_PROMOTION_256B, 0]


class FakeWeights:
    """What weight_rows_map reads of a CuPy array."""

    def __init__(self, address, shape):
        self.data = type("Pointer", (), {"ptr": address})()
        self.shape, self.size = shape, int(np.prod(shape))


def test_two_k_tile_stages_take_64_row_boxes_without_promotion(fake):
    _tma.weight_rows_map(FakeWeights(0x10000, (8, 512, 256)), 2)
    call, = fake.calls
    assert call["dims"] == [256, 8 * 512] and call["box"] == [64, 64]
    assert call["modes"][2] == _tma._L2_PROMOTION_NONE


def test_driver_error_names_the_request(fake):
    fake.status = 1
    with pytest.raises(RuntimeError, match=r"CUresult 1 for 512 rows of 256 16-bit values at 0x30000"):
        _tma._rows_map(0x30000, 512, 256)
