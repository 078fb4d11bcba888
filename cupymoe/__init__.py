"""cupymoe: the Mixture-of-Experts expert layer for LLM inference, in CUDA kernels driven from CuPy.

Public API: :func:`fused_experts`, :class:`MoE`, :func:`dispatch` (with :class:`Dispatch`),
:func:`route`, and :class:`MoEBlock` (a model's whole MoE block; ``cupymoe.families`` builds one from
a Hugging Face config and checkpoint, ``cupymoe.checkpoint`` reads safetensors files). GPU arrays (CuPy, or torch/JAX through DLPack) run the CUDA kernels;
NumPy arrays run the NumPy reference with the same semantics and checks.
"""
from ._types import Dispatch
from .block import MoEBlock
from .dispatch import dispatch
from .layer import MoE, fused_experts
from .route import route

__version__ = "0.1.0"
__all__ = ["Dispatch", "MoE", "MoEBlock", "dispatch", "fused_experts", "route", "__version__"]
