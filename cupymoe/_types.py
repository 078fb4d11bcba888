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
