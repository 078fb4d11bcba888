"""The public forward: ``fused_experts`` and the ``MoE`` layer object with its reusable workspace."""
from __future__ import annotations

import numpy as np

from . import _checks, _workspaces, reference


def _coerce(**arrays):
    coerced = {name: _checks.as_array(a, name) for name, a in arrays.items()}
    return _checks.array_module(coerced), coerced


def _prepare(xp, a, w13, w2, out):
    """Check one forward's arrays (``a`` holds x, topk_ids, topk_weights); return its Shape."""
    shape = _checks.check_forward(a["x"], w13, w2, a["topk_ids"], a["topk_weights"])
    if out is not None:
        device_id = None if xp is np else a["x"].device.id
        _checks.check_out(out, xp, (shape.tokens, shape.hidden), shape.dtype, device_id)
    if xp is not np:  # x is realigned by a copy if needed (_gpu_forward), these cannot be
        for name, array in (("w13", w13), ("w2", w2), ("out", out)):
            if array is not None:
                _checks.require_aligned(array, name)
    return shape


def fused_experts(x, w13, w2, topk_ids, topk_weights, *, out=None, check_ids=True, activation="silu",
                  w13_bias=None, w2_bias=None, apply_router_weight_on_input=False):
    """Run the MoE expert layer: route each token through its k experts and combine.

    ``out[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e, :I] @ x[t], w13[e, I:] @ x[t]))``
    with ``e = topk_ids[t, j]`` and ``act(g, u) = silu(g) * u`` by default; an id of -1 adds
    nothing. Biases, when given, are added to the gate/up projection before the activation and to
    each expert's output before its weight multiplies it.

    Parameters
    ----------
    x : array [T, H], bfloat16 (``ml_dtypes.bfloat16``) or float16
        Token activations. T may be 0.
    w13 : array [E, 2*I, H], dtype of ``x``, C-contiguous
        Rows ``[0, I)`` are each expert's gate projection, rows ``[I, 2I)`` its up projection.
    w2 : array [E, H, I], dtype of ``x``, C-contiguous
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
    xp, a = _coerce(x=x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights)
    shape = _prepare(xp, a, a["w13"], a["w2"], out)
    options = _checks.check_options(activation, w13_bias, w2_bias, apply_router_weight_on_input, a["w13"])
    if xp is np:
        return _forward_numpy(a, shape, out, check_ids, options)
    from . import _gpu_forward

    with a["x"].device:
        workspace = _gpu_forward.Workspace(shape, a["x"].device.id)
        return _gpu_forward.forward(a, shape, workspace, out, check_ids, options)


def _forward_numpy(a, shape, out, check_ids, options, addend=None):
    if check_ids:
        _checks.check_ids_in_range(a["topk_ids"], shape.experts)
    if out is None:
        out = np.empty((shape.tokens, shape.hidden), shape.dtype)
    if shape.tokens == 0:
        return out
    return reference.fused_experts(np.ascontiguousarray(a["x"]), a["w13"], a["w2"], a["topk_ids"],
                                   a["topk_weights"], out, options, addend)


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
    w13 : array [E, 2*I, H], bfloat16 or float16, C-contiguous
    w2 : array [E, H, I], dtype of ``w13``, C-contiguous
    activation, w13_bias, w2_bias, apply_router_weight_on_input
        As for :func:`fused_experts`, held by the layer.

    Notes
    -----
    Without ``out=``, a GPU call returns an output array owned by the layer: the next call
    with the same T writes into it again while the layer keeps that T's workspace (which is
    what graph replay needs). Pass ``out=``, or copy, to keep a result. Calls with the same T
    share one workspace, so they must not overlap on different streams: give each stream its
    own layer.
    """

    def __init__(self, w13, w2, *, activation="silu", w13_bias=None, w2_bias=None,
                 apply_router_weight_on_input=False):
        xp, a = _coerce(w13=w13, w2=w2)
        self.num_experts, self.intermediate_size, self.hidden_size, self.dtype = (
            _checks.check_weights(a["w13"], a["w2"])
        )
        self._xp = xp
        self.w13 = a["w13"]
        self.w2 = a["w2"]
        self.options = _checks.check_options(activation, w13_bias, w2_bias, apply_router_weight_on_input, self.w13)
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
        shape = _prepare(xp, a, self.w13, self.w2, out)
        a.update(w13=self.w13, w2=self.w2)
        if xp is np:
            return _forward_numpy(a, shape, out, check_ids, self.options, addend)
        from . import _gpu_forward

        with self.w13.device:
            workspace, owned = self._workspaces.use(
                (shape.tokens, shape.top_k),
                lambda: (_gpu_forward.Workspace(shape, self.w13.device.id),
                         xp.empty((shape.tokens, shape.hidden), shape.dtype)),
                captured=xp.cuda.get_current_stream().is_capturing())
            return _gpu_forward.forward(a, shape, workspace, owned if out is None else out, check_ids,
                                        self.options, addend)
