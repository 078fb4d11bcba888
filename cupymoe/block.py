"""The whole MoE block of a model: router GEMM, routing, the routed experts and the shared expert.

``MoEBlock`` holds a router weight (and bias), the routing options (``route``'s), the experts (an
``MoE`` with its expert options) and optionally a shared expert: a dense gated MLP that every token
runs, as an ``MoE`` of one expert, optionally scaled per token by ``sigmoid(x @ shared_gate)``
(Qwen2-MoE). The shared expert's output is added in the routed forward's combine, in float32.
``cupymoe.families`` builds blocks from Hugging Face configs and checkpoints.
"""
from __future__ import annotations

import numpy as np

from . import _checks, _workspaces, route as _route
from .layer import MoE

LOGITS_DTYPES = ("float32", "model")


class _Buffers:
    """What one call of a block with T tokens writes besides the layers' workspaces (GPU only)."""

    def __init__(self, xp, tokens: int, experts: int, top_k: int, shared: bool):
        self.logits = xp.empty((tokens, experts), np.float32)
        self.weights = xp.empty((tokens, top_k), np.float32)
        self.ids = xp.empty((tokens, top_k), np.int32)
        self.shared_ids = xp.zeros((tokens, 1), np.int32) if shared else None
        self.shared_weights = xp.ones((tokens, 1), np.float32) if shared else None
        self.gate_logit = xp.empty((tokens, 1), np.float32) if shared else None  # then its sigmoid

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if a is not None)


def _as_float32(xp, a):
    """``a`` (bfloat16, float16 or float32) as float32, exactly; bfloat16 by its bits."""
    if a.dtype == _checks.BFLOAT16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class MoEBlock:
    """A model's MoE block: ``block(x) -> out`` with out[t] = sum of the routed experts of token t,
    weighted by its router, plus the shared expert's output.

    Parameters
    ----------
    router_weight : array [E, H], dtype of ``w13`` (or float32)
        The router's linear layer; logits = x @ router_weight.T (+ router_bias).
    w13, w2 : arrays [E, 2*I, H] and [E, H, I]
        The routed experts, as for :class:`MoE`; FP8 ones with ``w13_scale``, ``w2_scale``, when the
        router weight's dtype (bfloat16 or float16) is the block's.
    top_k, scoring, renormalize, num_groups, topk_groups, correction_bias, scaling_factor
        The routing, as for :func:`cupymoe.route`.
    router_bias : array [E], optional
        Added to the logits (gpt-oss).
    router_logits_dtype : "float32" or "model"
        "float32": logits in float32 from the operands' exact values (DeepSeek-V3, GLM-4.5);
        "model": the float32 result rounded to the weights' dtype, as a bf16 linear layer gives
        (Mixtral, Qwen, gpt-oss, Llama-4).
    activation, w13_bias, w2_bias, apply_router_weight_on_input, w13_scale, w2_scale, fp8_compute
        The expert options and FP8 scales, as for :func:`cupymoe.fused_experts`.
    shared_w13, shared_w2 : arrays [2*S, H] and [H, S], optional
        The shared expert: gate rows [0, S), up rows [S, 2S), and its down projection.
    shared_gate : array [H] or [1, H], optional
        Scales the shared expert's output per token by sigmoid(x @ shared_gate) (Qwen2-MoE).

    Notes
    -----
    On the GPU the router GEMM (kernels_cu/router_logits.cu) sums each logit in float32 in one
    order for every T, so the whole block is bitwise reproducible and batch-invariant like the
    expert layer. After the first call for a given T the block allocates nothing, so it can be
    captured in a CUDA graph.
    """

    def __init__(self, router_weight, w13, w2, *, top_k, scoring="softmax", renormalize=True, num_groups=1,
                 topk_groups=1, correction_bias=None, scaling_factor=1.0, router_bias=None,
                 router_logits_dtype="model", activation="silu", w13_bias=None, w2_bias=None,
                 apply_router_weight_on_input=False, shared_w13=None, shared_w2=None, shared_gate=None,
                 w13_scale=None, w2_scale=None, fp8_compute=None):
        self.experts = MoE(w13, w2, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias,
                           apply_router_weight_on_input=apply_router_weight_on_input, w13_scale=w13_scale,
                           w2_scale=w2_scale, fp8_compute=fp8_compute)
        xp, dtype = self.experts._xp, self.experts.dtype
        num_experts, hidden = self.experts.num_experts, self.experts.hidden_size
        self._xp = xp
        arrays = {"router_weight": _checks.as_array(router_weight, "router_weight")}
        if dtype is None:  # FP8 experts without biases: the router weight's dtype is the block's
            _checks.check_array(arrays["router_weight"], "router_weight", 2, _checks.ACTIVATION_DTYPES)
            dtype = arrays["router_weight"].dtype
        self.dtype = dtype
        for name, a in (("router_bias", router_bias), ("correction_bias", correction_bias),
                        ("shared_w13", shared_w13), ("shared_w2", shared_w2), ("shared_gate", shared_gate)):
            if a is not None:
                arrays[name] = _checks.as_array(a, name)
        if _checks.array_module(dict(arrays, w13=self.experts.w13)) is not xp:
            raise TypeError("router_weight: expected arrays on the same side as w13")
        weight = arrays["router_weight"]
        _checks.check_array(weight, "router_weight", 2, (dtype, _checks.FLOAT32))
        if tuple(weight.shape) != (num_experts, hidden):
            raise ValueError(f"router_weight: expected shape {(num_experts, hidden)}, got {tuple(weight.shape)}")
        self.router_weight = xp.ascontiguousarray(weight)  # [E, H], as given: the GPU widens as it reads
        self.router_bias = None
        if "router_bias" in arrays:
            bias = arrays["router_bias"]
            _checks.check_array(bias, "router_bias", 1, (dtype, _checks.FLOAT32))
            if bias.shape[0] != num_experts:
                raise ValueError(f"router_bias: expected shape ({num_experts},), got {tuple(bias.shape)}")
            self.router_bias = _as_float32(xp, bias)
        if router_logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"router_logits_dtype: expected one of {LOGITS_DTYPES}, got {router_logits_dtype!r}")
        self.router_logits_dtype = router_logits_dtype
        self.routing = _route.check_routing(num_experts, top_k, scoring, renormalize, num_groups, topk_groups,
                                            arrays.get("correction_bias"), scaling_factor)
        self.shared = None
        self.shared_gate = None
        if ("shared_w13" in arrays) != ("shared_w2" in arrays):
            raise ValueError("shared_w13: the shared expert needs both shared_w13 and shared_w2")
        if "shared_w13" in arrays:
            s13, s2 = arrays["shared_w13"], arrays["shared_w2"]
            _checks.check_array(s13, "shared_w13", 2, (dtype,))
            _checks.check_array(s2, "shared_w2", 2, (dtype,))
            self.shared = MoE(s13[None], s2[None])
            if self.shared.hidden_size != hidden:
                raise ValueError(f"shared_w13: expected {hidden} columns (H), got {s13.shape[1]}")
        if "shared_gate" in arrays:
            if self.shared is None:
                raise ValueError("shared_gate: given without a shared expert (shared_w13, shared_w2)")
            gate = arrays["shared_gate"]
            if gate.size != hidden or gate.ndim not in (1, 2):
                raise ValueError(f"shared_gate: expected shape ({hidden},) or (1, {hidden}), got {tuple(gate.shape)}")
            _checks.check_array(gate.reshape(hidden), "shared_gate", 1, (dtype, _checks.FLOAT32))
            self.shared_gate = xp.ascontiguousarray(gate.reshape(1, hidden))  # [1, H]: a router of one output
        self._buffers = _workspaces.WorkspaceCache()

    @classmethod
    def from_config(cls, config: dict, tensors, *, xp=None) -> MoEBlock:
        """The block of a Hugging Face model family from its ``config.json`` dict and one layer's MoE
        tensors (names relative to the block, in the checkpoint's or the transformers module's
        layout); see :mod:`cupymoe.families`. ``xp``: numpy or cupy, where the weights go (default:
        where the tensors are)."""
        from . import families

        return families.block_from_config(config, tensors, xp=xp)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def hidden_size(self) -> int:
        return self.experts.hidden_size

    def free_workspaces(self) -> None:
        """Free every buffer and workspace the block and its layers keep (see MoE.free_workspaces)."""
        self._buffers.clear()
        self.experts.free_workspaces()
        if self.shared is not None:
            self.shared.free_workspaces()

    def router_logits(self, x):
        """The router's float32 logits [T, E] for ``x`` [T, H] (as the block computes them)."""
        xp, a = self._coerce(x)
        return self._logits(xp, a, None)

    def _coerce(self, x):
        x = _checks.as_array(x, "x")
        xp = _checks.array_module({"x": x})
        if xp is not self._xp:
            raise TypeError(f"x: expected an array on the same side as the block's weights "
                            f"({'NumPy' if self._xp is np else 'GPU'}), got {type(x).__name__}")
        _checks.check_array(x, "x", 2, (self.dtype,))
        if x.shape[1] != self.hidden_size:
            raise ValueError(f"x: expected {self.hidden_size} columns (H), got shape {tuple(x.shape)}")
        return xp, x

    def _logits(self, xp, x, buffers):
        """float32 logits [T, E]: on NumPy new arrays; on the GPU into ``buffers`` (None: new ones)."""
        round_to = self.dtype if self.router_logits_dtype == "model" else None
        if xp is np:
            logits = _as_float32(xp, x) @ _as_float32(xp, self.router_weight).T
            if self.router_bias is not None:
                logits += self.router_bias
            return logits if round_to is None else logits.astype(round_to).astype(np.float32)
        from . import _gpu_router_logits

        if buffers is None:
            buffers = _Buffers(xp, x.shape[0], self.num_experts, self.routing.top_k, False)
        _gpu_router_logits.run(_checks.on_gpu_grid(x), self.router_weight, self.router_bias, buffers.logits,
                               round_to_x=round_to is not None)
        return buffers.logits

    def __call__(self, x, *, out=None):
        """Run the block on ``x`` [T, H] (the experts' dtype); return out [T, H] of that dtype.

        ``out`` as for :meth:`MoE.__call__` (without it a GPU call returns a block-owned array that
        the next call with the same T overwrites). Raises TypeError or ValueError for bad input."""
        xp, x = self._coerce(x)
        tokens, k = x.shape[0], self.routing.top_k
        if xp is np:
            return self._forward(xp, x, out, None)
        with self.experts.w13.device:
            buffers, _ = self._buffers.use(
                tokens, lambda: (_Buffers(xp, tokens, self.num_experts, k, self.shared is not None),
                                 xp.empty(0)), captured=xp.cuda.get_current_stream().is_capturing())
            return self._forward(xp, x, out, buffers)

    def _forward(self, xp, x, out, buffers):
        logits = self._logits(xp, x, buffers)
        weights, ids = _route.run(xp, logits, self.routing, None if buffers is None else (buffers.weights, buffers.ids))
        addend = None
        if self.shared is not None:
            addend = self.shared.run(x, *self._shared_routing(xp, x, buffers), None, False)
        return self.experts.run(x, ids, weights, out, False, addend)

    def _shared_routing(self, xp, x, buffers):
        """(ids, weights) [T, 1] of the shared expert: expert 0, weight 1 or the gate's sigmoid."""
        if xp is np:
            tokens = x.shape[0]
            weights = np.ones((tokens, 1), np.float32)
            if self.shared_gate is not None:
                logit = _as_float32(xp, x) @ _as_float32(xp, self.shared_gate).T
                weights = (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
            return np.zeros((tokens, 1), np.int32), weights
        if self.shared_gate is None:
            return buffers.shared_ids, buffers.shared_weights
        from . import _gpu_router_logits

        _gpu_router_logits.run(_checks.on_gpu_grid(x), self.shared_gate, None, buffers.gate_logit, apply_sigmoid=True)
        return buffers.shared_ids, buffers.gate_logit
