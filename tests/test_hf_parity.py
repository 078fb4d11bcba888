"""Each family's block against its Hugging Face transformers module (torch, test-only): the module
built from a config with the family's real expert widths (fewer experts where memory and time ask),
random weights, and its state_dict handed to cupymoe.MoEBlock.from_config zero-copy through DLPack
(DeepSeek-V3 also through a safetensors file in the checkpoint's per-expert layout). The same
top-k experts but on exact ties, relative L2 error of the output under PARITY_TOL, bitwise
equal over two calls.

PARITY_TOL: both sides round h, the expert outputs and the result to bf16, transformers' eager
experts also accumulate the k outputs in bf16, and its router weights are bf16 for Qwen, so
the two differ by a few bf16 ulps (2^-8 relative) per element: about 5e-3 relative L2.
"""
import numpy as np
import pytest

import cupymoe
from cupymoe import checkpoint, families
from helpers import BF16, as_numpy, host_bits, rel_l2

PARITY_TOL = 1e-2
TOKENS = 256
# family -> (transformers module, block class, config class, config): real H and I of each
# family's released model (Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, DeepSeek-V3, GLM-4.5-Air,
# gpt-oss-20b, Llama-4-Scout), fewer experts for DeepSeek-V3 and GLM-4.5.
FAMILIES = {
    "mixtral": ("mixtral", "MixtralSparseMoeBlock", "MixtralConfig",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeConfig",
                  dict(hidden_size=2048, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                       num_experts=60, num_experts_per_tok=4, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeConfig",
                  dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                       norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE", "DeepseekV3Config",
                    dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=64, num_experts_per_tok=8,
                         n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1)),
    "glm4_moe": ("glm4_moe", "Glm4MoeMoE", "Glm4MoeConfig",
                 dict(hidden_size=4096, moe_intermediate_size=1408, n_routed_experts=32, num_experts_per_tok=8,
                      n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, n_shared_experts=1)),
    "gpt_oss": ("gpt_oss", "GptOssMLP", "GptOssConfig",
                dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)),
    "llama4_text": ("llama4", "Llama4TextMoe", "Llama4TextConfig",
                    dict(hidden_size=5120, intermediate_size=8192, num_local_experts=16, num_experts_per_tok=1)),
}


def hf_block(torch, name, device, config_kwargs, seed=0):
    """The transformers module with random weights: experts scaled by 1/sqrt(fan-in) (gpt-oss's by
    4x that, so its clamps are reached), routers so the logits spread over a few units."""
    import importlib

    module_name, block_name, config_name, _ = FAMILIES[name]
    transformers = importlib.import_module("transformers")
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    config = getattr(transformers, config_name)(**config_kwargs)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        block = getattr(module, block_name)(config)
    hidden = config_kwargs["hidden_size"]
    with torch.no_grad():
        for key, p in block.state_dict().items():
            if not p.is_floating_point():
                continue
            if "bias" in key:
                p.normal_(0.0, 0.05 if "correction" in key else 0.5)
            elif key in ("gate.weight", "router.weight", "shared_expert_gate.weight"):
                p.normal_(0.0, 2.0 / hidden**0.5)
            else:
                fan_in = p.shape[1] if name == "gpt_oss" or name.startswith("llama4") else p.shape[-1]
                p.normal_(0.0, (4.0 if name == "gpt_oss" else 1.0) / fan_in**0.5)
    return block.to(torch.bfloat16).eval(), config


def hf_forward(torch, name, block, x):
    """(out [T, H], ids [T, k]) of the transformers module on x [T, H]."""
    with torch.no_grad():
        out = block(x[None])
        out = out[0] if isinstance(out, tuple) else out
        router = block.router if hasattr(block, "router") else block.gate
        routed = router(x)
        if name.startswith("llama4"):
            ids = routed[1].topk(block.top_k, dim=1).indices
        else:
            ids = routed[2]
    return out.reshape(x.shape), ids


def near_ties(block, x, ids):
    """Tokens whose k-th and (k+1)-th choice values (on cupymoe's float32 logits) are equal or
    within float32 rounding: either pick is right."""
    r = block.routing
    logits = as_numpy(block.router_logits(x)).astype(np.float64)
    if r.scoring == "sigmoid" and r.correction_bias is not None:
        logits = 1 / (1 + np.exp(-logits)) + as_numpy(r.correction_bias)
    ordered = -np.sort(-logits, axis=1)
    k = ids.shape[1]
    if k == logits.shape[1]:
        return np.zeros(len(logits), bool)
    return np.abs(ordered[:, k - 1] - ordered[:, k]) <= 1e-6 * np.abs(ordered[:, k - 1]) + 1e-30


def parity(torch, xp, name, device, config_kwargs, tokens=TOKENS, through_file=None):
    """One family: (relative L2 error, tokens whose experts differ, tokens tied) of cupymoe against
    the transformers module, after checking the two calls' bits agree."""
    block, config = hf_block(torch, name, device, config_kwargs)
    x = torch.randn(tokens, config_kwargs["hidden_size"], device=device, dtype=torch.float32).to(torch.bfloat16)
    want, want_ids = hf_forward(torch, name, block, x)
    state = {k: v.contiguous() for k, v in block.state_dict().items()}
    to_xp = (lambda t: xp.from_dlpack(t)) if device != "cpu" else (
        lambda t: t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy())
    hf_config = dict(config.to_dict(), model_type=FAMILIES[name][0] if name != "llama4_text" else "llama4_text")
    if through_file is None:
        ours = cupymoe.MoEBlock.from_config(hf_config, {k: to_xp(v) for k, v in state.items()}, xp=xp)
    else:
        host = {k: as_numpy(to_xp(v)) for k, v in state.items()}
        on_disk = {k: v for k, v in host.items() if not k.startswith("experts.")}
        inter = config_kwargs["moe_intermediate_size"]
        for e in range(host["experts.gate_up_proj"].shape[0]):
            on_disk[f"experts.{e}.gate_proj.weight"] = host["experts.gate_up_proj"][e, :inter]
            on_disk[f"experts.{e}.up_proj.weight"] = host["experts.gate_up_proj"][e, inter:]
            on_disk[f"experts.{e}.down_proj.weight"] = host["experts.down_proj"][e]
        checkpoint.save(through_file, {f"model.layers.5.mlp.{k}": v for k, v in on_disk.items()})
        ours = families.block_from_checkpoint(hf_config, [through_file], "model.layers.5.mlp.", xp=xp)
    x_ours = to_xp(x)
    got = ours(x_ours)
    again = ours(x_ours, out=xp.empty_like(got))
    np.testing.assert_array_equal(host_bits(again), host_bits(got))
    r = ours.routing
    _, ids = cupymoe.route(ours.router_logits(x_ours), r.top_k, scoring=r.scoring, renormalize=r.renormalize,
                           num_groups=r.num_groups, topk_groups=r.topk_groups, correction_bias=r.correction_bias,
                           scaling_factor=r.scaling_factor)
    ids = np.sort(as_numpy(ids), axis=1)
    differ = (ids != np.sort(want_ids.cpu().numpy(), axis=1)).any(axis=1)
    tied = near_ties(ours, x_ours, ids)
    want_host = as_numpy(to_xp(want.contiguous()))
    return rel_l2(got, want_host), int(differ.sum()), int((differ & ~tied).sum()), int(tied.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_matches_the_transformers_module(name, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import cupy

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    err, differ, untied, tied = parity(torch, cupy, name, "cuda", FAMILIES[name][3])
    with capsys.disabled():
        print(f"\nPARITY {name}: rel L2 {err:.2e}, tokens with other experts {differ} of {TOKENS} "
              f"({differ - untied} on near ties; {tied} tokens near a tie)")
    assert untied == 0
    assert err < PARITY_TOL


@pytest.mark.gpu
def test_deepseek_v3_through_a_safetensors_file(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import cupy

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    err, _, untied, _ = parity(torch, cupy, "deepseek_v3", "cuda", FAMILIES["deepseek_v3"][3],
                               through_file=tmp_path / "layer.safetensors")
    assert untied == 0 and err < PARITY_TOL
