"""Quickstart: route tokens to experts, run the MoE expert layer, time it and check it.

On a CUDA GPU this runs a DeepSeek-V3-sized layer (H=4096, E=256 experts of I=1024, top-8,
512 tokens, bfloat16) and compares it with a float32 reference. Without a GPU it runs the
NumPy backend on a small layer and compares it with a float64 reference.

    python examples/quickstart.py
"""
import ml_dtypes
import numpy as np

import cupymoe
from cupymoe._compile import gpu_available

BF16 = ml_dtypes.bfloat16


def random_bf16(xp, shape, fan_in):
    """N(0, 1/fan_in) values rounded to bfloat16, drawn one slice at a time to bound temporary memory."""
    out = xp.empty(shape, BF16)
    for i in range(shape[0]):
        out[i] = (xp.random.standard_normal(shape[1:]) / np.sqrt(fan_in)).astype(BF16)
    return out


def reference(xp, x, w13, w2, topk_ids, topk_weights, dtype):
    """The layer in ``dtype`` arithmetic, one active expert at a time (numpy or cupy as ``xp``)."""
    inter = w13.shape[1] // 2
    xf = x.astype(dtype)
    out = xp.zeros(x.shape, dtype)
    for e in xp.unique(topk_ids).tolist():
        tokens, slots = xp.nonzero(topk_ids == e)  # route() gives distinct ids, so tokens are unique
        w = w13[e].astype(dtype)
        gate, up = xf[tokens] @ w[:inter].T, xf[tokens] @ w[inter:].T
        h = gate / (1 + xp.exp(-gate)) * up
        out[tokens] += topk_weights[tokens, slots][:, None] * (h @ w2[e].astype(dtype).T)
    return out


def rel_l2(xp, got, want):
    return float(xp.linalg.norm(got.astype(want.dtype) - want) / xp.linalg.norm(want))


def layer_inputs(xp, tokens, hidden, experts, inter, top_k):
    """Random activations and expert weights, and top-k routing from random router logits."""
    xp.random.seed(0)
    x = random_bf16(xp, (tokens, hidden), 1)
    w13 = random_bf16(xp, (experts, 2 * inter, hidden), hidden)  # gate rows, then up rows
    w2 = random_bf16(xp, (experts, hidden, inter), inter)
    logits = xp.random.standard_normal((tokens, experts)).astype(xp.float32)
    topk_weights, topk_ids = cupymoe.route(logits, top_k)
    return x, w13, w2, topk_ids, topk_weights


def run_gpu():
    import cupy

    x, w13, w2, topk_ids, topk_weights = layer_inputs(cupy, tokens=512, hidden=4096, experts=256,
                                                      inter=1024, top_k=8)
    print("GPU MoE layer: T=512 H=4096 E=256 I=1024 k=8, bfloat16")
    moe = cupymoe.MoE(w13, w2)
    out = moe(x, topk_ids, topk_weights)  # the first call compiles the kernels (then cached on disk)
    want = reference(cupy, x, w13, w2, topk_ids, topk_weights, cupy.float32)
    print(f"  rel L2 error vs float32 reference: {rel_l2(cupy, out, want):.2e}")

    # route() only returns valid ids, so skip the id check (it synchronises) when timing.
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(25):
        start.record()
        moe(x, topk_ids, topk_weights, check_ids=False)
        stop.record()
        stop.synchronize()
        if i >= 5:  # the first calls are warm-up
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    print(f"  time: {np.median(times):.3f} ms (median of 20 runs)")


def run_numpy():
    print("No CUDA GPU found; NumPy backend on a small layer: T=16 H=128 E=8 I=64 k=2, bfloat16")
    x, w13, w2, topk_ids, topk_weights = layer_inputs(np, tokens=16, hidden=128, experts=8, inter=64, top_k=2)
    out = cupymoe.fused_experts(x, w13, w2, topk_ids, topk_weights)
    want = reference(np, x, w13, w2, topk_ids, topk_weights, np.float64)
    print(f"  rel L2 error vs float64 reference: {rel_l2(np, out, want):.2e}")


if __name__ == "__main__":
    if gpu_available():
        run_gpu()
    else:
        run_numpy()
