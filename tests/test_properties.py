"""Property-based tests (hypothesis): random sizes and routings, checked against independent code.

Each example draws T, E, k, H and I (multiples of 64), the dtypes and a routing: random ids with
repeats inside a token (every slot counts) and -1s, distinct ids, every slot on one expert, a few
experts with all the tokens and the rest empty, or no expert at all; optionally mixed with ids
outside [-1, E), run with check_ids=False. The NumPy backend is checked against the float64
oracle of tests/helpers.py, the GPU against cupymoe's NumPy reference on the same inputs.
Examples are derandomized and no example database is written, so every run checks the same cases.
"""
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cupymoe
from cupymoe import reference
from test_dispatch import check_contract
from helpers import BF16, FP16, ORACLE_TOL, REFERENCE_TOL, oracle, out_of_range_ids, poison, random_problem, rel_l2

ROUTINGS = ("random", "distinct", "one_expert", "few_experts", "nowhere")
CPU_SETTINGS = settings(max_examples=150, deadline=None, database=None, derandomize=True)
GPU_SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                        suppress_health_check=[HealthCheck.too_slow])


class Case(NamedTuple):
    """One drawn problem; the arrays are built from ``seed`` by :func:`build`."""

    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    dtype: np.dtype
    id_dtype: type
    routing: str  # one of ROUTINGS
    unchecked: bool  # ids outside [-1, E) mixed in; run with check_ids=False
    seed: int


@st.composite
def cases(draw, max_tokens, max_experts, widths, min_tokens=0):
    experts = draw(st.integers(1, max_experts))
    return Case(
        tokens=draw(st.integers(min_tokens, max_tokens)),
        experts=experts,
        top_k=draw(st.integers(1, experts)),
        hidden=draw(st.sampled_from(widths)),
        inter=draw(st.sampled_from(widths)),
        dtype=draw(st.sampled_from([BF16, FP16])),
        id_dtype=draw(st.sampled_from([np.int32, np.int64])),
        routing=draw(st.sampled_from(ROUTINGS)),
        unchecked=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def make_ids(rng, case):
    """topk_ids [T, k] of ``case.id_dtype`` for the case's routing."""
    shape = (case.tokens, case.top_k)
    experts = case.experts
    if case.routing == "random":  # repeats inside a token, and -1s
        ids = rng.integers(-1, experts, shape)
    elif case.routing == "distinct":
        ids = np.argsort(rng.random((case.tokens, experts)), axis=1)[:, :case.top_k]
    elif case.routing == "one_expert":  # every slot of every token
        ids = np.full(shape, rng.integers(experts))
    elif case.routing == "few_experts":  # the other experts get no tokens
        used = rng.choice(experts, size=max(1, experts // 3), replace=False)
        ids = np.where(rng.random(shape) < 0.2, -1, rng.choice(used, size=shape))
    else:  # "nowhere"
        ids = np.full(shape, -1)
    ids = ids.astype(case.id_dtype)
    if case.unchecked:
        bad = rng.random(shape) < 0.25
        ids[bad] = rng.choice(out_of_range_ids(experts, case.id_dtype), int(bad.sum()))
    return ids


def build(case):
    """The NumPy arrays (x, w13, w2, topk_ids, topk_weights) of a case."""
    rng = np.random.default_rng(case.seed)
    x, w13, w2, _, weights = random_problem(rng, case.tokens, case.hidden, case.experts, case.inter,
                                            case.top_k, case.dtype)
    return x, w13, w2, make_ids(rng, case), weights


def routed(ids, experts):
    """[T] bool: the tokens with at least one id in [0, E)."""
    return ((ids >= 0) & (ids < experts)).any(axis=1)


def run_numpy(problem, check_ids):
    """fused_experts on the NumPy backend into a NaN-filled out=."""
    out = poison(np.empty_like(problem[0]))
    got = cupymoe.fused_experts(*problem, out=out, check_ids=check_ids)
    assert got is out
    return got


@CPU_SETTINGS
@given(cases(max_tokens=12, max_experts=8, widths=(64, 128)))
def test_numpy_backend_matches_oracle(case):
    problem = build(case)
    ids = problem[3]
    if ((ids < -1) | (ids >= case.experts)).any():
        with pytest.raises(ValueError, match="topk_ids"):
            cupymoe.fused_experts(*problem)
    got = run_numpy(problem, check_ids=not case.unchecked)
    assert rel_l2(got, oracle(*problem)) < ORACLE_TOL
    assert (got[~routed(ids, case.experts)].astype(np.float32) == 0).all()


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(cases(max_tokens=40, max_experts=16, widths=(64,)))
def test_dispatch_invariants(case):
    ids = make_ids(np.random.default_rng(case.seed), case)
    check_contract(cupymoe.dispatch(ids, case.experts, check_ids=not case.unchecked), np, ids, case.experts)


@CPU_SETTINGS
@given(cases(max_tokens=8, max_experts=8, widths=(64, 128), min_tokens=1), st.data())
def test_non_finite_input_changes_only_its_token_row(case, data):
    """A NaN or Inf in one token's x row makes that row non-finite (zero if it is routed nowhere)
    and leaves every other row bit for bit as it was."""
    problem = build(case)
    token = data.draw(st.integers(0, case.tokens - 1), label="token")
    column = data.draw(st.integers(0, case.hidden - 1), label="column")
    value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
    dirty_x = problem[0].copy()
    dirty_x[token, column] = value
    with np.errstate(all="ignore"):
        clean = run_numpy(problem, check_ids=False)
        dirty = run_numpy((dirty_x, *problem[1:]), check_ids=False)
    others = np.arange(case.tokens) != token
    np.testing.assert_array_equal(dirty[others].view(np.uint16), clean[others].view(np.uint16))
    row = dirty[token].astype(np.float32)
    if routed(problem[3], case.experts)[token]:
        assert not np.isfinite(row).any()
    else:
        assert (row == 0).all()


@pytest.mark.gpu
@GPU_SETTINGS
@given(cases(max_tokens=300, max_experts=64, widths=(64, 128, 192, 256)))
# Drawn examples lean small; these make sure every GEMM tile plan and k = E = 64 are seen.
@example(Case(300, 8, 8, 256, 192, BF16, np.int32, "distinct", False, 1))
@example(Case(300, 64, 64, 192, 256, FP16, np.int64, "random", True, 2))
@example(Case(257, 64, 8, 128, 128, BF16, np.int64, "few_experts", True, 3))
def test_gpu_matches_reference_and_dispatch_contract(case):
    import cupy

    problem = build(case)
    x, ids = problem[0], problem[3]
    args = [cupy.asarray(a) for a in problem]
    out = poison(cupy.empty(x.shape, x.dtype))
    got = cupymoe.fused_experts(*args, out=out, check_ids=not case.unchecked)
    assert got is out
    want = reference.fused_experts(*problem, np.empty_like(x))
    assert rel_l2(cupy.asnumpy(got), want) < REFERENCE_TOL

    check_contract(cupymoe.dispatch(args[3], case.experts, check_ids=not case.unchecked), cupy, ids, case.experts)
