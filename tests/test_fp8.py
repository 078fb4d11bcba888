"""FP8 expert weights (cupymoe.fp8): the scale layouts, quantization, the w8a8 GEMM numerics, and the
layer on FP8 weights against float64 oracles (the dequantized weights, FP8_ORACLE_TOL; the same
w8a8 steps written independently, ORACLE_TOL); ragged sizes, -1 ids, T = 0, checks; the loader of
FP8 checkpoints; on the GPU the kernels against the NumPy backend (FP8_REFERENCE_TOL), bitwise
determinism, batch invariance and graph replay."""
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cupymoe
from cupymoe import fp8, plans, reference
from helpers import (BF16, FP8_GPU_ORACLE_TOL, FP8_MATMUL_RTOL, FP8_ORACLE_TOL, FP8_REFERENCE_TOL, FP16, ORACLE_TOL,
                     REFERENCE_TOL, host_bits, oracle, poison, random_problem, rel_l2)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
LAYOUTS = ["block", "channel", "expert"]
# (H, I): multiples of 128, and sizes whose last 128-group is 64 wide
SIZES = [(256, 128), (192, 64), (320, 192)]


def plan_name(chosen):
    """A plan's name in cupymoe.plans."""
    return next(name for name, value in vars(plans).items() if value is chosen)


def fp8_problem(rng, tokens, hidden, experts, inter, top_k, layout, dtype=BF16):
    x, w13, w2, ids, weights = random_problem(rng, tokens, hidden, experts, inter, top_k, dtype)
    q13, s13 = fp8.quantize_weights(w13, layout)
    q2, s2 = fp8.quantize_weights(w2, layout)
    return x, (q13, s13, q2, s2), ids, weights


def w8a8_oracle_rows(a, q, scale):
    """float64 a @ (q * scale).T after quantizing each 128-group of a's rows, written apart from fp8."""
    a = a.astype(np.float64)
    out = np.zeros((a.shape[0], q.shape[0]))
    w = fp8.dequantize_weights(q[None], scale[None]).astype(np.float64)[0]
    for g0 in range(0, a.shape[1], 128):
        group = a[:, g0:g0 + 128]
        s = np.maximum(np.abs(group).max(axis=1, keepdims=True), 1e-10) / 448.0
        qa = (group / s).astype(np.float32).astype(E4M3).astype(np.float64) * s
        out += qa @ w[:, g0:g0 + 128].T
    return out


def w8a8_oracle(x, q13, s13, q2, s2, ids, weights):
    """The layer in float64 with x and h (rounded to x's dtype) quantized per row and 128-group as
    fp8's docstring says."""
    inter = q13.shape[1] // 2
    out = np.zeros((x.shape[0], q2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate_up = w8a8_oracle_rows(x[t:t + 1], q13[e], s13[e])[0]
            g, u = gate_up[:inter], gate_up[inter:]
            h = (g / (1.0 + np.exp(-g)) * u).astype(x.dtype).astype(np.float64)  # rounded, as in the bf16 path
            out[t] += float(weights[t, j]) * w8a8_oracle_rows(h[None], q2[e], s2[e])[0]
    return out


@pytest.mark.parametrize("cols", [128, 192, 64, 1000])
def test_quantize_activations(cols):
    rng = np.random.default_rng(cols)
    a = (rng.standard_normal((5, cols)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    a[3] = 0
    q, s = fp8.quantize_activations(a)
    assert q.dtype == E4M3 and q.shape == a.shape
    assert s.dtype == np.float32 and s.shape == (5, -(-cols // 128))
    for g in range(s.shape[1]):
        group = a[:, g * 128:(g + 1) * 128]
        np.testing.assert_allclose(s[:, g], np.maximum(np.abs(group).max(axis=1), 1e-10) / 448, rtol=1e-6)
        back = q[:, g * 128:(g + 1) * 128].astype(np.float32) * s[:, g, None]
        # e4m3 keeps 3 mantissa bits: within 2^-4 of each normal value, and of 2^-10 * s near zero
        assert np.all(np.abs(back - group) <= 2.0**-4 * np.abs(group) + 2.0**-10 * s[:, g, None])
    assert np.all(q[3].astype(np.float32) == 0)
    assert np.max(np.abs(q.astype(np.float32))) == 448


def test_quantize_activations_keeps_nan_in_its_group():
    a = np.ones((2, 256), np.float32)
    a[0, 130] = np.nan
    q, s = fp8.quantize_activations(a)
    assert np.isnan(s[0, 1]) and np.all(np.isfinite(s[[0, 1, 1], [0, 0, 1]]))
    assert np.all(q[0, :128].astype(np.float32) == 448)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,cols", [(256, 384), (192, 320), (64, 64)])
def test_quantize_weights_round_trips(layout, rows, cols):
    rng = np.random.default_rng(rows + cols)
    w = (rng.standard_normal((3, rows, cols)) * rng.uniform(0.01, 10, (3, rows, 1))).astype(np.float32)
    q, scale = fp8.quantize_weights(w, layout)
    assert q.dtype == E4M3 and q.shape == w.shape
    assert scale.dtype == np.float32
    assert scale.shape == fp8.scale_shape(fp8.ScaleLayout(layout), 3, rows, cols)
    assert fp8.layout_of(scale.ndim) is fp8.ScaleLayout(layout)
    back = fp8.dequantize_weights(q, scale)
    spread = fp8.expand_scale(scale, rows, cols)
    assert np.all(np.abs(back - w) <= 2.0**-4 * np.abs(w) + 2.0**-10 * spread)
    assert np.all(np.abs(q.astype(np.float32)) <= 448)


def test_block_scale_is_the_amax_of_its_block():
    w = np.zeros((1, 256, 192), np.float32)
    w[0, 200, 130] = -896.0
    w[0, 5, 5] = 4.48
    _, scale = fp8.quantize_weights(w, "block")
    assert scale.shape == (1, 2, 2)
    np.testing.assert_allclose(scale[0], [[0.01, 1e-10 / 448], [1e-10 / 448, 2.0]], rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,cols", [(256, 384), (192, 320), (64, 64)])
def test_matmul_scales_each_group(layout, rows, cols):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((9, cols)).astype(np.float32) * 3
    q, scale = fp8.quantize_weights(rng.standard_normal((2, rows, cols)).astype(np.float32), layout)
    got = fp8.matmul(a, q[1], scale[1])
    assert got.dtype == np.float32 and got.shape == (9, rows)
    np.testing.assert_allclose(got, w8a8_oracle_rows(a, q[1], scale[1]), rtol=FP8_MATMUL_RTOL,
                               atol=FP8_MATMUL_RTOL * np.abs(got).max())


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden,inter", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_against_the_oracles(layout, hidden, inter, dtype):
    rng = np.random.default_rng(hidden + inter)
    x, (q13, s13, q2, s2), ids, weights = fp8_problem(rng, 13, hidden, 6, inter, 2, layout, dtype)
    ids[2, 1] = -1
    out = poison(np.empty_like(x))
    got = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, out=out)
    assert got is out and got.dtype == dtype
    # the w8a8 steps in float64: only float32 sums and the bf16/fp16 rounding of y and out differ
    assert rel_l2(got, w8a8_oracle(x, q13, s13, q2, s2, ids, weights)) < ORACLE_TOL
    # against the dequantized weights: the cost of quantizing x and h
    error = rel_l2(got, oracle(x, fp8.dequantize_weights(q13, s13), fp8.dequantize_weights(q2, s2), ids, weights))
    assert 5e-3 < error < FP8_ORACLE_TOL


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden,inter", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_only_is_the_16_bit_path_on_the_dequantized_weights(layout, hidden, inter, dtype):
    """w8a16: nothing but h and y is rounded, so against the float64 oracle on the dequantized weights
    the bf16 path's bound holds; beside that path on those weights only the float32 products differ."""
    rng = np.random.default_rng(hidden + inter + 1)
    x, (q13, s13, q2, s2), ids, weights = fp8_problem(rng, 13, hidden, 6, inter, 2, layout, dtype)
    ids[2, 1] = -1
    w13, w2 = fp8.dequantize_weights(q13, s13), fp8.dequantize_weights(q2, s2)
    got = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, fp8_compute="w8a16")
    assert got.dtype == dtype
    assert rel_l2(got, oracle(x, w13, w2, ids, weights)) < ORACLE_TOL
    sixteen_bit = reference.fused_experts(x, w13, w2, ids, weights, np.empty_like(x))
    assert rel_l2(got, sixteen_bit) < REFERENCE_TOL
    w8a8 = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, fp8_compute="w8a8")
    assert np.array_equal(w8a8.view(np.uint16),
                          cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2).view(np.uint16))
    moe = cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2, fp8_compute="w8a16")
    assert moe.scales.weight_only and np.array_equal(moe(x, ids, weights).view(np.uint16), got.view(np.uint16))


def test_w8a8_on_a_gpu_without_fp8_tensor_cores_points_to_weight_only(monkeypatch):
    from cupymoe import _compile, layer
    from cupymoe._types import WeightScales

    monkeypatch.setattr(_compile, "compute_capability", lambda device_id: 80)
    with pytest.raises(ValueError, match=r'fp8_compute: w8a8 needs FP8 tensor cores .* GPU 0 is 8.0: pass '
                                         r'fp8_compute="w8a16"'):
        layer._require_fp8_kernels(WeightScales(None, None), (4, 128, 256), 0)
    layer._require_fp8_kernels(WeightScales(None, None, weight_only=True), (4, 128, 256), 0)


def test_torch_float8_tensors_come_in_as_their_bits(monkeypatch):
    class Tensor:  # torch.Tensor's stand-in: float8_e4m3fn data, a uint8 view of the same bytes
        __module__ = "torch"

        def __init__(self, a):
            self.a, self.dtype = a, "torch.float8_e4m3fn"

        def view(self, dtype):
            assert dtype == "torch.uint8"
            return self.a.view(np.uint8)

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(uint8="torch.uint8"))
    rng = np.random.default_rng(4)
    x, (q13, s13, q2, s2), ids, weights = fp8_problem(rng, 5, 128, 4, 64, 2, "block")
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    got = cupymoe.fused_experts(x, Tensor(q13), Tensor(q2), ids, weights, w13_scale=s13, w2_scale=s2)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_uint8_bits_are_the_same_weights():
    rng = np.random.default_rng(3)
    x, (q13, s13, q2, s2), ids, weights = fp8_problem(rng, 7, 128, 4, 64, 2, "block")
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    got = cupymoe.fused_experts(x, q13.view(np.uint8), q2.view(np.uint8), ids, weights, w13_scale=s13, w2_scale=s2)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_layer_object_edge_cases_and_options():
    rng = np.random.default_rng(5)
    x, (q13, s13, q2, s2), ids, weights = fp8_problem(rng, 9, 128, 4, 64, 2, "channel")
    moe = cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2)
    assert moe.dtype is None and moe.scales.w13 is s13
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    assert np.array_equal(moe(x, ids, weights).view(np.uint16), want.view(np.uint16))
    assert moe(x[:0], ids[:0], weights[:0]).shape == (0, 128)
    one = np.zeros_like(ids)  # every token on expert 0, the others idle
    assert rel_l2(moe(x, one, weights), w8a8_oracle(x, q13, s13, q2, s2, one, weights)) < ORACLE_TOL
    fp16 = moe(x.astype(np.float32).astype(FP16), ids, weights)
    assert fp16.dtype == FP16 and rel_l2(fp16, want) < 1e-2
    # biases fix the activation dtype of a layer of FP8 weights
    b2 = rng.standard_normal((4, 128)).astype(BF16)
    biased = cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2, w2_bias=b2, activation="gelu")
    assert biased.dtype == BF16
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        biased(x.astype(np.float32).astype(FP16), ids, weights)
    assert np.isfinite(biased(x, ids, weights).astype(np.float32)).all()


def test_block_on_fp8_experts():
    rng = np.random.default_rng(11)
    x, (q13, s13, q2, s2), _, _ = fp8_problem(rng, 6, 128, 8, 64, 2, "block")
    router = rng.standard_normal((8, 128)).astype(BF16)
    block = cupymoe.MoEBlock(router, q13, q2, top_k=2, w13_scale=s13, w2_scale=s2)
    assert block.dtype == BF16
    weights, ids = cupymoe.route(block.router_logits(x), 2)
    assert np.array_equal(block(x).view(np.uint16),
                          cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2).view(np.uint16))
    with pytest.raises(TypeError, match="router_weight: expected dtype"):
        cupymoe.MoEBlock(router.astype(np.float32), q13, q2, top_k=2, w13_scale=s13, w2_scale=s2)


def test_nan_in_x_stays_in_its_token():
    rng = np.random.default_rng(2)
    x, (q13, s13, q2, s2), ids, weights = fp8_problem(rng, 4, 128, 4, 64, 2, "block")
    x[1, 3] = np.nan
    out = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2).astype(np.float32)
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2, 3]]).all()


def bad(make, error, match):
    return pytest.param(make, error, match, id=match.split(":")[0] + "-" + error.__name__)


@pytest.mark.parametrize("make,error,match", [
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w2_scale=s2), TypeError, "w13_scale: FP8 weights need"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13), TypeError, "w2_scale: FP8 weights need"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13.astype(np.float32).astype(BF16), w2=q2, w13_scale=s13, w2_scale=s2),
        TypeError, "w13_scale: scales go with float8"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13[:, :1], w2_scale=s2), ValueError,
        r"w13_scale: expected a shape of \(4, 2, 2\) \(block\), \(4, 256\) \(channel\) or \(4,\)"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2[0]), ValueError,
        "w2_scale: expected a shape"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13.astype(np.float64), w2_scale=s2), TypeError,
        "w13_scale: expected dtype float32"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13.tolist(), w2_scale=s2), TypeError,
        "w13_scale: expected a NumPy"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=np.asfortranarray(s13), w2_scale=s2), ValueError,
        "w13_scale: expected a C-contiguous"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13.view(np.int8), w2=q2, w13_scale=s13, w2_scale=s2), TypeError,
        "w13_scale: scales go with float8_e4m3fn .or uint8. weights, got w13 of dtype int8"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2,
                                      w13_bias=np.zeros((4, 256), BF16), w2_bias=np.zeros((4, 256), FP16)),
        TypeError, "w2_bias: expected dtype bfloat16 like w13_bias"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, w2_bias=np.zeros((4, 256))),
        TypeError, "w2_bias: expected dtype bfloat16 or float16"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, fp8_compute="w4a16"), ValueError,
        r"fp8_compute: expected one of \('w8a8', 'w8a16'\) or None, got 'w4a16'"),
    bad(lambda q13, s13, q2, s2: dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, fp8_compute=True), TypeError,
        "fp8_compute: expected one of .* got bool"),
    bad(lambda q13, s13, q2, s2: dict(w13=fp8.dequantize_weights(q13, s13).astype(BF16),
                                      w2=fp8.dequantize_weights(q2, s2).astype(BF16), fp8_compute="w8a16"),
        ValueError, "fp8_compute: applies to FP8 weights only, got w13 of dtype bfloat16"),
])
def test_bad_fp8_arguments(make, error, match):
    rng = np.random.default_rng(0)
    x, (q13, s13, q2, s2), ids, weights = fp8_problem(rng, 3, 256, 4, 128, 2, "block")
    kwargs = make(q13, s13, q2, s2)
    w13, w2 = kwargs.pop("w13"), kwargs.pop("w2")
    with pytest.raises(error, match=match):
        cupymoe.fused_experts(x, w13, w2, ids, weights, **kwargs)
    with pytest.raises(error, match=match):
        cupymoe.MoE(w13, w2, **kwargs)


# ---- GPU: the kernels (quantize.cu, the FP8 GEMMs and the gate/up epilogue's quantization) against the NumPy backend


def gpu_fp8(cupy, problem):
    """The problem's arrays on the GPU, the FP8 weights as uint8 bits."""
    x, (q13, s13, q2, s2), ids, weights = problem
    return (cupy.asarray(x), cupy.asarray(q13.view(np.uint8)), cupy.asarray(s13), cupy.asarray(q2.view(np.uint8)),
            cupy.asarray(s2), cupy.asarray(ids), cupy.asarray(weights))


def gpu_forward(cupy, args, **kwargs):
    x, q13, s13, q2, s2, ids, weights = args
    out = poison(cupy.empty_like(x))
    return cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, out=out, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cols", [256, 192, 64])
def test_quantize_kernel_is_quantize_activations(cols, dtype):
    import cupy
    from cupymoe import _gpu_quantize

    rng = np.random.default_rng(cols)
    a = (rng.standard_normal((37, cols)) * rng.uniform(1e-3, 1e3, (37, 1))).astype(dtype)
    a[3] = 0
    a[5, 7] = np.nan
    a[6, 1] = np.inf
    q = cupy.full(a.shape, 0x55, np.uint8)
    scale = cupy.full((37, -(-cols // 128)), np.nan, np.float32)
    _gpu_quantize.run(cupy.asarray(a), q, scale)
    want_q, want_scale = fp8.quantize_activations(a)
    np.testing.assert_array_equal(scale.get(), want_scale)
    got = q.get().view(E4M3).astype(np.float32)
    want = want_q.astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))


@pytest.mark.gpu
def test_quantize_kernel_stops_at_the_row_count():
    import cupy
    from cupymoe import _gpu_quantize

    a = cupy.ones((10, 128), BF16)
    q = cupy.zeros((10, 128), np.uint8)
    scale = cupy.zeros((10, 1), np.float32)
    _gpu_quantize.run(a, q, scale, cupy.array([4], np.int32))
    assert (q[:4].get() != 0).all() and (q[4:].get() == 0).all() and (scale[4:].get() == 0).all()


@pytest.mark.gpu
def test_gate_up_epilogue_quantizes_h_as_the_quantize_kernel():
    """The persistent gate/up writes h quantized (its epilogue joins the two consumers' halves of a
    128-column group): bit for bit quantize.cu's on the 16-bit h of an mma.sync plan. Integers up
    to 7 with a 7 in every 128-group and 128 x 128 block quantize exactly (scale 1/64, q = 64 v), so
    every product and K-tile sum is an exact fp32 integer and both GEMMs give h the same bits in any
    order. 77 tokens: tiles short of a 32-slot pass and past it; a NaN token; a -1 id."""
    import cupy
    from cupymoe import _gpu_dispatch, _gpu_forward
    from cupymoe._types import ExpertOptions, Shape, WeightScales

    rng = np.random.default_rng(41)
    tokens, hidden, experts, inter, top_k = 77, 256, 8, 256, 4
    x = rng.integers(-7, 8, (tokens, hidden)).astype(np.float32)
    x[:, ::128] = 7
    x = x.astype(BF16)
    x[3, 5] = np.nan
    w13 = rng.integers(-7, 8, (experts, 2 * inter, hidden)).astype(np.float32)
    w13[:, ::128, ::128] = 7
    q13, s13 = fp8.quantize_weights(w13, "block")
    assert (s13 == 1 / 64).all()
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    ids[0, 1] = -1
    weights = rng.random((tokens, top_k)).astype(np.float32)
    x_d, ids_d, weights_d = cupy.asarray(x), cupy.asarray(ids), cupy.asarray(weights)
    w13_d, s13_d = cupy.asarray(q13.view(np.uint8)), cupy.asarray(s13)
    shape = Shape(tokens=tokens, hidden=hidden, experts=experts, intermediate=inter, top_k=top_k, dtype=x.dtype)
    scales = WeightScales(s13_d, cupy.ones((experts, hidden), np.float32), False)
    got = []
    for plan, fused in ((plans.PERSISTENT_FP8, True), (plans.MEDIUM_32, False)):
        with plans.forced(plan):
            ws = _gpu_forward.Workspace(shape, 0, scales)
        assert ws.gate_up_quantizes_h is fused
        ws.quantized[1][0].fill(0x55)
        ws.quantized[1][1].fill(np.nan)
        _gpu_dispatch.launch(ids_d, ws.dispatch)
        h_q, h_scale = _gpu_forward.fp8_gate_up(x_d, weights_d, w13_d, s13_d, shape, ws, ExpertOptions())
        rows = int(ws.dispatch.offsets[experts])
        got.append((h_q[:rows].get(), h_scale[:rows].get()))
    (q, scale), (want_q, want_scale) = got
    assert rows == tokens * top_k - 1
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(scale, want_scale)
    nan_rows = np.isnan(scale).all(axis=1)
    assert nan_rows.sum() == top_k and not np.isnan(scale[~nan_rows]).any()
    # each group's largest value lands on the e4m3 maximum
    assert (np.abs(q[~nan_rows].view(E4M3).astype(np.float32)).reshape(-1, 2, 128).max(axis=2) == 448).all()


@pytest.mark.gpu
@pytest.mark.parametrize("plan", plans.FP8_PLANS + plans.FP8_TRIAL_PLANS, ids=lambda p: plan_name(p))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_gpu_against_the_numpy_backend(tokens, layout, plan):
    import cupy

    problem = fp8_problem(np.random.default_rng(tokens), tokens, 256, 8, 384, 4, layout)
    problem[2][0, 1] = -1
    x, (q13, s13, q2, s2), ids, weights = problem
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    args = gpu_fp8(cupy, problem)
    with plans.forced(plan):
        got = gpu_forward(cupy, args)
        again = gpu_forward(cupy, args)
    assert rel_l2(got, want) < FP8_REFERENCE_TOL
    assert np.array_equal(host_bits(got), host_bits(again))
    n = min(tokens, 4)
    assert rel_l2(got[:n], w8a8_oracle(x[:n], q13, s13, q2, s2, ids[:n], weights[:n])) < FP8_GPU_ORACLE_TOL


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("plan", plans.FP8_TRIAL_PLANS, ids=lambda p: plan_name(p))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hidden,inter", [(512, 384), (256, 128)])
@pytest.mark.parametrize("tokens", [1, 64, 300, 1000])
def test_gpu_trial_plans_give_the_persistent_plans_bits(tokens, hidden, inter, layout, plan):
    """A trial plan (plans.FP8_TRIAL_PLANS) sums the same products in the same order as
    PERSISTENT_FP8: the same bits, both GEMMs on the persistent kernel with 1 to 4 K-tiles, experts
    of 2 to 500 rows (a 128-slot tile's second consumer with none, some or all of its 64)."""
    import cupy

    problem = fp8_problem(np.random.default_rng(tokens + 1), tokens, hidden, 8, inter, 4, layout)
    problem[2][0, 1] = -1
    args = gpu_fp8(cupy, problem)
    bits = []
    for chosen in (plans.PERSISTENT_FP8, plan):
        with plans.forced(chosen):
            bits.append(host_bits(gpu_forward(cupy, args)))
    assert np.array_equal(bits[0], bits[1])


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["one", "sparse"])
def test_gpu_skewed_routing_options_and_fp16(routing):
    import cupy

    rng = np.random.default_rng(4)
    x, w13, w2, ids, weights = random_problem(rng, 200, 256, 16, 128, 4, FP16, routing)
    q13, s13 = fp8.quantize_weights(w13, "block")
    q2, s2 = fp8.quantize_weights(w2, "channel")
    kwargs = dict(activation="swigluoai", apply_router_weight_on_input=True,
                  w13_bias=(0.5 * rng.standard_normal((16, 256))).astype(FP16),
                  w2_bias=(0.5 * rng.standard_normal((16, 256))).astype(FP16))
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, **kwargs)
    args = gpu_fp8(cupy, (x, (q13, s13, q2, s2), ids, weights))
    gpu_kwargs = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    assert rel_l2(gpu_forward(cupy, args, **gpu_kwargs), want) < FP8_REFERENCE_TOL


def assert_batch_invariant_and_replayable(cupy, layer, x, ids, weights, full):
    """``layer`` on slices of its 300 tokens (other plans) gives ``full``'s bits, and so does a CUDA
    graph captured on 64 tokens and replayed on others."""
    for rows in (slice(0, 1), slice(5, 12), slice(17, 81)):
        assert np.array_equal(host_bits(layer(x[rows], ids[rows], weights[rows])), host_bits(full[rows]))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        part = [cupy.ascontiguousarray(a[:64]) for a in (x, ids, weights)]
        layer(*part, check_ids=False)
        stream.begin_capture()
        out = layer(*part, check_ids=False)
        graph = stream.end_capture()
        part[0][...] = x[100:164]
        part[1][...] = ids[100:164]
        part[2][...] = weights[100:164]
        poison(out)
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(host_bits(out), host_bits(full[100:164]))


@pytest.mark.gpu
def test_gpu_layer_zero_tokens_batch_invariance_and_graph_replay():
    import cupy

    problem = fp8_problem(np.random.default_rng(6), 300, 256, 16, 128, 4, "expert")
    x, q13, s13, q2, s2, ids, weights = gpu_fp8(cupy, problem)
    layer = cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2)
    assert layer(x[:0], ids[:0], weights[:0]).shape == (0, 256)
    full = layer(x, ids, weights).copy()
    assert_batch_invariant_and_replayable(cupy, layer, x, ids, weights, full)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_gpu_weight_only_against_the_numpy_backend(tokens, layout, dtype):
    """w8a16 on the GPU: the NumPy backend's numerics up to the float32 summation order (the bf16
    path's bound), every plan with the same bits, reproducible; subnormal and largest e4m3 weights."""
    import cupy

    problem = fp8_problem(np.random.default_rng(tokens + 1), tokens, 256, 8, 384, 4, layout, dtype)
    x, (q13, s13, q2, s2), ids, weights = problem
    ids[0, 1] = -1
    q13.view(np.uint8)[1, :4, :8] = [0x01, 0x81, 0x07, 0x7e, 0xfe, 0x00, 0x80, 0x39]  # subnormals, +-448, +-0
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, fp8_compute="w8a16")
    args = gpu_fp8(cupy, problem)
    bits = []
    for plan in plans.WEIGHT_ONLY_PLANS:
        with plans.forced(plan):
            got = gpu_forward(cupy, args, fp8_compute="w8a16")
            bits.append(host_bits(got))
            assert np.array_equal(host_bits(gpu_forward(cupy, args, fp8_compute="w8a16")), bits[-1])
        assert rel_l2(got, want) < REFERENCE_TOL
    assert all(np.array_equal(b, bits[0]) for b in bits)
    with plans.forced(plans.PERSISTENT_FP8), pytest.raises(ValueError, match="weight-only FP8 runs its own plans"):
        gpu_forward(cupy, args, fp8_compute="w8a16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_gpu_weight_only_widens_every_e4m3_code(dtype):
    """Gate/up weights of subnormal codes only (a flush to zero would zero h), down weights of every
    code but NaN's: the GPU's widening against ml_dtypes' values."""
    import cupy

    rng = np.random.default_rng(12)
    problem = fp8_problem(rng, 40, 256, 4, 128, 2, "channel", dtype)
    x, (q13, s13, q2, s2), ids, weights = problem
    subnormals = np.array([c | sign for c in range(1, 8) for sign in (0, 0x80)], np.uint8)
    q13.view(np.uint8)[...] = rng.choice(subnormals, q13.shape)
    q2.view(np.uint8)[...] = rng.choice(np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8), q2.shape)
    s13[...] = 2.0**9 / rng.uniform(8, 32, s13.shape).astype(np.float32)  # weights up to 7/64
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, fp8_compute="w8a16")
    assert np.abs(want.astype(np.float32)).max() > 0
    assert rel_l2(gpu_forward(cupy, gpu_fp8(cupy, problem), fp8_compute="w8a16"), want) < REFERENCE_TOL


@pytest.mark.gpu
def test_gpu_weight_only_layer_batch_invariance_options_and_graph_replay():
    import cupy

    rng = np.random.default_rng(8)
    x, w13, w2, ids, weights = random_problem(rng, 300, 256, 16, 128, 4, BF16, "sparse")
    q13, s13 = fp8.quantize_weights(w13, "block")
    q2, s2 = fp8.quantize_weights(w2, "expert")
    kwargs = dict(activation="swigluoai", w13_bias=(0.5 * rng.standard_normal((16, 256))).astype(BF16))
    want = cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, fp8_compute="w8a16", **kwargs)
    x, q13, s13, q2, s2, ids, weights = gpu_fp8(cupy, (x, (q13, s13, q2, s2), ids, weights))
    layer = cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2, fp8_compute="w8a16", activation="swigluoai",
                        w13_bias=cupy.asarray(kwargs["w13_bias"]))
    assert layer(x[:0], ids[:0], weights[:0]).shape == (0, 256)
    full = layer(x, ids, weights).copy()
    assert rel_l2(full, want) < REFERENCE_TOL
    assert_batch_invariant_and_replayable(cupy, layer, x, ids, weights, full)


@pytest.mark.gpu
def test_gpu_fp8_checks():
    import cupy

    problem = fp8_problem(np.random.default_rng(0), 3, 192, 4, 128, 2, "block")
    x, q13, s13, q2, s2, ids, weights = gpu_fp8(cupy, problem)
    with pytest.raises(ValueError, match="w13: FP8 weights on the GPU need H and I multiples of 128"):
        cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="w13_scale: expected a shape"):  # the checks of both backends first
        cupymoe.fused_experts(x, q13, q2, ids, weights, w13_scale=s13[:, :1], w2_scale=s2)


def fp8_checkpoint(rng, experts=16, hidden=256, inter=128):
    """A DeepSeek-V3 FP8 layer as its checkpoint holds it: per-expert e4m3 weights with their
    weight_scale_inv blocks, a bf16 router, an FP8 shared expert; and the stacked FP8 experts."""
    config = dict(model_type="deepseek_v3", hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                  num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                  n_shared_experts=1, quantization_config=dict(quant_method="fp8", fmt="e4m3",
                                                               activation_scheme="dynamic", weight_block_size=[128, 128]))
    t = {"gate.weight": (0.3 * rng.standard_normal((experts, hidden))).astype(BF16),
         "gate.e_score_correction_bias": (0.05 * rng.standard_normal(experts)).astype(np.float32)}
    _, w13, w2, _, _ = random_problem(rng, 1, hidden, experts, inter, 1)
    q13, s13 = fp8.quantize_weights(w13, "block")
    q2, s2 = fp8.quantize_weights(w2, "block")
    for e in range(experts):
        for name, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            t[f"experts.{e}.{name}.weight"] = q13[e, rows]
            t[f"experts.{e}.{name}.weight_scale_inv"] = s13[e, rows.start // 128:rows.stop // 128]
        t[f"experts.{e}.down_proj.weight"], t[f"experts.{e}.down_proj.weight_scale_inv"] = q2[e], s2[e]
    _, shared13, shared2, _, _ = random_problem(rng, 1, hidden, 1, inter, 1)
    sq13, ss13 = fp8.quantize_weights(shared13, "block")
    sq2, ss2 = fp8.quantize_weights(shared2, "block")
    for name, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
        t[f"shared_experts.{name}.weight"] = sq13[0, rows]
        t[f"shared_experts.{name}.weight_scale_inv"] = ss13[0, rows.start // 128:rows.stop // 128]
    t["shared_experts.down_proj.weight"], t["shared_experts.down_proj.weight_scale_inv"] = sq2[0], ss2[0]
    shared = (fp8.dequantize_weights(sq13, ss13)[0].astype(BF16), fp8.dequantize_weights(sq2, ss2)[0].astype(BF16))
    return config, t, (q13, s13, q2, s2), shared


def test_fp8_checkpoint_loads_as_fp8_experts(tmp_path):
    from cupymoe import checkpoint, families

    rng = np.random.default_rng(8)
    config, tensors, (q13, s13, q2, s2), (shared13, shared2) = fp8_checkpoint(rng)
    path = tmp_path / "fp8.safetensors"
    checkpoint.save(path, {f"model.layers.3.mlp.{name}": a for name, a in tensors.items()})
    block = families.block_from_checkpoint(config, [path], "model.layers.3.mlp.")
    assert block.experts.w13.dtype == E4M3 and np.array_equal(block.experts.w13.view(np.uint8), q13.view(np.uint8))
    assert np.array_equal(block.experts.w2.view(np.uint8), q2.view(np.uint8))
    assert np.array_equal(block.experts.scales.w13, s13) and np.array_equal(block.experts.scales.w2, s2)
    assert block.dtype == BF16
    want = cupymoe.MoEBlock(tensors["gate.weight"], q13, q2, w13_scale=s13, w2_scale=s2, top_k=4, scoring="sigmoid",
                            num_groups=4, topk_groups=2, correction_bias=tensors["gate.e_score_correction_bias"],
                            scaling_factor=2.5, router_logits_dtype="float32", shared_w13=shared13, shared_w2=shared2)
    x = rng.standard_normal((9, 256)).astype(BF16)
    assert np.array_equal(block(x).view(np.uint16), want(x).view(np.uint16))


def test_fp8_checkpoint_limits():
    from cupymoe import families

    rng = np.random.default_rng(9)
    config, tensors, _, _ = fp8_checkpoint(rng, experts=8, inter=128)
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        families.block_kwargs({**config, "quantization_config": dict(weight_block_size=[64, 64])}, tensors)
    config, tensors, _, _ = fp8_checkpoint(rng, experts=8, inter=192)
    with pytest.raises(ValueError, match="a multiple of 128 .* got 192"):
        families.block_kwargs(config, tensors)
