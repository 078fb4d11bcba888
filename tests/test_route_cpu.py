"""cupymoe.route on NumPy logits against a brute-force softmax top-k."""
import math

import numpy as np
import pytest

import cupymoe
from helpers import BF16

DTYPES = [
    pytest.param(np.dtype(np.float32), id="f32"),
    pytest.param(BF16, id="bf16"),
    pytest.param(np.dtype(np.float16), id="f16"),
]


def brute_force_route(logits, top_k, renormalize):
    """(weights, ids) as lists: repeated argmax (ties to the lower id, NaN lowest), float64 softmax."""
    weights, ids = [], []
    for row in np.asarray(logits, dtype=np.float64):
        values = [-math.inf if math.isnan(v) else float(v) for v in row]
        chosen = []
        for _ in range(top_k):
            best = None
            for e, v in enumerate(values):
                if e not in chosen and (best is None or v > values[best]):
                    best = e
            chosen.append(best)
        top = max(values)
        exps = [math.exp(v - top) for v in values]
        probs = [exps[e] / sum(exps) for e in chosen]
        if renormalize:
            probs = [p / sum(probs) for p in probs]
        weights.append(probs)
        ids.append(chosen)
    return weights, ids


def check_route(logits, top_k, renormalize):
    weights, ids = cupymoe.route(logits, top_k, renormalize=renormalize)
    tokens = logits.shape[0]
    assert isinstance(weights, np.ndarray) and isinstance(ids, np.ndarray)
    assert weights.dtype == np.float32 and weights.shape == (tokens, top_k)
    assert ids.dtype == np.int32 and ids.shape == (tokens, top_k)
    want_weights, want_ids = brute_force_route(logits, top_k, renormalize)
    assert ids.tolist() == want_ids
    np.testing.assert_allclose(weights, np.array(want_weights).reshape(tokens, top_k), rtol=2e-6, atol=1e-7)
    if renormalize and tokens:
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k", [(1, 1), (4, 1), (4, 2), (8, 8), (64, 6), (128, 8)])
@pytest.mark.parametrize("tokens", [0, 1, 7, 50])
def test_route_random_logits(tokens, experts, top_k, dtype, renormalize):
    rng = np.random.default_rng([tokens, experts, top_k, dtype.itemsize])
    logits = (3 * rng.standard_normal((tokens, experts), dtype=np.float32)).astype(dtype)
    check_route(logits, top_k, renormalize)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_ties(dtype, renormalize):
    rng = np.random.default_rng(dtype.itemsize)
    logits = rng.integers(-2, 3, (40, 16)).astype(dtype)  # five distinct values: many ties
    logits[0] = 1  # a whole row tied
    logits[1] = 0
    logits[1, ::2] = 2  # ties among the even ids
    check_route(logits, 4, renormalize)
    _, ids = cupymoe.route(logits, 4, renormalize=renormalize)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_nan_ranks_lowest(dtype, renormalize):
    rng = np.random.default_rng(10 + dtype.itemsize)
    logits = rng.standard_normal((20, 8), dtype=np.float32).astype(dtype)
    logits[rng.random((20, 8)) < 0.3] = np.nan
    logits[:, 7] = -30  # every row keeps a finite logit
    logits[0, :] = np.nan
    logits[0, 5] = -1  # one finite logit: it comes first, then the NaNs by id
    check_route(logits, 8, renormalize)
    _, ids = cupymoe.route(logits, 8, renormalize=renormalize)
    assert ids[0].tolist() == [5, 0, 1, 2, 3, 4, 6, 7]


def test_route_numpy_integer_top_k_and_strided_logits():
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((9, 32), dtype=np.float32)
    logits = wide[:, ::2]
    want = cupymoe.route(np.ascontiguousarray(logits), 3)
    got = cupymoe.route(logits, np.int64(3))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
