"""cupymoe.dispatch on the NumPy and the CuPy backend, one test body for both: the Dispatch contract
checked from its definition (which fixes every array), a brute-force loop on small inputs, bad ids."""
import numpy as np
import pytest

import cupymoe
from helpers import ID_DTYPES, as_numpy, out_of_range_ids

FIELDS = ("counts", "offsets", "sorted_slots", "slot_positions")
ROUTINGS = ["distinct", "with-minus-one", "all-on-one", "empty-experts", "all-minus-one"]
# (T, k, E): empty, tiny, one expert, k = E, the most slots of the one-block GPU dispatch and one
# more, many slots over many or very few experts
CASES = [(0, 1, 8), (0, 8, 256), (1, 1, 1), (1, 8, 8), (3, 2, 8), (5, 2, 3), (33, 6, 64), (64, 8, 64),
         (300, 8, 8), (320, 8, 256), (2561, 1, 256), (777, 6, 64), (1000, 8, 256), (5000, 8, 256),
         (5000, 3, 3), (5000, 1, 3), (10000, 8, 64)]


def random_ids(rng, tokens, experts, top_k, routing):
    """ids [T, k] int64 for a routing pattern; may repeat ids within a token and hold -1."""
    if routing == "distinct":
        return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    if routing == "with-minus-one":
        return rng.integers(-1, experts, (tokens, top_k))
    if routing == "all-on-one":
        return np.full((tokens, top_k), experts - 1)
    if routing == "empty-experts":  # only even experts are used
        return 2 * rng.integers(0, (experts + 1) // 2, (tokens, top_k))
    return np.full((tokens, top_k), -1)  # "all-minus-one"


def check_contract(d, xp, topk_ids, experts):
    """The properties Dispatch documents, which determine its arrays, checked on the host."""
    ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    valid = (ids >= 0) & (ids < experts)
    assert (d.num_experts, d.top_k) == (experts, topk_ids.shape[1])
    assert type(d.num_experts) is int
    for name, size in zip(FIELDS, (experts, experts + 1, ids.size, ids.size)):
        array = getattr(d, name)
        assert isinstance(array, xp.ndarray) and array.dtype == np.int32 and array.shape == (size,), name
    counts, offsets, sorted_slots, positions = (as_numpy(getattr(d, name)) for name in FIELDS)
    np.testing.assert_array_equal(counts, np.bincount(ids[valid], minlength=experts))
    assert offsets[0] == 0
    np.testing.assert_array_equal(np.diff(offsets), counts)
    used = int(offsets[-1])
    for e in np.unique(ids[valid]):  # each expert's slots, ascending
        np.testing.assert_array_equal(sorted_slots[offsets[e]:offsets[e + 1]], np.flatnonzero(ids == e))
    assert (sorted_slots[used:] == -1).all()
    np.testing.assert_array_equal(positions[~valid], -1)
    np.testing.assert_array_equal(positions[sorted_slots[:used]], np.arange(used))


def brute_force(topk_ids, experts):
    """(counts, offsets, sorted_slots, slot_positions) as lists, one slot at a time."""
    flat = [int(e) for e in np.asarray(topk_ids).reshape(-1)]
    counts = [sum(1 for e in flat if e == expert) for expert in range(experts)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    sorted_slots = [s for e in range(experts) for s, id_ in enumerate(flat) if id_ == e]
    positions = [-1] * len(flat)
    for position, s in enumerate(sorted_slots):
        positions[s] = position
    return counts, offsets, sorted_slots + [-1] * (len(flat) - len(sorted_slots)), positions


@pytest.mark.sanitize
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens,top_k,experts", CASES)
def test_dispatch(xp, tokens, top_k, experts, routing, id_dtype):
    rng = np.random.default_rng([tokens, top_k, experts, ROUTINGS.index(routing)])
    ids = random_ids(rng, tokens, experts, top_k, routing).astype(id_dtype)
    d = cupymoe.dispatch(xp.asarray(ids), experts)
    check_contract(d, xp, ids, experts)
    if tokens * top_k <= 2400:
        for name, want in zip(FIELDS, brute_force(ids, experts)):
            assert as_numpy(getattr(d, name)).tolist() == want, name


def test_small_example(xp):
    ids = xp.asarray(np.array([[2, 0], [-1, 2], [0, 0]], np.int32))
    d = cupymoe.dispatch(ids, 3)
    assert as_numpy(d.counts).tolist() == [3, 0, 2]
    assert as_numpy(d.offsets).tolist() == [0, 3, 3, 5]
    assert as_numpy(d.sorted_slots).tolist() == [1, 4, 5, 0, 3, -1]
    assert as_numpy(d.slot_positions).tolist() == [3, 0, -1, 4, 1, 2]


@pytest.mark.sanitize
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_unchecked_out_of_range_ids_count_as_minus_one(xp, id_dtype):
    """With check_ids=False ids outside [-1, E) are dropped like -1; with the check they raise."""
    experts = 64
    rng = np.random.default_rng(id_dtype.itemsize)
    ids = random_ids(rng, 1000, experts, 8, "with-minus-one").astype(id_dtype)
    bad = rng.random(ids.shape) < 0.2
    as_minus_one = np.where(bad, -1, ids).astype(id_dtype)
    ids[bad] = rng.choice(out_of_range_ids(experts, id_dtype), int(bad.sum()))
    with pytest.raises(ValueError, match="^topk_ids: "):
        cupymoe.dispatch(xp.asarray(ids), experts)
    got = cupymoe.dispatch(xp.asarray(ids), experts, check_ids=False)
    check_contract(got, xp, as_minus_one, experts)


def test_is_deterministic(xp):
    ids = xp.asarray(random_ids(np.random.default_rng(0), 5000, 256, 8, "with-minus-one").astype(np.int32))
    runs = [cupymoe.dispatch(ids, 256) for _ in range(3)]
    for name in FIELDS:
        for run in runs[1:]:
            np.testing.assert_array_equal(as_numpy(getattr(run, name)), as_numpy(getattr(runs[0], name)), name)


def test_numpy_integer_num_experts(xp):
    d = cupymoe.dispatch(xp.asarray(np.array([[1, 0]], np.int32)), np.int64(2))
    assert d.num_experts == 2 and type(d.num_experts) is int
    assert as_numpy(d.counts).tolist() == [1, 1]
