"""GPU tier for the layer: fused_experts and MoE on the GPU against the NumPy reference and the oracle.

Every output buffer is filled with NaN before a run, so a row the kernels fail to write shows
up as an error. Sizes are kept moderate so the file runs in well under a minute on one GPU.
"""
import dataclasses
import os

import numpy as np
import pytest

import cupymoe
from cupymoe import _compile, experts as experts_module, reference
from helpers import BF16, host_bits, oracle, poison, random_problem, rel_l2, to_gpu

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

FP16 = np.dtype(np.float16)
REF_TOL = 2e-3  # vs cupymoe.reference: same numerics, only the fp32 summation order differs
ORACLE_TOL = 1e-2  # vs the float64 oracle: h and expert outputs are rounded to bf16/fp16
ORACLE_TOKENS = 4  # the oracle is a Python loop: compare it on the first few tokens only
SIZES = {8: (512, 256), 64: (256, 128), 256: (128, 64)}  # E -> (H, I): more experts, smaller ones
EXPERTS_TOP_K = [(8, 1), (8, 2), (8, 8), (64, 1), (64, 2), (64, 8), (256, 1), (256, 2), (256, 8)]


def run_fused(problem, args=None, **kwargs):
    """fused_experts on ``args`` (default: GPU copies of the host ``problem``) into a NaN-filled out=."""
    x = problem[0]
    out = poison(cupy.empty(x.shape, x.dtype))
    got = cupymoe.fused_experts(*(to_gpu(*problem) if args is None else args), out=out, **kwargs)
    assert got is out
    return got


def check_close(got, problem):
    """A GPU result against the reference on the host ``problem`` and, on its first rows, the oracle."""
    x, w13, w2, ids, weights = problem
    got = cupy.asnumpy(got)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = reference.fused_experts(x, w13, w2, ids, weights, np.empty_like(x))
    assert rel_l2(got, want) < REF_TOL
    n = ORACLE_TOKENS
    assert rel_l2(got[:n], oracle(x[:n], w13, w2, ids[:n], weights[:n])) < ORACLE_TOL


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("experts,top_k", EXPERTS_TOP_K)
@pytest.mark.parametrize("tokens", [0, 1, 3, 64, 1000])
def test_matches_reference_and_is_deterministic(tokens, experts, top_k, dtype):
    """fused_experts three times and MoE twice: all close to the reference and bitwise equal."""
    hidden, inter = SIZES[experts]
    rng = np.random.default_rng([tokens, experts, top_k, int(dtype == BF16)])
    problem = random_problem(rng, tokens, hidden, experts, inter, top_k, dtype)
    args = to_gpu(*problem)
    runs = [run_fused(problem, args) for _ in range(3)]
    check_close(runs[0], problem)

    layer = cupymoe.MoE(args[1], args[2])
    first = layer(args[0], args[3], args[4])
    poison(first)
    again = layer(args[0], args[3], args[4])
    assert again.data.ptr == first.data.ptr  # the layer-owned output is reused for the same T
    runs.append(again)
    want = host_bits(runs[0])
    for run in runs[1:]:
        np.testing.assert_array_equal(host_bits(run), want)


@pytest.mark.parametrize("hidden,inter", [(64, 64), (64, 512), (512, 64), (128, 256), (256, 128), (512, 512)])
@pytest.mark.parametrize("tokens", [3, 200])
def test_hidden_and_intermediate_sizes(tokens, hidden, inter):
    problem = random_problem(np.random.default_rng([tokens, hidden, inter]), tokens, hidden, 8, inter, 2)
    check_close(run_fused(problem), problem)


@pytest.mark.parametrize("routing", ["one", "sparse"])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 8), (256, 8)])
@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_skewed_routing(tokens, experts, top_k, routing):
    """Every token on expert 0 ("one"), or half the experts without tokens ("sparse")."""
    hidden, inter = SIZES[experts]
    rng = np.random.default_rng([tokens, experts, top_k, routing == "one"])
    problem = random_problem(rng, tokens, hidden, experts, inter, top_k, routing=routing)
    check_close(run_fused(problem), problem)


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (3, 8), (64, 8), (1000, 8)])
def test_every_slot_on_one_expert(tokens, top_k):
    """All k ids of every token are the same expert: repeated ids within a token count k times."""
    rng = np.random.default_rng([tokens, top_k])
    x, w13, w2, _, weights = random_problem(rng, tokens, 256, 64, 128, top_k)
    problem = (x, w13, w2, np.full((tokens, top_k), 63, np.int32), weights)
    check_close(run_fused(problem), problem)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("tokens", [3, 64, 1000])
def test_minus_one_ids(tokens, id_dtype):
    """Slots with id -1 add nothing; a token whose ids are all -1 gets an exact zero row."""
    rng = np.random.default_rng([tokens, np.dtype(id_dtype).itemsize])
    x, w13, w2, ids, weights = random_problem(rng, tokens, 256, 64, 128, 8)
    ids = np.where(rng.random(ids.shape) < 0.3, -1, ids).astype(id_dtype)
    ids[0] = -1
    problem = (x, w13, w2, ids, weights)
    got = run_fused(problem)
    check_close(got, problem)
    assert (cupy.asnumpy(got[0]).astype(np.float32) == 0).all()


@pytest.mark.parametrize("bad", [8, 300, -5, -2])
def test_out_of_range_ids_raise(bad):
    x, w13, w2, ids, weights = to_gpu(*random_problem(np.random.default_rng(0), 16, 128, 8, 64, 2))
    ids[3, 1] = bad
    with pytest.raises(ValueError, match="topk_ids"):
        cupymoe.fused_experts(x, w13, w2, ids, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        cupymoe.MoE(w13, w2)(x, ids, weights)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_out_of_range_ids_unchecked_count_as_minus_one(id_dtype):
    """With check_ids=False ids outside [-1, E) give the same bits as -1 ids (int64 ids are not truncated)."""
    experts = 64
    rng = np.random.default_rng(np.dtype(id_dtype).itemsize)
    x, w13, w2, ids, weights = random_problem(rng, 300, 256, experts, 128, 8)
    info = np.iinfo(id_dtype)
    bad_values = [experts, 300, -5, -2, info.max, info.min]
    if info.bits == 64:
        bad_values += [2**33, -(2**40)]  # both would alias expert 0 if truncated to 32 bits
    bad = rng.random(ids.shape) < 0.2
    ids = ids.astype(id_dtype)
    as_minus_one = np.where(bad, -1, ids).astype(id_dtype)
    ids[bad] = rng.choice(bad_values, int(bad.sum()))
    problem = (x, w13, w2, as_minus_one, weights)
    got = run_fused((x, w13, w2, ids, weights), check_ids=False)
    check_close(got, problem)
    np.testing.assert_array_equal(host_bits(got), host_bits(run_fused(problem)))
    layer = cupymoe.MoE(*to_gpu(w13, w2))
    args = to_gpu(x, ids, weights)
    np.testing.assert_array_equal(host_bits(layer(*args, check_ids=False)), host_bits(got))


def test_zero_tokens():
    x, w13, w2, ids, weights = to_gpu(*random_problem(np.random.default_rng(0), 0, 128, 8, 64, 2))
    for out in (cupymoe.fused_experts(x, w13, w2, ids, weights), cupymoe.MoE(w13, w2)(x, ids, weights)):
        assert isinstance(out, cupy.ndarray)
        assert out.shape == (0, 128) and out.dtype == BF16


def test_non_default_stream():
    """Everything issued on a non-blocking stream gives the same bits as on the default stream."""
    problem = random_problem(np.random.default_rng(0), 300, 256, 64, 128, 8)
    want = host_bits(run_fused(problem))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        args = to_gpu(*problem)
        checked = run_fused(problem, args)
        layer = cupymoe.MoE(args[1], args[2])
        unchecked = layer(args[0], args[3], args[4], out=poison(cupy.empty_like(args[0])), check_ids=False)
    stream.synchronize()
    np.testing.assert_array_equal(host_bits(checked), want)
    np.testing.assert_array_equal(host_bits(unchecked), want)


@pytest.mark.parametrize("tokens", [64, 5, 1])  # T = 5 and 1 go by slot, without the dispatch
def test_cuda_graph_replay_sees_new_inputs(tokens):
    """Capture MoE once, then replay it on new x, ids (one of them -1) and weights copied into the
    same buffers. On sm_90 the replay at T = 64 with every token on one expert runs the skewed
    plan, picked on the GPU."""
    hidden, experts, inter, top_k = 256, 64, 128, 8
    problem = random_problem(np.random.default_rng(0), tokens, hidden, experts, inter, top_k)
    w13, w2 = problem[1], problem[2]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        args = to_gpu(*problem)
        x, ids, weights = args[0], args[3], args[4]
        layer = cupymoe.MoE(args[1], args[2])
        layer(x, ids, weights, check_ids=False)  # warm-up: compiles the kernels, allocates the workspace
        stream.begin_capture()
        out = layer(x, ids, weights, check_ids=False)
        graph = stream.end_capture()
        for seed, routing in ((1, "uniform"), (2, "one")):
            new_x, _, _, new_ids, new_weights = random_problem(
                np.random.default_rng(seed), tokens, hidden, experts, inter, top_k, routing=routing
            )
            new_ids[-1, -1] = -1
            x[...] = cupy.asarray(new_x)
            ids[...] = cupy.asarray(new_ids)
            weights[...] = cupy.asarray(new_weights)
            poison(out)
            graph.launch(stream)
            stream.synchronize()
            check_close(out, (new_x, w13, w2, new_ids, new_weights))
            dispatch = layer._workspaces[(tokens, top_k)][0].dispatch
            assert (dispatch is None) == (tokens * top_k <= experts_module.SLOT_SLOTS)
            if dispatch is not None and _compile.compute_capability(cupy.cuda.Device().id) == 90:
                assert int(dispatch.tiles_gate_up[-1]) == (routing == "one")


def test_memory_stays_bounded_as_t_varies_and_captured_workspaces_stay():
    """With no room for spare workspaces, calls at several T keep only the latest call's workspace
    and the captured one. The graph still replays right, and an output held from a dropped
    workspace keeps its values: the next call with its T gets a new buffer. free_workspaces
    drops them all, and the layer still runs."""
    host = random_problem(np.random.default_rng(7), 64, 256, 64, 128, 8)
    first = lambda tokens: (host[0][:tokens], host[1], host[2], host[3][:tokens], host[4][:tokens])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, w13, w2, ids, weights = to_gpu(*host)
        layer = cupymoe.MoE(w13, w2)
        layer._workspaces.spare_bytes = 0
        layer(x[:5], ids[:5], weights[:5], check_ids=False)  # warm-up
        stream.begin_capture()
        captured = layer(x[:5], ids[:5], weights[:5], check_ids=False)
        graph = stream.end_capture()
        held = layer(x[:40], ids[:40], weights[:40])
        held_bits = host_bits(held)
        for tokens in (1, 3, 40, 64):
            check_close(layer(x[:tokens], ids[:tokens], weights[:tokens]), first(tokens))
        assert len(layer._workspaces) == 2 and (5, 8) in layer._workspaces and (64, 8) in layer._workspaces
        np.testing.assert_array_equal(host_bits(held), held_bits)
        poison(captured)
        graph.launch(stream)
        stream.synchronize()
        check_close(captured, first(5))
        layer.free_workspaces()
        assert len(layer._workspaces) == 0
        check_close(layer(x[:5], ids[:5], weights[:5]), first(5))


def test_check_ids_refused_in_graph_capture():
    """check_ids=True synchronises, so it must raise ValueError under capture instead of breaking it."""
    x, w13, w2, ids, weights = to_gpu(*random_problem(np.random.default_rng(0), 16, 128, 8, 64, 2))
    layer = cupymoe.MoE(w13, w2)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        layer(x, ids, weights, check_ids=False)
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="check_ids"):
                layer(x, ids, weights)
        finally:
            stream.end_capture()


def test_torch_inputs():
    """torch CUDA tensors go in zero-copy; the CuPy result goes back to torch through DLPack."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    problem = random_problem(np.random.default_rng(0), 64, 256, 64, 128, 8)
    x, w13, w2, ids, weights = problem

    def to_bf16(a):
        return torch.from_numpy(a.astype(np.float32)).to("cuda", torch.bfloat16)

    args = (to_bf16(x), to_bf16(w13), to_bf16(w2),
            torch.from_numpy(ids).cuda(), torch.from_numpy(weights).cuda())
    torch.cuda.synchronize()
    got = run_fused(problem, args)
    check_close(got, problem)
    layer = cupymoe.MoE(args[1], args[2])
    np.testing.assert_array_equal(host_bits(layer(args[0], args[3].long(), args[4])), host_bits(got))
    back = torch.from_dlpack(got)
    assert back.is_cuda and back.dtype == torch.bfloat16 and tuple(back.shape) == x.shape


def test_jax_inputs():
    """JAX GPU arrays go in through DLPack; the CuPy result goes back to JAX the same way."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend")
    problem = random_problem(np.random.default_rng(0), 64, 256, 64, 128, 8)
    args = jax.block_until_ready(tuple(jax.device_put(jnp.asarray(a), device) for a in problem))
    got = run_fused(problem, args)
    check_close(got, problem)
    back = jnp.from_dlpack(got)
    assert back.dtype == jnp.bfloat16 and back.shape == problem[0].shape


def check_plan(chosen, hidden, inter, tokens, routing, seed, monkeypatch):
    """The layer on a random problem (E = 8, k = 2) with the tile plan ``chosen``, whatever T would pick."""
    fitted = experts_module.fitted(chosen, hidden, inter, _compile.shared_memory_limit(cupy.cuda.Device().id))
    monkeypatch.setattr(experts_module, "plan", lambda *args: fitted)
    problem = random_problem(np.random.default_rng(seed), tokens, hidden, 8, inter, 2, routing=routing)
    check_close(run_fused(problem), problem)


@pytest.mark.parametrize("plan_index", range(len(experts_module.PLANS)))
@pytest.mark.parametrize("tokens,routing", [(37, "sparse"), (700, "uniform"), (700, "one")])
def test_every_plan_matches_reference(tokens, routing, plan_index, monkeypatch):
    """Each tile plan, whatever T would choose: experts of every size, a chunk of each pass count."""
    chosen = experts_module.PLANS[plan_index]
    if chosen.gate_up.kernel == experts_module.PERSISTENT and _compile.compute_capability(cupy.cuda.Device().id) != 90:
        pytest.skip("the persistent kernel needs sm_90")
    check_plan(chosen, *SIZES[8], tokens, routing, [tokens, plan_index], monkeypatch)


@pytest.mark.parametrize("plan_index", [i for i, p in enumerate(experts_module.PLANS)
                                        if max(p.gate_up.k_group, p.down.k_group) > 1])
@pytest.mark.parametrize("tokens,routing", [(37, "sparse"), (300, "uniform")])
@pytest.mark.parametrize("hidden,inter", [(320, 192), (320, 256), (512, 192)])
def test_two_k_tile_stages_with_an_odd_k(tokens, routing, hidden, inter, plan_index, monkeypatch):
    """H = 320 and I = 192 are 5 and 3 K-tiles: the last stage of two K-tiles holds one. The persistent
    kernel's tiles divide I = 256 (gate/up, K = H = 320) and H = 512 (down) only, so each runs one GEMM
    there."""
    check_plan(experts_module.PLANS[plan_index], hidden, inter, tokens, routing, [tokens, plan_index, hidden, inter],
               monkeypatch)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("tokens,top_k,routing", [(1, 1, "uniform"), (1, 3, "uniform"), (1, 8, "uniform"),
                                                  (2, 8, "sparse"), (5, 3, "one"), (8, 8, "sparse"),
                                                  (8, 8, "all")])
def test_by_slot_gives_the_dispatch_paths_bits(tokens, top_k, routing, id_dtype, monkeypatch):
    """The plan without a dispatch, forced, against the TINY plan on the same problem at E = 256: the
    same bits, with an id of -1, an id out of range (unchecked), an expert repeated within a token,
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
    limit = _compile.shared_memory_limit(cupy.cuda.Device().id)
    runs = {}
    for name in ("_SLOT", "_TINY"):
        chosen = experts_module.fitted(getattr(experts_module, name), hidden, inter, limit)
        monkeypatch.setattr(experts_module, "plan", lambda *args, p=chosen: p)
        runs[name] = run_fused(problem, args, check_ids=False)
    check_close(runs["_SLOT"], (x, w13, w2, np.where((ids >= 0) & (ids < experts), ids, -1), weights))
    np.testing.assert_array_equal(host_bits(runs["_SLOT"]), host_bits(runs["_TINY"]))


def test_experts_of_every_size_give_the_same_bits_on_every_plan(monkeypatch):
    """Experts of 1 to 156 rows, one in each band of 8 (k = 1): every plan matches the reference and
    gives the same bits, whatever its tiles and the MMA width it picks for each chunk."""
    experts, step = 20, 8
    counts = [step * e + 1 + e % step for e in range(experts)]  # ceil(count / 8) = e + 1
    rng = np.random.default_rng(160)
    hidden, inter = SIZES[8]
    x, w13, w2, _, weights = random_problem(rng, sum(counts), hidden, experts, inter, 1)
    ids = rng.permutation(np.repeat(np.arange(experts, dtype=np.int32), counts))[:, None]
    problem = (x, w13, w2, ids, weights)
    limit = _compile.shared_memory_limit(cupy.cuda.Device().id)
    bits = {}
    for index, chosen in enumerate(experts_module.PLANS):
        if chosen.gate_up.kernel == experts_module.PERSISTENT and _compile.compute_capability(cupy.cuda.Device().id) != 90:
            continue
        fitted = experts_module.fitted(chosen, hidden, inter, limit)
        monkeypatch.setattr(experts_module, "plan", lambda *args, p=fitted: p)
        got = run_fused(problem)
        check_close(got, problem)
        bits[index] = host_bits(got)
    for index, got in bits.items():
        np.testing.assert_array_equal(got, bits[0], err_msg=f"plan {index} against plan 0")


@pytest.mark.parametrize("blocks", [None, 3])
@pytest.mark.parametrize("routing", ["uniform", "one"])
def test_a_standby_plan_claims_its_tiles(routing, blocks, monkeypatch):
    """T = 256, E = 64, k = 2 (8 rows per expert): the 16-row tiles, with the 160-slot plan standing
    by, run from a grid of one wave (or of 3 blocks, each claiming many tiles). Whichever plan the
    dispatch takes, the bits are those of the 16-row tiles alone, one tile per block."""
    if _compile.compute_capability(cupy.cuda.Device().id) != 90:
        pytest.skip("plans stand by on sm_90 only")
    if blocks is not None:
        monkeypatch.setattr(experts_module, "_one_wave", lambda *args: blocks)
    hidden, inter = SIZES[64]
    problem = random_problem(np.random.default_rng([256, routing == "one"]), 256, hidden, 64, inter, 2,
                             routing=routing)
    args = to_gpu(*problem)
    layer = cupymoe.MoE(args[1], args[2])
    got = layer(args[0], args[3], args[4], out=poison(cupy.empty(args[0].shape, args[0].dtype)))
    workspace = layer._workspaces[(256, 2)][0]
    assert workspace.plan.gate_up.kernel == experts_module.MMA and workspace.plan.skewed is not None
    assert int(workspace.dispatch.tiles_down[-1]) == (routing == "one")  # the plan the dispatch chose
    check_close(got, problem)
    alone = dataclasses.replace(workspace.plan, skewed=None)
    monkeypatch.setattr(experts_module, "plan", lambda *args: alone)
    np.testing.assert_array_equal(host_bits(run_fused(problem, args)), host_bits(got))


@pytest.mark.parametrize("tokens", [320, 2500])  # one-block and three-kernel dispatch
@pytest.mark.parametrize("routing", ["uniform", "one"])
def test_skewed_routing_takes_the_skewed_plan(tokens, routing, monkeypatch):
    """E = 64, k = 2 (10 and 78 rows per expert): T's plan has a 160-slot plan for skewed routing, which
    the dispatch takes when one expert has every token. Either way the bits are T's plan's alone."""
    if _compile.compute_capability(cupy.cuda.Device().id) != 90:
        pytest.skip("the skewed plan is the persistent kernel's (sm_90)")
    hidden, inter = SIZES[64]
    problem = random_problem(np.random.default_rng([tokens, routing == "one"]), tokens, hidden, 64, inter, 2,
                             routing=routing)
    args = to_gpu(*problem)
    layer = cupymoe.MoE(args[1], args[2])
    got = layer(args[0], args[3], args[4], out=poison(cupy.empty(args[0].shape, args[0].dtype)))
    workspace = layer._workspaces[(tokens, 2)][0]
    assert workspace.plan.skewed is not None
    for tiles in (workspace.dispatch.tiles_gate_up, workspace.dispatch.tiles_down):
        assert int(tiles[-1]) == (routing == "one")  # the plan the dispatch chose
    check_close(got, problem)
    alone = dataclasses.replace(workspace.plan, skewed=None)
    monkeypatch.setattr(experts_module, "plan", lambda *args: alone)
    np.testing.assert_array_equal(host_bits(run_fused(problem, args)), host_bits(got))
