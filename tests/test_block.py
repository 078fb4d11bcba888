"""MoEBlock and the model families (cupymoe.families, cupymoe.checkpoint) on the NumPy and the CuPy
backend, one test body for both: each family's block built from a config dict and a safetensors
file written here, against a float64 oracle of that family's block written from its transformers
module (router, routing, experts, shared expert). The transformers modules themselves are the
reference of tests/test_hf_parity.py, on the GPU."""
import ml_dtypes
import numpy as np
import pytest

import cupymoe
from cupymoe import checkpoint, families
from helpers import BF16, ORACLE_TOL, as_numpy, host_bits, oracle, rel_l2

H, I, S = 128, 64, 192  # hidden, expert and shared-expert widths


def bf16(rng, shape, scale):
    return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(BF16)


# Per family: its config, and its tensors in the checkpoint's layout (names relative to the block).
def mixtral(rng, e=8):
    config = dict(model_type="mixtral", hidden_size=H, intermediate_size=I, num_local_experts=e,
                  num_experts_per_tok=2, hidden_act="silu")
    t = {"gate.weight": bf16(rng, (e, H), 0.3)}
    for x in range(e):
        t[f"experts.{x}.w1.weight"] = bf16(rng, (I, H), H**-0.5)
        t[f"experts.{x}.w3.weight"] = bf16(rng, (I, H), H**-0.5)
        t[f"experts.{x}.w2.weight"] = bf16(rng, (H, I), I**-0.5)
    return config, t


def qwen_experts(rng, t, e):
    for x in range(e):
        t[f"experts.{x}.gate_proj.weight"] = bf16(rng, (I, H), H**-0.5)
        t[f"experts.{x}.up_proj.weight"] = bf16(rng, (I, H), H**-0.5)
        t[f"experts.{x}.down_proj.weight"] = bf16(rng, (H, I), I**-0.5)


def shared_mlp(rng, t, prefix, width):
    t[f"{prefix}.gate_proj.weight"] = bf16(rng, (width, H), H**-0.5)
    t[f"{prefix}.up_proj.weight"] = bf16(rng, (width, H), H**-0.5)
    t[f"{prefix}.down_proj.weight"] = bf16(rng, (H, width), width**-0.5)


def qwen2_moe(rng, e=16):
    config = dict(model_type="qwen2_moe", hidden_size=H, moe_intermediate_size=I, num_experts=e,
                  num_experts_per_tok=4, norm_topk_prob=False, shared_expert_intermediate_size=S)
    t = {"gate.weight": bf16(rng, (e, H), 0.3), "shared_expert_gate.weight": bf16(rng, (1, H), 0.2)}
    qwen_experts(rng, t, e)
    shared_mlp(rng, t, "shared_expert", S)
    return config, t


def qwen3_moe(rng, e=16):
    config = dict(model_type="qwen3_moe", hidden_size=H, moe_intermediate_size=I, num_experts=e,
                  num_experts_per_tok=4, norm_topk_prob=True)
    t = {"gate.weight": bf16(rng, (e, H), 0.3)}
    qwen_experts(rng, t, e)
    return config, t


def deepseek_v3(rng, e=32, model_type="deepseek_v3", groups=8, kept=4):
    config = dict(model_type=model_type, hidden_size=H, moe_intermediate_size=I, n_routed_experts=e,
                  num_experts_per_tok=8, n_group=groups, topk_group=kept, norm_topk_prob=True,
                  routed_scaling_factor=2.5, n_shared_experts=2)
    t = {"gate.weight": bf16(rng, (e, H), 0.3),
         "gate.e_score_correction_bias": (0.05 * rng.standard_normal(e)).astype(np.float32)}
    qwen_experts(rng, t, e)
    shared_mlp(rng, t, "shared_experts", 2 * I)
    return config, t


def glm4_moe(rng):
    return deepseek_v3(rng, 24, "glm4_moe", 1, 1)


def gpt_oss(rng, e=8):
    config = dict(model_type="gpt_oss", hidden_size=H, intermediate_size=I, num_local_experts=e,
                  num_experts_per_tok=4, swiglu_limit=7.0)
    t = {"router.weight": bf16(rng, (e, H), 0.3), "router.bias": bf16(rng, (e,), 0.3),
         "experts.gate_up_proj": bf16(rng, (e, H, 2 * I), 4 * H**-0.5),  # gate, up interleaved
         "experts.gate_up_proj_bias": bf16(rng, (e, 2 * I), 0.5),
         "experts.down_proj": bf16(rng, (e, I, H), I**-0.5), "experts.down_proj_bias": bf16(rng, (e, H), 0.5)}
    return config, t


def llama4(rng, e=8):
    config = dict(model_type="llama4", text_config=dict(hidden_size=H, intermediate_size=I, num_local_experts=e,
                                                         num_experts_per_tok=1, hidden_act="silu"))
    t = {"router.weight": bf16(rng, (e, H), 0.3), "experts.gate_up_proj": bf16(rng, (e, H, 2 * I), H**-0.5),
         "experts.down_proj": bf16(rng, (e, I, H), I**-0.5)}
    shared_mlp(rng, t, "shared_expert", I)
    return config, t


FAMILIES = [mixtral, qwen2_moe, qwen3_moe, deepseek_v3, glm4_moe, gpt_oss, llama4]


def family_oracle(config, t, x):
    """The block in float64 from the family's definition, and the ids it routes to."""
    c = config.get("text_config", config)
    x64 = x.astype(np.float64)
    kind = config["model_type"]
    f64 = lambda name: t[name].astype(np.float64)  # noqa: E731
    router = f64("router.weight" if kind in ("gpt_oss", "llama4") else "gate.weight")
    logits = x64 @ router.T + (f64("router.bias") if kind == "gpt_oss" else 0.0)
    if kind != "deepseek_v3" and kind != "glm4_moe":  # a linear layer of the model's dtype
        logits = logits.astype(BF16).astype(np.float64)
    e = logits.shape[1]
    k = c["num_experts_per_tok"]
    on_input, activation, b13, b2, shared = False, "silu", None, None, None
    if kind in ("deepseek_v3", "glm4_moe"):
        scores = 1 / (1 + np.exp(-logits))
        biased = scores + t["gate.e_score_correction_bias"]
        g = c["n_group"]
        group = np.sort(biased.reshape(len(x), g, e // g), axis=2)[:, :, -2:].sum(axis=2)
        kept = np.argsort(-group, axis=1, kind="stable")[:, :c["topk_group"]]
        mask = np.zeros((len(x), g), bool)
        np.put_along_axis(mask, kept, True, axis=1)
        biased = np.where(np.repeat(mask, e // g, axis=1), biased, -np.inf)
        ids = np.argsort(-biased, axis=1, kind="stable")[:, :k]
        weights = np.take_along_axis(scores, ids, axis=1)
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20) * c["routed_scaling_factor"]
    elif kind == "llama4":
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        weights = 1 / (1 + np.exp(-np.take_along_axis(logits, ids, axis=1)))
        on_input = True
    else:
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        weights = np.take_along_axis(probs / probs.sum(axis=1, keepdims=True), ids, axis=1)
        if c.get("norm_topk_prob", True):
            weights = weights / weights.sum(axis=1, keepdims=True)
    if kind in ("gpt_oss", "llama4"):
        gate_up, down = t["experts.gate_up_proj"], t["experts.down_proj"]
        order = np.r_[0:2 * I:2, 1:2 * I:2] if kind == "gpt_oss" else np.arange(2 * I)
        w13 = np.ascontiguousarray(gate_up.transpose(0, 2, 1)[:, order])
        w2 = np.ascontiguousarray(down.transpose(0, 2, 1))
        if kind == "gpt_oss":
            activation = "swigluoai"
            b13, b2 = t["experts.gate_up_proj_bias"][:, order], t["experts.down_proj_bias"]
    else:
        names = (("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj"))
        w13 = np.stack([np.concatenate([t[f"experts.{j}.{names[0]}.weight"], t[f"experts.{j}.{names[1]}.weight"]])
                        for j in range(e)])
        w2 = np.stack([t[f"experts.{j}.{names[2]}.weight"] for j in range(e)])
    out = oracle(x, w13, w2, ids, weights, activation, b13, b2, on_input)
    prefix = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts", "glm4_moe": "shared_experts",
              "llama4": "shared_expert"}.get(kind)
    if prefix:
        g_, u_, d_ = (f64(f"{prefix}.{p}_proj.weight") for p in ("gate", "up", "down"))
        shared = ((x64 @ g_.T) / (1 + np.exp(-(x64 @ g_.T))) * (x64 @ u_.T)) @ d_.T
        if kind == "qwen2_moe":
            shared *= 1 / (1 + np.exp(-(x64 @ f64("shared_expert_gate.weight").T)))
        out += shared
    return out, ids


def load_block(xp, tmp_path, family, seed=0):
    config, tensors = family(np.random.default_rng(seed))
    path = tmp_path / f"{config['model_type']}.safetensors"
    checkpoint.save(path, {f"model.layers.1.mlp.{name}": a for name, a in tensors.items()})
    block = families.block_from_checkpoint(config, [path], "model.layers.1.mlp.", xp=xp)
    return block, config, tensors


@pytest.mark.sanitize
@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_family_block_matches_its_definition(xp, tmp_path, family, tokens):
    """From a safetensors file to the block's output: the family's routing (ids exactly) and output
    (ORACLE_TOL against float64), bitwise equal on a second call and through out=."""
    block, config, tensors = load_block(xp, tmp_path, family)
    x = (np.random.default_rng(tokens).standard_normal((tokens, H), dtype=np.float32)).astype(BF16)
    want, want_ids = family_oracle(config, tensors, x)
    logits = block.router_logits(xp.asarray(x))
    _, ids = cupymoe.route(logits, block.routing.top_k, scoring=block.routing.scoring,
                           renormalize=block.routing.renormalize, num_groups=block.routing.num_groups,
                           topk_groups=block.routing.topk_groups, correction_bias=block.routing.correction_bias,
                           scaling_factor=block.routing.scaling_factor)
    np.testing.assert_array_equal(np.sort(as_numpy(ids), axis=1), np.sort(want_ids, axis=1))
    got = block(xp.asarray(x))
    assert got.shape == x.shape and got.dtype == BF16
    assert rel_l2(got, want) < ORACLE_TOL
    bits = host_bits(got).copy()
    out = xp.empty_like(xp.asarray(x))
    assert block(xp.asarray(x), out=out) is out
    np.testing.assert_array_equal(host_bits(out), bits)


@pytest.mark.parametrize("family", [mixtral, qwen2_moe, deepseek_v3], ids=lambda f: f.__name__)
def test_transformers_module_layout_gives_the_same_bits(xp, tmp_path, family):
    """The stacked ``experts.gate_up_proj`` / ``experts.down_proj`` of a transformers v5 module's
    state_dict load to the same block as the checkpoint's per-expert tensors."""
    block, config, tensors = load_block(xp, tmp_path, family)
    names = ("w1", "w3", "w2") if family is mixtral else ("gate_proj", "up_proj", "down_proj")
    e = block.num_experts
    stacked = {n: a for n, a in tensors.items() if not n.startswith("experts.")}
    stacked["experts.gate_up_proj"] = np.stack([np.concatenate([tensors[f"experts.{j}.{names[0]}.weight"],
                                                                tensors[f"experts.{j}.{names[1]}.weight"]])
                                                for j in range(e)])
    stacked["experts.down_proj"] = np.stack([tensors[f"experts.{j}.{names[2]}.weight"] for j in range(e)])
    other = cupymoe.MoEBlock.from_config(config, {n: xp.asarray(a) for n, a in stacked.items()})
    x = xp.asarray(np.random.default_rng(1).standard_normal((50, H), dtype=np.float32).astype(BF16))
    np.testing.assert_array_equal(host_bits(other(x)), host_bits(block(x)))


def test_zero_tokens(xp, tmp_path):
    block, _, _ = load_block(xp, tmp_path, deepseek_v3)
    out = block(xp.zeros((0, H), BF16))
    assert out.shape == (0, H) and out.dtype == BF16


def test_checkpoint_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": bf16(rng, (3, 5), 1.0), "b": rng.standard_normal(7).astype(np.float32),
               "c": rng.standard_normal((2, 2)).astype(ml_dtypes.float8_e4m3fn), "d": np.arange(4, dtype=np.int64)}
    checkpoint.save(tmp_path / "one.safetensors", dict(list(tensors.items())[:2]))
    checkpoint.save(tmp_path / "two.safetensors", dict(list(tensors.items())[2:]))
    ckpt = checkpoint.Checkpoint([tmp_path / "one.safetensors", tmp_path / "two.safetensors"])
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, a in tensors.items():
        assert ckpt[name].dtype == a.dtype and ckpt[name].shape == a.shape
        np.testing.assert_array_equal(ckpt[name].view(np.uint8), a.view(np.uint8))


def test_checkpoint_reads_what_the_safetensors_package_writes(tmp_path):
    numpy_api = pytest.importorskip("safetensors.numpy")
    a = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    numpy_api.save_file({"w": a, "i": np.arange(3, dtype=np.int32)}, tmp_path / "x.safetensors")
    ckpt = checkpoint.Checkpoint(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(ckpt["w"], a)
    np.testing.assert_array_equal(ckpt["i"], np.arange(3))


BAD_CONFIGS = [
    pytest.param(lambda c: "mixtral", TypeError, "config", id="not-a-dict"),
    pytest.param(lambda c: dict(c, model_type="llama"), ValueError, "config", id="unknown-family"),
    pytest.param(lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, ValueError, "config", id="no-key"),
    pytest.param(lambda c: dict(c, hidden_act="relu"), ValueError, "config", id="activation"),
    pytest.param(lambda c: dict(c, intermediate_size=2 * I), ValueError, "tensors", id="shape"),
]


@pytest.mark.parametrize("edit,error,match", BAD_CONFIGS)
def test_bad_config(edit, error, match):
    config, tensors = mixtral(np.random.default_rng(0))
    with pytest.raises(error, match=f"^{match}: "):
        cupymoe.MoEBlock.from_config(edit(config), tensors)


def test_missing_tensor_is_named():
    config, tensors = qwen3_moe(np.random.default_rng(0))
    del tensors["experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="experts.3.up_proj.weight"):
        cupymoe.MoEBlock.from_config(config, tensors)


@pytest.mark.gpu
def test_block_graph_replay_sees_new_inputs(tmp_path):
    """DeepSeek-V3's block (router GEMM, grouped sigmoid routing, shared expert) captured once and
    replayed on new x gives the eager call's bits."""
    import cupy

    block, _, _ = load_block(cupy, tmp_path, deepseek_v3)
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(2)
    with stream:
        x = cupy.asarray(rng.standard_normal((64, H), dtype=np.float32).astype(BF16))
        block(x)
        stream.begin_capture()
        out = block(x)
        graph = stream.end_capture()
        new = rng.standard_normal((64, H), dtype=np.float32).astype(BF16)
        want = block(cupy.asarray(new), out=cupy.empty_like(x))
        x[...] = cupy.asarray(new)
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(host_bits(out), host_bits(want))
