"""The forward (fused_experts and MoE: dispatch, expert GEMMs and combine together) on the NumPy and
the CuPy backend, one test body for both.

Every output is poisoned (NaN) before a run, so a row the kernels fail to write shows up. Results
are compared with cupymoe's NumPy reference (exact on NumPy) and, on their first rows, with the
float64 oracle of tests/helpers.py.
"""
import os

import numpy as np
import pytest

import cupymoe
from cupymoe import _compile, plans, reference
from helpers import (BF16, DTYPES, ID_DTYPES, ORACLE_TOKENS, ORACLE_TOL, REFERENCE_TOL, as_numpy, host_bits,
                     oracle, out_of_range_ids, poison, random_problem, rel_l2, to_gpu, to_xp)

SIZES = {8: (512, 256), 64: (256, 128), 256: (128, 64)}  # E -> (H, I): more experts, smaller ones
EXPERTS_TOP_K = [(8, 1), (8, 2), (8, 8), (64, 1), (64, 2), (64, 8), (256, 1), (256, 2), (256, 8)]


def run_fused(xp, problem, args=None, **kwargs):
    """fused_experts on ``args`` (default: ``xp`` copies of the host ``problem``) into a poisoned out=."""
    x = problem[0]
    out = poison(xp.empty(x.shape, x.dtype))
    got = cupymoe.fused_experts(*(to_xp(xp, *problem) if args is None else args), out=out, **kwargs)
    assert got is out
    return got


def check_close(got, problem):
    """A result against the reference on the host ``problem`` and, on its first rows, the oracle."""
    x, w13, w2, ids, weights = problem
    got = as_numpy(got)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = reference.fused_experts(x, w13, w2, ids, weights, np.empty_like(x))
    assert rel_l2(got, want) < REFERENCE_TOL
    n = ORACLE_TOKENS
    assert rel_l2(got[:n], oracle(x[:n], w13, w2, ids[:n], weights[:n])) < ORACLE_TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k", EXPERTS_TOP_K)
@pytest.mark.parametrize("tokens", [0, 1, 3, 64, 1000])
def test_matches_reference_and_is_deterministic(xp, tokens, experts, top_k, dtype):
    """fused_experts three times and MoE twice: all close to the reference and bitwise equal."""
    hidden, inter = SIZES[experts]
    rng = np.random.default_rng([tokens, experts, top_k, int(dtype == BF16)])
    problem = random_problem(rng, tokens, hidden, experts, inter, top_k, dtype)
    args = to_xp(xp, *problem)
    runs = [run_fused(xp, problem, args) for _ in range(3)]
    check_close(runs[0], problem)

    layer = cupymoe.MoE(args[1], args[2])
    first = layer(args[0], args[3], args[4])
    poison(first)
    again = layer(args[0], args[3], args[4])
    if xp is not np:
        assert again.data.ptr == first.data.ptr  # the layer-owned output is reused for the same T
    runs.append(again)
    for run in runs[1:]:
        np.testing.assert_array_equal(host_bits(run), host_bits(runs[0]))


@pytest.mark.sanitize
@pytest.mark.parametrize("hidden,inter", [(64, 64), (64, 512), (512, 64), (128, 256), (256, 128), (512, 512)])
@pytest.mark.parametrize("tokens", [3, 200])
def test_hidden_and_intermediate_sizes(xp, tokens, hidden, inter):
    problem = random_problem(np.random.default_rng([tokens, hidden, inter]), tokens, hidden, 8, inter, 2)
    check_close(run_fused(xp, problem), problem)


@pytest.mark.sanitize
@pytest.mark.parametrize("routing", ["one", "sparse"])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (64, 8), (256, 8)])
@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_skewed_routing(xp, tokens, experts, top_k, routing):
    """Every token on expert 0 ("one"), or half the experts without tokens ("sparse")."""
    hidden, inter = SIZES[experts]
    rng = np.random.default_rng([tokens, experts, top_k, routing == "one"])
    problem = random_problem(rng, tokens, hidden, experts, inter, top_k, routing=routing)
    check_close(run_fused(xp, problem), problem)


@pytest.mark.sanitize
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (3, 8), (64, 8), (1000, 8)])
def test_every_slot_on_one_expert(xp, tokens, top_k):
    """All k ids of every token are the same expert: repeated ids within a token count k times."""
    rng = np.random.default_rng([tokens, top_k])
    x, w13, w2, _, weights = random_problem(rng, tokens, 256, 64, 128, top_k)
    problem = (x, w13, w2, np.full((tokens, top_k), 63, np.int32), weights)
    check_close(run_fused(xp, problem), problem)


def test_repeated_ids_add_their_weights(xp):
    """A token that sends its row to one expert three times gets that expert's output times the
    sum of the three weights."""
    rng = np.random.default_rng(6)
    x, w13, w2, _, _ = random_problem(rng, 3, 64, 4, 64, 3)
    ids = np.array([[2, 2, 2], [1, 3, 1], [0, -1, 0]], np.int32)
    weights = rng.random((3, 3), dtype=np.float32)
    got = run_fused(xp, (x, w13, w2, ids, weights))
    check_close(got, (x, w13, w2, ids, weights))
    single = oracle(x[:1], w13, w2, np.array([[2]]), weights[:1].sum(axis=1, keepdims=True))
    assert rel_l2(as_numpy(got)[:1], single) < ORACLE_TOL


@pytest.mark.sanitize
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("tokens", [3, 64, 1000])
def test_minus_one_ids(xp, tokens, id_dtype):
    """Slots with id -1 add nothing; a token whose ids are all -1 gets an exact zero row."""
    rng = np.random.default_rng([tokens, id_dtype.itemsize])
    x, w13, w2, ids, weights = random_problem(rng, tokens, 256, 64, 128, 8)
    ids = np.where(rng.random(ids.shape) < 0.3, -1, ids).astype(id_dtype)
    ids[0] = -1
    problem = (x, w13, w2, ids, weights)
    got = run_fused(xp, problem)
    check_close(got, problem)
    assert (as_numpy(got)[0].astype(np.float32) == 0).all()


@pytest.mark.parametrize("bad", [8, 300, -5, -2])
def test_out_of_range_ids_raise(xp, bad):
    x, w13, w2, ids, weights = to_xp(xp, *random_problem(np.random.default_rng(0), 16, 128, 8, 64, 2))
    ids[3, 1] = bad
    with pytest.raises(ValueError, match="^topk_ids: "):
        cupymoe.fused_experts(x, w13, w2, ids, weights)
    with pytest.raises(ValueError, match="^topk_ids: "):
        cupymoe.MoE(w13, w2)(x, ids, weights)


@pytest.mark.sanitize
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_out_of_range_ids_unchecked_count_as_minus_one(xp, id_dtype):
    """With check_ids=False ids outside [-1, E) give the same bits as -1 ids (int64 ids are not truncated)."""
    experts = 64
    rng = np.random.default_rng(id_dtype.itemsize)
    x, w13, w2, ids, weights = random_problem(rng, 300, 256, experts, 128, 8)
    bad = rng.random(ids.shape) < 0.2
    ids = ids.astype(id_dtype)
    as_minus_one = np.where(bad, -1, ids).astype(id_dtype)
    ids[bad] = rng.choice(out_of_range_ids(experts, id_dtype), int(bad.sum()))
    problem = (x, w13, w2, as_minus_one, weights)
    got = run_fused(xp, (x, w13, w2, ids, weights), check_ids=False)
    check_close(got, problem)
    np.testing.assert_array_equal(host_bits(got), host_bits(run_fused(xp, problem)))
    layer = cupymoe.MoE(*to_xp(xp, w13, w2))
    np.testing.assert_array_equal(host_bits(layer(*to_xp(xp, x, ids, weights), check_ids=False)), host_bits(got))


@pytest.mark.sanitize
def test_zero_tokens(xp):
    x, w13, w2, ids, weights = to_xp(xp, *random_problem(np.random.default_rng(0), 0, 128, 8, 64, 2))
    for out in (cupymoe.fused_experts(x, w13, w2, ids, weights), cupymoe.MoE(w13, w2)(x, ids, weights)):
        assert isinstance(out, xp.ndarray)
        assert out.shape == (0, 128) and out.dtype == BF16


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_over_calls_of_changing_t_and_k(xp, dtype):
    """One MoE called with T and k changing (T = 0 too), against the reference each time."""
    rng = np.random.default_rng(1)
    _, w13, w2, _, _ = random_problem(rng, 1, 128, 6, 64, 2, dtype)
    layer = cupymoe.MoE(*to_xp(xp, w13, w2))
    assert (layer.num_experts, layer.intermediate_size, layer.hidden_size, layer.dtype) == (6, 64, 128, dtype)
    for tokens, top_k in [(5, 2), (0, 2), (3, 1), (5, 2), (5, 3), (1, 6), (5, 2)]:
        x, _, _, ids, weights = random_problem(rng, tokens, 128, 6, 64, top_k, dtype)
        ids = np.where(rng.random(ids.shape) < 0.2, -1, ids).astype(np.int32)
        out = layer(*to_xp(xp, x, ids, weights))
        check_close(out, (x, w13, w2, ids, weights))


def test_strided_x_is_accepted(xp):
    rng = np.random.default_rng(8)
    problem = random_problem(rng, 10, 64, 4, 64, 2)
    x, w13, w2, ids, weights = to_xp(xp, *problem)
    wide = xp.zeros((10, 128), BF16)
    wide[:, ::2] = x
    check_close(cupymoe.fused_experts(wide[:, ::2], w13, w2, ids, weights), problem)


# GPU only: streams, graphs, memory, other frameworks' arrays.


@pytest.mark.gpu
def test_non_default_stream():
    """Everything issued on a non-blocking stream gives the same bits as on the default stream."""
    import cupy

    problem = random_problem(np.random.default_rng(0), 300, 256, 64, 128, 8)
    want = host_bits(run_fused(cupy, problem))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        args = to_gpu(*problem)
        checked = run_fused(cupy, problem, args)
        layer = cupymoe.MoE(args[1], args[2])
        unchecked = layer(args[0], args[3], args[4], out=poison(cupy.empty_like(args[0])), check_ids=False)
    stream.synchronize()
    np.testing.assert_array_equal(host_bits(checked), want)
    np.testing.assert_array_equal(host_bits(unchecked), want)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 5, 1])  # T = 5 and 1 go by slot, without the dispatch
def test_cuda_graph_replay_sees_new_inputs(tokens):
    """Capture MoE once, then replay it on new x, ids (one of them -1) and weights copied into the
    same buffers. On sm_90 the replay at T = 64 with every token on one expert runs the skewed
    plan, picked on the GPU."""
    import cupy

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
            assert (dispatch is None) == (tokens * top_k <= plans.SLOT_SLOTS)
            if dispatch is not None and _compile.compute_capability(cupy.cuda.Device().id) == 90:
                assert dispatch.chosen_plan(gated=True) == (routing == "one")


@pytest.mark.gpu
def test_memory_stays_bounded_as_t_varies_and_captured_workspaces_stay():
    """With no room for spare workspaces, calls at several T keep only the latest call's workspace
    and the captured one. The graph still replays right, and an output held from a dropped
    workspace keeps its values: the next call with its T gets a new buffer. free_workspaces
    drops them all, and the layer still runs."""
    import cupy

    host = random_problem(np.random.default_rng(7), 64, 256, 64, 128, 8)
    first = lambda tokens: (host[0][:tokens], host[1], host[2], host[3][:tokens], host[4][:tokens])  # noqa: E731
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


@pytest.mark.gpu
def test_check_ids_refused_in_graph_capture():
    """check_ids=True synchronises, so it must raise ValueError under capture instead of breaking it."""
    import cupy

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


@pytest.mark.gpu
def test_torch_inputs():
    """torch CUDA tensors go in zero-copy; the CuPy result goes back to torch through DLPack."""
    import cupy

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
    got = run_fused(cupy, problem, args)
    check_close(got, problem)
    layer = cupymoe.MoE(args[1], args[2])
    np.testing.assert_array_equal(host_bits(layer(args[0], args[3].long(), args[4])), host_bits(got))
    back = torch.from_dlpack(got)
    assert back.is_cuda and back.dtype == torch.bfloat16 and tuple(back.shape) == x.shape


@pytest.mark.gpu
def test_jax_inputs():
    """JAX GPU arrays go in through DLPack; the CuPy result goes back to JAX the same way."""
    import cupy

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend")
    problem = random_problem(np.random.default_rng(0), 64, 256, 64, 128, 8)
    args = jax.block_until_ready(tuple(jax.device_put(jnp.asarray(a), device) for a in problem))
    got = run_fused(cupy, problem, args)
    check_close(got, problem)
    back = jnp.from_dlpack(got)
    assert back.dtype == jnp.bfloat16 and back.shape == problem[0].shape
