"""Launches the dispatch kernels (kernels_cu/dispatch.cu: histogram, scan, stable scatter) into
preallocated buffers, and with them the GEMMs' m-tile maps (kernels_cu/tile_map.cuh)."""
from __future__ import annotations

import numpy as np

from . import _compile, _contract
from ._contract import DISPATCH_CHUNK, DISPATCH_EXPERT_SCAN_WARPS, DISPATCH_FUSED_WARPS

SOURCE = "dispatch.cu"
NAMES = ("dispatch_count<int>", "dispatch_count<long long>", "dispatch_expert_scan",
         "dispatch_scatter<int>", "dispatch_scatter<long long>",
         "dispatch_fused<int>", "dispatch_fused<long long>")
COUNT_WARPS = 4
SCATTER_THREADS = 256
# Up to here one block does all three steps (one launch, not three). It could take
# DISPATCH_FUSED_WARPS * DISPATCH_CHUNK, but from about 2500 slots the three kernels are faster.
FUSED_MAX_SLOTS = 5 * DISPATCH_CHUNK
FUSED_MAX_SHARED = 160 * 1024
# tile_map.cuh's TileMap, passed by value: one GEMM's m-tile map for the plan and its skewed plan.
TILE_MAP = np.dtype({"names": ["block_m", "skewed_block_m", "tiles"], "formats": [np.int32, np.int32, np.uint64],
                          "offsets": [0, 4, 8], "itemsize": 16, "aligned": True})


class DispatchBuffers:
    """Device arrays for dispatching S slots over E experts, including the GEMMs' m-tile maps."""

    def __init__(self, slots: int, experts: int, plan=None):
        """``plan`` (a plans.Plan) sets the tile maps' rows per tile; None (the public dispatch):
        no tile maps, which the kernels then skip."""
        import cupy

        self.slots, self.experts = slots, experts
        self.chunks = max(1, -(-slots // DISPATCH_CHUNK))
        self.counts = cupy.empty(experts, np.int32)
        self.offsets = cupy.empty(experts + 1, np.int32)
        self.sorted_slots = cupy.empty(slots, np.int32)
        self.slot_positions = cupy.empty(slots, np.int32)
        if plan is None:
            self.tiles_gate_up = self.tiles_down = None
            self.skew_rows = np.int32(0)
            self.tile_maps = (_tile_map(0, 0, None),) * 2
        else:
            self.tiles_gate_up = cupy.empty(_contract.tile_map_size(experts), np.int32)
            self.tiles_down = cupy.empty(_contract.tile_map_size(experts), np.int32)
            skewed = plan.skewed or plan
            self.skew_rows = np.int32(plan.skew_rows if plan.skewed else 0)
            self.tile_maps = (_tile_map(plan.gate_up.block_m, skewed.gate_up.block_m, self.tiles_gate_up),
                              _tile_map(plan.down.block_m, skewed.down.block_m, self.tiles_down))
        self.chunk_starts = cupy.empty(experts * self.chunks, np.int32)
        self.rank = cupy.empty(max(1, slots), np.int32)

    def chosen_plan(self, gated: bool) -> int:
        """Which plan the dispatch chose for a GEMM: 0 the host's own, 1 its skewed plan (synchronises)."""
        tiles = self.tiles_gate_up if gated else self.tiles_down
        return int(tiles[self.experts + _contract.TILE_MAP_PLAN])


def _tile_map(block_m: int, skewed_block_m: int, tiles) -> np.void:
    """A TileMap argument; ``tiles`` None passes a null map."""
    out = np.zeros(1, TILE_MAP)
    out[0] = (block_m, skewed_block_m, 0 if tiles is None else tiles.data.ptr)
    return out[0]


def _kernel(name: str, device_id: int, shared_bytes: int):
    kernel = _compile.kernel(SOURCE, name, NAMES, device_id)
    if kernel.max_dynamic_shared_size_bytes < shared_bytes:
        kernel.max_dynamic_shared_size_bytes = shared_bytes
    return kernel


def fused_shared_bytes(experts: int) -> int:
    return 2 * DISPATCH_FUSED_WARPS * experts * 4  # per-warp counters, then per-warp starts


def fused_fits(slots: int, experts: int, shared_limit: int) -> bool:
    """Whether dispatch_fused takes S slots over E experts on a GPU with ``shared_limit`` bytes."""
    return slots <= FUSED_MAX_SLOTS and fused_shared_bytes(experts) <= min(FUSED_MAX_SHARED, shared_limit)


def launch(ids, buffers: DispatchBuffers) -> None:
    """Fill ``buffers`` from contiguous ids [T, k] (int32 or int64) on the current stream."""
    b = buffers
    id_type = "int" if ids.dtype == np.int32 else "long long"
    device_id = ids.device.id
    slots, experts = np.int64(b.slots), np.int32(b.experts)
    fused_bytes = fused_shared_bytes(b.experts)
    if fused_fits(b.slots, b.experts, _compile.shared_memory_limit(device_id)):
        _kernel(f"dispatch_fused<{id_type}>", device_id, fused_bytes)(
            (1,), (32 * DISPATCH_FUSED_WARPS,),
            (ids, slots, experts, b.counts, b.offsets, b.skew_rows, *b.tile_maps, b.rank, b.sorted_slots,
             b.slot_positions),
            shared_mem=fused_bytes)
        return
    chunks = np.int32(b.chunks)
    counters_bytes = COUNT_WARPS * b.experts * 4
    _kernel(f"dispatch_count<{id_type}>", device_id, counters_bytes)(
        (-(-b.chunks // COUNT_WARPS),), (32 * COUNT_WARPS,),
        (ids, slots, experts, chunks, b.chunk_starts, b.rank), shared_mem=counters_bytes)
    _kernel("dispatch_expert_scan", device_id, 0)(
        (-(-b.experts // DISPATCH_EXPERT_SCAN_WARPS),), (32 * DISPATCH_EXPERT_SCAN_WARPS,),
        (b.chunk_starts, chunks, experts, b.counts))
    offsets_bytes = (b.experts + 1) * 4
    _kernel(f"dispatch_scatter<{id_type}>", device_id, offsets_bytes)(
        (max(1, -(-b.slots // SCATTER_THREADS)),), (SCATTER_THREADS,),
        (ids, slots, experts, chunks, b.chunk_starts, b.rank, b.counts, b.offsets, b.skew_rows,
         *b.tile_maps, b.sorted_slots, b.slot_positions), shared_mem=offsets_bytes)
