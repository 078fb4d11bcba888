"""The NumPy backend (fused_experts and MoE on NumPy arrays) against the float64 oracle."""
import numpy as np
import pytest

import cupymoe
from helpers import BF16, oracle, random_problem, rel_l2

TOL = 1e-2
DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(np.dtype(np.float16), id="fp16")]
EXPERT_TOPK = [(1, 1), (4, 1), (4, 2), (4, 4), (9, 1), (9, 2), (9, 9)]  # k in {1, 2, E}


def drop_slots(rng, ids, fraction):
    """Set about ``fraction`` of the slots to -1 (no expert); returns a new array."""
    ids = ids.copy()
    ids[rng.random(ids.shape) < fraction] = -1
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ["uniform", "one", "sparse"])
@pytest.mark.parametrize("hidden,inter", [(64, 64), (64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("experts,top_k", EXPERT_TOPK)
@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
def test_fused_experts_matches_oracle(tokens, experts, top_k, hidden, inter, routing, dtype):
    rng = np.random.default_rng([tokens, experts, top_k, hidden, inter, len(routing), dtype.itemsize])
    x, w13, w2, ids, weights = random_problem(rng, tokens, hidden, experts, inter, top_k, dtype, routing)
    ids = drop_slots(rng, ids, 0.2)
    out = cupymoe.fused_experts(x, w13, w2, ids, weights)
    assert isinstance(out, np.ndarray)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert rel_l2(out, oracle(x, w13, w2, ids, weights)) < TOL


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_matches_oracle_over_repeated_calls(dtype):
    rng = np.random.default_rng(1)
    _, w13, w2, _, _ = random_problem(rng, 1, 128, 6, 64, 2, dtype)
    moe = cupymoe.MoE(w13, w2)
    assert (moe.num_experts, moe.intermediate_size, moe.hidden_size, moe.dtype) == (6, 64, 128, dtype)
    for tokens, top_k in [(5, 2), (0, 2), (3, 1), (5, 2), (5, 3), (1, 6), (5, 2)]:
        x, _, _, ids, weights = random_problem(rng, tokens, 128, 6, 64, top_k, dtype)
        ids = drop_slots(rng, ids, 0.2)
        out = moe(x, ids, weights)
        assert out.shape == (tokens, 128) and out.dtype == dtype
        assert rel_l2(out, oracle(x, w13, w2, ids, weights)) < TOL


def test_zero_tokens_returns_empty():
    rng = np.random.default_rng(2)
    x, w13, w2, ids, weights = random_problem(rng, 0, 64, 4, 64, 2)
    for out in (cupymoe.fused_experts(x, w13, w2, ids, weights), cupymoe.MoE(w13, w2)(x, ids, weights)):
        assert out.shape == (0, 64) and out.dtype == BF16


def test_out_is_written_and_returned():
    rng = np.random.default_rng(3)
    x, w13, w2, ids, weights = random_problem(rng, 7, 64, 4, 128, 2)
    want = oracle(x, w13, w2, ids, weights)
    out = np.full((7, 64), np.nan, BF16)
    assert cupymoe.fused_experts(x, w13, w2, ids, weights, out=out) is out
    assert rel_l2(out, want) < TOL
    out[...] = np.nan
    assert cupymoe.MoE(w13, w2)(x, ids, weights, out=out) is out
    assert rel_l2(out, want) < TOL


def test_out_rows_with_no_expert_are_zero():
    rng = np.random.default_rng(4)
    x, w13, w2, ids, weights = random_problem(rng, 4, 64, 4, 64, 2)
    ids[1] = -1
    out = np.full((4, 64), np.nan, BF16)
    cupymoe.fused_experts(x, w13, w2, ids, weights, out=out)
    assert np.all(out[1].astype(np.float32) == 0)
    assert not np.isnan(out.astype(np.float32)).any()


def test_int64_ids():
    rng = np.random.default_rng(5)
    x, w13, w2, ids, weights = random_problem(rng, 9, 64, 5, 64, 3)
    ids = drop_slots(rng, ids, 0.2).astype(np.int64)
    out = cupymoe.fused_experts(x, w13, w2, ids, weights)
    assert rel_l2(out, oracle(x, w13, w2, ids, weights)) < TOL
    np.testing.assert_array_equal(
        out.astype(np.float32),
        cupymoe.fused_experts(x, w13, w2, ids.astype(np.int32), weights).astype(np.float32),
    )


def test_ids_repeated_within_a_token_each_slot_counts():
    rng = np.random.default_rng(6)
    x, w13, w2, _, _ = random_problem(rng, 3, 64, 4, 64, 3)
    ids = np.array([[2, 2, 2], [1, 3, 1], [0, -1, 0]], np.int32)
    weights = rng.random((3, 3), dtype=np.float32)
    out = cupymoe.fused_experts(x, w13, w2, ids, weights)
    assert rel_l2(out, oracle(x, w13, w2, ids, weights)) < TOL
    # Token 0 sends the same row to expert 2 three times: the weights add up.
    single = oracle(x[:1], w13, w2, np.array([[2]]), weights[:1].sum(axis=1, keepdims=True))
    assert rel_l2(out[:1], single) < TOL


def test_check_ids_false_treats_out_of_range_ids_as_no_expert():
    rng = np.random.default_rng(7)
    x, w13, w2, ids, weights = random_problem(rng, 6, 64, 4, 64, 2)
    bad = ids.copy()
    bad[0, 0], bad[1, 1], bad[2, 0], bad[3, :] = 4, -2, 1000, (-7, 99)
    as_none = np.where((bad >= 0) & (bad < 4), bad, -1).astype(np.int32)
    with pytest.raises(ValueError, match="topk_ids"):
        cupymoe.fused_experts(x, w13, w2, bad, weights)
    got = cupymoe.fused_experts(x, w13, w2, bad, weights, check_ids=False)
    want = cupymoe.fused_experts(x, w13, w2, as_none, weights)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert rel_l2(got, oracle(x, w13, w2, as_none, weights)) < TOL
    moe_out = cupymoe.MoE(w13, w2)(x, bad, weights, check_ids=False)
    np.testing.assert_array_equal(moe_out.astype(np.float32), want.astype(np.float32))


def test_strided_x_is_accepted():
    rng = np.random.default_rng(8)
    x, w13, w2, ids, weights = random_problem(rng, 10, 64, 4, 64, 2)
    wide = np.zeros((10, 128), BF16)
    wide[:, ::2] = x
    out = cupymoe.fused_experts(wide[:, ::2], w13, w2, ids, weights)
    assert rel_l2(out, oracle(x, w13, w2, ids, weights)) < TOL
