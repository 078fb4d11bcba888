"""cupymoe.route on the NumPy and the CuPy backend, one test body for both, against a brute-force
softmax top-k: ids exactly, weights to float32 rounding (ROUTE_RTOL, ROUTE_ATOL)."""
import math

import numpy as np
import pytest

import cupymoe
from helpers import BF16, FP16, ROUTE_ATOL, ROUTE_RTOL, as_numpy

LOGIT_DTYPES = [pytest.param(np.dtype(np.float32), id="f32"), pytest.param(BF16, id="bf16"),
                pytest.param(FP16, id="f16")]


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


def check_route(xp, logits, top_k, renormalize=True):
    """route on ``xp`` logits against the brute force; returns (weights, ids) on the host."""
    weights, ids = cupymoe.route(xp.asarray(logits), top_k, renormalize=renormalize)
    tokens = logits.shape[0]
    assert isinstance(weights, xp.ndarray) and isinstance(ids, xp.ndarray)
    assert weights.dtype == np.float32 and weights.shape == (tokens, top_k)
    assert ids.dtype == np.int32 and ids.shape == (tokens, top_k)
    weights, ids = as_numpy(weights), as_numpy(ids)
    want_weights, want_ids = brute_force_route(logits, top_k, renormalize)
    assert ids.tolist() == want_ids
    np.testing.assert_allclose(weights, np.array(want_weights).reshape(tokens, top_k), rtol=ROUTE_RTOL,
                               atol=ROUTE_ATOL)
    return weights, ids


@pytest.mark.sanitize
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("experts,top_k", [(1, 1), (4, 2), (8, 1), (8, 8), (64, 6), (128, 8), (256, 2), (256, 8)])
@pytest.mark.parametrize("tokens", [0, 1, 7, 50])
def test_random_logits(xp, tokens, experts, top_k, dtype, renormalize):
    rng = np.random.default_rng([tokens, experts, top_k, dtype.itemsize])
    logits = (3 * rng.standard_normal((tokens, experts), dtype=np.float32)).astype(dtype)
    weights, _ = check_route(xp, logits, top_k, renormalize)
    if renormalize and tokens:
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=ROUTE_RTOL)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("experts,top_k", [(16, 4), (64, 8), (256, 8)])
def test_ties_go_to_the_lower_id(xp, experts, top_k, dtype, renormalize):
    """Logits from five values tie everywhere; a row of equal logits picks experts 0..k-1, and a row
    tied among its even ids picks the lowest even ones."""
    logits = np.random.default_rng(experts).integers(-2, 3, (60, experts)).astype(dtype)
    logits[0] = 1
    logits[1] = 0
    logits[1, ::2] = 2
    weights, ids = check_route(xp, logits, top_k, renormalize)
    assert ids[0].tolist() == list(range(top_k))
    assert ids[1].tolist() == list(range(0, 2 * top_k, 2))
    if renormalize:
        np.testing.assert_allclose(weights[0], 1 / top_k, rtol=ROUTE_RTOL)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (8, 8), (64, 8), (256, 8)])
def test_nan_ranks_lowest(xp, experts, top_k, dtype, renormalize):
    """NaN logits are never picked while finite ones remain; a row of NaNs but one picks that one,
    then the NaNs by id."""
    rng = np.random.default_rng(experts + dtype.itemsize)
    logits = rng.standard_normal((40, experts), dtype=np.float32).astype(dtype)
    nan = rng.random((40, experts)) < 0.4
    keep = np.argsort(rng.random((40, experts)), axis=1)[:, :top_k]
    np.put_along_axis(nan, keep, False, axis=1)
    nan[0] = True
    nan[0, 5 % experts] = False
    logits[nan] = np.nan
    _, ids = check_route(xp, logits, top_k, renormalize)
    assert not np.take_along_axis(nan[1:], ids[1:].astype(np.int64), axis=1).any()
    assert ids[0].tolist() == [5 % experts] + [e for e in range(experts) if e != 5 % experts][:top_k - 1]


def test_numpy_integer_top_k_and_strided_logits(xp):
    wide = xp.asarray(np.random.default_rng(3).standard_normal((9, 32), dtype=np.float32))
    want = cupymoe.route(xp.ascontiguousarray(wide[:, ::2]), 3)
    got = cupymoe.route(wide[:, ::2], np.int64(3))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(as_numpy(a), as_numpy(b))
