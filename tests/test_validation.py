"""Bad inputs raise TypeError (array type, dtype, host/GPU mix) or ValueError (rank, shape,
sizes, ids), with a message that names the argument. The checks (cupymoe/_checks.py) are the same
code for both backends, so they run on NumPy arrays; what only GPU arrays can get wrong (host and
GPU mixed, data off the 16-byte grid) is marked gpu."""
import numpy as np
import pytest

import cupymoe
from cupymoe import _checks
from helpers import BF16, FP16, random_problem

T, H, E, I, K = 3, 64, 4, 64, 2


def leads_with(name):
    """A ``pytest.raises`` pattern for a message that starts by naming the argument."""
    return f"^{name}: "


@pytest.fixture
def problem():
    """A valid problem as a dict of the fused_experts arguments."""
    x, w13, w2, ids, weights = random_problem(np.random.default_rng(0), T, H, E, I, K)
    return dict(x=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=weights)


def fused(p):
    return cupymoe.fused_experts(p["x"], p["w13"], p["w2"], p["topk_ids"], p["topk_weights"])


def layer(p):
    return cupymoe.MoE(p["w13"], p["w2"])(p["x"], p["topk_ids"], p["topk_weights"])


FORWARDS = [pytest.param(fused, id="fused_experts"), pytest.param(layer, id="MoE")]


def noncontiguous(a):
    """A C-non-contiguous view with the values and shape of ``a``."""
    wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    wide[..., ::2] = a
    return wide[..., ::2]


def weights_of(hidden=H, inter=I, experts=E, dtype=BF16):
    rng = np.random.default_rng(1)
    w13 = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32).astype(dtype)
    w2 = rng.standard_normal((experts, hidden, inter), dtype=np.float32).astype(dtype)
    return w13, w2


def case(label, name, make, error, named=None):
    """One bad argument: ``make(problem)`` replaces argument ``name``; the error names ``named``."""
    return pytest.param(name, make, error, named or name, id=f"{name}-{label}")


BAD_ARGUMENTS = [
    # wrong array type
    case("list", "x", lambda p: p["x"].tolist(), TypeError),
    case("str", "x", lambda p: "not an array", TypeError),
    case("list", "w13", lambda p: p["w13"].tolist(), TypeError),
    case("None", "w2", lambda p: None, TypeError),
    case("list", "topk_ids", lambda p: p["topk_ids"].tolist(), TypeError),
    case("list", "topk_weights", lambda p: p["topk_weights"].tolist(), TypeError),
    # wrong dtype
    case("f32", "x", lambda p: p["x"].astype(np.float32), TypeError),
    case("fp16-with-bf16-weights", "x", lambda p: p["x"].astype(FP16), TypeError),
    case("f32", "w13", lambda p: p["w13"].astype(np.float32), TypeError),
    case("fp16-with-bf16-w13", "w2", lambda p: p["w2"].astype(FP16), TypeError),
    case("f32", "topk_ids", lambda p: p["topk_ids"].astype(np.float32), TypeError),
    case("int16", "topk_ids", lambda p: p["topk_ids"].astype(np.int16), TypeError),
    case("uint32", "topk_ids", lambda p: p["topk_ids"].astype(np.uint32), TypeError),
    case("f64", "topk_weights", lambda p: p["topk_weights"].astype(np.float64), TypeError),
    case("bf16", "topk_weights", lambda p: p["topk_weights"].astype(BF16), TypeError),
    # wrong rank
    case("1d", "x", lambda p: p["x"][0], ValueError),
    case("3d", "x", lambda p: p["x"][None], ValueError),
    case("2d", "w13", lambda p: p["w13"][0], ValueError),
    case("4d", "w2", lambda p: p["w2"][None], ValueError),
    case("1d", "topk_ids", lambda p: p["topk_ids"].reshape(-1), ValueError),
    case("1d", "topk_weights", lambda p: p["topk_weights"].reshape(-1), ValueError),
    # wrong shape
    case("columns", "x", lambda p: np.concatenate([p["x"], p["x"]], axis=1), ValueError),
    case("rows", "x", lambda p: p["x"][:2], ValueError, named="topk_ids"),  # T of x and ids disagree
    case("I", "w2", lambda p: p["w2"][:, :, : I // 2].copy(), ValueError),
    case("H", "w2", lambda p: np.zeros((E, H, 2 * I), BF16), ValueError),
    case("E", "w2", lambda p: p["w2"][:2].copy(), ValueError),
    case("columns", "topk_weights", lambda p: p["topk_weights"][:, :1].copy(), ValueError),
    case("rows", "topk_weights", lambda p: p["topk_weights"][:2].copy(), ValueError),
    case("rows", "topk_ids", lambda p: p["topk_ids"][:2].copy(), ValueError),
    # k outside [1, E]
    case("k-0", "topk_ids", lambda p: np.zeros((T, 0), np.int32), ValueError),
    case("k-above-E", "topk_ids", lambda p: np.zeros((T, E + 1), np.int32), ValueError),
    # non-contiguous weights
    case("non-contiguous", "w13", lambda p: noncontiguous(p["w13"]), ValueError),
    case("non-contiguous", "w2", lambda p: noncontiguous(p["w2"]), ValueError),
    case("fortran", "w13", lambda p: np.asfortranarray(p["w13"]), ValueError),
    # ids outside [-1, E) with check_ids=True (the default)
    case("id-E", "topk_ids", lambda p: np.full((T, K), E, np.int32), ValueError),
    case("id-minus-2", "topk_ids", lambda p: np.full((T, K), -2, np.int64), ValueError),
    case("id-huge", "topk_ids",
         lambda p: np.where(np.eye(T, K, dtype=bool), np.int64(2**40), p["topk_ids"]), ValueError),
]


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("name,make,error,match", BAD_ARGUMENTS)
def test_bad_argument(problem, forward, name, make, error, match):
    problem[name] = make(problem)
    with pytest.raises(error, match=leads_with(match)):
        forward(problem)


BAD_WEIGHT_SIZES = [
    pytest.param(dict(hidden=96), id="H-not-multiple-of-64"),
    pytest.param(dict(hidden=32), id="H-below-64"),
    pytest.param(dict(inter=32), id="I-below-64"),
    pytest.param(dict(inter=100), id="I-not-multiple-of-64"),
    pytest.param(dict(experts=0), id="no-experts"),
]


@pytest.mark.parametrize("sizes", BAD_WEIGHT_SIZES)
def test_bad_weight_sizes(sizes):
    w13, w2 = weights_of(**sizes)
    hidden = w13.shape[2]
    x = np.ones((T, hidden), BF16)
    ids = np.full((T, 1), -1, np.int32)
    weights = np.ones((T, 1), np.float32)
    with pytest.raises(ValueError, match=leads_with("w13")):
        cupymoe.fused_experts(x, w13, w2, ids, weights)
    with pytest.raises(ValueError, match=leads_with("w13")):
        cupymoe.MoE(w13, w2)


def test_odd_w13_rows():
    w13, w2 = weights_of()
    odd = np.ascontiguousarray(w13[:, 1:])
    with pytest.raises(ValueError, match=leads_with("w13")):
        cupymoe.MoE(odd, w2)
    x, ids, weights = np.ones((T, H), BF16), np.zeros((T, 1), np.int32), np.ones((T, 1), np.float32)
    with pytest.raises(ValueError, match=leads_with("w13")):
        cupymoe.fused_experts(x, odd, w2, ids, weights)


def test_moe_constructor_bad_weights():
    w13, w2 = weights_of()
    cases = [
        (w13, np.ascontiguousarray(w2[:, :, : I // 2]), ValueError, "w2"),
        (w13, np.zeros((E + 1, H, I), BF16), ValueError, "w2"),
        (weights_of(dtype=FP16)[0], w2, TypeError, "w2"),  # dtypes of w13 and w2 differ
        (w13.astype(np.float32), w2.astype(np.float32), TypeError, "w13"),
        (w13.tolist(), w2, TypeError, "w13"),
        (w13, w2.tolist(), TypeError, "w2"),
        (w13[0], w2, ValueError, "w13"),
        (noncontiguous(w13), w2, ValueError, "w13"),
        (w13, noncontiguous(w2), ValueError, "w2"),
    ]
    for bad_w13, bad_w2, error, match in cases:
        with pytest.raises(error, match=leads_with(match)):
            cupymoe.MoE(bad_w13, bad_w2)


BAD_OUT = [
    pytest.param(lambda: np.zeros((T + 1, H), BF16), ValueError, id="rows"),
    pytest.param(lambda: np.zeros((T, 2 * H), BF16), ValueError, id="columns"),
    pytest.param(lambda: np.zeros((T * H,), BF16), ValueError, id="rank"),
    pytest.param(lambda: np.zeros((T, H), FP16), TypeError, id="dtype-fp16"),
    pytest.param(lambda: np.zeros((T, H), np.float32), TypeError, id="dtype-f32"),
    pytest.param(lambda: noncontiguous(np.zeros((T, H), BF16)), ValueError, id="non-contiguous"),
    pytest.param(lambda: np.asfortranarray(np.zeros((T, H), BF16)), ValueError, id="fortran"),
    pytest.param(lambda: np.zeros((T, H), BF16).tolist(), TypeError, id="list"),
]


@pytest.mark.parametrize("forward", ["fused_experts", "MoE"])
@pytest.mark.parametrize("make,error", BAD_OUT)
def test_bad_out(problem, forward, make, error):
    p = problem
    out = make()
    if forward == "fused_experts":
        call = lambda: cupymoe.fused_experts(  # noqa: E731
            p["x"], p["w13"], p["w2"], p["topk_ids"], p["topk_weights"], out=out)
    else:
        call = lambda: cupymoe.MoE(p["w13"], p["w2"])(  # noqa: E731
            p["x"], p["topk_ids"], p["topk_weights"], out=out)
    with pytest.raises(error, match=leads_with("out")):
        call()


def test_bad_out_is_left_untouched(problem):
    out = np.full((T, H), np.nan, FP16)
    with pytest.raises(TypeError, match=leads_with("out")):
        cupymoe.fused_experts(**problem, out=out)
    assert np.isnan(out).all()


def test_check_ids_false_skips_the_range_check(problem):
    problem["topk_ids"] = np.full((T, K), E, np.int32)
    out = cupymoe.fused_experts(**problem, check_ids=False)
    assert np.all(out.astype(np.float32) == 0)


# dispatch


@pytest.mark.parametrize(
    "ids,num_experts,error,match",
    [
        pytest.param([[0, 1]], 4, TypeError, "topk_ids", id="list-ids"),
        pytest.param(np.zeros((2, 2), np.float32), 4, TypeError, "topk_ids", id="float-ids"),
        pytest.param(np.zeros((2, 2), np.uint8), 4, TypeError, "topk_ids", id="uint8-ids"),
        pytest.param(np.zeros(4, np.int32), 4, ValueError, "topk_ids", id="rank-1"),
        pytest.param(np.zeros((1, 2, 2), np.int32), 4, ValueError, "topk_ids", id="rank-3"),
        pytest.param(np.zeros((2, 0), np.int32), 4, ValueError, "topk_ids", id="k-0"),
        pytest.param(np.zeros((2, 5), np.int32), 4, ValueError, "topk_ids", id="k-above-E"),
        pytest.param(np.full((2, 2), 4, np.int32), 4, ValueError, "topk_ids", id="id-E"),
        pytest.param(np.full((2, 2), -2, np.int64), 4, ValueError, "topk_ids", id="id-minus-2"),
        pytest.param(np.zeros((2, 2), np.int32), 0, ValueError, "num_experts", id="E-0"),
        pytest.param(np.zeros((2, 2), np.int32), -3, ValueError, "num_experts", id="E-negative"),
        pytest.param(np.zeros((2, 2), np.int32), 1, ValueError, "topk_ids", id="E-below-k"),
        pytest.param(np.zeros((2, 2), np.int32), 4.0, TypeError, "num_experts", id="E-float"),
        pytest.param(np.zeros((2, 2), np.int32), True, TypeError, "num_experts", id="E-bool"),
        pytest.param(np.zeros((2, 2), np.int32), None, TypeError, "num_experts", id="E-None"),
    ],
)
def test_dispatch_bad_input(ids, num_experts, error, match):
    with pytest.raises(error, match=leads_with(match)):
        cupymoe.dispatch(ids, num_experts)


# route


@pytest.mark.parametrize(
    "logits,top_k,error,match",
    [
        pytest.param([[0.0, 1.0]], 1, TypeError, "router_logits", id="list"),
        pytest.param(np.zeros((2, 4), np.float64), 1, TypeError, "router_logits", id="f64"),
        pytest.param(np.zeros((2, 4), np.int32), 1, TypeError, "router_logits", id="int"),
        pytest.param(np.zeros(4, np.float32), 1, ValueError, "router_logits", id="rank-1"),
        pytest.param(np.zeros((1, 2, 4), np.float32), 1, ValueError, "router_logits", id="rank-3"),
        pytest.param(np.zeros((2, 4), np.float32), 0, ValueError, "top_k", id="k-0"),
        pytest.param(np.zeros((2, 4), np.float32), -1, ValueError, "top_k", id="k-negative"),
        pytest.param(np.zeros((2, 4), np.float32), 5, ValueError, "top_k", id="k-above-E"),
        pytest.param(np.zeros((2, 0), np.float32), 1, ValueError, "top_k", id="no-experts"),
        pytest.param(np.zeros((2, 4), np.float32), 2.0, TypeError, "top_k", id="k-float"),
        pytest.param(np.zeros((2, 4), np.float32), True, TypeError, "top_k", id="k-bool"),
        pytest.param(np.zeros((2, 4), np.float32), "2", TypeError, "top_k", id="k-str"),
    ],
)
def test_route_bad_input(logits, top_k, error, match):
    with pytest.raises(error, match=leads_with(match)):
        cupymoe.route(logits, top_k)


ROUTE_LOGITS = np.zeros((2, 16), np.float32)
BAD_ROUTE_OPTIONS = [
    pytest.param(dict(scoring="softplus"), ValueError, "scoring", id="scoring"),
    pytest.param(dict(num_groups=4), ValueError, "num_groups", id="groups-with-softmax"),
    pytest.param(dict(correction_bias=np.zeros(16, np.float32)), ValueError, "correction_bias", id="bias-softmax"),
    pytest.param(dict(scaling_factor=2.0), ValueError, "scaling_factor", id="scaling-with-softmax"),
    pytest.param(dict(scoring="sigmoid", num_groups=3), ValueError, "num_groups", id="groups-not-dividing"),
    pytest.param(dict(scoring="sigmoid", num_groups=16), ValueError, "num_groups", id="group-of-one"),
    pytest.param(dict(scoring="sigmoid", num_groups=0), ValueError, "num_groups", id="groups-0"),
    pytest.param(dict(scoring="sigmoid", num_groups=2.0), TypeError, "num_groups", id="groups-float"),
    pytest.param(dict(scoring="sigmoid", num_groups=4, topk_groups=5), ValueError, "topk_groups", id="kept-above"),
    pytest.param(dict(scoring="sigmoid", num_groups=4, topk_groups=0), ValueError, "topk_groups", id="kept-0"),
    pytest.param(dict(scoring="sigmoid", top_k=5, num_groups=4, topk_groups=1), ValueError, "top_k",
                 id="k-above-kept-experts"),
    pytest.param(dict(scoring="sigmoid", correction_bias=np.zeros(15, np.float32)), ValueError, "correction_bias",
                 id="bias-shape"),
    pytest.param(dict(scoring="sigmoid", correction_bias=np.zeros(16, BF16)), TypeError, "correction_bias",
                 id="bias-dtype"),
    pytest.param(dict(scoring="sigmoid", correction_bias=[0.0] * 16), TypeError, "correction_bias", id="bias-list"),
    pytest.param(dict(scoring="sigmoid", scaling_factor="2"), TypeError, "scaling_factor", id="scaling-str"),
]


@pytest.mark.parametrize("options,error,match", BAD_ROUTE_OPTIONS)
def test_route_bad_options(options, error, match):
    options = dict(options)
    top_k = options.pop("top_k", 2)
    with pytest.raises(error, match=leads_with(match)):
        cupymoe.route(ROUTE_LOGITS, top_k, **options)


def test_route_more_groups_than_the_kernel_holds():
    with pytest.raises(ValueError, match=leads_with("num_groups")):
        cupymoe.route(np.zeros((2, 128), np.float32), 2, scoring="sigmoid", num_groups=64)


BAD_EXPERT_OPTIONS = [
    pytest.param(dict(activation="relu"), ValueError, "activation", id="activation"),
    pytest.param(dict(activation=None), ValueError, "activation", id="activation-None"),
    pytest.param(dict(w13_bias=np.zeros((E, 2 * I), np.float32)), TypeError, "w13_bias", id="w13-bias-f32"),
    pytest.param(dict(w13_bias=np.zeros((E, I), BF16)), ValueError, "w13_bias", id="w13-bias-shape"),
    pytest.param(dict(w13_bias=np.zeros((E, 2 * I, 1), BF16)), ValueError, "w13_bias", id="w13-bias-rank"),
    pytest.param(dict(w2_bias=np.zeros((E, H + 1), BF16)), ValueError, "w2_bias", id="w2-bias-shape"),
    pytest.param(dict(w2_bias=[[0.0] * H] * E), TypeError, "w2_bias", id="w2-bias-list"),
    pytest.param(dict(w2_bias=noncontiguous(np.zeros((E, H), BF16))), ValueError, "w2_bias", id="w2-bias-strided"),
    pytest.param(dict(apply_router_weight_on_input=1), TypeError, "apply_router_weight_on_input", id="on-input-int"),
]


@pytest.mark.parametrize("forward", ["fused_experts", "MoE"])
@pytest.mark.parametrize("options,error,match", BAD_EXPERT_OPTIONS)
def test_bad_expert_options(problem, forward, options, error, match):
    p = problem
    with pytest.raises(error, match=leads_with(match)):
        if forward == "MoE":
            cupymoe.MoE(p["w13"], p["w2"], **options)
        else:
            cupymoe.fused_experts(p["x"], p["w13"], p["w2"], p["topk_ids"], p["topk_weights"], **options)


# host and GPU arrays mixed


class FakeGpuArray:
    """Stands in for an already-coerced GPU array: anything that is not a numpy.ndarray."""


def test_mixing_host_and_gpu_arrays_is_a_type_error():
    arrays = {"x": np.zeros((1, 64), BF16), "topk_ids": FakeGpuArray()}
    with pytest.raises(TypeError, match="x.*topk_ids"):
        _checks.array_module(arrays)


def gpu_problem(problem, on_gpu):
    import cupy

    return {n: cupy.asarray(a) if n in on_gpu else a for n, a in problem.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("on_gpu", [("x",), ("w13", "w2"), ("topk_ids",), ("topk_weights",)])
def test_fused_experts_host_gpu_mix(problem, on_gpu):
    with pytest.raises(TypeError, match=f"but {', '.join(on_gpu)} on the GPU"):
        cupymoe.fused_experts(**gpu_problem(problem, on_gpu))


@pytest.mark.gpu
def test_moe_host_gpu_mix(problem):
    import cupy

    host_layer = cupymoe.MoE(problem["w13"], problem["w2"])
    with pytest.raises(TypeError, match=leads_with("x")):
        host_layer(cupy.asarray(problem["x"]), cupy.asarray(problem["topk_ids"]),
                   cupy.asarray(problem["topk_weights"]))
    gpu_layer = cupymoe.MoE(cupy.asarray(problem["w13"]), cupy.asarray(problem["w2"]))
    with pytest.raises(TypeError, match=leads_with("x")):
        gpu_layer(problem["x"], problem["topk_ids"], problem["topk_weights"])
    with pytest.raises(TypeError, match="topk_ids on the host"):
        gpu_layer(cupy.asarray(problem["x"]), problem["topk_ids"], cupy.asarray(problem["topk_weights"]))


@pytest.mark.gpu
def test_host_out_for_gpu_inputs(problem):
    import cupy

    p = {n: cupy.asarray(a) for n, a in problem.items()}
    with pytest.raises(TypeError, match=leads_with("out")):
        cupymoe.fused_experts(**p, out=np.zeros((T, H), BF16))


class FakeDeviceArray:
    def __init__(self, address):
        self.data = type("Memory", (), {"ptr": address})()


@pytest.mark.parametrize("address", [0x7F0000000002, 0x7F0000000008])
def test_off_grid_gpu_data_is_a_value_error(address):
    with pytest.raises(ValueError, match=leads_with("w13") + ".*16 bytes.*0x7f000000000"):
        _checks.require_aligned(FakeDeviceArray(address), "w13")
    _checks.require_aligned(FakeDeviceArray(0x7F0000000010), "w13")


def off_grid(a):
    """A C-contiguous CuPy copy of ``a`` whose data starts 2 bytes past a 16-byte boundary."""
    import cupy

    flat = cupy.empty(a.size + 8, a.dtype)
    view = flat[1:1 + a.size].reshape(a.shape)
    view[...] = cupy.asarray(a)
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["w13", "w2", "out"])
def test_off_grid_weights_and_out_are_value_errors(problem, name):
    import cupy

    p = {n: cupy.asarray(a) for n, a in problem.items()}
    out = cupy.zeros((T, H), BF16)
    if name == "out":
        out = off_grid(out)
    else:
        p[name] = off_grid(p[name])
    with pytest.raises(ValueError, match=leads_with(name) + ".*16 bytes"):
        cupymoe.fused_experts(**p, out=out)
    if name != "out":
        with pytest.raises(ValueError, match=leads_with(name)):
            cupymoe.MoE(p["w13"], p["w2"])(p["x"], p["topk_ids"], p["topk_weights"])


@pytest.mark.gpu
def test_off_grid_x_is_copied(problem):
    import cupy

    p = {n: cupy.asarray(a) for n, a in problem.items()}
    want = cupymoe.fused_experts(**p)
    got = cupymoe.fused_experts(**dict(p, x=off_grid(p["x"])))
    assert np.array_equal(cupy.asnumpy(got).view(np.uint16), cupy.asnumpy(want).view(np.uint16))
