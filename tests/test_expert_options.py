"""The expert options of fused_experts and MoE (activation, w13_bias, w2_bias,
apply_router_weight_on_input) on the NumPy and the CuPy backend, one test body for both: against
cupymoe's reference (REFERENCE_TOL) and, on the first tokens, the float64 oracle (ORACLE_TOL);
every tile plan forced on the GPU; bitwise equal across runs."""
import numpy as np
import pytest

import cupymoe
from cupymoe import _compile, plans, reference
from cupymoe._types import ExpertOptions
from helpers import (BF16, DTYPES, ORACLE_TOKENS, ORACLE_TOL, REFERENCE_TOL, as_numpy, host_bits, oracle, poison,
                     random_problem, rel_l2, to_xp)

ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "swigluoai"]
# (activation, w13 bias, w2 bias, weight on input): each activation alone and with both biases (gpt-oss),
# Llama-4's weight on the input, and each bias alone.
OPTION_SETS = ([(a, False, False, False) for a in ACTIVATIONS] + [(a, True, True, False) for a in ACTIVATIONS]
               + [("silu", False, False, True), ("swigluoai", True, True, True), ("silu", True, False, False),
                  ("gelu", False, True, False)])


def option_id(options):
    activation, b13, b2, on_input = options
    return "-".join([activation] + [name for name, on in (("b13", b13), ("b2", b2), ("in", on_input)) if on])


def problem_with_options(rng, tokens, hidden, experts, inter, top_k, options, dtype=BF16):
    """A random problem and the keyword arguments of its options (biases as host arrays). swigluoai
    gets inputs four times larger, so its clamps at +-7 are reached."""
    activation, b13, b2, on_input = options
    x, w13, w2, ids, weights = random_problem(rng, tokens, hidden, experts, inter, top_k, dtype)
    if activation == "swigluoai":
        x = (4 * x.astype(np.float32)).astype(dtype)
    kwargs = dict(activation=activation, apply_router_weight_on_input=on_input)
    if b13:
        kwargs["w13_bias"] = (0.5 * rng.standard_normal((experts, 2 * inter), dtype=np.float32)).astype(dtype)
    if b2:
        kwargs["w2_bias"] = (0.5 * rng.standard_normal((experts, hidden), dtype=np.float32)).astype(dtype)
    return (x, w13, w2, ids, weights), kwargs


def xp_kwargs(xp, kwargs):
    return {k: xp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def check_options_close(got, problem, kwargs):
    x, w13, w2, ids, weights = problem
    got = as_numpy(got)
    options = ExpertOptions(kwargs["activation"], kwargs.get("w13_bias"), kwargs.get("w2_bias"),
                            kwargs["apply_router_weight_on_input"])
    want = reference.fused_experts(x, w13, w2, ids, weights, np.empty_like(x), options)
    assert rel_l2(got, want) < REFERENCE_TOL
    n = ORACLE_TOKENS
    assert rel_l2(got[:n], oracle(x[:n], w13, w2, ids[:n], weights[:n], kwargs["activation"], kwargs.get("w13_bias"),
                                  kwargs.get("w2_bias"), kwargs["apply_router_weight_on_input"])) < ORACLE_TOL


def run_options(xp, problem, kwargs):
    x = problem[0]
    out = poison(xp.empty(x.shape, x.dtype))
    got = cupymoe.fused_experts(*to_xp(xp, *problem), out=out, **xp_kwargs(xp, kwargs))
    assert got is out
    return got


@pytest.mark.sanitize
@pytest.mark.parametrize("options", OPTION_SETS, ids=option_id)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 64, 8), (64, 64, 8), (700, 8, 2)])
def test_options_match_reference_and_oracle(xp, tokens, experts, top_k, options):
    """T = 1 and 5 run by slot; 64 and 700 through the dispatch (the persistent kernel on sm_90)."""
    rng = np.random.default_rng([tokens, experts, top_k, OPTION_SETS.index(options)])
    problem, kwargs = problem_with_options(rng, tokens, 256, experts, 128, top_k, options)
    got = run_options(xp, problem, kwargs)
    check_options_close(got, problem, kwargs)
    again = run_options(xp, problem, kwargs)
    np.testing.assert_array_equal(host_bits(again), host_bits(got))
    layer = cupymoe.MoE(*to_xp(xp, problem[1], problem[2]), **{k: v for k, v in xp_kwargs(xp, kwargs).items()})
    np.testing.assert_array_equal(host_bits(layer(*to_xp(xp, problem[0], problem[3], problem[4]))), host_bits(got))


@pytest.mark.parametrize("dtype", DTYPES)
def test_options_on_both_dtypes(xp, dtype):
    problem, kwargs = problem_with_options(np.random.default_rng(3), 200, 128, 8, 64, 2,
                                           ("gelu_tanh", True, True, False), dtype)
    check_options_close(run_options(xp, problem, kwargs), problem, kwargs)


def test_weight_on_input_ignores_nothing_when_weights_are_one(xp):
    """With every routing weight 1, weights on the input and on the output give the same bits."""
    problem, kwargs = problem_with_options(np.random.default_rng(4), 64, 128, 8, 64, 2, ("silu", True, True, False))
    problem = problem[:4] + (np.ones_like(problem[4]),)
    on_output = run_options(xp, problem, kwargs)
    on_input = run_options(xp, problem, dict(kwargs, apply_router_weight_on_input=True))
    np.testing.assert_array_equal(host_bits(on_input), host_bits(on_output))


def _forceable_plans():
    if not _compile.gpu_available():
        return []
    import cupy

    sm90 = _compile.compute_capability(cupy.cuda.Device().id) == plans.WGMMA_COMPUTE_CAPABILITY
    return [p for p in plans.PLANS if sm90 or plans.PERSISTENT not in (p.gate_up.kernel, p.down.kernel)]


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("options", [("gelu", True, True, False), ("swigluoai", True, True, True),
                                     ("silu", False, True, True)], ids=option_id)
@pytest.mark.parametrize("tokens", [3, 300])
def test_options_under_every_plan(tokens, options):
    """Each tile plan forced, so every kernel's epilogue runs each flag (the bias columns of the
    persistent kernel's consumers, the weights of short tiles' padding slots)."""
    import cupy

    rng = np.random.default_rng([tokens, OPTION_SETS.index(options) if options in OPTION_SETS else 99])
    problem, kwargs = problem_with_options(rng, tokens, 512, 8, 256, 2, options)
    for chosen in _forceable_plans():
        with plans.forced(chosen):
            got = run_options(cupy, problem, kwargs)
        check_options_close(got, problem, kwargs)
