"""cupymoe.dispatch on NumPy ids: its invariants and a brute-force loop."""
import numpy as np
import pytest

import cupymoe


def brute_force_dispatch(topk_ids, experts):
    """(counts, offsets, sorted_slots, slot_positions) as Python lists, one slot at a time."""
    flat = [int(e) for e in np.asarray(topk_ids).reshape(-1)]
    counts = [0] * experts
    for e in flat:
        if 0 <= e < experts:
            counts[e] += 1
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    sorted_slots = [s for e in range(experts) for s, id_ in enumerate(flat) if id_ == e]
    slot_positions = [-1] * len(flat)
    for position, s in enumerate(sorted_slots):
        slot_positions[s] = position
    sorted_slots += [-1] * (len(flat) - len(sorted_slots))
    return counts, offsets, sorted_slots, slot_positions


def random_ids(rng, tokens, experts, top_k, routing):
    """ids [T, k] int32 for a routing pattern; may repeat ids and hold -1 / out-of-range ids."""
    if routing == "distinct":
        return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    if routing == "with-minus-one":
        return rng.integers(-1, experts, (tokens, top_k), dtype=np.int32)
    if routing == "all-on-one":
        return np.full((tokens, top_k), experts - 1, np.int32)
    if routing == "empty-experts":  # only even experts are used
        return (2 * rng.integers(0, (experts + 1) // 2, (tokens, top_k))).astype(np.int32)
    if routing == "all-minus-one":
        return np.full((tokens, top_k), -1, np.int32)
    raise ValueError(routing)


def check_invariants(d, topk_ids, experts):
    """The properties Dispatch documents, checked directly on the arrays."""
    ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    valid = (ids >= 0) & (ids < experts)
    slots = ids.size
    used = int(valid.sum())
    for a, size in ((d.counts, experts), (d.offsets, experts + 1),
                    (d.sorted_slots, slots), (d.slot_positions, slots)):
        assert isinstance(a, np.ndarray) and a.dtype == np.int32 and a.shape == (size,)
    assert d.num_experts == experts and d.top_k == topk_ids.shape[1]
    assert int(d.counts.sum()) == used
    assert d.offsets[0] == 0 and np.array_equal(d.offsets[1:], np.cumsum(d.counts))
    assert np.all(d.sorted_slots[used:] == -1)
    head = d.sorted_slots[:used]
    for e in range(experts):
        group = head[d.offsets[e]:d.offsets[e + 1]]
        assert np.all(ids[group] == e)
        assert np.all(np.diff(group) > 0)  # ascending inside each expert
    assert np.array_equal(np.sort(head), np.flatnonzero(valid))  # each valid slot exactly once
    assert np.all(d.slot_positions[~valid] == -1)
    assert np.array_equal(d.slot_positions[head], np.arange(used))  # inverse permutation


ROUTINGS = ["distinct", "with-minus-one", "all-on-one", "empty-experts", "all-minus-one"]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("experts,top_k", [(1, 1), (3, 2), (8, 1), (8, 2), (8, 8), (64, 6)])
@pytest.mark.parametrize("tokens", [0, 1, 5, 33, 300])
def test_dispatch(tokens, experts, top_k, routing):
    rng = np.random.default_rng([tokens, experts, top_k, ROUTINGS.index(routing)])
    ids = random_ids(rng, tokens, experts, top_k, routing)
    d = cupymoe.dispatch(ids, experts)
    check_invariants(d, ids, experts)
    want = brute_force_dispatch(ids, experts)
    for got, expected in zip((d.counts, d.offsets, d.sorted_slots, d.slot_positions), want):
        assert got.tolist() == expected


def test_zero_tokens():
    d = cupymoe.dispatch(np.zeros((0, 3), np.int32), 5)
    assert d.counts.tolist() == [0] * 5 and d.offsets.tolist() == [0] * 6
    assert d.sorted_slots.shape == (0,) and d.slot_positions.shape == (0,)


def test_small_example():
    ids = np.array([[2, 0], [-1, 2], [0, 0]], np.int32)
    d = cupymoe.dispatch(ids, 3)
    assert d.counts.tolist() == [3, 0, 2]
    assert d.offsets.tolist() == [0, 3, 3, 5]
    assert d.sorted_slots.tolist() == [1, 4, 5, 0, 3, -1]
    assert d.slot_positions.tolist() == [3, 0, -1, 4, 1, 2]


def test_int64_ids_match_int32():
    ids = random_ids(np.random.default_rng(1), 40, 16, 4, "with-minus-one")
    a, b = cupymoe.dispatch(ids, 16), cupymoe.dispatch(ids.astype(np.int64), 16)
    for name in ("counts", "offsets", "sorted_slots", "slot_positions"):
        assert np.array_equal(getattr(a, name), getattr(b, name))


def test_check_ids_false_treats_out_of_range_ids_as_minus_one():
    ids = np.array([[0, 7], [-5, 1], [3, 2], [2**31 - 1, -(2**31)]], np.int32)
    with pytest.raises(ValueError, match="topk_ids"):
        cupymoe.dispatch(ids, 3)
    d = cupymoe.dispatch(ids, 3, check_ids=False)
    check_invariants(d, ids, 3)
    as_minus_one = np.where((ids >= 0) & (ids < 3), ids, -1)
    for got, expected in zip((d.counts, d.offsets, d.sorted_slots, d.slot_positions),
                             brute_force_dispatch(as_minus_one, 3)):
        assert got.tolist() == expected


def test_numpy_integer_num_experts():
    ids = np.array([[1, 0]], np.int32)
    d = cupymoe.dispatch(ids, np.int64(2))
    assert d.num_experts == 2 and type(d.num_experts) is int
    assert d.counts.tolist() == [1, 1]
