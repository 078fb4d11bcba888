"""The GEMM tile plans (host side, no GPU): every config fits the GPU it is planned for."""
import dataclasses
import itertools

import pytest

from cupymoe import _checks, _gpu_dispatch, experts

SHARED_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
TOKENS = (1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192)
SIZES = ((4096, 1024), (64, 64), (192, 320), (512, 64), (2048, 1408))  # (H, I), multiples of 64


def plans():
    for cc, tokens, (hidden, inter) in itertools.product(SHARED_LIMITS, TOKENS, SIZES):
        p = experts.plan(tokens, 8, 256, hidden, inter, cc, SHARED_LIMITS[cc])
        yield cc, hidden, inter, p


@pytest.mark.parametrize("cc,hidden,inter,p", list(plans()))
def test_configs_fit_the_problem_and_the_gpu(cc, hidden, inter, p):
    for cfg, gated, n_out in ((p.gate_up, True, inter), (p.down, False, hidden)):
        assert n_out % cfg.block_n == 0
        assert cfg.shared_bytes(gated) + experts.STATIC_SHARED_BYTES <= SHARED_LIMITS[cc]
        assert cfg.stages >= 2
        assert cfg.kernel != experts.PERSISTENT or cc == experts.WGMMA_COMPUTE_CAPABILITY
        assert cfg.threads <= 1024
        assert cfg.kernel != experts.PERSISTENT or cfg.k_group == 1 or cfg.stages % 2 == 0


@pytest.mark.parametrize("cc", [80, 90, 100])
def test_sm80_sm90_and_sm100_plans_are_precompiled(cc):
    """What A100s, H100/H200s and B200s run is in name_expressions (compiled once, checked for spills)."""
    for tokens, (hidden, inter) in itertools.product(TOKENS, SIZES):
        p = experts.plan(tokens, 8, 256, hidden, inter, cc, SHARED_LIMITS[cc])
        for cfg, gated in ((p.gate_up, True), (p.down, False)):
            for dtype in (_checks.BFLOAT16, _checks.FLOAT16):
                assert cfg.name_expression(dtype, gated) in experts.name_expressions(cfg.source, dtype)


def test_small_shared_memory_cuts_stages_only():
    """On a 99 KiB GPU the deep small-tile pipelines lose stages; tile shapes stay."""
    roomy = experts.plan(256, 8, 256, 4096, 1024, 80, SHARED_LIMITS[80])
    tight = experts.plan(256, 8, 256, 4096, 1024, 86, SHARED_LIMITS[86])
    assert roomy.gate_up.shared_bytes(True) > SHARED_LIMITS[86]
    assert tight.gate_up.stages < roomy.gate_up.stages
    assert (tight.gate_up.block_m, tight.gate_up.block_n) == (roomy.gate_up.block_m, roomy.gate_up.block_n)


def test_persistent_stages_of_two_k_tiles_are_cut_in_pairs():
    """Its consumers take alternate stages, so each keeps its own only in an even ring."""
    cfg = experts._PERSISTENT_64.gate_up
    assert (cfg.kernel, cfg.k_group, cfg.stages) == (experts.PERSISTENT, 2, 4)
    three = dataclasses.replace(cfg, stages=3).shared_bytes(True) + experts.STATIC_SHARED_BYTES
    assert experts._fit_shared(cfg, True, three).stages == 2
    assert experts._fit_shared(cfg, True, cfg.shared_bytes(True) + experts.STATIC_SHARED_BYTES).stages == 4
    assert experts._fit_shared(cfg, True, cfg.shared_bytes(True)).stages == 2  # the kernel's own needs room too


def test_narrow_gate_up_tiles_up_to_two_rows_per_expert():
    assert experts.plan(64, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90]).gate_up.block_n == 32
    assert experts.plan(65, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90]).gate_up.block_n == 64
    assert experts.plan(1, 8, 256, 4096, 1024, 80, SHARED_LIMITS[80]).gate_up.block_n == 32


@pytest.mark.parametrize("cc", sorted(SHARED_LIMITS))
def test_few_slots_go_by_slot_with_the_tiny_tiles(cc):
    """Up to 128 slots, where the TINY plan would run, the GEMMs skip the dispatch on every GPU; their
    tiles are the TINY plan's, so are their bits."""
    def plan(tokens, top_k=8, num_experts=256):
        return experts.plan(tokens, top_k, num_experts, 4096, 1024, cc, SHARED_LIMITS[cc])
    assert plan(1).by_slot and plan(16).by_slot and plan(128, top_k=1).by_slot
    assert not plan(17).by_slot and not plan(1, top_k=256).by_slot
    assert plan(8, top_k=2, num_experts=8).by_slot  # 2 rows per expert
    assert not plan(9, top_k=2, num_experts=8).by_slot  # past TINY's rows
    tiny = plan(17)
    for got, want in ((plan(16).gate_up, tiny.gate_up), (plan(16).down, tiny.down)):
        assert (got.kernel, want.kernel) == (experts.SLOT, experts.MMA)
        assert dataclasses.replace(got, kernel=experts.MMA) == want


def test_persistent_kernel_above_9_rows_per_expert_on_sm90():
    """Its slot count (the MMA's N) grows with the rows per expert: 64, then 96, then 160. Elsewhere
    16-row mma.sync tiles go on to 12 rows."""
    def gate_up(tokens, cc=90):
        return experts.plan(tokens, 8, 256, 4096, 1024, cc, SHARED_LIMITS[cc]).gate_up
    assert (gate_up(288).kernel, gate_up(288).block_m) == (experts.MMA, 16)
    assert (gate_up(289).kernel, gate_up(289).block_m) == (experts.PERSISTENT, 64)
    assert (gate_up(384, cc=80).block_m, gate_up(385, cc=80).block_m) == (16, 32)
    assert gate_up(1536).block_m == 64
    assert gate_up(1537).block_m == 96
    assert gate_up(2560).block_m == 96
    assert gate_up(2561).block_m == 160
    assert gate_up(8192).block_m == 160
    assert gate_up(8192, cc=80).kernel == experts.MMA


def test_persistent_kernel_falls_back_where_its_tiles_do_not_divide():
    """Gate/up tiles are 128 columns of I, down tiles 256 of H; else the mma.sync kernel."""
    p = experts.plan(4096, 8, 256, 4096 + 64, 1024 + 64, 90, SHARED_LIMITS[90])
    assert (p.gate_up.kernel, p.down.kernel) == (experts.MMA, experts.MMA)
    assert p.gate_up.shared_bytes(True) <= SHARED_LIMITS[90]


def test_one_block_dispatch_only_where_its_shared_memory_fits():
    most = _gpu_dispatch.FUSED_MAX_SLOTS
    assert most <= _gpu_dispatch.FUSED_WARPS * _gpu_dispatch.CHUNK  # what one block can take
    assert _gpu_dispatch.fused_fits(most, 256, SHARED_LIMITS[86])
    assert not _gpu_dispatch.fused_fits(most + 1, 256, SHARED_LIMITS[90])  # three kernels from here
    experts_99k = SHARED_LIMITS[86] // _gpu_dispatch.fused_shared_bytes(1)
    assert _gpu_dispatch.fused_fits(64, experts_99k, SHARED_LIMITS[86])
    assert not _gpu_dispatch.fused_fits(64, experts_99k + 1, SHARED_LIMITS[86])
    assert _gpu_dispatch.fused_fits(64, experts_99k + 1, SHARED_LIMITS[90])


def test_160_slot_plan_stands_by_for_skewed_routing_on_sm90():
    """From SKEWED_MIN_ROWS rows per expert, where T's plan has shorter chunks, both are launched."""
    def plan(tokens, cc=90, hidden=4096, inter=1024):
        return experts.plan(tokens, 8, 256, hidden, inter, cc, SHARED_LIMITS[cc])
    first = experts.SKEWED_MIN_ROWS * 256 // 8
    assert plan(first - 1).skewed is None
    for tokens in (first, 512, 2048):
        p = plan(tokens)
        assert p.skewed == experts.fitted(experts._PERSISTENT_160, 4096, 1024, SHARED_LIMITS[90])
        assert p.skew_rows == experts.SKEW_CHUNKS * p.gate_up.block_m
        assert p.launches(gated=True) == ((p.gate_up, 0), (p.skewed.gate_up, 1))
        assert p.launches(gated=False) == ((p.down, 0), (p.skewed.down, 1))
    assert plan(4096).skewed is None  # already the 160-slot plan
    assert plan(512, cc=80).skewed is None
    assert plan(8192).launches(gated=True) == ((plan(8192).gate_up, -1),)
    # Where neither plan's persistent tiles divide H and I, both fall back to the same configs.
    assert plan(2048, hidden=4096 + 64, inter=1024 + 64).skewed is None


@pytest.mark.parametrize("cc,hidden,inter,p", [case for case in plans() if case[3].skewed])
def test_skewed_plans_fit_and_are_precompiled(cc, hidden, inter, p):
    test_configs_fit_the_problem_and_the_gpu(cc, hidden, inter, p.skewed)
    for cfg, gated in ((p.skewed.gate_up, True), (p.skewed.down, False)):
        assert cfg.name_expression(_checks.BFLOAT16, gated) in experts.name_expressions(cfg.source, _checks.BFLOAT16)
