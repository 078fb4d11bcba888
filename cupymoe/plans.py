"""The tile plans of the expert GEMMs: the kernel configs, the thresholds that pick them from the
problem's size, and a supported way to force one.

A plan names the config of each GEMM (gate/up and down): which kernel, the block tile, the warp
grid and the pipeline. :func:`plan` picks one from the average number of rows per expert; the
reasons behind its thresholds are in ``docs/design.md`` ("Tile plans"). Tests and the sanitizer
force a plan with :func:`forced`. The launches are ``_gpu_experts``'s.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, replace

from . import _checks
from ._contract import (ACTIVATIONS, EPILOGUE_BIAS, EPILOGUE_INPUT_WEIGHT, K_TILE, NOT_FP8, PRODUCER_THREADS,
                        STAGED_SLOTS)
from ._types import ExpertOptions

WGMMA_COMPUTE_CAPABILITY = 90
MMA, PERSISTENT, SLOT = "mma", "persistent", "slot"
SOURCES = {MMA: "expert_gemm.cu", PERSISTENT: "expert_gemm_ws.cu", SLOT: "expert_gemm.cu"}
ID_TYPES = {"int32": "int", "int64": "long long"}  # slot_gemm's IdT, by the ids' dtype name


@dataclass(frozen=True)
class Epilogue:
    """A GEMM epilogue's template arguments: the activation's index in _contract.ACTIVATIONS (gate/up
    only) and the flags of what it adds (_contract.EPILOGUE_BIAS, EPILOGUE_INPUT_WEIGHT)."""

    activation: int = 0
    flags: int = 0

    @classmethod
    def of(cls, options: ExpertOptions, gated: bool) -> Epilogue:
        """The epilogue of one GEMM of a forward with ``options``."""
        if not gated:
            return cls(0, EPILOGUE_BIAS if options.w2_bias is not None else 0)
        flags = (EPILOGUE_BIAS if options.w13_bias is not None else 0) | (
            EPILOGUE_INPUT_WEIGHT if options.weight_on_input else 0)
        return cls(ACTIVATIONS.index(options.activation), flags)


PLAIN = Epilogue()  # SwiGLU, no bias, the routing weights on the output


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
    # rows by all block_m slots (FP8's 128-slot tiles: half the slots by each half of the rows in
    # turn). SLOT: slot_gemm (mma.sync), no dispatch: a block per routed slot, the blocks of an
    # expert's first slot and of every block_m-th after it computing its slots.
    kernel: str = MMA
    # FP8 on PERSISTENT: accumulators per consumer. 2 sums the K-tiles into two by turns, promoting
    # one K-tile's sums while the next one's MMAs run (FP8_TRIAL_PLANS; not yet measured).
    accumulators: int = 1

    @property
    def source(self) -> str:
        return SOURCES[self.kernel]

    def splits_slots(self, fp8: bool) -> bool:
        """Whether the persistent kernel's consumers split this tile's slots, multiplying them by each
        half of the weight rows in turn (FP8's 128-slot tiles, the kernel's TileShape), not its rows."""
        return self.kernel == PERSISTENT and fp8 and self.block_m == FP8_SLOT_SPLIT_SLOTS

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n + (PRODUCER_THREADS if self.kernel == PERSISTENT else 0)

    def shared_bytes(self, gated: bool, fp8: bool = False, weight_only: bool = False) -> int:
        """Dynamic shared memory of one block: its pipeline's stages (``weight_only``: e4m3 weights
        beside 16-bit A, two K-tiles of A a weight K-tile); for PERSISTENT also (``fp8``) its stages
        of the slots' scales, its mbarriers and epilogue staging, and the slack to align the stages
        to 1 KiB (the kernel's WsLayout, held equal by tests/test_contract.py)."""
        weight_rows = 2 * self.block_n if gated else self.block_n
        if self.kernel == PERSISTENT:
            weight_rows //= self.k_group * (2 if self.splits_slots(fp8) else 1)  # a stage's
        a_rows = 2 * self.block_m if weight_only else self.block_m
        stages = self.stages * self.k_group * (a_rows + weight_rows) * K_TILE * 2
        if self.kernel != PERSISTENT:
            return stages
        scales = self.stages * self.block_m * 4 if fp8 else 0  # a float32 per slot and stage
        barriers = 16 * self.stages  # a full and an empty mbarrier per stage
        staged_columns = self.block_n if self.splits_slots(fp8) and gated else self.block_n // 2  # a consumer's
        staging = 2 * STAGED_SLOTS * (2 * staged_columns + 16)  # the epilogue's
        return stages + scales + 1024 + barriers + staging

    def quantizes_h(self, fp8: bool, weight_only: bool = False) -> bool:
        """Whether this gate/up config writes h for an FP8 down GEMM already quantized (e4m3 bytes
        and their scales, from the persistent kernel's epilogue); otherwise h is 16-bit."""
        return fp8 and not weight_only and self.kernel == PERSISTENT

    def name_expression(self, dtype, gated: bool, id_type: str = "int", epilogue: Epilogue = PLAIN,
                        fp8: int = NOT_FP8, weight_only: bool = False) -> str:
        """The kernel's template instantiation; ``id_type`` (an ID_TYPES value) only for SLOT,
        ``fp8`` (e4m3 weights with scales of that layout index, and e4m3 A unless ``weight_only``;
        ``dtype`` is the output's) not for SLOT, and on PERSISTENT with stages of one K-tile,
        FP8_PERSISTENT_SLOTS or FP8_SLOT_SPLIT_SLOTS slots and not weight-only."""
        tag = _checks.CUDA_TYPES[dtype]
        tail = f"{'true' if gated else 'false'},{epilogue.activation},{epilogue.flags}"
        if fp8 != NOT_FP8 and self.kernel == SLOT:
            raise ValueError("FP8 operands run on expert_gemm and expert_gemm_ws, not on slot_gemm")
        if weight_only and (fp8 == NOT_FP8 or self.kernel != MMA):
            raise ValueError(f"weight-only FP8 runs on expert_gemm with FP8 weights, not {self} (fp8={fp8})")
        fp8_slots = (FP8_PERSISTENT_SLOTS, FP8_SLOT_SPLIT_SLOTS)
        if fp8 != NOT_FP8 and self.kernel == PERSISTENT and (self.k_group != 1 or self.block_m not in fp8_slots):
            raise ValueError(f"FP8 operands on expert_gemm_ws take stages of one K-tile and tiles of "
                             f"{' or '.join(map(str, fp8_slots))} slots, not {self}")
        columns = 128 if gated else 256  # the kernel's TileShape
        if self.kernel == PERSISTENT and self.block_n != columns:
            raise ValueError(f"this expert_gemm_ws tile has {columns} columns, not {self}")
        if self.accumulators != 1 and (fp8 == NOT_FP8 or self.kernel != PERSISTENT):
            raise ValueError(f"two accumulators run FP8 operands on expert_gemm_ws, not {self} (fp8={fp8})")
        if self.kernel == PERSISTENT:
            return (f"expert_gemm_ws<{tag},{self.block_m},{self.stages},{self.k_group},{tail},{fp8},"
                    f"{self.accumulators}>")
        if self.kernel == SLOT:
            name, types = "slot_gemm", f"{tag},{id_type}"
        else:
            name, types, tail = "expert_gemm", tag, f"{tail},{fp8},{'true' if weight_only else 'false'}"
        return (f"{name}<{types},{self.block_m},{self.block_n},{self.warps_m},{self.warps_n},"
                f"{self.stages},{self.k_group},{tail}>")


@dataclass(frozen=True)
class Plan:
    """Both GEMMs' configs, and optionally a plan the GPU runs instead when the routing is skewed."""

    gate_up: GemmConfig
    down: GemmConfig
    # Launched too; the dispatch picks it when one expert holds skew_rows slots or more (dispatch.cu).
    skewed: Plan | None = None
    # The grid of an expert_gemm launch that stands by (the dispatch may take the other plan): its
    # blocks claim the tiles. None: one wave, the most blocks the GPU holds at once.
    standby_blocks: int | None = None

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


# The plans, smallest tiles first; docs/design.md ("Tile plans") gives the measurement behind each.
# Up to SLOT_SLOTS routed slots, TINY's tiles without a dispatch (SLOT). Beyond, by the average rows
# per expert that has any: at one or two, narrow gate/up tiles spread the weights over the most
# blocks and 128-column down tiles; up to a dozen (on Hopper nine), 16-row tiles; beyond, on Hopper,
# the persistent wgmma kernel with the smallest slot count (the MMA's N) that holds most experts
# whole, 160 from 80 rows; elsewhere, mma.sync tiles of 32 to 128 rows. The two smallest plans and
# the 64-slot plan's gate/up take two K-tiles per stage.
TINY = Plan(GemmConfig(16, 32, 1, 2, 4, 2), GemmConfig(16, 128, 1, 4, 3, 2))
BY_SLOT = Plan(replace(TINY.gate_up, kernel=SLOT), replace(TINY.down, kernel=SLOT))
SMALL = Plan(GemmConfig(16, 64, 1, 4, 3, 2), GemmConfig(16, 64, 1, 4, 3, 2))
MEDIUM_32 = Plan(GemmConfig(32, 64, 2, 2, 5), GemmConfig(32, 128, 1, 4, 5))
MEDIUM = Plan(GemmConfig(64, 64, 2, 2, 4), GemmConfig(64, 128, 2, 2, 4))
LARGE = Plan(GemmConfig(128, 64, 4, 2, 3), GemmConfig(128, 128, 4, 2, 3))
PERSISTENT_64 = Plan(_persistent(64, True, 4, k_group=2), _persistent(64, False, 5))
PERSISTENT_96 = _persistent_plan(96, 4)
PERSISTENT_160 = _persistent_plan(160, 4)
PLANS = (BY_SLOT, TINY, SMALL, MEDIUM_32, MEDIUM, LARGE, PERSISTENT_64, PERSISTENT_96, PERSISTENT_160)
# FP8 weights (w8a8, sm_89+): on sm_90 the persistent kernel's e4m3 wgmma with 64-slot tiles (its
# totals beside the sums leave no registers for more) at every T, since mma.sync e4m3 (which ptxas
# widens to f16 HMMA there) sums to other last bits. Elsewhere TINY from the first slot (slot_gemm
# has no FP8 variant), SMALL up to SMALL_ROWS, then MEDIUM_32: the fastest from T = 512 to 8192 on
# an H100 beside SMALL and 64-row tiles.
FP8_PERSISTENT_SLOTS = 64
PERSISTENT_FP8 = _persistent_plan(FP8_PERSISTENT_SLOTS, 5)
FP8_PLANS = (TINY, SMALL, MEDIUM_32, PERSISTENT_FP8)
# Variants waiting for a GPU measurement: forced() runs them, plan() never picks them, and each
# compiles into a module of its own. PERSISTENT_FP8 with two accumulators (its bits are the same).
PERSISTENT_FP8_TWO_ACCUMULATORS = Plan(replace(PERSISTENT_FP8.gate_up, accumulators=2),
                                       replace(PERSISTENT_FP8.down, accumulators=2))
# Tiles of 128 slots, 64 a consumer, which multiplies them by each half of the tile's weight rows
# in turn: a weight row is read from L2 once per 128 slots, not 64 (the same bits).
FP8_SLOT_SPLIT_SLOTS = 128
PERSISTENT_FP8_128 = _persistent_plan(FP8_SLOT_SPLIT_SLOTS, 6)
FP8_TRIAL_PLANS = (PERSISTENT_FP8_TWO_ACCUMULATORS, PERSISTENT_FP8_128)
FP8_COMPUTE_CAPABILITY = 89
# Weight-only FP8 (w8a16; e4m3 weights widened in registers, 16-bit MMAs), on every GPU: the mma.sync
# FP8 plans by the same rows per expert.
WEIGHT_ONLY_PLANS = (TINY, SMALL, MEDIUM_32)
SLOT_SLOTS = 128  # up to this many routed slots (where TINY's tiles fit), slot_gemm
TINY_ROWS = 2  # beyond, a skewed routing's busy experts favour the wider tiles
SMALL_ROWS = 12
SMALL_ROWS_SM90 = 9  # where the 64-slot persistent plan takes over
# From this many rows per expert on sm_90 the 160-slot plan stands by for skewed routing: when one
# expert holds SKEW_CHUNKS chunks of the plan T chose, the busy experts' few long chunks beat many
# short ones.
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


def _fit_shared(cfg: GemmConfig, gated: bool, limit: int, fp8: bool = False, weight_only: bool = False) -> GemmConfig:
    """cfg with its pipeline cut (to 2 stages at the least) until it fits ``limit`` bytes with the
    kernel's static shared memory. The persistent kernel's consumers take alternate stages of two
    K-tiles, so those go in pairs."""
    step = 2 if cfg.kernel == PERSISTENT and cfg.k_group == 2 else 1
    while cfg.shared_bytes(gated, fp8, weight_only) + STATIC_SHARED_BYTES > limit and cfg.stages - step >= 2:
        cfg = replace(cfg, stages=cfg.stages - step)
    return cfg


_FORCED: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("cupymoe_forced_plan", default=None)


@contextlib.contextmanager
def forced(chosen: Plan):
    """Within the ``with`` block, every GPU forward of this thread runs ``chosen`` (fitted to its H
    and I and to the GPU's shared memory), whatever its size would pick. For tests and the
    sanitizer. An ``MoE`` layer keeps the plan of the workspace it made for a T, so force before
    a layer's first call with that T (or use ``fused_experts``).

    >>> with plans.forced(plans.PERSISTENT_96):
    ...     out = cupymoe.fused_experts(x, w13, w2, ids, weights)
    """
    if not isinstance(chosen, Plan):
        raise TypeError(f"chosen: expected a cupymoe.plans.Plan, got {type(chosen).__name__}")
    token = _FORCED.set(chosen)
    try:
        yield chosen
    finally:
        _FORCED.reset(token)


def plan(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int,
         compute_capability: int, shared_limit: int, fp8: bool = False, weight_only: bool = False) -> Plan:
    """The GEMM configurations for T tokens routed to k of E experts at sizes H and I, on a GPU
    of the given compute capability with ``shared_limit`` bytes of shared memory per block, for
    bf16/fp16 or ``fp8`` weights (``weight_only``: beside 16-bit activations); the plan of
    :func:`forced` inside its block."""
    sm90 = compute_capability == WGMMA_COMPUTE_CAPABILITY
    chosen = _FORCED.get()
    if chosen is not None and weight_only and chosen not in WEIGHT_ONLY_PLANS:
        raise ValueError("chosen: weight-only FP8 runs its own plans only (plans.WEIGHT_ONLY_PLANS)")
    if chosen is not None and fp8 and chosen not in FP8_PLANS + FP8_TRIAL_PLANS:
        raise ValueError("chosen: FP8 weights run their own plans only (plans.FP8_PLANS, FP8_TRIAL_PLANS)")
    if chosen is not None and not fp8 and chosen in FP8_TRIAL_PLANS:
        raise ValueError("chosen: plans.FP8_TRIAL_PLANS run FP8 weights (w8a8) only")
    if chosen is not None:
        if not sm90 and PERSISTENT in (chosen.gate_up.kernel, chosen.down.kernel):
            raise ValueError(f"chosen: the persistent kernel needs compute capability 9.0, "
                             f"this GPU is {compute_capability / 10:.1f}")
        return fitted(chosen, hidden, intermediate, shared_limit, fp8, weight_only)
    slots = tokens * top_k
    rows_per_expert = slots / max(1, min(experts, slots))
    if fp8:
        chosen = _fp8_plan(rows_per_expert, sm90 and not weight_only)
        return fitted(chosen, hidden, intermediate, shared_limit, True, weight_only)
    if rows_per_expert <= TINY_ROWS:
        chosen = BY_SLOT if slots <= SLOT_SLOTS else TINY
    elif rows_per_expert <= (SMALL_ROWS_SM90 if sm90 else SMALL_ROWS):
        chosen = SMALL
    elif sm90 and rows_per_expert <= PERSISTENT_64_ROWS:
        chosen = PERSISTENT_64
    elif sm90 and rows_per_expert <= PERSISTENT_96_ROWS:
        chosen = PERSISTENT_96
    elif sm90:
        chosen = PERSISTENT_160
    elif rows_per_expert <= MEDIUM_32_ROWS:
        chosen = MEDIUM_32
    elif rows_per_expert <= MEDIUM_ROWS:
        chosen = MEDIUM
    else:
        chosen = LARGE
    if sm90 and rows_per_expert >= SKEWED_MIN_ROWS and chosen is not PERSISTENT_160:
        chosen = replace(chosen, skewed=PERSISTENT_160)
    return fitted(chosen, hidden, intermediate, shared_limit)


def _fp8_plan(rows_per_expert: float, persistent: bool) -> Plan:
    if persistent:  # e4m3 wgmma sums differ in their last bits from mma.sync's: one kernel at every T, one set of bits
        return PERSISTENT_FP8
    if rows_per_expert <= TINY_ROWS:
        return TINY
    return SMALL if rows_per_expert <= SMALL_ROWS else MEDIUM_32


def _fallback(fp8: bool) -> Plan:
    """The plan whose configs take over a persistent one whose tile does not divide H or I."""
    return MEDIUM_32 if fp8 else LARGE


def fitted(chosen: Plan, hidden: int, intermediate: int, shared_limit: int, fp8: bool = False,
           weight_only: bool = False) -> Plan:
    """``chosen`` (and its skewed plan) with tiles that divide H and I and pipelines that fit
    ``shared_limit`` bytes (with ``fp8`` operands, ``weight_only``: FP8 weights beside 16-bit A).
    A skewed plan that fits to the same configs is dropped."""
    fallback = _fallback(fp8)
    own = Plan(_fit_shared(_fit(chosen.gate_up, fallback.gate_up, intermediate), True, shared_limit, fp8, weight_only),
               _fit_shared(_fit(chosen.down, fallback.down, hidden), False, shared_limit, fp8, weight_only),
               standby_blocks=chosen.standby_blocks)
    if chosen.skewed is None:
        return own
    skewed = fitted(chosen.skewed, hidden, intermediate, shared_limit, fp8)
    same = (skewed.gate_up, skewed.down) == (own.gate_up, own.down)
    return own if same else replace(own, skewed=skewed)


@functools.lru_cache(maxsize=None)  # every launch asks; building the list takes ~20 us
def name_expressions(source: str, dtype, gated: bool, epilogue: Epilogue = PLAIN, fp8: int = NOT_FP8,
                     weight_only: bool = False) -> tuple:
    """Every instantiation of one GEMM in ``source`` that the plans use on sm_80 and sm_90, for one
    dtype and epilogue, with bf16/fp16 operands or ``fp8`` ones (``weight_only``: FP8 weights only;
    one module)."""
    names = []
    fallback = _fallback(fp8 != NOT_FP8)
    for p in WEIGHT_ONLY_PLANS if weight_only else PLANS if fp8 == NOT_FP8 else FP8_PLANS:
        cfg = p.gate_up if gated else p.down
        for variant in (cfg, _fit(cfg, fallback.gate_up if gated else fallback.down, K_TILE)):
            if variant.source == source:
                # one name, or slot_gemm's for each id type
                names += [variant.name_expression(dtype, gated, i, epilogue, fp8, weight_only)
                          for i in ID_TYPES.values()]
    return tuple(dict.fromkeys(names))


def max_m_tiles(slots: int, experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m), known without reading the counts."""
    return -(-slots // block_m) + min(experts, slots)
