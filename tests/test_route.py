"""cupymoe.route on the NumPy and the CuPy backend, one test body for both, against a brute-force
softmax top-k: ids exactly, weights to float32 rounding (ROUTE_RTOL, ROUTE_ATOL)."""
import math

import numpy as np
import pytest

import cupymoe
from helpers import BF16, FP16, ROUTE_ATOL, ROUTE_RTOL, as_numpy

LOGIT_DTYPES = [pytest.param(np.dtype(np.float32), id="f32"), pytest.param(BF16, id="bf16"),
                pytest.param(FP16, id="f16")]


def argmax_order(values, count):
    """The indices of the ``count`` largest values by repeated argmax, ties to the lower index."""
    chosen = []
    for _ in range(count):
        best = None
        for i, v in enumerate(values):
            if i not in chosen and (best is None or v > values[best]):
                best = i
        chosen.append(best)
    return chosen


def brute_force_route(logits, top_k, renormalize):
    """(weights, ids) as lists: repeated argmax (ties to the lower id, NaN lowest), float64 softmax."""
    weights, ids = [], []
    for row in np.asarray(logits, dtype=np.float64):
        values = [-math.inf if math.isnan(v) else float(v) for v in row]
        chosen = argmax_order(values, top_k)
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


def brute_force_sigmoid(logits, top_k, renormalize, num_groups, topk_groups, bias, scaling_factor):
    """(weights, ids) as lists of sigmoid routing in float64 by repeated argmax: groups by the sum of
    their two best biased scores, experts by biased score among the kept groups (ties to the lower
    id, NaN lowest), weighted by the unbiased scores."""
    weights, ids = [], []
    experts = logits.shape[1]
    size = experts // num_groups
    bias = np.zeros(experts) if bias is None else np.asarray(bias, np.float64)
    for row in np.asarray(logits, dtype=np.float64):
        scores = [1 / (1 + math.exp(-v)) if not math.isnan(v) else math.nan for v in row]
        biased = [-math.inf if math.isnan(s) else s + b for s, b in zip(scores, bias)]
        group_scores = [sum(sorted(biased[g * size:(g + 1) * size])[-2:]) for g in range(num_groups)]
        kept = argmax_order([-math.inf if math.isnan(v) else v for v in group_scores], topk_groups)
        eligible = [v if e // size in kept else -math.inf for e, v in enumerate(biased)]
        chosen = argmax_order(eligible, top_k)
        picked = [scores[e] for e in chosen]
        if renormalize:
            picked = [p / (sum(picked) + 1e-20) for p in picked]
        weights.append([p * scaling_factor for p in picked])
        ids.append(chosen)
    return weights, ids


def check_sigmoid(xp, logits, top_k, renormalize=True, num_groups=1, topk_groups=1, bias=None, scaling_factor=1.0):
    weights, ids = cupymoe.route(xp.asarray(logits), top_k, scoring="sigmoid", renormalize=renormalize,
                                 num_groups=num_groups, topk_groups=topk_groups,
                                 correction_bias=None if bias is None else xp.asarray(bias),
                                 scaling_factor=scaling_factor)
    tokens = logits.shape[0]
    assert isinstance(weights, xp.ndarray) and weights.dtype == np.float32 and weights.shape == (tokens, top_k)
    assert isinstance(ids, xp.ndarray) and ids.dtype == np.int32 and ids.shape == (tokens, top_k)
    weights, ids = as_numpy(weights), as_numpy(ids)
    want_weights, want_ids = brute_force_sigmoid(logits, top_k, renormalize, num_groups, topk_groups, bias,
                                                 scaling_factor)
    assert ids.tolist() == want_ids
    np.testing.assert_allclose(weights, np.array(want_weights).reshape(tokens, top_k), rtol=ROUTE_RTOL,
                               atol=ROUTE_ATOL)
    return weights, ids


# (E, k, groups, kept groups, renormalize, scaling): DeepSeek-V3's, a smaller grouped one, GLM-4.5's
# ungrouped one, Llama-4's top-1 without renormalisation, and a group per pair of experts.
SIGMOID_CASES = [(256, 8, 8, 4, True, 2.5), (64, 6, 8, 3, True, 1.0), (160, 8, 1, 1, True, 2.5),
                 (16, 1, 1, 1, False, 1.0), (64, 4, 32, 5, False, 1.5), (8, 8, 1, 1, True, 1.0)]


@pytest.mark.sanitize
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("experts,top_k,groups,kept,renormalize,scaling", SIGMOID_CASES)
@pytest.mark.parametrize("tokens", [0, 1, 7, 50])
def test_sigmoid_random_logits(xp, tokens, experts, top_k, groups, kept, renormalize, scaling, dtype, with_bias):
    rng = np.random.default_rng([tokens, experts, top_k, groups, dtype.itemsize, with_bias])
    logits = (2 * rng.standard_normal((tokens, experts), dtype=np.float32)).astype(dtype)
    bias = (0.1 * rng.standard_normal(experts)).astype(np.float32) if with_bias else None
    weights, _ = check_sigmoid(xp, logits, top_k, renormalize, groups, kept, bias, scaling)
    if renormalize and tokens:
        np.testing.assert_allclose(weights.sum(axis=1), scaling, rtol=ROUTE_RTOL)


def test_sigmoid_choice_takes_the_bias_and_weights_do_not(xp):
    """A large bias on expert 3 picks it in every row, but its weight stays its unbiased score."""
    logits = np.random.default_rng(5).standard_normal((20, 16), dtype=np.float32)
    bias = np.zeros(16, np.float32)
    bias[3] = 10.0
    weights, ids = check_sigmoid(xp, logits, 2, False, bias=bias)
    assert (ids[:, 0] == 3).all()
    np.testing.assert_allclose(weights[:, 0], 1 / (1 + np.exp(-logits[:, 3].astype(np.float64))), rtol=ROUTE_RTOL)


def test_sigmoid_ties_go_to_the_lower_expert_and_group(xp):
    """Equal logits everywhere: groups 0..kept-1, then their experts in id order."""
    logits = np.zeros((3, 64), np.float32)
    _, ids = check_sigmoid(xp, logits, 8, num_groups=8, topk_groups=2)
    assert ids[0].tolist() == list(range(8))
    logits[1, 40:48] = 1.0  # group 5's best: it is kept first
    logits[2, 8:16] = np.nan  # group 1 drops below every finite group
    _, ids = check_sigmoid(xp, logits, 12, num_groups=8, topk_groups=2)
    assert ids[1].tolist() == list(range(40, 48)) + [0, 1, 2, 3]
    assert ids[2].tolist() == list(range(8)) + [16, 17, 18, 19]


@pytest.mark.parametrize("num_groups,topk_groups", [(1, 1), (8, 4)])
def test_sigmoid_nan_ranks_lowest(xp, num_groups, topk_groups):
    rng = np.random.default_rng(num_groups)
    logits = rng.standard_normal((40, 64), dtype=np.float32)
    nan = rng.random((40, 64)) < 0.2
    logits[nan] = np.nan
    _, ids = check_sigmoid(xp, logits, 4, True, num_groups, topk_groups)
    assert not np.take_along_axis(nan, ids.astype(np.int64), axis=1).any()
