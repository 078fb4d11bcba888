"""The public forward: ``fused_experts`` and the ``MoE`` layer object with its reusable workspace."""
from __future__ import annotations

import numpy as np

from . import _checks, _workspaces, reference
from ._contract import FP8_BLOCK


def _coerce(**arrays):
    coerced = {name: _checks.as_array(a, name) for name, a in arrays.items()}
    return _checks.array_module(coerced), coerced


def _given(**arrays) -> dict:
    """The optional arrays that were passed."""
    return {name: a for name, a in arrays.items() if a is not None}


def _prepare(xp, a, w13, w2, sizes, dtype, out):
    """Check one forward's arrays (``a`` holds x, topk_ids, topk_weights) against the checked weights'
    sizes (E, I, H) and x's dtype (None: either); return its Shape."""
    shape = _checks.check_forward(a["x"], sizes, dtype, a["topk_ids"], a["topk_weights"])
    if out is not None:
        device_id = None if xp is np else a["x"].device.id
        _checks.check_out(out, xp, (shape.tokens, shape.hidden), shape.dtype, device_id)
    if xp is not np:  # x is realigned by a copy if needed (_gpu_forward), these cannot be
        for name, array in (("w13", w13), ("w2", w2), ("out", out)):
            if array is not None:
                _checks.require_aligned(array, name)
    return shape


def fused_experts(x, w13, w2, topk_ids, topk_weights, *, out=None, check_ids=True, activation="silu",
                  w13_bias=None, w2_bias=None, apply_router_weight_on_input=False, w13_scale=None, w2_scale=None,
                  fp8_compute=None):
    """Run the MoE expert layer: route each token through its k experts and combine.

    ``out[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e, :I] @ x[t], w13[e, I:] @ x[t]))``
    with ``e = topk_ids[t, j]`` and ``act(g, u) = silu(g) * u`` by default; an id of -1 adds
    nothing. Biases, when given, are added to the gate/up projection before the activation and to
    each expert's output before its weight multiplies it.

    Parameters
    ----------
    x : array [T, H], bfloat16 (``ml_dtypes.bfloat16``) or float16
        Token activations. T may be 0.
    w13 : array [E, 2*I, H], dtype of ``x`` or FP8, C-contiguous
        Rows ``[0, I)`` are each expert's gate projection, rows ``[I, 2I)`` its up projection.
        FP8 weights (``ml_dtypes.float8_e4m3fn``, uint8 holding its bits, or a torch
        ``float8_e4m3fn`` tensor) come with ``w13_scale``.
    w2 : array [E, H, I], dtype of ``x`` or FP8 like ``w13``, C-contiguous
        Each expert's down projection. H and I must be multiples of 64.
    topk_ids : array [T, k], int32 or int64
        The experts of each token, ``1 <= k <= E``; -1 means no expert.
    topk_weights : array [T, k], float32
        Routing weights.
    out : array [T, H], dtype of ``x``, optional
        Written in place and returned when given.
    check_ids : bool
        When True (default) ids outside [-1, E) raise ValueError; on the GPU the check
        synchronises. When False they are treated as -1 (no synchronisation, safe in
        CUDA graph capture); they never cause an out-of-bounds access either way.
    activation : {"silu", "gelu", "gelu_tanh", "swigluoai"}
        ``act(g, u)``: ``silu(g) * u``; ``gelu(g) * u`` (erf); ``gelu_tanh(g) * u`` (the tanh
        approximation); ``"swigluoai"`` (gpt-oss) ``g' * sigmoid(1.702 g') * (u' + 1)`` with
        ``g' = min(g, 7)`` and ``u' = clip(u, -7, 7)``. ``w13`` keeps gate rows then up rows for
        every activation.
    w13_bias : array [E, 2*I], dtype of ``x``, optional
        Added to the gate (``[:, :I]``) and up (``[:, I:]``) projections before the activation.
    w2_bias : array [E, H], dtype of ``x``, optional
        Added to each expert's output before the routing weight multiplies it.
    apply_router_weight_on_input : bool
        When True (Llama-4) the routing weight multiplies the token's input to the expert (the
        gate/up projection, before its bias), and the expert outputs are summed unweighted.
    w13_scale, w2_scale : arrays, float32, with FP8 weights only
        Real weight = FP8 value x scale, one scale per 128 x 128 block (``[E, ceil(2I/128),
        ceil(H/128)]`` and ``[E, ceil(H/128), ceil(I/128)]``), per output channel (``[E, 2I]``,
        ``[E, H]``) or per expert (``[E]``), told apart by their shapes. Activations are then
        quantized per token and 128 channels (w8a8; see :mod:`cupymoe.fp8`). On the GPU (uint8
        weights: CuPy has no float8 dtype) H and I must be multiples of 128.
    fp8_compute : {"w8a8", "w8a16"}, with FP8 weights only
        "w8a8" (None, the default): the activations are quantized too and the GEMMs run on FP8
        tensor cores (compute capability 8.9 or newer). "w8a16": weight-only, the activations stay
        16-bit and the weights are widened exactly for 16-bit MMAs (any supported GPU; the
        numerics of :mod:`cupymoe.fp8`).

    Returns
    -------
    out : array [T, H], dtype of ``x``
        A CuPy array for GPU inputs (CuPy, torch, JAX, any DLPack or CUDA array
        interface array), a NumPy array for NumPy inputs. GPU work runs on the current
        CuPy stream.

    Raises
    ------
    TypeError
        Wrong array type or dtype, or host and GPU arrays mixed.
    ValueError
        Wrong rank or shape, unsupported sizes, arrays on different GPUs, bad ids, or GPU
        ``w13``, ``w2`` or ``out`` data not starting on a 16-byte boundary (every allocation
        and every slice of whole rows does; a flat view may not).
    """
    xp, a = _coerce(x=x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights,
                    **_given(w13_scale=w13_scale, w2_scale=w2_scale))
    *sizes, weights_dtype, scales = _checks.check_weights(a["w13"], a["w2"], a.get("w13_scale"), a.get("w2_scale"),
                                                          fp8_compute)
    options = _checks.check_options(activation, w13_bias, w2_bias, apply_router_weight_on_input, a["w13"],
                                    weights_dtype)
    shape = _prepare(xp, a, a["w13"], a["w2"], sizes, _checks.activation_dtype(weights_dtype, options), out)
    if xp is np:
        return _forward_numpy(a, shape, out, check_ids, options, scales)
    _require_fp8_kernels(scales, sizes, a["x"].device.id)
    from . import _gpu_forward

    with a["x"].device:
        scales = None if scales is None else _gpu_forward.kernel_scales(scales, sizes)
        workspace = _gpu_forward.Workspace(shape, a["x"].device.id, scales)
        return _gpu_forward.forward(a, shape, workspace, out, check_ids, options, scales=scales)


def _require_fp8_kernels(scales, sizes: tuple, device_id: int) -> None:
    """FP8 weights on the GPU: FP8 tensor cores for w8a8, and H and I in whole 128-column scale groups."""
    if scales is None:
        return
    from . import _compile, plans

    cc = _compile.compute_capability(device_id)
    if cc < plans.FP8_COMPUTE_CAPABILITY and not scales.weight_only:
        raise ValueError(f"fp8_compute: w8a8 needs FP8 tensor cores (compute capability 8.9 or newer); GPU "
                         f"{device_id} is {cc / 10:.1f}: pass fp8_compute=\"w8a16\" (weight-only)")
    _, inter, hidden = sizes
    if hidden % FP8_BLOCK or inter % FP8_BLOCK:
        raise ValueError(f"w13: FP8 weights on the GPU need H and I multiples of {FP8_BLOCK} (a K-tile is one scale "
                         f"group), got H = {hidden}, I = {inter}")


def _forward_numpy(a, shape, out, check_ids, options, scales, addend=None):
    if check_ids:
        _checks.check_ids_in_range(a["topk_ids"], shape.experts)
    if out is None:
        out = np.empty((shape.tokens, shape.hidden), shape.dtype)
    if shape.tokens == 0:
        return out
    return reference.fused_experts(np.ascontiguousarray(a["x"]), a["w13"], a["w2"], a["topk_ids"],
                                   a["topk_weights"], out, options, scales, addend)


class MoE:
    """An MoE expert layer that holds its weights and reusable workspaces.

    ``moe = MoE(w13, w2)`` then ``moe(x, topk_ids, topk_weights)``. After the first call
    for a given token count T, a call on the GPU allocates nothing, so it can be captured
    in a CUDA graph (``cupy.cuda.Graph`` through stream capture, with ``check_ids=False``)
    and replayed. The layer keeps the workspace of every T it ran during capture and of its
    latest call; of other T, the most recent up to 512 MiB (``_workspaces.SPARE_BYTES``). An
    older one is freed to CuPy's memory pool, and the next call with its T allocates again.

    Parameters
    ----------
    w13 : array [E, 2*I, H], bfloat16, float16 or FP8, C-contiguous
    w2 : array [E, H, I], dtype of ``w13`` (FP8: either FP8 dtype), C-contiguous
    activation, w13_bias, w2_bias, apply_router_weight_on_input, w13_scale, w2_scale, fp8_compute
        As for :func:`fused_experts`, held by the layer.

    Attributes
    ----------
    dtype : the dtype of x and out: the weights', or for FP8 weights their biases' (None without
        biases: either bfloat16 or float16).
    scales : WeightScales or None
        The FP8 weights' scales (``scales.weight_only``: w8a16).

    Notes
    -----
    Without ``out=``, a GPU call returns an output array owned by the layer: the next call
    with the same T writes into it again while the layer keeps that T's workspace (which is
    what graph replay needs). Pass ``out=``, or copy, to keep a result. Calls with the same T
    share one workspace, so they must not overlap on different streams: give each stream its
    own layer.
    """

    def __init__(self, w13, w2, *, activation="silu", w13_bias=None, w2_bias=None,
                 apply_router_weight_on_input=False, w13_scale=None, w2_scale=None, fp8_compute=None):
        xp, a = _coerce(w13=w13, w2=w2, **_given(w13_scale=w13_scale, w2_scale=w2_scale))
        self.num_experts, self.intermediate_size, self.hidden_size, weights_dtype, self.scales = (
            _checks.check_weights(a["w13"], a["w2"], a.get("w13_scale"), a.get("w2_scale"), fp8_compute)
        )
        self._xp = xp
        self.w13 = a["w13"]
        self.w2 = a["w2"]
        self.options = _checks.check_options(activation, w13_bias, w2_bias, apply_router_weight_on_input, self.w13,
                                             weights_dtype)
        self.dtype = _checks.activation_dtype(weights_dtype, self.options)
        self._kernel_scales = self.scales  # the GEMMs' form of them (GPU)
        if xp is not np and self.scales is not None:
            from . import _gpu_forward

            sizes = (self.num_experts, self.intermediate_size, self.hidden_size)
            _require_fp8_kernels(self.scales, sizes, self.w13.device.id)
            with self.w13.device:
                self._kernel_scales = _gpu_forward.kernel_scales(self.scales, sizes)
        self._workspaces = _workspaces.WorkspaceCache()  # (T, k) -> (Workspace, owned output array)

    def free_workspaces(self) -> None:
        """Free every workspace the layer keeps, those of captured T too (to CuPy's memory pool).
        A graph captured from this layer must not be replayed afterwards; the next call with any
        T allocates again."""
        self._workspaces.clear()

    def __call__(self, x, topk_ids, topk_weights, *, out=None, check_ids=True):
        """Run the layer; arguments, return value and errors as for :func:`fused_experts`."""
        return self.run(x, topk_ids, topk_weights, out, check_ids)

    def run(self, x, topk_ids, topk_weights, out, check_ids, addend=None):
        """The forward, with ``addend`` [T, H] (checked by the caller) added in the combine."""
        xp, a = _coerce(x=x, topk_ids=topk_ids, topk_weights=topk_weights)
        if xp is not self._xp:
            raise TypeError(
                "x: expected an array on the same side as the layer's weights "
                f"({'NumPy' if self._xp is np else 'GPU'}), got {type(a['x']).__name__}"
            )
        if xp is not np and a["x"].device.id != self.w13.device.id:
            raise ValueError(
                f"x: expected an array on GPU {self.w13.device.id} like the weights, "
                f"got one on GPU {a['x'].device.id}"
            )
        sizes = (self.num_experts, self.intermediate_size, self.hidden_size)
        shape = _prepare(xp, a, self.w13, self.w2, sizes, self.dtype, out)
        a.update(w13=self.w13, w2=self.w2)
        if xp is np:
            return _forward_numpy(a, shape, out, check_ids, self.options, self.scales, addend)
        from . import _gpu_forward

        with self.w13.device:
            workspace, owned = self._workspaces.use(
                (shape.tokens, shape.top_k),
                lambda: (_gpu_forward.Workspace(shape, self.w13.device.id, self.scales),
                         xp.empty((shape.tokens, shape.hidden), shape.dtype)),
                captured=xp.cuda.get_current_stream().is_capturing())
            return _gpu_forward.forward(a, shape, workspace, owned if out is None else out, check_ids,
                                        self.options, addend, self._kernel_scales)
