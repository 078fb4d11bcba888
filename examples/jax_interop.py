"""Use cupymoe from JAX: JAX GPU arrays in through DLPack, and the result back as a JAX array.

cupymoe wraps the JAX arrays without copying and runs on CuPy's current stream; DLPack makes
each side wait for the other's work. ``jnp.from_dlpack`` wraps the CuPy result without a copy.

    python examples/jax_interop.py
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory for CuPy

import cupymoe  # noqa: E402

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    sys.exit("This example needs JAX with CUDA (pip install 'jax[cuda12]').")

HIGHEST = jax.lax.Precision.HIGHEST  # true float32 matmuls (no TF32) for the reference


def jax_reference(x, w13, w2, topk_ids, topk_weights):
    """The MoE expert layer in float32 jax.numpy, densely: every expert on every token, then
    weighted by the routing (fine for a small example)."""
    experts, two_i, _ = w13.shape
    x, w13, w2 = (a.astype(jnp.float32) for a in (x, w13, w2))
    gate_up = jnp.einsum("th,eih->eti", x, w13, precision=HIGHEST)
    h = jax.nn.silu(gate_up[..., : two_i // 2]) * gate_up[..., two_i // 2:]
    y = jnp.einsum("eti,ehi->eth", h, w2, precision=HIGHEST)
    routing = (topk_weights[..., None] * jax.nn.one_hot(topk_ids, experts)).sum(axis=1)  # [T, E]
    return jnp.einsum("te,eth->th", routing, y, precision=HIGHEST)


def main():
    try:
        jax.devices("gpu")  # jax then places new arrays on the GPU by default
    except RuntimeError:
        sys.exit("This example needs JAX with a CUDA GPU (pip install 'jax[cuda12]').")
    tokens, hidden, experts, inter, top_k = 256, 1024, 32, 512, 4
    keys = jax.random.split(jax.random.key(0), 4)

    def randn(key, shape, fan_in=1):
        return (jax.random.normal(key, shape) / fan_in**0.5).astype(jnp.bfloat16)

    x = randn(keys[0], (tokens, hidden))
    w13 = randn(keys[1], (experts, 2 * inter, hidden), fan_in=hidden)  # rows [0, I) gate, [I, 2I) up
    w2 = randn(keys[2], (experts, hidden, inter), fan_in=inter)
    logits = jax.random.normal(keys[3], (tokens, experts))
    topk_weights, topk_ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # ids are int32
    topk_weights = topk_weights / topk_weights.sum(axis=-1, keepdims=True)

    out = jnp.from_dlpack(cupymoe.fused_experts(x, w13, w2, topk_ids, topk_weights))
    want = jax_reference(x, w13, w2, topk_ids, topk_weights)
    error = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    print(f"cupymoe on JAX arrays: out {out.shape} {out.dtype} on {out.devices()}")
    print(f"rel L2 error vs jax.numpy float32 reference: {error:.2e}")


if __name__ == "__main__":
    main()
