"""The small frozen types the stages hand each other: a forward's sizes and a dispatch's result."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    """The sizes of one MoE forward."""

    tokens: int  # T
    hidden: int  # H
    experts: int  # E
    intermediate: int  # I
    top_k: int  # k
    dtype: np.dtype  # activations, weights and output


@dataclass(frozen=True)
class Dispatch:
    """Where each routed slot goes. Slot ``s = t * k + j`` is token t's j-th expert choice.

    Arrays are int32 and live where the ids came from (NumPy or CuPy).
    """

    num_experts: int  # E
    top_k: int  # k
    counts: object  # [E]: valid slots routed to each expert
    offsets: object  # [E + 1]: exclusive prefix sum of counts; offsets[E] = valid slots
    sorted_slots: object  # [T * k]: valid slots by expert, ascending inside each; then -1
    slot_positions: object  # [T * k]: index of each slot in sorted_slots; -1 for ids not in [0, E)


@dataclass(frozen=True, eq=False)
class ExpertOptions:
    """How the expert GEMMs differ from a bias-free SwiGLU; each is fused into a GEMM's epilogue."""

    activation: str = "silu"  # one of _contract.ACTIVATIONS, applied to (gate, up)
    w13_bias: object = None  # [E, 2I], the weights' dtype: added to gate/up before the activation
    w2_bias: object = None  # [E, H]: added to each expert's output before its routing weight
    weight_on_input: bool = False  # the routing weight scales the expert's input, not its output

    @property
    def plain(self) -> bool:
        """Plain SwiGLU without biases, weights on the output."""
        return (self.activation == "silu" and self.w13_bias is None and self.w2_bias is None
                and not self.weight_on_input)


@dataclass(frozen=True, eq=False)
class Routing:
    """How a router turns each token's logits into its top-k experts and their weights (checked by
    route.check_routing)."""

    top_k: int  # k
    scoring: str = "softmax"  # "softmax" over all E, or "sigmoid" per expert
    renormalize: bool = True  # the k weights divided by their sum (sigmoid: plus 1e-20)
    num_groups: int = 1  # sigmoid: the experts form this many equal groups ...
    topk_groups: int = 1  # ... of which the best this many are eligible
    correction_bias: object = None  # sigmoid: [E] float32, added to the scores for choosing only
    scaling_factor: float = 1.0  # sigmoid: multiplies the weights last


@dataclass(frozen=True, eq=False)
class WeightScales:
    """The float32 scales of FP8 expert weights, each in the layout its rank gives (cupymoe.fp8)."""

    w13: object  # [E, ceil(2I/128), ceil(H/128)], [E, 2I] or [E]
    w2: object  # [E, ceil(H/128), ceil(I/128)], [E, H] or [E]
    weight_only: bool = False  # w8a16: the GEMMs' inputs stay 16-bit (else w8a8: quantized too)
