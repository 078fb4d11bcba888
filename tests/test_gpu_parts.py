"""GPU tier for the parts: the dispatch and route kernels against the NumPy versions of the same API."""
import numpy as np
import pytest

import cupymoe
from helpers import BF16

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DISPATCH_FIELDS = ("counts", "offsets", "sorted_slots", "slot_positions")
# (T, k, E): empty, tiny, one expert, k = E, the most slots of the one-block dispatch and one more,
# many slots over many or very few experts
DISPATCH_CASES = [(0, 1, 8), (0, 8, 256), (1, 1, 1), (1, 8, 8), (3, 2, 8), (64, 8, 64), (320, 8, 256),
                  (2561, 1, 256), (777, 6, 64),
                  (1000, 8, 256), (5000, 8, 256), (5000, 3, 3), (5000, 1, 3), (10000, 8, 64)]
LOGIT_DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.float16)]
LOGIT_IDS = ["f32", "bf16", "f16"]


def routing_ids(rng, tokens, top_k, experts, routing):
    """Expert ids [T, k] (int64): "random" repeats ids within a token and has -1s, "distinct" does
    not, "one" puts every slot on the last expert, "none" routes nothing."""
    if routing == "random":
        return rng.integers(-1, experts, (tokens, top_k))
    if routing == "distinct":
        return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.full((tokens, top_k), experts - 1 if routing == "one" else -1)


def check_dispatch(ids, experts, check_ids=True):
    """dispatch on CuPy ids equals dispatch on the NumPy ids, array for array; returns the GPU one."""
    want = cupymoe.dispatch(ids, experts, check_ids=check_ids)
    got = cupymoe.dispatch(cupy.asarray(ids), experts, check_ids=check_ids)
    assert (got.num_experts, got.top_k) == (want.num_experts, want.top_k)
    for name in DISPATCH_FIELDS:
        array = getattr(got, name)
        assert isinstance(array, cupy.ndarray) and array.dtype == np.int32, name
        np.testing.assert_array_equal(cupy.asnumpy(array), getattr(want, name), err_msg=name)
    return got


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("routing", ["random", "distinct", "one", "none"])
@pytest.mark.parametrize("tokens,top_k,experts", DISPATCH_CASES)
def test_dispatch_matches_numpy(tokens, top_k, experts, routing, id_dtype):
    rng = np.random.default_rng([tokens, top_k, experts])
    check_dispatch(routing_ids(rng, tokens, top_k, experts, routing).astype(id_dtype), experts)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_dispatch_unchecked_out_of_range_ids(id_dtype):
    """With check_ids=False ids outside [-1, E) are dropped like -1, on both sides."""
    experts = 64
    rng = np.random.default_rng(np.dtype(id_dtype).itemsize)
    ids = routing_ids(rng, 1000, 8, experts, "random").astype(id_dtype)
    info = np.iinfo(id_dtype)
    bad_values = [experts, 300, -5, -2, info.max, info.min]
    if info.bits == 64:
        bad_values += [2**33, -(2**40)]  # both would alias expert 0 if truncated to 32 bits
    bad = rng.random(ids.shape) < 0.2
    as_minus_one = np.where(bad, -1, ids).astype(id_dtype)
    ids[bad] = rng.choice(bad_values, int(bad.sum()))
    got = check_dispatch(ids, experts, check_ids=False)
    want = cupymoe.dispatch(as_minus_one, experts)
    for name in DISPATCH_FIELDS:
        np.testing.assert_array_equal(cupy.asnumpy(getattr(got, name)), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("bad", [8, 300, -5])
def test_dispatch_checked_out_of_range_ids_raise(bad):
    ids = cupy.zeros((16, 2), np.int32)
    ids[5, 1] = bad
    with pytest.raises(ValueError, match="topk_ids"):
        cupymoe.dispatch(ids, 8)


def test_dispatch_is_deterministic():
    ids = cupy.asarray(routing_ids(np.random.default_rng(0), 5000, 8, 256, "random").astype(np.int32))
    runs = [cupymoe.dispatch(ids, 256) for _ in range(3)]
    for name in DISPATCH_FIELDS:
        want = cupy.asnumpy(getattr(runs[0], name))
        for run in runs[1:]:
            np.testing.assert_array_equal(cupy.asnumpy(getattr(run, name)), want, err_msg=name)


def check_route(logits, top_k, renormalize=True):
    """route on CuPy logits against the NumPy route: ids exactly, weights to float32 rounding.

    Returns the GPU (weights, ids) on the host.
    """
    want_weights, want_ids = cupymoe.route(logits, top_k, renormalize=renormalize)
    got_weights, got_ids = cupymoe.route(cupy.asarray(logits), top_k, renormalize=renormalize)
    assert isinstance(got_ids, cupy.ndarray) and isinstance(got_weights, cupy.ndarray)
    assert got_ids.dtype == np.int32 and got_weights.dtype == np.float32
    got_weights, got_ids = cupy.asnumpy(got_weights), cupy.asnumpy(got_ids)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-5, atol=1e-6)
    return got_weights, got_ids


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=LOGIT_IDS)
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("experts", [8, 64, 256])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_route_matches_numpy(tokens, experts, top_k, dtype, renormalize):
    rng = np.random.default_rng([tokens, experts, top_k])
    logits = (3 * rng.standard_normal((tokens, experts), dtype=np.float32)).astype(dtype)
    check_route(logits, top_k, renormalize)


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=LOGIT_IDS)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 8), (256, 8)])
def test_route_ties_go_to_lower_id(experts, top_k, dtype):
    """Logits drawn from {0, 1, 2} tie everywhere; a row of equal logits picks experts 0..k-1."""
    logits = np.random.default_rng(experts).integers(0, 3, (300, experts)).astype(dtype)
    logits[0] = 1
    weights, ids = check_route(logits, top_k)
    np.testing.assert_array_equal(ids[0], np.arange(top_k))
    np.testing.assert_allclose(weights[0], 1 / top_k, rtol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=LOGIT_IDS)
@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 8), (256, 8)])
def test_route_nan_ranks_lowest(experts, top_k, dtype, renormalize):
    """NaN logits are never picked while k finite ones remain (row 0: only the last k are finite)."""
    tokens = 300
    rng = np.random.default_rng(experts)
    logits = rng.standard_normal((tokens, experts), dtype=np.float32).astype(dtype)
    nan = rng.random((tokens, experts)) < 0.4
    keep = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    np.put_along_axis(nan, keep, False, axis=1)
    nan[0] = True
    nan[0, -top_k:] = False
    logits[nan] = np.nan
    _, ids = check_route(logits, top_k, renormalize)
    assert not np.take_along_axis(nan, ids.astype(np.int64), axis=1).any()
    np.testing.assert_array_equal(np.sort(ids[0]), np.arange(experts - top_k, experts))


def test_plans_fit_this_gpu():
    """The workspace plans with this GPU's shared memory; every plan's configs fit it."""
    from cupymoe import _compile, experts

    device_id = cupy.cuda.Device().id
    limit = _compile.shared_memory_limit(device_id)
    capability = _compile.compute_capability(device_id)
    assert limit >= experts.SHARED_LIMIT_SMALLEST
    for tokens in (1, 64, 512, 2048, 8192):
        p = experts.plan(tokens, 8, 256, 4096, 1024, capability, limit)
        assert p.gate_up.shared_bytes(True) <= limit and p.down.shared_bytes(False) <= limit
