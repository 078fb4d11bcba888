"""The MoE blocks of model families, from a Hugging Face ``config.json`` dict and one layer's tensors.

Each family's conventions (router, routing, activation, biases, shared expert, weight layouts)
follow its transformers module (``models/<family>/modeling_<family>.py``). The tensors, by name
relative to the block, come in the checkpoint's layout or the transformers module's
(``block.state_dict()``):

========== ==================== ============================================================
family     model_type           experts
========== ==================== ============================================================
Mixtral    mixtral              ``experts.{e}.w1/w3/w2.weight`` or ``experts.gate_up_proj`` [E, 2I, H]
Qwen2-MoE  qwen2_moe            ``experts.{e}.gate_proj/up_proj/down_proj.weight`` or stacked;
                                ``shared_expert.*``, ``shared_expert_gate.weight``
Qwen3-MoE  qwen3_moe            as Qwen2-MoE, no shared expert
DeepSeek-V3 deepseek_v3         as Qwen2-MoE; ``gate.e_score_correction_bias``, ``shared_experts.*``
GLM-4.5    glm4_moe             as DeepSeek-V3
gpt-oss    gpt_oss              ``experts.gate_up_proj`` [E, H, 2I], gate and up columns interleaved,
                                ``experts.down_proj`` [E, I, H], their ``_bias``; ``router.weight/bias``
Llama-4    llama4, llama4_text  ``experts.gate_up_proj`` [E, H, 2I] (gate half, up half),
                                ``experts.down_proj`` [E, I, H]; ``router.weight``, ``shared_expert.*``
========== ==================== ============================================================

The router weight is ``gate.weight`` but for gpt-oss and Llama-4 (``router.weight``). Weights are
copied to the GPU expert by expert, so no second host copy of the layer is made.

FP8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8: ``quantization_config`` with ``quant_method`` "fp8" and
``weight_block_size`` [128, 128]) store each per-expert ``*.weight`` as float8 e4m3 with its
``*.weight_scale_inv`` [ceil(rows/128), ceil(cols/128)] (real value = weight x scale); the
experts stay FP8 (uint8 bits on the GPU) with block scales stacked like the weights, which needs
I to be a multiple of 128; FP8 shared experts are dequantized to the router weight's dtype.
"""
from __future__ import annotations

import numpy as np

from . import _checks, fp8
from ._contract import FP8_BLOCK, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

HIDDEN_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_new": "gelu_tanh"}


class _Layer:
    """One layer's tensors by name, checked and copied to ``xp`` on request."""

    def __init__(self, tensors, xp):
        self.tensors = tensors
        self.xp = xp

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def host(self, name: str, shape: tuple):
        if name not in self.tensors:
            raise ValueError(f"tensors: expected a tensor {name!r} for this family, not found")
        a = self.tensors[name]
        if not hasattr(a, "shape") or tuple(a.shape) != tuple(shape):
            raise ValueError(f"tensors: expected {name!r} of shape {tuple(shape)}, got "
                             f"{tuple(getattr(a, 'shape', ())) or type(a).__name__}")
        return _checks.as_array(a, name)

    def get(self, name: str, shape: tuple):
        """The tensor on ``xp``'s side, contiguous."""
        return self.xp.ascontiguousarray(self.xp.asarray(self.host(name, shape)))

    def dense(self, name: str, shape: tuple, dtype):
        """A weight ``name`` on ``xp``'s side in ``dtype``: dequantized with its ``_scale_inv`` if FP8."""
        if self.dtype(name) != fp8.E4M3:
            return self.get(name, shape)
        scale = self.host(f"{name}_scale_inv", (fp8.blocks(shape[0]), fp8.blocks(shape[1])))
        return self.xp.asarray(fp8.dequantize_weights(self.host(name, shape)[None], scale[None])[0].astype(dtype))

    def dtype(self, name: str):
        return np.dtype(self.tensors[name].dtype) if name in self.tensors else None

    def stacked(self, shape: tuple, dtype, pieces):
        """An ``xp`` array of ``shape`` filled from (index, name, shape) pieces, one tensor at a time
        (FP8 as uint8 bits on the GPU, which has no float8 dtype)."""
        bits = dtype == fp8.E4M3 and self.xp is not np
        out = self.xp.empty(shape, np.uint8 if bits else dtype)
        for index, name, piece_shape in pieces:
            piece = self.host(name, piece_shape)
            out[index] = self.xp.asarray(piece.view(np.uint8) if bits else piece)
        return out


def _gated_experts(t: _Layer, e_count, hidden, inter, names, config) -> dict:
    """w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] from the stacked module tensors
    ``experts.gate_up_proj`` / ``experts.down_proj`` or the per-expert ``names`` (gate, up, down);
    with ``w13_scale`` and ``w2_scale`` from a block-scaled FP8 checkpoint."""
    if "experts.gate_up_proj" in t:
        return dict(w13=t.get("experts.gate_up_proj", (e_count, 2 * inter, hidden)),
                    w2=t.get("experts.down_proj", (e_count, hidden, inter)))
    gate, up, down = names
    dtype = t.dtype(gate.format(0))
    if dtype is None:
        raise ValueError(f"tensors: expected {gate.format(0)!r} or 'experts.gate_up_proj', not found")
    gate_up_rows = [(half * inter, name) for half, name in enumerate((gate, up))]
    w13 = t.stacked((e_count, 2 * inter, hidden), dtype, [
        ((e, slice(row, row + inter)), name.format(e), (inter, hidden)) for e in range(e_count) for row, name in gate_up_rows])
    w2 = t.stacked((e_count, hidden, inter), dtype,
                   [(e, down.format(e), (hidden, inter)) for e in range(e_count)])
    if dtype != fp8.E4M3:
        return dict(w13=w13, w2=w2)
    block = config.get("quantization_config", {}).get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"config: FP8 weight_block_size {block} is not supported (expected [128, 128])")
    if inter % FP8_BLOCK:
        raise ValueError(f"config: FP8 experts need an intermediate size that is a multiple of {FP8_BLOCK} (gate "
                         f"and up blocks stack into w13's), got {inter}")
    gate_blocks = (fp8.blocks(inter), fp8.blocks(hidden))
    w13_scale = t.stacked((e_count, 2 * gate_blocks[0], gate_blocks[1]), np.float32, [
        ((e, slice(row // FP8_BLOCK, row // FP8_BLOCK + gate_blocks[0])), f"{name.format(e)}_scale_inv", gate_blocks)
        for e in range(e_count) for row, name in gate_up_rows])
    w2_scale = t.stacked((e_count, fp8.blocks(hidden), fp8.blocks(inter)), np.float32,
                         [(e, f"{down.format(e)}_scale_inv", (fp8.blocks(hidden), fp8.blocks(inter)))
                          for e in range(e_count)])
    return dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)


def _transposed_experts(t: _Layer, e_count, hidden, inter, interleaved: bool):
    """w13, w2 from ``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj`` [E, I, H]; the 2I
    columns are gate/up interleaved (gpt-oss) or a gate half and an up half (Llama-4)."""
    xp = t.xp
    order = (lambda w: xp.concatenate([w[0::2], w[1::2]])) if interleaved else (lambda w: w)
    gate_up = t.host("experts.gate_up_proj", (e_count, hidden, 2 * inter))
    down = t.host("experts.down_proj", (e_count, inter, hidden))
    w13 = xp.empty((e_count, 2 * inter, hidden), gate_up.dtype)
    w2 = xp.empty((e_count, hidden, inter), down.dtype)
    for e in range(e_count):  # one expert at a time on xp's side
        w13[e] = order(xp.asarray(gate_up[e]).T)
        w2[e] = xp.asarray(down[e]).T
    return w13, w2


def _shared_expert(t: _Layer, prefix: str, hidden, inter, dtype=None):
    """(shared_w13 [2S, H], shared_w2 [H, S]) of a dense gated MLP under ``prefix``; FP8 ones
    dequantized to ``dtype``."""
    gate = t.dense(f"{prefix}.gate_proj.weight", (inter, hidden), dtype)
    up = t.dense(f"{prefix}.up_proj.weight", (inter, hidden), dtype)
    return t.xp.concatenate([gate, up]), t.dense(f"{prefix}.down_proj.weight", (hidden, inter), dtype)


def _key(config: dict, *names):
    """The value of the first of ``names`` (a key and its aliases) that ``config`` has."""
    for name in names:
        if name in config:
            return config[name]
    raise KeyError(names[0])


def _activation(config: dict) -> str:
    name = config.get("hidden_act", "silu")
    if name not in HIDDEN_ACTIVATIONS:
        raise ValueError(f"config: hidden_act {name!r} is not supported (expected one of {', '.join(HIDDEN_ACTIVATIONS)})")
    return HIDDEN_ACTIVATIONS[name]


def _mixtral(c, t: _Layer):
    e, h, i = _key(c, "num_local_experts", "num_experts"), c["hidden_size"], c["intermediate_size"]
    experts = _gated_experts(t, e, h, i, ("experts.{}.w1.weight", "experts.{}.w3.weight", "experts.{}.w2.weight"), c)
    return dict(router_weight=t.get("gate.weight", (e, h)), **experts, top_k=c.get("num_experts_per_tok", 2),
                activation=_activation(c))


QWEN_EXPERTS = ("experts.{}.gate_proj.weight", "experts.{}.up_proj.weight", "experts.{}.down_proj.weight")


def _qwen(c, t: _Layer):
    e, h, i = _key(c, "num_experts", "num_local_experts"), c["hidden_size"], c["moe_intermediate_size"]
    kwargs = dict(router_weight=t.get("gate.weight", (e, h)), **_gated_experts(t, e, h, i, QWEN_EXPERTS, c),
                  top_k=c.get("num_experts_per_tok", 4),
                  renormalize=c.get("norm_topk_prob", False), activation=_activation(c))
    if "shared_expert.gate_proj.weight" in t:  # Qwen2-MoE
        s = c["shared_expert_intermediate_size"]
        kwargs["shared_w13"], kwargs["shared_w2"] = _shared_expert(t, "shared_expert", h, s, t.dtype("gate.weight"))
        kwargs["shared_gate"] = t.get("shared_expert_gate.weight", (1, h))
    return kwargs


def _deepseek(defaults):
    def build(c, t: _Layer):
        c = {**defaults, **c}
        e, h, i = _key(c, "num_local_experts", "n_routed_experts"), c["hidden_size"], c["moe_intermediate_size"]
        bias = None
        if "gate.e_score_correction_bias" in t:
            bias = t.xp.asarray(t.host("gate.e_score_correction_bias", (e,))).astype(np.float32)
        kwargs = dict(router_weight=t.get("gate.weight", (e, h)), **_gated_experts(t, e, h, i, QWEN_EXPERTS, c),
                      top_k=c["num_experts_per_tok"],
                      scoring="sigmoid", renormalize=c["norm_topk_prob"], num_groups=c["n_group"],
                      topk_groups=c["topk_group"], correction_bias=bias, scaling_factor=c["routed_scaling_factor"],
                      router_logits_dtype="float32", activation=_activation(c))
        if c.get("n_shared_experts"):
            kwargs["shared_w13"], kwargs["shared_w2"] = _shared_expert(t, "shared_experts", h,
                                                                       i * c["n_shared_experts"], t.dtype("gate.weight"))
        return kwargs
    return build


def _gpt_oss(c, t: _Layer):
    e, h, i = _key(c, "num_local_experts", "num_experts"), c["hidden_size"], c["intermediate_size"]
    for key, ours in (("swiglu_limit", SWIGLUOAI_LIMIT), ("swiglu_alpha", SWIGLUOAI_ALPHA)):
        if key in c and float(c[key]) != ours:
            raise ValueError(f"config: {key} {c[key]} is not supported (swigluoai uses {ours})")
    w13, w2 = _transposed_experts(t, e, h, i, interleaved=True)
    b13 = t.get("experts.gate_up_proj_bias", (e, 2 * i))
    b13 = t.xp.concatenate([b13[:, 0::2], b13[:, 1::2]], axis=1)
    return dict(router_weight=t.get("router.weight", (e, h)), router_bias=t.get("router.bias", (e,)), w13=w13, w2=w2,
                top_k=c.get("num_experts_per_tok", 4), activation="swigluoai", w13_bias=t.xp.ascontiguousarray(b13),
                w2_bias=t.get("experts.down_proj_bias", (e, h)))


def _llama4(c, t: _Layer):
    c = c.get("text_config", c)
    e, h, i = _key(c, "num_local_experts", "num_experts"), c["hidden_size"], c["intermediate_size"]
    w13, w2 = _transposed_experts(t, e, h, i, interleaved=False)
    s13, s2 = _shared_expert(t, "shared_expert", h, i)
    return dict(router_weight=t.get("router.weight", (e, h)), w13=w13, w2=w2, top_k=c.get("num_experts_per_tok", 1),
                scoring="sigmoid", renormalize=False, apply_router_weight_on_input=True, activation=_activation(c),
                shared_w13=s13, shared_w2=s2)


# Each family's transformers config defaults where its config.json may leave a key out.
FAMILIES = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen,
    "qwen3_moe": _qwen,
    "deepseek_v3": _deepseek(dict(n_routed_experts=256, n_group=8, topk_group=4, norm_topk_prob=True,
                                  routed_scaling_factor=2.5, n_shared_experts=1, num_experts_per_tok=8)),
    "glm4_moe": _deepseek(dict(n_routed_experts=128, n_group=1, topk_group=1, norm_topk_prob=True,
                               routed_scaling_factor=1.0, n_shared_experts=1, num_experts_per_tok=8)),
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "llama4_text": _llama4,
}


def block_kwargs(config: dict, tensors, xp=None) -> dict:
    """The MoEBlock arguments of a family's block (see the module docstring)."""
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a dict (a parsed config.json), got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config: model_type {model_type!r} is not supported (expected one of {', '.join(FAMILIES)})")
    if xp is None:
        first = next(iter(tensors.values()), None)
        xp = np if first is None or isinstance(_checks.as_array(first, "tensors"), np.ndarray) else _cupy()
    try:
        return FAMILIES[model_type](config, _Layer(tensors, xp))
    except KeyError as err:
        raise ValueError(f"config: expected the key {err.args[0]!r} for model_type {model_type!r}") from None


def _cupy():
    import cupy

    return cupy


def block_from_config(config: dict, tensors, *, xp=None):
    from .block import MoEBlock

    return MoEBlock(**block_kwargs(config, tensors, xp))


def block_from_checkpoint(config: dict, paths, prefix: str, *, xp=None):
    """The block whose tensors are named ``prefix`` + their names in the ``.safetensors`` files
    ``paths`` (e.g. ``"model.layers.3.mlp."``; Mixtral's checkpoints say ``block_sparse_moe.``)."""
    from .checkpoint import Checkpoint

    layer = Checkpoint(paths).layer(prefix)
    if not layer:
        raise ValueError(f"prefix: no tensor of the checkpoint starts with {prefix!r}")
    return block_from_config(config, layer, xp=xp)
