"""The router GEMM (kernels_cu/router_logits.cu): float32 logits against float64, every tile giving
the same bits, and a token's logits the same in every batch."""
import numpy as np
import pytest

from cupymoe import _gpu_router_logits
from helpers import BF16, FP16, as_numpy, host_bits, poison, to_gpu

pytestmark = pytest.mark.gpu
FLOAT32 = np.dtype(np.float32)


def sum_error_bound(x, w):
    """|error| of a float32 sum of the exact products x[t, h] w[n, h]: gamma_n * sum |x w| (Higham), n
    the longest chain a logit is added along: 4 fmas per 128 columns in a lane, then 5 butterfly adds."""
    chain = 4 * -(-x.shape[1] // 128) + 5
    eps = 2.0**-24
    return chain * eps / (1 - chain * eps) * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)


def draw(rng, tokens, outputs, hidden, x_dtype, w_dtype):
    x = rng.standard_normal((tokens, hidden), dtype=np.float32).astype(x_dtype)
    w = (rng.standard_normal((outputs, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(w_dtype)
    return x, w


def logits(x, w, bias=None, tile=None, **flags):
    import cupy

    out = poison(cupy.empty((x.shape[0], w.shape[0]), np.float32))
    _gpu_router_logits.run(x, w, bias, out, tile=tile, **flags)
    return out


@pytest.mark.parametrize("x_dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("same_w", [True, False], ids=["w-like-x", "w-float32"])
@pytest.mark.parametrize("tokens,outputs,hidden", [(1, 256, 7168), (5, 7, 4160), (37, 1, 192), (300, 260, 2048), (70, 64, 4)])
def test_every_tile_matches_float64_with_the_same_bits(x_dtype, same_w, tokens, outputs, hidden):
    rng = np.random.default_rng([tokens, outputs, hidden])
    x, w = draw(rng, tokens, outputs, hidden, x_dtype, x_dtype if same_w else FLOAT32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bound = sum_error_bound(x, w)
    gx, gw = to_gpu(x, w)
    first = None
    for tile in _gpu_router_logits.TILES:
        got = as_numpy(logits(gx, gw, tile=tile))
        assert np.all(np.abs(got - want) <= bound), tile
        if first is None:
            first = host_bits(got)
        np.testing.assert_array_equal(host_bits(got), first, err_msg=str(tile))


def test_a_tokens_logits_are_the_same_in_every_batch():
    rng = np.random.default_rng(7)
    x, w = draw(rng, 700, 256, 7168, BF16, BF16)
    gx, gw = to_gpu(x, w)
    whole = host_bits(logits(gx, gw))
    for tokens in (1, 3, 64, 65, 256, 257):  # both of tile_for's choices, and partial blocks
        np.testing.assert_array_equal(host_bits(logits(gx[:tokens], gw)), whole[:tokens], err_msg=str(tokens))
    np.testing.assert_array_equal(host_bits(logits(gx[300:], gw)), whole[300:])


def test_bias_rounding_and_sigmoid():
    import cupy

    rng = np.random.default_rng(3)
    x, w = draw(rng, 40, 32, 512, BF16, BF16)
    bias = rng.standard_normal(32).astype(np.float32)
    gx, gw, gb = to_gpu(x, w, bias)
    plain = as_numpy(logits(gx, gw))
    np.testing.assert_array_equal(as_numpy(logits(gx, gw, gb)), plain + bias)  # one float32 add
    rounded = as_numpy(logits(gx, gw, gb, round_to_x=True))
    np.testing.assert_array_equal(rounded, (plain + bias).astype(BF16).astype(np.float32))
    gated = as_numpy(logits(gx, gw, gb, round_to_x=True, apply_sigmoid=True))
    np.testing.assert_allclose(gated, 1.0 / (1.0 + np.exp(-rounded.astype(np.float64))), rtol=1e-6, atol=0)
    empty = cupy.empty((0, 32), np.float32)
    _gpu_router_logits.run(gx[:0], gw, None, empty)  # T = 0 launches nothing
