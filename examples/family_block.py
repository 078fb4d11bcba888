"""A model family's MoE block end to end, from a .safetensors file to the block's output.

Writes one DeepSeek-V3-style MoE layer with random weights to a safetensors shard in the
checkpoint's own layout (per-expert gate_proj/up_proj/down_proj, the router and its correction
bias, the shared expert), loads it with ``cupymoe.families.block_from_checkpoint`` from the
config dict, and runs it: grouped sigmoid routing, the routed experts, the shared expert. On a
CUDA GPU the layer has DeepSeek-V3's widths (H=7168, I=2048, 8 groups, top-8) with 16 experts;
without one, a small layer on the NumPy backend. Its output is checked against a float64
computation of the same block. With ``--fp8`` (on a GPU at H=4096, I=1024) the shard holds the experts as DeepSeek-V3's FP8
checkpoints do (e4m3 weights and their 128 x 128 ``weight_scale_inv``); the block then runs them
in FP8 (w8a8), checked against float64 on the dequantized weights.

    python examples/family_block.py [--fp8]
"""
import argparse
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import cupymoe
from cupymoe import checkpoint, families, fp8
from cupymoe._compile import gpu_available

BF16 = ml_dtypes.bfloat16


def random_layer(rng, config):
    """The layer's tensors in DeepSeek-V3's checkpoint layout (names relative to the block)."""
    h, i, e = config["hidden_size"], config["moe_intermediate_size"], config["n_routed_experts"]

    def bf16(shape, scale):
        return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(BF16)

    t = {"gate.weight": bf16((e, h), 2 / h**0.5),
         "gate.e_score_correction_bias": (0.05 * rng.standard_normal(e)).astype(np.float32)}
    for x in range(e):
        t[f"experts.{x}.gate_proj.weight"] = bf16((i, h), h**-0.5)
        t[f"experts.{x}.up_proj.weight"] = bf16((i, h), h**-0.5)
        t[f"experts.{x}.down_proj.weight"] = bf16((h, i), i**-0.5)
    s = i * config["n_shared_experts"]
    t["shared_experts.gate_proj.weight"] = bf16((s, h), h**-0.5)
    t["shared_experts.up_proj.weight"] = bf16((s, h), h**-0.5)
    t["shared_experts.down_proj.weight"] = bf16((h, s), s**-0.5)
    return t


def as_fp8_checkpoint(t):
    """The layer with every projection as e4m3 plus its block scales (DeepSeek-V3's FP8 shards), and
    the real values of those, dequantized, for the float64 check."""
    shard, real = dict(t), dict(t)
    for name in t:
        if name.endswith("_proj.weight"):
            q, scale = fp8.quantize_weights(t[name][None], "block")
            shard[name], shard[f"{name}_scale_inv"] = q[0], scale[0]
            real[name] = fp8.dequantize_weights(q, scale)[0]
    return shard, real


def float64_block(config, t, x, tokens):
    """The same block in float64 for the first ``tokens`` rows: DeepSeek-V3's router, experts, shared expert."""
    e, g = config["n_routed_experts"], config["n_group"]
    x = x[:tokens].astype(np.float64)
    scores = 1 / (1 + np.exp(-(x @ t["gate.weight"].astype(np.float64).T)))
    biased = scores + t["gate.e_score_correction_bias"]
    group = np.sort(biased.reshape(tokens, g, e // g), axis=2)[:, :, -2:].sum(axis=2)
    kept = np.argsort(-group, axis=1, kind="stable")[:, :config["topk_group"]]
    eligible = np.zeros((tokens, g), bool)
    np.put_along_axis(eligible, kept, True, axis=1)
    biased = np.where(np.repeat(eligible, e // g, axis=1), biased, -np.inf)
    ids = np.argsort(-biased, axis=1, kind="stable")[:, :config["num_experts_per_tok"]]
    weights = np.take_along_axis(scores, ids, axis=1)
    weights = weights / weights.sum(axis=1, keepdims=True) * config["routed_scaling_factor"]

    def mlp(prefix, v):
        gate = v @ t[f"{prefix}.gate_proj.weight"].astype(np.float64).T
        up = v @ t[f"{prefix}.up_proj.weight"].astype(np.float64).T
        return (gate / (1 + np.exp(-gate)) * up) @ t[f"{prefix}.down_proj.weight"].astype(np.float64).T

    out = mlp("shared_experts", x)
    for row in range(tokens):
        for j, expert in enumerate(ids[row]):
            out[row] += weights[row, j] * mlp(f"experts.{expert}", x[row:row + 1])[0]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true", help="the experts as an FP8 checkpoint holds them")
    use_fp8 = parser.parse_args().fp8
    on_gpu = gpu_available()
    if on_gpu:
        import cupy as xp
        dims, tokens = dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=16), 512
        if use_fp8:  # quantizing on the host takes 0.7 s per matrix of DeepSeek-V3's size
            dims.update(hidden_size=4096, moe_intermediate_size=1024)
    else:
        xp = np
        dims, tokens = dict(hidden_size=256, moe_intermediate_size=128, n_routed_experts=32), 64
    config = dict(model_type="deepseek_v3", num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
                  routed_scaling_factor=2.5, n_shared_experts=1, **dims)
    if use_fp8:
        config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                             weight_block_size=[128, 128])
    rng = np.random.default_rng(0)
    layer = random_layer(rng, config)
    shard, layer = as_fp8_checkpoint(layer) if use_fp8 else (layer, layer)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model-00001-of-00001.safetensors"
        checkpoint.save(path, {f"model.layers.3.mlp.{name}": a for name, a in shard.items()})
        started = time.perf_counter()
        block = families.block_from_checkpoint(config, [path], "model.layers.3.mlp.", xp=xp)
        print(f"loaded {path.stat().st_size / 2**30:.2f} GiB into {'the GPU' if on_gpu else 'NumPy'} "
              f"in {time.perf_counter() - started:.1f} s: E={block.num_experts}, H={block.hidden_size}, "
              f"routing {block.routing.scoring} top-{block.routing.top_k} in {block.routing.num_groups} groups"
              + (", FP8 experts" if block.experts.scales is not None else ""))
    x_host = rng.standard_normal((tokens, config["hidden_size"]), dtype=np.float32).astype(BF16)
    x = xp.asarray(x_host)
    out = block(x)
    again = block(x, out=xp.empty_like(x))
    same = bool((out.view(np.uint16) == again.view(np.uint16)).all())
    check = 4
    want = float64_block(config, layer, x_host, check)
    got = (out.get() if on_gpu else out)[:check].astype(np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"out {tuple(out.shape)} {out.dtype}; two calls bitwise equal: {same}; "
          f"relative L2 error of the first {check} tokens against float64: {err:.2e}")
    if not same or err > (6e-2 if use_fp8 else 1e-2):  # FP8: tests/helpers.py's FP8_ORACLE_TOL
        raise SystemExit("mismatch")


if __name__ == "__main__":
    main()
