"""Shared test helpers: random problems, an independent float64 oracle, error metrics, and the
tolerances and bad values every test file uses."""
import math

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")]
ID_DTYPES = [pytest.param(np.dtype(np.int32), id="int32"), pytest.param(np.dtype(np.int64), id="int64")]

# The GPU against cupymoe's NumPy reference: the same roundings (h and each expert's output to the
# activation dtype), only the fp32 summation order differs, so a few elements round to the
# neighbouring bf16 value (3.9e-3 of the element) and the relative L2 error stays near 1e-3.
REFERENCE_TOL = 3e-3
# Anything against the float64 oracle: h and the expert outputs are rounded to bf16 (8 bits of
# mantissa, 2e-3 relative rms), then summed over k experts.
ORACLE_TOL = 1e-2
ORACLE_TOKENS = 8  # the oracle is a Python loop: compare it on the first tokens only
# FP8 (w8a8) against the float64 oracle on the dequantized weights: x and h are quantized to e4m3
# (3 mantissa bits: rounding errors up to 2^-4 of a value, 2.5-3% rms), and the errors of the two
# GEMMs add, which lands near 4% on Gaussian data.
FP8_ORACLE_TOL = 6e-2
# The FP8 GPU path against the NumPy backend: the same quantization steps, but the float32 sums run
# in another order, which now and then moves an h value to the neighbouring bf16 value and its e4m3
# rounding with it (2^-4 of that element).
FP8_REFERENCE_TOL = 1e-2
# The FP8 GPU path against the independent w8a8 oracle (float64), on a few tokens: the same moves,
# and Hopper's e4m3 wgmma keeps fewer bits than float32 while it sums a K-tile (about 14, DeepSeek-V3
# report 3.3.2), so more h values cross to the other bf16 neighbour (measured up to 1.2e-2, H100).
FP8_GPU_ORACLE_TOL = 2e-2
# fp8.matmul against float64 on the same quantized operands: only the float32 sums differ.
FP8_MATMUL_RTOL = 1e-5
# Router weights against a float64 softmax: float32 exp and a sum over up to 256 terms.
ROUTE_RTOL, ROUTE_ATOL = 1e-5, 1e-6


def out_of_range_ids(experts, id_dtype):
    """Ids outside [-1, E), which count as -1 with check_ids=False: just past each end, far off, the
    dtype's extremes and, for int64, values that would alias expert 0 if truncated to 32 bits."""
    info = np.iinfo(id_dtype)
    values = [experts, experts + 3, 300, -2, -5, info.max, info.min]
    if info.bits == 64:
        values += [2**33, -(2**40)]
    return np.array(values, id_dtype)


def random_problem(rng, tokens, hidden, experts, inter, top_k, dtype=BF16, routing="uniform"):
    """Return numpy (x, w13, w2, topk_ids int32, topk_weights float32) with distinct ids per token.

    routing: "uniform" (distinct random experts), "one" (every token's first choice is expert 0),
    "sparse" (only experts in the lower half are used, so some have no tokens).
    """
    x = rng.standard_normal((tokens, hidden), dtype=np.float32).astype(dtype)
    w13 = (rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(dtype)
    w2 = (rng.standard_normal((experts, hidden, inter), dtype=np.float32) / np.sqrt(inter)).astype(dtype)
    pool = experts if routing != "sparse" else max(top_k, experts // 2)
    ids = np.argsort(rng.random((tokens, pool)), axis=1, kind="stable")[:, :top_k].astype(np.int32)
    if routing == "one":
        ids = np.argsort(rng.random((tokens, experts - 1)), axis=1)[:, : top_k - 1].astype(np.int32) + 1
        ids = np.concatenate([np.zeros((tokens, 1), np.int32), ids], axis=1)
    logits = rng.standard_normal((tokens, top_k)).astype(np.float32)
    weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return x, w13, w2, ids, weights.astype(np.float32)


def oracle_activation(activation, g, u):
    """act(g, u) in float64, from each family's definition."""
    if activation == "silu":
        return g / (1.0 + np.exp(-g)) * u
    if activation == "gelu":
        return 0.5 * g * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0))) * u
    if activation == "gelu_tanh":
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))) * u
    assert activation == "swigluoai"
    g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    return g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)


def oracle(x, w13, w2, topk_ids, topk_weights, activation="silu", w13_bias=None, w2_bias=None, on_input=False):
    """float64 loop over tokens and slots, written independently of cupymoe.reference."""
    x64 = x.astype(np.float64)
    inter = w13.shape[1] // 2
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0 or e >= w13.shape[0]:
                continue
            weight = float(topk_weights[t, j])
            xt = x64[t] * weight if on_input else x64[t]
            w = w13[e].astype(np.float64)
            g = w[:inter] @ xt
            u = w[inter:] @ xt
            if w13_bias is not None:
                g = g + w13_bias[e, :inter].astype(np.float64)
                u = u + w13_bias[e, inter:].astype(np.float64)
            y = w2[e].astype(np.float64) @ oracle_activation(activation, g, u)
            if w2_bias is not None:
                y = y + w2_bias[e].astype(np.float64)
            out[t] += y if on_input else weight * y
    return out


def rel_l2(got, want):
    got = np.asarray(as_numpy(got), dtype=np.float64)
    want = np.asarray(as_numpy(want), dtype=np.float64)
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))


def poison(a):
    """Fill a bfloat16 or float16 array (NumPy or CuPy) with NaN in place and return it.

    Writes the NaN bit pattern through a uint16 view, so it needs no float support for the dtype.
    """
    a.view(np.uint16).fill(0x7E00 if a.dtype == np.float16 else 0x7FC0)
    return a


def as_numpy(a):
    """A NumPy array of ``a``, copied to the host if it is a CuPy array."""
    return a if isinstance(a, np.ndarray) else a.get()


def to_xp(xp, *arrays):
    """The host arrays as arrays of ``xp`` (CuPy: copies on the current device and stream)."""
    return tuple(xp.asarray(a) for a in arrays)


def to_gpu(*arrays):
    """CuPy copies of host arrays, on the current device and stream."""
    import cupy

    return to_xp(cupy, *arrays)


def host_bits(a):
    """The raw 16-bit patterns of a bf16/fp16 array (NumPy or CuPy), on the host."""
    return as_numpy(a).view(np.uint16)
