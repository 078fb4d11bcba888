"""Expert parallelism: the experts split over ranks (one process and GPU each), tokens exchanged
with NCCL, and each token's k expert outputs combined on its home rank in the fixed order.

A forward on one rank, for its own tokens:

1. :func:`plan_exchange`: each routed slot goes to the rank that owns its expert
   (:class:`ExpertPartition`), slots grouped by rank in slot order; -1 ids go nowhere.
2. The send counts go first (an all-to-all of one int per pair of ranks), then the x rows of the
   slots (and their routing weights, where they scale the input), so each rank holds the rows of
   its own experts.
3. The rank runs its experts on those rows through the single-GPU kernels, each row a token with
   k = 1 and weight 1 (or its routing weight, on the input, for ``apply_router_weight_on_input``):
   the rows come out bitwise as the single-GPU layer makes them, since every row's GEMM sums in
   one order whatever the batch (batch invariance).
4. The outputs go back the same way, in the order they came, and the home rank sums each token's k
   rows in slot order in float32 (the combine kernel), as one GPU does: the result is bitwise
   equal to :func:`cupymoe.fused_experts` on one GPU, for every rank count.

The plan works on NumPy or CuPy arrays; :class:`ExpertParallelMoE` moves the rows with NCCL through
CuPy (``cupy.cuda.nccl``), started by ``python -m cupymoe.launch``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _module(a):
    return np if isinstance(a, np.ndarray) else __import__("cupy")


@dataclass(frozen=True, eq=False)
class ExpertPartition:
    """Which rank owns each expert, and each expert's index among its rank's."""

    owner: np.ndarray  # [E] int32: rank of each expert
    local: np.ndarray  # [E] int32: the expert's index on its rank (ascending expert ids)
    ranks: int

    @classmethod
    def contiguous(cls, num_experts: int, ranks: int) -> ExpertPartition:
        """Experts in ``ranks`` contiguous runs, the first ``E % ranks`` one longer."""
        for name, value in (("num_experts", num_experts), ("ranks", ranks)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if ranks > num_experts:
            raise ValueError(f"ranks: expected at most num_experts = {num_experts} ranks, got {ranks}")
        sizes = np.full(ranks, num_experts // ranks) + (np.arange(ranks) < num_experts % ranks)
        return cls.from_owner(np.repeat(np.arange(ranks), sizes), ranks)

    @classmethod
    def from_owner(cls, owner, ranks: int) -> ExpertPartition:
        """The partition of a given owner rank per expert; every rank must own one expert at least."""
        owner = np.asarray(owner)
        if owner.ndim != 1 or owner.size == 0 or not np.issubdtype(owner.dtype, np.integer):
            raise ValueError(f"owner: expected a 1-d int array of one rank per expert, got {owner.dtype} "
                             f"of shape {owner.shape}")
        if owner.min() < 0 or owner.max() >= ranks or np.unique(owner).size != ranks:
            raise ValueError(f"owner: expected every rank of [0, {ranks}) to own an expert, got ranks "
                             f"{sorted(set(owner.tolist()))}")
        local = np.zeros(owner.size, np.int32)
        for r in range(ranks):
            mine = owner == r
            local[mine] = np.arange(int(mine.sum()), dtype=np.int32)
        return cls(owner.astype(np.int32), local, ranks)

    @property
    def num_experts(self) -> int:
        return self.owner.size

    def experts_of(self, rank: int) -> np.ndarray:
        """The expert ids rank ``rank`` holds, ascending (its local order)."""
        return np.flatnonzero(self.owner == rank)


@dataclass(frozen=True, eq=False)
class ExchangePlan:
    """Where one rank's routed slots go (arrays of the ids' module, int32)."""

    send_slots: object  # [S]: the slots that go somewhere, grouped by destination rank, slot order within
    send_counts: object  # [R]: how many of them go to each rank
    local_ids: object  # [S]: the expert of each, as its destination rank numbers it
    slot_rows: object  # [T * k]: each slot's row among send_slots (and among the rows that return); -1 for none


def plan_exchange(topk_ids, partition: ExpertPartition) -> ExchangePlan:
    """The exchange plan of one rank's ``topk_ids`` [T, k]; ids outside [0, E) send nothing."""
    xp = _module(topk_ids)
    ids = topk_ids.reshape(-1).astype(np.int64)
    valid = (ids >= 0) & (ids < partition.num_experts)
    safe = xp.where(valid, ids, 0)
    owner, local = xp.asarray(partition.owner), xp.asarray(partition.local)
    dest = xp.where(valid, owner[safe], partition.ranks)  # the invalid last, then cut
    order = xp.argsort(dest, kind="stable") if xp is np else xp.argsort(dest)  # CuPy's argsort is stable
    sent = int(valid.sum())
    send_slots = order[:sent].astype(np.int32)
    slot_rows = xp.full(ids.size, -1, np.int32)
    slot_rows[send_slots] = xp.arange(sent, dtype=np.int32)
    counts = xp.bincount(dest[send_slots], minlength=partition.ranks)[:partition.ranks].astype(np.int32)
    return ExchangePlan(send_slots, counts, local[safe[send_slots]].astype(np.int32), slot_rows)


class ExpertParallelMoE:
    """One rank's part of an expert-parallel MoE layer: its experts' weights, the partition, and an
    NCCL communicator of all ranks (``cupy.cuda.nccl.NcclCommunicator``).

    ``layer(x, topk_ids, topk_weights)`` runs a forward of this rank's tokens (every rank calls it
    together, each with its own T) and returns their output, bitwise equal to the single-GPU
    ``fused_experts`` with all experts. Expert options as for :class:`cupymoe.MoE`. It synchronises
    its stream once, to size the exchange from the counts, so it cannot be captured in a CUDA graph.
    """

    def __init__(self, w13_local, w2_local, partition: ExpertPartition, comm, rank: int, **options):
        from .layer import MoE

        if not isinstance(partition, ExpertPartition):
            raise TypeError(f"partition: expected an ExpertPartition, got {type(partition).__name__}")
        if not 0 <= rank < partition.ranks:
            raise ValueError(f"rank: expected a rank in [0, {partition.ranks}), got {rank}")
        self.partition, self.comm, self.rank = partition, comm, rank
        self.on_input = bool(options.get("apply_router_weight_on_input", False))
        self.experts = MoE(w13_local, w2_local, **options)
        if self.experts.num_experts != partition.experts_of(rank).size:
            raise ValueError(f"w13_local: expected the {partition.experts_of(rank).size} experts of rank {rank}, "
                             f"got {self.experts.num_experts}")

    def __call__(self, x, topk_ids, topk_weights):
        import cupy

        from . import _gpu_combine
        from ._checks import ACTIVATION_DTYPES, as_array, check_array, check_routing
        from ._types import Shape

        x, ids, weights = (cupy.ascontiguousarray(as_array(a, n)) for a, n in
                           ((x, "x"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights")))
        check_array(x, "x", 2, (self.experts.dtype,) if self.experts.dtype else ACTIVATION_DTYPES)
        if x.shape[1] != self.experts.hidden_size:
            raise ValueError(f"x: expected {self.experts.hidden_size} columns, got shape {tuple(x.shape)}")
        tokens = x.shape[0]
        top_k = check_routing(ids, weights, tokens, self.partition.num_experts)
        plan = plan_exchange(ids, self.partition)
        recv_counts = self._all_to_all(plan.send_counts, cupy.ones(self.partition.ranks, np.int64), np.int32)
        send_counts, recv_counts = plan.send_counts.get(), recv_counts.get()  # the one synchronisation
        rows = x[plan.send_slots // top_k]
        received = self._all_to_all(rows, send_counts, x.dtype, recv_counts)
        local_ids = self._all_to_all(plan.local_ids, send_counts, np.int32, recv_counts)
        if self.on_input:  # the routing weights travel with the rows only where they scale the input
            scale = self._all_to_all(weights.reshape(-1)[plan.send_slots], send_counts, np.float32, recv_counts)
        else:
            scale = cupy.ones(received.shape[0], np.float32)
        y = self.experts(received, local_ids[:, None], scale[:, None], check_ids=False)
        back = self._all_to_all(y, recv_counts, x.dtype, send_counts)
        out = cupy.empty_like(x)
        if tokens:
            shape = Shape(tokens, x.shape[1], self.partition.num_experts, self.experts.intermediate_size, top_k,
                          x.dtype)
            _gpu_combine.run(back, plan.slot_rows, None if self.on_input else weights, out, shape)
        return out

    def _all_to_all(self, send, send_counts, dtype, recv_counts=None):
        """The rows of ``send`` grouped by destination (send_counts[r] rows to rank r) exchanged with every
        rank; returns the rows received, grouped by source. Without ``recv_counts`` one element each way."""
        import cupy
        from cupy.cuda import nccl

        send_counts = np.asarray(send_counts.get() if hasattr(send_counts, "get") else send_counts)
        recv_counts = send_counts if recv_counts is None else np.asarray(recv_counts)
        row = int(np.prod(send.shape[1:], dtype=np.int64)) if send.ndim > 1 else 1
        recv = cupy.empty((int(recv_counts.sum()),) + tuple(send.shape[1:]), dtype)
        send_bytes, recv_bytes = send.view(np.uint8).reshape(-1), recv.view(np.uint8).reshape(-1)
        item = np.dtype(dtype).itemsize * row
        send_at, recv_at = np.concatenate([[0], np.cumsum(send_counts)]), np.concatenate([[0], np.cumsum(recv_counts)])
        stream = cupy.cuda.get_current_stream().ptr
        nccl.groupStart()
        for peer in range(self.partition.ranks):
            if send_counts[peer]:
                self.comm.send(send_bytes[send_at[peer] * item:].data.ptr, int(send_counts[peer]) * item,
                               nccl.NCCL_UINT8, peer, stream)
            if recv_counts[peer]:
                self.comm.recv(recv_bytes[recv_at[peer] * item:].data.ptr, int(recv_counts[peer]) * item,
                               nccl.NCCL_UINT8, peer, stream)
        nccl.groupEnd()
        return recv


RANK_ENV, WORLD_ENV, NCCL_ID_ENV = "CUPYMOE_RANK", "CUPYMOE_WORLD_SIZE", "CUPYMOE_NCCL_ID"


def init_from_env():
    """(rank, world size, NCCL communicator) of a process that ``python -m cupymoe.launch`` started;
    the rank's GPU (device ``rank``) becomes CuPy's current device."""
    import json
    import os

    import cupy
    from cupy.cuda import nccl

    missing = [name for name in (RANK_ENV, WORLD_ENV, NCCL_ID_ENV) if name not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start the ranks with python -m cupymoe.launch")
    rank, world = int(os.environ[RANK_ENV]), int(os.environ[WORLD_ENV])
    cupy.cuda.Device(rank).use()
    return rank, world, nccl.NcclCommunicator(world, tuple(json.loads(os.environ[NCCL_ID_ENV])), rank)
