"""The per-expert tensor-core GEMMs: gate/up with SwiGLU fused, then down. Tile shapes by problem size."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from . import _checks, _compile, _tma

K_TILE = 64  # the kernels' BK; H and I are multiples of it
WGMMA_COMPUTE_CAPABILITY = 90
MMA, PERSISTENT, SLOT = "mma", "persistent", "slot"
SOURCES = {MMA: "expert_gemm.cu", PERSISTENT: "expert_gemm_ws.cu", SLOT: "expert_gemm.cu"}
ID_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}  # slot_gemm's IdT
PRODUCER_THREADS = 128  # the persistent kernel's loading warpgroup
STAGED_SLOTS = 32  # slots per pass of the persistent kernel's epilogue (its STAGED_SLOTS)


@dataclass(frozen=True)
class GemmConfig:
    """One instantiation of an expert GEMM kernel: block tile, warp grid, pipeline depth."""

    block_m: int  # rows (slots) per block
    block_n: int  # output columns per block (gate/up: of h, so 2 * block_n weight rows)
    warps_m: int
    warps_n: int
    stages: int  # shared-memory pipeline depth
    # K-tiles per stage: each weight row is read k_group * 128 bytes at a time. In the persistent
    # kernel a stage of two holds one consumer's half of the weight rows, the consumers alternating.
    k_group: int = 1
    # MMA: expert_gemm (mma.sync, sm_80+). PERSISTENT: expert_gemm_ws (sm_90a), a loading
    # warpgroup and two wgmma warpgroups (warps_m = 8), each multiplying half the tile's weight
    # rows by all block_m slots. SLOT: slot_gemm (mma.sync), no dispatch: a block per routed slot,
    # the blocks of an expert's first slot and of every block_m-th after it computing its slots.
    kernel: str = MMA

    @property
    def source(self) -> str:
        return SOURCES[self.kernel]

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n + (PRODUCER_THREADS if self.kernel == PERSISTENT else 0)

    def shared_bytes(self, gated: bool) -> int:
        weight_rows = 2 * self.block_n if gated else self.block_n
        if self.kernel == PERSISTENT:
            weight_rows //= self.k_group
        stages = self.stages * self.k_group * (self.block_m + weight_rows) * K_TILE * 2
        if self.kernel != PERSISTENT:
            return stages
        barriers = 16 * self.stages  # a full and an empty mbarrier per stage
        staging = 2 * STAGED_SLOTS * (self.block_n + 16)  # the epilogue's: each consumer's half of the columns
        return stages + 1024 + barriers + staging  # stages are aligned to 1 KiB

    def name_expression(self, dtype, gated: bool, id_type: str = "int") -> str:
        """The kernel's template instantiation; ``id_type`` (an ID_TYPES value) only for SLOT."""
        tag = "bf16" if dtype == _checks.BFLOAT16 else "f16"
        flag = "true" if gated else "false"
        if self.kernel == PERSISTENT:
            return f"expert_gemm_ws<{tag},{self.block_m},{self.stages},{self.k_group},{flag}>"
        name, types = ("slot_gemm", f"{tag},{id_type}") if self.kernel == SLOT else ("expert_gemm", tag)
        return (f"{name}<{types},{self.block_m},{self.block_n},{self.warps_m},{self.warps_n},"
                f"{self.stages},{self.k_group},{flag}>")


@dataclass(frozen=True)
class Plan:
    """Both GEMMs' configs, and optionally a plan the GPU runs instead when the routing is skewed."""

    gate_up: GemmConfig
    down: GemmConfig
    # Launched too; the dispatch picks it when one expert holds skew_rows slots or more (dispatch.cu).
    skewed: Plan | None = None

    @property
    def by_slot(self) -> bool:
        """slot_gemm's plan: the GEMMs find each expert's slots themselves, no dispatch."""
        return self.gate_up.kernel == SLOT

    @property
    def skew_rows(self) -> int:
        """An expert this large (SKEW_CHUNKS of this plan's chunks) makes the routing skewed."""
        return SKEW_CHUNKS * max(self.gate_up.block_m, self.down.block_m)

    def launches(self, gated: bool) -> tuple:
        """(config, plan index) of each launch of one GEMM: index 0 works if the dispatch keeps this
        plan, 1 if it takes the skewed one, -1 always (no alternative for this GEMM)."""
        own = self.gate_up if gated else self.down
        other = None if self.skewed is None else self.skewed.gate_up if gated else self.skewed.down
        return ((own, -1),) if other in (None, own) else ((own, 0), (other, 1))


def _persistent(block_m: int, gated: bool, stages: int, k_group: int = 1) -> GemmConfig:
    """expert_gemm_ws: 256 weight rows per tile, so gate/up 128 columns (of gate and of up), down 256."""
    return GemmConfig(block_m, 128 if gated else 256, 8, 1, stages, k_group, kernel=PERSISTENT)


def _persistent_plan(block_m: int, stages: int) -> Plan:
    return Plan(_persistent(block_m, True, stages), _persistent(block_m, False, stages))


# Up to SLOT_SLOTS routed slots, the TINY plan's tiles without a dispatch: the block of each expert's
# first slot finds the expert's other slots itself (NOTES.md, v19, v20).
# Beyond, by the average number of slots per expert that has any. At one or two rows, narrow mma.sync
# gate/up tiles spread the weights over the most blocks (NOTES.md, v6), and down tiles of 128
# columns put T=1's eight experts in one wave of two blocks per SM (v18); up to a dozen (on Hopper
# nine, v23), 16-row tiles. Beyond, on Hopper, the persistent wgmma kernel streams the weights by
# TMA, its slot count (the MMA's N) the smallest that holds most experts whole (NOTES.md, v7), and
# beyond 80 rows 160, which holds experts of 128 whole and splits 256 in two (v8); elsewhere,
# mma.sync tiles of 32 to 128 rows. The two smallest, which stream the weights, take two K-tiles per stage (v12),
# and so does the 64-slot persistent plan's gate/up, each stage half its weight rows; its down,
# with fewer K-tiles, gained nothing from that (v22-v23, measured while ptxas serialised those wgmmas).
_TINY = Plan(GemmConfig(16, 32, 1, 2, 4, 2), GemmConfig(16, 128, 1, 4, 3, 2))
_SLOT = Plan(replace(_TINY.gate_up, kernel=SLOT), replace(_TINY.down, kernel=SLOT))
_SMALL = Plan(GemmConfig(16, 64, 1, 4, 3, 2), GemmConfig(16, 64, 1, 4, 3, 2))
_MEDIUM_32 = Plan(GemmConfig(32, 64, 2, 2, 5), GemmConfig(32, 128, 1, 4, 5))
_MEDIUM = Plan(GemmConfig(64, 64, 2, 2, 4), GemmConfig(64, 128, 2, 2, 4))
_LARGE = Plan(GemmConfig(128, 64, 4, 2, 3), GemmConfig(128, 128, 4, 2, 3))
_PERSISTENT_64 = Plan(_persistent(64, True, 4, k_group=2), _persistent(64, False, 5))
_PERSISTENT_96 = _persistent_plan(96, 4)
_PERSISTENT_160 = _persistent_plan(160, 4)
PLANS = (_SLOT, _TINY, _SMALL, _MEDIUM_32, _MEDIUM, _LARGE, _PERSISTENT_64, _PERSISTENT_96, _PERSISTENT_160)
SLOT_SLOTS = 128  # up to this many routed slots (where TINY's tiles fit), slot_gemm
TINY_ROWS = 2  # beyond, a skewed routing's busy experts favour the wider tiles
SMALL_ROWS = 12
SMALL_ROWS_SM90 = 9  # where the 64-slot persistent plan takes over (NOTES.md, v23)
# From this many rows per expert on sm_90 the 160-slot plan stands by for skewed routing: when one
# expert holds SKEW_CHUNKS chunks of the plan T chose, the busy experts' few long chunks beat many
# short ones (NOTES.md, v17).
SKEWED_MIN_ROWS = 7
SKEW_CHUNKS = 4
MEDIUM_32_ROWS = 24
MEDIUM_ROWS = 64
PERSISTENT_64_ROWS = 48
PERSISTENT_96_ROWS = 80
# Opt-in shared memory per block on sm_86, sm_89 and sm_120; sm_80 has 163 KiB, sm_90 227 KiB.
SHARED_LIMIT_SMALLEST = 99 * 1024
# What the GEMM kernels declare in shared memory themselves (a claimed tile, a stage's tile),
# beyond shared_bytes(); tests/test_compile.py holds ptxas's count to it.
STATIC_SHARED_BYTES = 128


def _fit(cfg: GemmConfig, fallback: GemmConfig, n_out: int) -> GemmConfig:
    """A config whose block_n divides the output width (H and I are multiples of K_TILE)."""
    if n_out % cfg.block_n == 0:
        return cfg
    if cfg.kernel == PERSISTENT:
        return _fit(fallback, fallback, n_out)
    return replace(cfg, block_n=K_TILE)


def _fit_shared(cfg: GemmConfig, gated: bool, limit: int) -> GemmConfig:
    """cfg with its pipeline cut (to 2 stages at the least) until it fits ``limit`` bytes with the
    kernel's static shared memory. The persistent kernel's consumers take alternate stages of two
    K-tiles, so those go in pairs."""
    step = 2 if cfg.kernel == PERSISTENT and cfg.k_group == 2 else 1
    while cfg.shared_bytes(gated) + STATIC_SHARED_BYTES > limit and cfg.stages - step >= 2:
        cfg = replace(cfg, stages=cfg.stages - step)
    return cfg


def plan(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int,
         compute_capability: int, shared_limit: int) -> Plan:
    """The GEMM configurations for T tokens routed to k of E experts at sizes H and I, on a GPU
    of the given compute capability with ``shared_limit`` bytes of shared memory per block."""
    slots = tokens * top_k
    rows_per_expert = slots / max(1, min(experts, slots))
    sm90 = compute_capability == WGMMA_COMPUTE_CAPABILITY
    if rows_per_expert <= TINY_ROWS:
        chosen = _SLOT if slots <= SLOT_SLOTS else _TINY
    elif rows_per_expert <= (SMALL_ROWS_SM90 if sm90 else SMALL_ROWS):
        chosen = _SMALL
    elif sm90 and rows_per_expert <= PERSISTENT_64_ROWS:
        chosen = _PERSISTENT_64
    elif sm90 and rows_per_expert <= PERSISTENT_96_ROWS:
        chosen = _PERSISTENT_96
    elif sm90:
        chosen = _PERSISTENT_160
    elif rows_per_expert <= MEDIUM_32_ROWS:
        chosen = _MEDIUM_32
    elif rows_per_expert <= MEDIUM_ROWS:
        chosen = _MEDIUM
    else:
        chosen = _LARGE
    if sm90 and rows_per_expert >= SKEWED_MIN_ROWS and chosen is not _PERSISTENT_160:
        chosen = replace(chosen, skewed=_PERSISTENT_160)
    return fitted(chosen, hidden, intermediate, shared_limit)


def fitted(chosen: Plan, hidden: int, intermediate: int, shared_limit: int) -> Plan:
    """``chosen`` (and its skewed plan) with tiles that divide H and I and pipelines that fit
    ``shared_limit`` bytes. A skewed plan that fits to the same configs is dropped."""
    own = Plan(_fit_shared(_fit(chosen.gate_up, _LARGE.gate_up, intermediate), True, shared_limit),
               _fit_shared(_fit(chosen.down, _LARGE.down, hidden), False, shared_limit))
    if chosen.skewed is None:
        return own
    skewed = fitted(chosen.skewed, hidden, intermediate, shared_limit)
    return own if skewed == own else replace(own, skewed=skewed)


@functools.lru_cache(maxsize=None)  # every launch asks; building the list takes ~20 us
def name_expressions(source: str, dtype) -> tuple:
    """Every instantiation in ``source`` the plans use on sm_80 and sm_90 for one dtype (one module)."""
    names = []
    for p in PLANS:
        for cfg, gated in ((p.gate_up, True), (p.down, False)):
            for variant in (cfg, _fit(cfg, _LARGE.gate_up if gated else _LARGE.down, K_TILE)):
                if variant.source == source:
                    # one name, or slot_gemm's for each id type
                    names += [variant.name_expression(dtype, gated, i) for i in ID_TYPES.values()]
    return tuple(dict.fromkeys(names))


def max_m_tiles(slots: int, experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m), known without reading the counts."""
    return -(-slots // block_m) + min(experts, slots)


def _compiled(cfg: GemmConfig, gated: bool, dtype, device_id: int, id_type: str = "int"):
    """The kernel of ``cfg``, allowed its shared memory."""
    name = cfg.name_expression(dtype, gated, id_type)
    names = name_expressions(cfg.source, dtype)
    if name not in names:  # stages cut for a GPU with less shared memory: a module of its own
        names = (name,)
    kernel = _compile.kernel(cfg.source, name, names, device_id)
    smem = cfg.shared_bytes(gated)
    if kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    return kernel


@functools.lru_cache(maxsize=None)
def _one_wave(cfg: GemmConfig, gated: bool, dtype, device_id: int) -> int:
    """How many blocks of an expert_gemm config the GPU runs at once. A plan that stands by is
    launched with no more, so when the dispatch takes the other one, about 30,000 fewer blocks
    start only to exit (NOTES.md, v24)."""
    kernel = _compiled(cfg, gated, dtype, device_id)
    per_sm = _compile.resident_blocks(kernel, cfg.threads, cfg.shared_bytes(gated))
    return max(1, per_sm) * _compile.multiprocessors(device_id)


def _launch(cfg: GemmConfig, plan_index: int, gated: bool, dtype, device_id: int, a, sorted_slots, top_k,
            w, offsets, tile_offsets, experts, n_out, k_dim, c, slots):
    kernel = _compiled(cfg, gated, dtype, device_id)
    grid = max_m_tiles(slots, experts, cfg.block_m) * (n_out // cfg.block_n)
    if cfg.kernel == PERSISTENT:
        grid = min(grid, _compile.multiprocessors(device_id))  # one block per SM claims tiles
        w = _tma.weight_rows_map(w, cfg.k_group)  # the weight tiles come by TMA
    elif plan_index >= 0:  # the dispatch may choose the other plan: one wave, claiming the tiles
        grid = min(grid, _one_wave(cfg, gated, dtype, device_id))
    kernel((grid,), (cfg.threads,),
           (a, sorted_slots, np.int32(top_k), w, offsets, tile_offsets, np.int32(plan_index),
            np.int32(experts), np.int32(n_out), np.int32(k_dim), c),
           shared_mem=cfg.shared_bytes(gated))


def gate_up(x, w13, dispatch, h, shape, chosen: Plan):
    """h[p] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T) for each sorted slot p = (t, e)."""
    for cfg, index in chosen.launches(gated=True):
        _launch(cfg, index, True, shape.dtype, x.device.id, x, dispatch.sorted_slots, shape.top_k, w13,
                dispatch.offsets, dispatch.tiles_gate_up, shape.experts, shape.intermediate,
                shape.hidden, h, shape.tokens * shape.top_k)


def down(h, w2, dispatch, y, shape, chosen: Plan):
    """y[p] = h[p] @ w2[e].T for each sorted slot p of expert e."""
    for cfg, index in chosen.launches(gated=False):
        _launch(cfg, index, False, shape.dtype, h.device.id, h, dispatch.sorted_slots, shape.top_k, w2,
                dispatch.offsets, dispatch.tiles_down, shape.experts, shape.hidden,
                shape.intermediate, y, shape.tokens * shape.top_k)


def by_slot(x, ids, w13, w2, h, y, slot_positions, shape, chosen: Plan):
    """Both GEMMs without a dispatch, in slot order: h[s] = SwiGLU of x[t] through expert
    e = ids[t, j] for each routed slot s = (t, j), y[s] = h[s] @ w2[e].T, and slot_positions[s] = s,
    or -1 where the id is outside [0, E) (then h[s] and y[s] are not written). An expert's slots
    go block_m at a time to the blocks of its first slot and of every block_m-th after it.
    Contiguous ids."""
    slots = shape.tokens * shape.top_k
    id_type = ID_TYPES[ids.dtype]
    gemms = ((chosen.gate_up, True, x, w13, shape.intermediate, shape.hidden, h),
             (chosen.down, False, h, w2, shape.hidden, shape.intermediate, y))
    for cfg, gated, a, w, n_out, k_dim, c in gemms:
        kernel = _compiled(cfg, gated, shape.dtype, x.device.id, id_type)
        kernel((slots * (n_out // cfg.block_n),), (cfg.threads,),
               (a, ids, np.int32(slots), np.int32(shape.top_k), w, np.int32(shape.experts),
                np.int32(n_out), np.int32(k_dim), c, slot_positions),
               shared_mem=cfg.shared_bytes(gated))
