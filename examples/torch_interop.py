"""Use cupymoe from PyTorch: torch CUDA tensors in, zero-copy, and the result back as a torch tensor.

cupymoe reads torch tensors through DLPack without copying and runs on CuPy's current stream
(by default the same legacy default stream torch uses); ``torch.from_dlpack`` wraps the CuPy
result without a copy either.

    python examples/torch_interop.py
"""
import sys

import cupymoe

try:
    import torch
except ImportError:
    sys.exit("This example needs PyTorch (pip install torch).")


def torch_reference(x, w13, w2, topk_ids, topk_weights):
    """The MoE expert layer in plain torch, float32, looping over the experts that have tokens."""
    inter = w13.shape[1] // 2
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        w = w13[e].float()
        h = torch.nn.functional.silu(xf[tokens] @ w[:inter].T) * (xf[tokens] @ w[inter:].T)
        out.index_add_(0, tokens, topk_weights[tokens, slots].unsqueeze(1) * (h @ w2[e].float().T))
    return out


def main():
    if not torch.cuda.is_available():
        sys.exit("This example needs a CUDA GPU visible to PyTorch.")
    tokens, hidden, experts, inter, top_k = 256, 1024, 32, 512, 4
    gen = torch.Generator("cuda").manual_seed(0)

    def randn(*shape, fan_in=1):
        return (torch.randn(shape, generator=gen, device="cuda") / fan_in**0.5).to(torch.bfloat16)

    x = randn(tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, fan_in=hidden)  # rows [0, I) gate, [I, 2I) up
    w2 = randn(experts, hidden, inter, fan_in=inter)
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    topk_weights, topk_ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_ids = topk_ids.to(torch.int32)

    out = torch.from_dlpack(cupymoe.fused_experts(x, w13, w2, topk_ids, topk_weights))
    want = torch_reference(x, w13, w2, topk_ids, topk_weights)
    error = ((out.float() - want).norm() / want.norm()).item()
    print(f"cupymoe on torch tensors: out {tuple(out.shape)} {out.dtype} on {out.device}")
    print(f"rel L2 error vs torch float32 reference: {error:.2e}")


if __name__ == "__main__":
    main()
