"""The GEMM tile plans: every config fits the GPU it is planned for (host side), and every plan,
forced with plans.forced, computes the same function with the same bits (GPU)."""
import dataclasses
import itertools

import numpy as np
import pytest

import cupymoe
from cupymoe import _checks, _compile, _gpu_dispatch, plans
from helpers import host_bits, poison, random_problem, to_gpu
from test_layer import SIZES, check_close, run_fused

SHARED_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
TOKENS = (1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192)
PLANNED_SIZES = ((4096, 1024), (64, 64), (192, 320), (512, 64), (2048, 1408))  # (H, I), multiples of 64


def planned():
    for cc, tokens, (hidden, inter) in itertools.product(SHARED_LIMITS, TOKENS, PLANNED_SIZES):
        p = plans.plan(tokens, 8, 256, hidden, inter, cc, SHARED_LIMITS[cc])
        yield cc, hidden, inter, p


@pytest.mark.parametrize("cc,hidden,inter,p", list(planned()))
def test_configs_fit_the_problem_and_the_gpu(cc, hidden, inter, p):
    for cfg, gated, n_out in ((p.gate_up, True, inter), (p.down, False, hidden)):
        assert n_out % cfg.block_n == 0
        assert cfg.shared_bytes(gated) + plans.STATIC_SHARED_BYTES <= SHARED_LIMITS[cc]
        assert cfg.stages >= 2
        assert cfg.kernel != plans.PERSISTENT or cc == plans.WGMMA_COMPUTE_CAPABILITY
        assert cfg.threads <= 1024
        assert cfg.kernel != plans.PERSISTENT or cfg.k_group == 1 or cfg.stages % 2 == 0


@pytest.mark.parametrize("cc", [80, 90, 100])
def test_sm80_sm90_and_sm100_plans_are_precompiled(cc):
    """What A100s, H100/H200s and B200s run is in name_expressions (compiled once, checked for spills)."""
    for tokens, (hidden, inter) in itertools.product(TOKENS, PLANNED_SIZES):
        p = plans.plan(tokens, 8, 256, hidden, inter, cc, SHARED_LIMITS[cc])
        for cfg, gated in ((p.gate_up, True), (p.down, False)):
            for dtype in (_checks.BFLOAT16, _checks.FLOAT16):
                assert cfg.name_expression(dtype, gated) in plans.name_expressions(cfg.source, dtype, gated)


def test_small_shared_memory_cuts_stages_only():
    """On a 99 KiB GPU the deep small-tile pipelines lose stages; tile shapes stay."""
    roomy = plans.plan(256, 8, 256, 4096, 1024, 80, SHARED_LIMITS[80])
    tight = plans.plan(256, 8, 256, 4096, 1024, 86, SHARED_LIMITS[86])
    assert roomy.gate_up.shared_bytes(True) > SHARED_LIMITS[86]
    assert tight.gate_up.stages < roomy.gate_up.stages
    assert (tight.gate_up.block_m, tight.gate_up.block_n) == (roomy.gate_up.block_m, roomy.gate_up.block_n)


def test_persistent_stages_of_two_k_tiles_are_cut_in_pairs():
    """Its consumers take alternate stages, so each keeps its own only in an even ring."""
    cfg = plans.PERSISTENT_64.gate_up
    assert (cfg.kernel, cfg.k_group, cfg.stages) == (plans.PERSISTENT, 2, 4)
    three = dataclasses.replace(cfg, stages=3).shared_bytes(True) + plans.STATIC_SHARED_BYTES
    assert plans._fit_shared(cfg, True, three).stages == 2
    assert plans._fit_shared(cfg, True, cfg.shared_bytes(True) + plans.STATIC_SHARED_BYTES).stages == 4
    assert plans._fit_shared(cfg, True, cfg.shared_bytes(True)).stages == 2  # the kernel's own needs room too


def test_narrow_gate_up_tiles_up_to_two_rows_per_expert():
    assert plans.plan(64, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90]).gate_up.block_n == 32
    assert plans.plan(65, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90]).gate_up.block_n == 64
    assert plans.plan(1, 8, 256, 4096, 1024, 80, SHARED_LIMITS[80]).gate_up.block_n == 32


@pytest.mark.parametrize("cc", sorted(SHARED_LIMITS))
def test_few_slots_go_by_slot_with_the_tiny_tiles(cc):
    """Up to 128 slots, where the TINY plan would run, the GEMMs skip the dispatch on every GPU; their
    tiles are the TINY plan's, so are their bits."""
    def plan(tokens, top_k=8, num_experts=256):
        return plans.plan(tokens, top_k, num_experts, 4096, 1024, cc, SHARED_LIMITS[cc])
    assert plan(1).by_slot and plan(16).by_slot and plan(128, top_k=1).by_slot
    assert not plan(17).by_slot and not plan(1, top_k=256).by_slot
    assert plan(8, top_k=2, num_experts=8).by_slot  # 2 rows per expert
    assert not plan(9, top_k=2, num_experts=8).by_slot  # past TINY's rows
    tiny = plan(17)
    for got, want in ((plan(16).gate_up, tiny.gate_up), (plan(16).down, tiny.down)):
        assert (got.kernel, want.kernel) == (plans.SLOT, plans.MMA)
        assert dataclasses.replace(got, kernel=plans.MMA) == want


def test_persistent_kernel_above_9_rows_per_expert_on_sm90():
    """Its slot count (the MMA's N) grows with the rows per expert: 64, then 96, then 160. Elsewhere
    16-row mma.sync tiles go on to 12 rows."""
    def gate_up(tokens, cc=90):
        return plans.plan(tokens, 8, 256, 4096, 1024, cc, SHARED_LIMITS[cc]).gate_up
    assert (gate_up(288).kernel, gate_up(288).block_m) == (plans.MMA, 16)
    assert (gate_up(289).kernel, gate_up(289).block_m) == (plans.PERSISTENT, 64)
    assert (gate_up(384, cc=80).block_m, gate_up(385, cc=80).block_m) == (16, 32)
    assert gate_up(1536).block_m == 64
    assert gate_up(1537).block_m == 96
    assert gate_up(2560).block_m == 96
    assert gate_up(2561).block_m == 160
    assert gate_up(8192).block_m == 160
    assert gate_up(8192, cc=80).kernel == plans.MMA


def test_persistent_kernel_falls_back_where_its_tiles_do_not_divide():
    """Gate/up tiles are 128 columns of I, down tiles 256 of H; else the mma.sync kernel."""
    p = plans.plan(4096, 8, 256, 4096 + 64, 1024 + 64, 90, SHARED_LIMITS[90])
    assert (p.gate_up.kernel, p.down.kernel) == (plans.MMA, plans.MMA)
    assert p.gate_up.shared_bytes(True) <= SHARED_LIMITS[90]


def test_one_block_dispatch_only_where_its_shared_memory_fits():
    most = _gpu_dispatch.FUSED_MAX_SLOTS
    assert most <= _gpu_dispatch.DISPATCH_FUSED_WARPS * _gpu_dispatch.DISPATCH_CHUNK  # what one block can take
    assert _gpu_dispatch.fused_fits(most, 256, SHARED_LIMITS[86])
    assert not _gpu_dispatch.fused_fits(most + 1, 256, SHARED_LIMITS[90])  # three kernels from here
    experts_99k = SHARED_LIMITS[86] // _gpu_dispatch.fused_shared_bytes(1)
    assert _gpu_dispatch.fused_fits(64, experts_99k, SHARED_LIMITS[86])
    assert not _gpu_dispatch.fused_fits(64, experts_99k + 1, SHARED_LIMITS[86])
    assert _gpu_dispatch.fused_fits(64, experts_99k + 1, SHARED_LIMITS[90])


def test_160_slot_plan_stands_by_for_skewed_routing_on_sm90():
    """From SKEWED_MIN_ROWS rows per expert, where T's plan has shorter chunks, both are launched."""
    def plan(tokens, cc=90, hidden=4096, inter=1024):
        return plans.plan(tokens, 8, 256, hidden, inter, cc, SHARED_LIMITS[cc])
    first = plans.SKEWED_MIN_ROWS * 256 // 8
    assert plan(first - 1).skewed is None
    for tokens in (first, 512, 2048):
        p = plan(tokens)
        assert p.skewed == plans.fitted(plans.PERSISTENT_160, 4096, 1024, SHARED_LIMITS[90])
        assert p.skew_rows == plans.SKEW_CHUNKS * p.gate_up.block_m
        assert p.launches(gated=True) == ((p.gate_up, 0), (p.skewed.gate_up, 1))
        assert p.launches(gated=False) == ((p.down, 0), (p.skewed.down, 1))
    assert plan(4096).skewed is None  # already the 160-slot plan
    assert plan(512, cc=80).skewed is None
    assert plan(8192).launches(gated=True) == ((plan(8192).gate_up, -1),)
    # Where neither plan's persistent tiles divide H and I, both fall back to the same configs.
    assert plan(2048, hidden=4096 + 64, inter=1024 + 64).skewed is None


@pytest.mark.parametrize("cc,hidden,inter,p", [case for case in planned() if case[3].skewed])
def test_skewed_plans_fit_and_are_precompiled(cc, hidden, inter, p):
    test_configs_fit_the_problem_and_the_gpu(cc, hidden, inter, p.skewed)
    for cfg, gated in ((p.skewed.gate_up, True), (p.skewed.down, False)):
        assert cfg.name_expression(_checks.BFLOAT16, gated) in plans.name_expressions(cfg.source, _checks.BFLOAT16, gated)


@pytest.mark.parametrize("cc", [89, 90, 100])
def test_fp8_weights_take_their_plans_and_compiled_names(cc):
    """FP8: mma.sync plans, and on sm_90 the persistent e4m3 plan at every T (where its tiles divide
    H and I); each config fits with the slots' scales in its stages and is one of name_expressions(fp8=)."""
    seen = set()
    for tokens, (hidden, inter) in itertools.product((1, 3, 16, 64, 256, 512, 1024, 8192),
                                                    ((7168, 2048), (4096, 1024), (384, 640))):
        p = plans.plan(tokens, 8, 256, hidden, inter, cc, 227 * 1024, fp8=True)
        assert p.skewed is None
        persistent = cc == plans.WGMMA_COMPUTE_CAPABILITY
        for cfg, gated, n_out in ((p.gate_up, True, inter), (p.down, False, hidden)):
            divides = n_out % plans.PERSISTENT_FP8.gate_up.block_n == 0 if gated else n_out % 256 == 0
            assert (cfg.kernel == plans.PERSISTENT) == (persistent and divides)
            assert n_out % cfg.block_n == 0
            assert cfg.shared_bytes(gated, fp8=True) + plans.STATIC_SHARED_BYTES <= 227 * 1024
            name = cfg.name_expression(_checks.BFLOAT16, gated, fp8=0)
            assert name.endswith(",0,1>" if cfg.kernel == plans.PERSISTENT else ",0,false>") and name in plans.name_expressions(cfg.source, _checks.BFLOAT16, gated, fp8=0)
        if (hidden, inter) == (7168, 2048):
            seen.add(p)
    expected = {plans.PERSISTENT_FP8} if cc == 90 else {plans.TINY, plans.SMALL, plans.MEDIUM_32}
    assert seen == expected
    with plans.forced(plans.PERSISTENT_96), pytest.raises(ValueError, match="FP8 weights run their own plans"):
        plans.plan(64, 8, 256, 7168, 2048, cc, 227 * 1024, fp8=True)
    with pytest.raises(ValueError, match="not on slot_gemm"):
        plans.BY_SLOT.gate_up.name_expression(_checks.BFLOAT16, True, fp8=0)
    with pytest.raises(ValueError, match="tiles of 64 or 128 slots"):
        plans.PERSISTENT_96.gate_up.name_expression(_checks.BFLOAT16, True, fp8=0)
    with pytest.raises(ValueError, match="has 256 columns"):
        dataclasses.replace(plans.PERSISTENT_FP8.down, block_n=128).name_expression(_checks.BFLOAT16, False, fp8=0)
    with pytest.raises(ValueError, match="tiles of 64 or 128 slots"):
        plans.PERSISTENT_160.down.name_expression(_checks.BFLOAT16, False, fp8=0)


@pytest.mark.parametrize("chosen", plans.FP8_TRIAL_PLANS)
def test_fp8_trial_plans_run_only_when_forced_and_only_fp8(chosen):
    """A trial plan is forced only (plan() never returns it), runs w8a8 on sm_90 only, and compiles
    in a module of its own, outside name_expressions."""
    shape = (64, 8, 256, 7168, 2048)
    assert all(plans.plan(t, 8, 256, 7168, 2048, 90, 227 * 1024, fp8=True) not in plans.FP8_TRIAL_PLANS
               for t in (1, 64, 4096))
    with plans.forced(chosen):
        assert plans.plan(*shape, 90, 227 * 1024, fp8=True) == chosen
        with pytest.raises(ValueError, match="FP8_TRIAL_PLANS run FP8 weights"):
            plans.plan(*shape, 90, 227 * 1024)
        with pytest.raises(ValueError, match="weight-only FP8 runs its own plans"):
            plans.plan(*shape, 90, 227 * 1024, fp8=True, weight_only=True)
        with pytest.raises(ValueError, match="compute capability 9.0"):
            plans.plan(*shape, 89, 99 * 1024, fp8=True)
    trial_configs = {(cfg, gated) for cfg, gated in ((chosen.gate_up, True), (chosen.down, False))
                     if cfg != (plans.PERSISTENT_FP8.gate_up if gated else plans.PERSISTENT_FP8.down)}
    assert trial_configs
    for cfg, gated in trial_configs:
        name = cfg.name_expression(_checks.BFLOAT16, gated, fp8=0)
        assert name.endswith(f",0,{cfg.accumulators}>")
        assert name not in plans.name_expressions(cfg.source, _checks.BFLOAT16, gated, fp8=0)
        if cfg.accumulators != 1:
            with pytest.raises(ValueError, match="two accumulators run FP8 operands"):
                cfg.name_expression(_checks.BFLOAT16, gated)


@pytest.mark.parametrize("cc", [80, 86, 89, 90])
def test_weight_only_fp8_takes_the_mma_plans_everywhere(cc):
    """w8a16: the mma.sync FP8 plans on every GPU, sm_90 too, with two K-tiles of A beside each weight
    K-tile in a stage (cut to the GPU's shared memory), each config one of name_expressions(weight_only=)."""
    seen = set()
    for tokens, (hidden, inter) in itertools.product((1, 3, 16, 64, 256, 1024, 8192), ((7168, 2048), (384, 640))):
        p = plans.plan(tokens, 8, 256, hidden, inter, cc, SHARED_LIMITS[cc], fp8=True, weight_only=True)
        for cfg, gated in ((p.gate_up, True), (p.down, False)):
            assert cfg.kernel == plans.MMA
            weight_rows = 2 * cfg.block_n if gated else cfg.block_n
            smem = cfg.shared_bytes(gated, True, weight_only=True)
            assert smem == cfg.stages * cfg.k_group * (2 * cfg.block_m + weight_rows) * 128
            assert smem + plans.STATIC_SHARED_BYTES <= SHARED_LIMITS[cc]
            name = cfg.name_expression(_checks.BFLOAT16, gated, fp8=1, weight_only=True)
            assert name.endswith(",1,true>")
            if cc in (80, 90):  # the 99 KiB GPUs cut some stages: modules of their own
                assert name in plans.name_expressions(cfg.source, _checks.BFLOAT16, gated, fp8=1, weight_only=True)
        if (hidden, inter) == (7168, 2048):
            seen.add(p)
    if cc in (80, 90):
        assert seen == {plans.fitted(p, 7168, 2048, SHARED_LIMITS[cc], True, True) for p in plans.WEIGHT_ONLY_PLANS}
    with plans.forced(plans.PERSISTENT_FP8), pytest.raises(ValueError, match="weight-only FP8 runs its own plans"):
        plans.plan(64, 8, 256, 7168, 2048, cc, SHARED_LIMITS[cc], fp8=True, weight_only=True)
    with pytest.raises(ValueError, match="weight-only FP8 runs on expert_gemm with FP8 weights"):
        plans.PERSISTENT_FP8.gate_up.name_expression(_checks.BFLOAT16, True, fp8=0, weight_only=True)
    with pytest.raises(ValueError, match="weight-only FP8 runs on expert_gemm with FP8 weights"):
        plans.TINY.gate_up.name_expression(_checks.BFLOAT16, True, weight_only=True)


def test_fp8_scales_widen_only_the_persistent_stages():
    cfg = plans.PERSISTENT_FP8.down
    assert cfg.shared_bytes(False, fp8=True) == cfg.shared_bytes(False) + cfg.stages * cfg.block_m * 4
    assert plans.MEDIUM_32.down.shared_bytes(False, fp8=True) == plans.MEDIUM_32.down.shared_bytes(False)


def test_forced_plan_is_used_and_restored():
    """plans.forced: inside the block plan() returns the forced plan fitted to H and I; after it,
    the heuristic again. A persistent plan on a GPU without wgmma is refused."""
    assert plans.plan(1, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90]).by_slot
    with plans.forced(plans.LARGE) as chosen:
        assert chosen is plans.LARGE
        got = plans.plan(1, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90])
        assert got == plans.fitted(plans.LARGE, 4096, 1024, SHARED_LIMITS[90])
        with plans.forced(plans.PERSISTENT_96):
            with pytest.raises(ValueError, match="^chosen: .*9.0"):
                plans.plan(1, 8, 256, 4096, 1024, 80, SHARED_LIMITS[80])
        assert plans.plan(1, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90]) == got
    assert plans.plan(1, 8, 256, 4096, 1024, 90, SHARED_LIMITS[90]).by_slot
    with pytest.raises(TypeError, match="^chosen: "), plans.forced("LARGE"):
        pass


# GPU: each plan forced on problems where T would pick another.


def gpu_has_wgmma():
    import cupy

    return _compile.compute_capability(cupy.cuda.Device().id) == plans.WGMMA_COMPUTE_CAPABILITY


def runnable_plans():
    """The indices of PLANS this GPU runs (the persistent kernel needs sm_90)."""
    return [i for i, p in enumerate(plans.PLANS) if p.gate_up.kernel != plans.PERSISTENT or gpu_has_wgmma()]


def forced_forward(chosen, problem, args=None, **kwargs):
    import cupy

    with plans.forced(chosen):
        return run_fused(cupy, problem, args, **kwargs)


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("plan_index", range(len(plans.PLANS)))
@pytest.mark.parametrize("tokens,routing", [(37, "sparse"), (700, "uniform"), (700, "one")])
def test_every_plan_matches_reference(tokens, routing, plan_index):
    """Each tile plan, whatever T would choose: experts of every size, a chunk of each pass count."""
    if plan_index not in runnable_plans():
        pytest.skip("the persistent kernel needs sm_90")
    hidden, inter = SIZES[8]
    problem = random_problem(np.random.default_rng([tokens, plan_index]), tokens, hidden, 8, inter, 2, routing=routing)
    check_close(forced_forward(plans.PLANS[plan_index], problem), problem)


@pytest.mark.gpu
@pytest.mark.parametrize("plan_index", [i for i, p in enumerate(plans.PLANS) if max(p.gate_up.k_group, p.down.k_group) > 1])
@pytest.mark.parametrize("tokens,routing", [(37, "sparse"), (300, "uniform")])
@pytest.mark.parametrize("hidden,inter", [(320, 192), (320, 256), (512, 192)])
def test_two_k_tile_stages_with_an_odd_k(tokens, routing, hidden, inter, plan_index):
    """H = 320 and I = 192 are 5 and 3 K-tiles: the last stage of two K-tiles holds one. The persistent
    kernel's tiles divide I = 256 (gate/up, K = H = 320) and H = 512 (down) only, so each runs one GEMM
    there."""
    if plan_index not in runnable_plans():
        pytest.skip("the persistent kernel needs sm_90")
    rng = np.random.default_rng([tokens, plan_index, hidden, inter])
    problem = random_problem(rng, tokens, hidden, 8, inter, 2, routing=routing)
    check_close(forced_forward(plans.PLANS[plan_index], problem), problem)


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("tokens,top_k,routing", [(1, 1, "uniform"), (1, 3, "uniform"), (1, 8, "uniform"),
                                                  (2, 8, "sparse"), (5, 3, "one"), (8, 8, "sparse"),
                                                  (8, 8, "all")])
def test_by_slot_gives_the_dispatch_paths_bits(tokens, top_k, routing, id_dtype):
    """The plan without a dispatch against the TINY plan on the same problem at E = 256: the same
    bits, with an id of -1, an id out of range (unchecked), an expert repeated within a token,
    experts shared by tokens, and ("all") every slot on one expert, whose 64 slots are four tiles."""
    experts = 256
    hidden, inter = SIZES[experts]
    rng = np.random.default_rng([tokens, top_k, np.dtype(id_dtype).itemsize])
    x, w13, w2, ids, weights = random_problem(rng, tokens, hidden, experts, inter, top_k,
                                              routing="uniform" if routing == "all" else routing)
    ids = ids.astype(id_dtype)
    if routing == "all":
        ids[:] = 7
    elif top_k > 2:
        ids[0, 0], ids[0, -1] = -1, experts + 3
        ids[0, 1] = ids[0, 2]
    problem = (x, w13, w2, ids, weights)
    args = to_gpu(*problem)
    by_slot = forced_forward(plans.BY_SLOT, problem, args, check_ids=False)
    tiny = forced_forward(plans.TINY, problem, args, check_ids=False)
    check_close(by_slot, (x, w13, w2, np.where((ids >= 0) & (ids < experts), ids, -1), weights))
    np.testing.assert_array_equal(host_bits(by_slot), host_bits(tiny))


@pytest.mark.gpu
def test_experts_of_every_size_give_the_same_bits_on_every_plan():
    """Experts of 1 to 156 rows, one in each band of 8 (k = 1): every plan matches the reference and
    gives the same bits, whatever its tiles and the MMA width it picks for each chunk."""
    experts, step = 20, 8
    counts = [step * e + 1 + e % step for e in range(experts)]  # ceil(count / 8) = e + 1
    rng = np.random.default_rng(160)
    hidden, inter = SIZES[8]
    x, w13, w2, _, weights = random_problem(rng, sum(counts), hidden, experts, inter, 1)
    ids = rng.permutation(np.repeat(np.arange(experts, dtype=np.int32), counts))[:, None]
    problem = (x, w13, w2, ids, weights)
    bits = {}
    for index in runnable_plans():
        got = forced_forward(plans.PLANS[index], problem)
        check_close(got, problem)
        bits[index] = host_bits(got)
    for index, got in bits.items():
        np.testing.assert_array_equal(got, bits[0], err_msg=f"plan {index} against plan 0")


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("blocks", [None, 3])
@pytest.mark.parametrize("routing", ["uniform", "one"])
def test_a_standby_plan_claims_its_tiles(routing, blocks):
    """T = 256, E = 64, k = 2 (8 rows per expert): the 16-row tiles, with the 160-slot plan standing
    by, run from a grid of one wave (or of 3 blocks, each claiming many tiles). Whichever plan the
    dispatch takes, the bits are those of the 16-row tiles alone, one tile per block."""
    import cupy

    if not gpu_has_wgmma():
        pytest.skip("plans stand by on sm_90 only")
    hidden, inter = SIZES[64]
    problem = random_problem(np.random.default_rng([256, routing == "one"]), 256, hidden, 64, inter, 2,
                             routing=routing)
    args = to_gpu(*problem)
    layer = cupymoe.MoE(args[1], args[2])
    standing_by = dataclasses.replace(plans.SMALL, skewed=plans.PERSISTENT_160, standby_blocks=blocks)
    with plans.forced(standing_by):
        got = layer(args[0], args[3], args[4], out=poison(cupy.empty(args[0].shape, args[0].dtype)))
    workspace = layer._workspaces[(256, 2)][0]
    assert workspace.plan.gate_up.kernel == plans.MMA and workspace.plan.skewed is not None
    assert workspace.dispatch.chosen_plan(gated=False) == (routing == "one")
    check_close(got, problem)
    alone = forced_forward(plans.SMALL, problem, args)
    np.testing.assert_array_equal(host_bits(alone), host_bits(got))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [320, 2500])  # one-block and three-kernel dispatch
@pytest.mark.parametrize("routing", ["uniform", "one"])
def test_skewed_routing_takes_the_skewed_plan(tokens, routing):
    """E = 64, k = 2 (10 and 78 rows per expert): T's plan has a 160-slot plan for skewed routing, which
    the dispatch takes when one expert has every token. Either way the bits are T's plan's alone."""
    import cupy

    if not gpu_has_wgmma():
        pytest.skip("the skewed plan is the persistent kernel's (sm_90)")
    hidden, inter = SIZES[64]
    problem = random_problem(np.random.default_rng([tokens, routing == "one"]), tokens, hidden, 64, inter, 2,
                             routing=routing)
    args = to_gpu(*problem)
    layer = cupymoe.MoE(args[1], args[2])
    got = layer(args[0], args[3], args[4], out=poison(cupy.empty(args[0].shape, args[0].dtype)))
    workspace = layer._workspaces[(tokens, 2)][0]
    assert workspace.plan.skewed is not None
    for gated in (True, False):
        assert workspace.dispatch.chosen_plan(gated) == (routing == "one")
    check_close(got, problem)
    alone = forced_forward(dataclasses.replace(workspace.plan, skewed=None), problem, args)
    np.testing.assert_array_equal(host_bits(alone), host_bits(got))


@pytest.mark.gpu
def test_plans_fit_this_gpu():
    """The plans for this GPU's shared memory fit it."""
    import cupy

    device_id = cupy.cuda.Device().id
    limit = _compile.shared_memory_limit(device_id)
    capability = _compile.compute_capability(device_id)
    assert limit >= plans.SHARED_LIMIT_SMALLEST
    for tokens in (1, 64, 512, 2048, 8192):
        p = plans.plan(tokens, 8, 256, 4096, 1024, capability, limit)
        for cfg, gated in ((p.gate_up, True), (p.down, False)):
            assert cfg.shared_bytes(gated) + plans.STATIC_SHARED_BYTES <= limit
