"""GPU reliability: bitwise determinism and batch invariance, 64-bit indexing at large T, a clear
error when the workspace does not fit, non-finite inputs, threads and streams, a second GPU, and
GPUs too old for the kernels.

The whole file runs in well under two minutes on one H200. The large-T test dominates (about
12 GiB of GPU memory); the out-of-memory test holds 32 GiB while it runs. Both give the memory
back to the device when they end, passed or failed.
"""
import gc
import threading

import numpy as np
import pytest

import cupymoe
from cupymoe import _compile, reference
from helpers import (BF16, DTYPES, FP16, ORACLE_TOL, REFERENCE_TOL, host_bits, oracle, poison, random_problem,
                     rel_l2, to_gpu)

cupy = pytest.importorskip("cupy")

NAN_BF16 = 0x7FC0  # what helpers.poison writes into a bf16 array


def assert_close_to_reference(got, problem):
    """A GPU result against cupymoe's NumPy backend on the host ``problem``."""
    want = cupymoe.fused_experts(*problem, check_ids=False)
    assert rel_l2(cupy.asnumpy(got), want) < REFERENCE_TOL


@pytest.fixture
def free_gpu_memory():
    """Give the memory pool's cached blocks back to the device after a test that used tens of GiB."""
    yield
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()


# ---------------------------------------------------------------------------------------------
# Determinism and batch invariance


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "one"])
@pytest.mark.parametrize("tokens", [3, 1000])
def test_bitwise_identical_across_runs_streams_and_out_buffers(tokens, routing):
    hidden, experts, inter, top_k = 512, 64, 256, 8
    rng = np.random.default_rng([tokens, routing == "one"])
    problem = random_problem(rng, tokens, hidden, experts, inter, top_k, routing=routing)
    args = to_gpu(*problem)
    x, w13, w2, ids, weights = args
    first = cupymoe.fused_experts(*args, out=poison(cupy.empty_like(x)))
    assert_close_to_reference(first, problem)
    want = host_bits(first)
    for _ in range(3):
        np.testing.assert_array_equal(host_bits(cupymoe.fused_experts(*args, out=poison(cupy.empty_like(x)))), want)

    cupy.cuda.Device().synchronize()  # the inputs exist before non-blocking streams read them
    results = []
    streams = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))
    for stream in streams:
        with stream:
            wider = poison(cupy.empty((tokens + 1, hidden), x.dtype))
            results.append(cupymoe.fused_experts(*args, out=wider[1:]))  # out= at an offset in a larger buffer
            results.append(cupymoe.fused_experts(*args))
            layer = cupymoe.MoE(w13, w2)
            results.append(layer(x, ids, weights, out=poison(cupy.empty_like(x)), check_ids=False))
            results.append(layer(x, ids, weights, check_ids=False))  # the layer-owned output
    cupy.cuda.Device().synchronize()  # the two streams were not ordered: they may have overlapped
    for got in results:
        np.testing.assert_array_equal(host_bits(got), want)


BATCHES = ((1, "uniform"), (7, "crowd"), (64, "apart"), (1000, "crowd"), (4096, "uniform"))
PROBES = 4


def probe_tokens(rng, hidden, experts, top_k, dtype):
    """(x, ids, weights) of the tokens followed from batch to batch: distinct ids, a -1 slot,
    every slot on one expert, distinct ids."""
    x = rng.standard_normal((PROBES, hidden), dtype=np.float32).astype(dtype)
    ids = np.argsort(rng.random((PROBES, experts)), axis=1)[:, :top_k].astype(np.int32)
    ids[1, top_k // 2] = -1
    ids[2] = ids[2, 0]
    weights = rng.uniform(0.1, 1.0, (PROBES, top_k)).astype(np.float32)
    return x, ids, weights


def batch_around(rng, probes, tokens, experts, top_k, routing):
    """(x, ids, weights, rows): T random tokens with the first min(T, PROBES) probes at ``rows``.

    The other tokens pick distinct experts: "uniform" from all, "crowd" always including the first
    probe's first expert (so its rows land in different tiles), "apart" from experts no probe uses.
    """
    probe_x, probe_ids, probe_weights = probes
    pool = np.arange(experts)
    if routing == "apart":
        pool = np.setdiff1d(pool, probe_ids)
    ids = pool[np.argsort(rng.random((tokens, pool.size)), axis=1)[:, :top_k]].astype(np.int32)
    if routing == "crowd":
        ids[:, 0] = probe_ids[0, 0]
    x = rng.standard_normal((tokens, probe_x.shape[1]), dtype=np.float32).astype(probe_x.dtype)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    rows = rng.choice(tokens, min(tokens, PROBES), replace=False)
    x[rows] = probe_x[:rows.size]
    ids[rows] = probe_ids[:rows.size]
    weights[rows] = probe_weights[:rows.size]
    return x, ids, weights, rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_batch(dtype):
    """Batch invariance (the default): a token's output bits depend only on its own x, ids and
    weights, whatever the batch size (and so the tile plan and kernel) and the other tokens' routes."""
    hidden, experts, inter, top_k = 512, 64, 256, 8
    rng = np.random.default_rng(int(dtype == BF16))
    _, w13, w2, _, _ = random_problem(rng, 0, hidden, experts, inter, top_k, dtype)
    probes = probe_tokens(rng, hidden, experts, top_k, dtype)
    gpu_weights = to_gpu(w13, w2)
    seen = {}  # probe -> its output row's bits the first time it was computed
    for tokens, routing in BATCHES:
        x, ids, weights, rows = batch_around(np.random.default_rng(tokens), probes, tokens, experts, top_k, routing)
        args = (cupy.asarray(x), *gpu_weights, *to_gpu(ids, weights))
        got = cupymoe.fused_experts(*args, out=poison(cupy.empty_like(args[0])))
        assert_close_to_reference(got, (x, w13, w2, ids, weights))
        for probe, row_bits in enumerate(host_bits(got)[rows]):
            want = seen.setdefault(probe, row_bits)
            np.testing.assert_array_equal(row_bits, want, err_msg=f"probe {probe} in a batch of {tokens}")
    probe_x, probe_ids, probe_weights = probes
    got = np.stack([seen[p] for p in range(PROBES)]).view(dtype)
    assert rel_l2(got, oracle(probe_x, w13, w2, probe_ids, probe_weights)) < ORACLE_TOL


# ---------------------------------------------------------------------------------------------
# Large inputs


@pytest.mark.gpu
def test_large_batch_past_32_bit_offsets(free_gpu_memory):
    """T = 131072 at H = 4096, k = 8: offsets into the [T*k, H] workspace pass 2^32 elements."""
    tokens, hidden, experts, inter, top_k = 131072, 4096, 8, 64, 8
    assert tokens * top_k * hidden >= 2**32
    rng = np.random.default_rng(0)
    _, w13, w2, _, _ = random_problem(rng, 0, hidden, experts, inter, top_k)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    ids[rng.random(ids.shape) < 0.05] = -1
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    x = out = None
    try:
        x = cupy.random.default_rng(0).standard_normal((tokens, hidden), dtype=cupy.float32).astype(BF16)
        out = poison(cupy.empty_like(x))
        got = cupymoe.fused_experts(x, *to_gpu(w13, w2, ids, weights), out=out)
        assert got is out
        exponent_bits = 0x7F80  # all ones: Inf or NaN (the poison)
        assert not bool(((out.view(cupy.uint16) & exponent_bits) == exponent_bits).any())
        # the first, last and 2^31/(k*H)-th tokens, and 60 more from anywhere
        rows = np.unique(np.concatenate([[0, 65535, 65536, tokens - 1], rng.choice(tokens, 60, replace=False)]))
        picked = cupy.asarray(rows)
        want = oracle(cupy.asnumpy(x[picked]), w13, w2, ids[rows], weights[rows])
        assert rel_l2(cupy.asnumpy(out[picked]), want) < ORACLE_TOL
    finally:
        x = out = got = None  # a failure's traceback keeps this frame: do not keep 2 GiB with it


@pytest.mark.gpu
def test_workspace_out_of_memory_raises_and_leaves_out_untouched(free_gpu_memory):
    """A workspace that cannot be allocated is a MemoryError naming it, before anything is written."""
    tokens, hidden, experts, inter, top_k = 2**21, 4096, 8, 64, 8
    activation_bytes = tokens * hidden * 2  # x, and out: 16 GiB each
    workspace_bytes = tokens * top_k * hidden * 2  # the down projection's rows alone: 128 GiB
    if 2 * activation_bytes + workspace_bytes <= cupy.cuda.runtime.memGetInfo()[1]:
        pytest.skip("this GPU can hold the workspace")
    _, w13, w2, _, _ = random_problem(np.random.default_rng(0), 0, hidden, experts, inter, top_k)
    x = out = None
    try:
        x = cupy.empty((tokens, hidden), BF16)
        x.view(cupy.uint16).fill(0x3F80)  # 1.0 everywhere: the call has to fail before it reads x
        ids = (cupy.arange(tokens * top_k, dtype=cupy.int32) % experts).reshape(tokens, top_k)
        weights = cupy.full((tokens, top_k), 1 / top_k, cupy.float32)
        gpu_w13, gpu_w2 = to_gpu(w13, w2)
        out = poison(cupy.empty_like(x))
        with pytest.raises(MemoryError, match="(?i)workspace"):
            cupymoe.fused_experts(x, gpu_w13, gpu_w2, ids, weights, out=out)
        with pytest.raises(MemoryError, match="(?i)workspace"):
            cupymoe.MoE(gpu_w13, gpu_w2)(x, ids, weights, out=out)
        chunk = 2**18  # rows: 2^30 elements per comparison
        for start in range(0, tokens, chunk):
            assert not bool((out[start:start + chunk].view(cupy.uint16) != NAN_BF16).any()), start
    finally:
        x = out = None  # a failure's traceback keeps this frame: do not keep 32 GiB with it
    small = random_problem(np.random.default_rng(1), 64, 256, 8, 64, 2)
    assert_close_to_reference(cupymoe.fused_experts(*to_gpu(*small)), small)  # still works afterwards


# ---------------------------------------------------------------------------------------------
# Non-finite values


@pytest.mark.gpu
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_input_changes_only_its_token_row(dtype, value):
    """Token 3 gets one NaN/Inf in x and shares expert 0 (so its GEMM tiles) with every other
    token; token 7 is all NaN/Inf but routed nowhere. Only row 3 changes, and all of it."""
    tokens, hidden, experts, inter, top_k = 300, 256, 64, 128, 8
    x, w13, w2, ids, weights = random_problem(np.random.default_rng(0), tokens, hidden, experts, inter,
                                              top_k, dtype, routing="one")
    ids[7] = -1
    dirty_x = x.copy()
    dirty_x[3, 17] = value
    dirty_x[7] = value
    layer = cupymoe.MoE(*to_gpu(w13, w2))
    runs = []
    for inputs in (x, dirty_x):
        args = to_gpu(inputs, w13, w2, ids, weights)
        fused = cupymoe.fused_experts(*args, out=poison(cupy.empty_like(args[0])))
        layered = layer(args[0], args[3], args[4], out=poison(cupy.empty_like(args[0])))
        np.testing.assert_array_equal(host_bits(layered), host_bits(fused))
        runs.append(cupy.asnumpy(fused))
    clean, dirty = runs
    changed = np.flatnonzero((clean.view(np.uint16) != dirty.view(np.uint16)).any(axis=1))
    np.testing.assert_array_equal(changed, [3])
    assert not np.isfinite(dirty[3].astype(np.float32)).any()
    assert (dirty[7].astype(np.float32) == 0).all()


# ---------------------------------------------------------------------------------------------
# Concurrency and devices


@pytest.mark.gpu
def test_threads_on_their_own_streams_run_at_once_from_a_cold_start(monkeypatch):
    """Four threads, each on its own stream, call fused_experts and MoE at the same moment; their
    first calls compile the kernels concurrently. Every result equals a single-threaded run."""
    monkeypatch.setattr(_compile, "_modules", {})  # forget compiled modules: the threads compile them
    monkeypatch.setattr(_compile, "_kernels", {})
    jobs = ((1, BF16), (64, FP16), (300, BF16), (1000, FP16))  # (T, dtype): different plans and modules
    problems = [random_problem(np.random.default_rng(i), tokens, 256, 64, 128, 8, dtype)
                for i, (tokens, dtype) in enumerate(jobs)]
    rounds = 3
    start = threading.Barrier(len(jobs), timeout=120)
    results = [None] * len(jobs)
    errors = []

    def work(i):
        try:
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                x, w13, w2, ids, weights = to_gpu(*problems[i])
                layer = cupymoe.MoE(w13, w2)
                stream.synchronize()
                start.wait()
                outs = []
                for _ in range(rounds):
                    outs.append(cupymoe.fused_experts(x, w13, w2, ids, weights, out=poison(cupy.empty_like(x))))
                    outs.append(layer(x, ids, weights, out=poison(cupy.empty_like(x)), check_ids=False))
                stream.synchronize()
                results[i] = [host_bits(o) for o in outs]
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)
            start.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads)
    for problem, outs in zip(problems, results, strict=True):
        single = cupymoe.fused_experts(*to_gpu(*problem))
        assert_close_to_reference(single, problem)
        for bits in outs:
            np.testing.assert_array_equal(bits, host_bits(single))


@pytest.mark.gpu
def test_inputs_on_a_second_gpu_run_there():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs a second GPU")
    problem = random_problem(np.random.default_rng(0), 300, 256, 64, 128, 8)
    on_first = cupymoe.fused_experts(*to_gpu(*problem))
    with cupy.cuda.Device(1):
        x, w13, w2, ids, weights = to_gpu(*problem)
        out = poison(cupy.empty_like(x))
        logits = cupy.asarray(np.random.default_rng(1).standard_normal((300, 64), dtype=np.float32))
    assert cupy.cuda.Device().id == 0  # every call below is made with GPU 0 current
    results = [cupymoe.fused_experts(x, w13, w2, ids, weights, out=out),
               cupymoe.fused_experts(x, w13, w2, ids, weights),
               cupymoe.MoE(w13, w2)(x, ids, weights)]
    same_model = cupy.cuda.Device(0).compute_capability == cupy.cuda.Device(1).compute_capability
    for got in results:
        assert got.device.id == 1
        assert_close_to_reference(got, problem)
        if same_model:
            np.testing.assert_array_equal(host_bits(got), host_bits(on_first))
    assert cupymoe.dispatch(ids, 64).sorted_slots.device.id == 1
    route_weights, route_ids = cupymoe.route(logits, 8)
    assert route_weights.device.id == 1 and route_ids.device.id == 1
    want_weights, want_ids = cupymoe.route(cupy.asnumpy(logits), 8)
    np.testing.assert_array_equal(cupy.asnumpy(route_ids), want_ids)
    np.testing.assert_allclose(cupy.asnumpy(route_weights), want_weights, rtol=1e-5, atol=1e-6)
    assert cupy.cuda.Device().id == 0


# ---------------------------------------------------------------------------------------------
# GPUs below compute capability 8.0 (the arch_option(75) case is in test_compile.py)

_RealDevice = cupy.cuda.Device


class _OldDevice:
    """Stands in for cupy.cuda.Device: reports compute capability 7.5, delegates everything else."""

    compute_capability = "75"

    def __init__(self, device_id=None):
        self.id = cupy.cuda.runtime.getDevice() if device_id is None else int(device_id)
        self._real = None

    def __getattr__(self, name):
        return getattr(_RealDevice(self.id), name)

    def __enter__(self):
        self._real = _RealDevice(self.id)
        return self._real.__enter__()

    def __exit__(self, *exc_info):
        return self._real.__exit__(*exc_info)


def pretend_old_gpu(monkeypatch):
    monkeypatch.setattr(cupy.cuda, "Device", _OldDevice)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda device_id: {"name": b"Fake GPU"})


def test_old_gpu_is_refused_by_name(monkeypatch):
    """No GPU needed: only CuPy's device queries are involved, and they are faked."""
    pretend_old_gpu(monkeypatch)
    with pytest.raises(NotImplementedError) as info:
        _compile.compute_capability(0)
    assert "Fake GPU" in str(info.value) and "8.0" in str(info.value)


@pytest.mark.gpu
def test_old_gpu_is_refused_before_any_kernel_runs(monkeypatch):
    args = to_gpu(*random_problem(np.random.default_rng(0), 16, 128, 8, 64, 2))
    monkeypatch.setattr(_compile, "_modules", {})  # nothing compiled yet, as in a fresh process
    monkeypatch.setattr(_compile, "_kernels", {})
    pretend_old_gpu(monkeypatch)
    with pytest.raises(NotImplementedError, match="Fake GPU") as info:
        cupymoe.fused_experts(*args, check_ids=False)
    assert "8.0" in str(info.value)


# ---------------------------------------------------------------------------------------------
# The benchmark's reference workload: H = 4096, E = 256, I = 1024, k = 8, full-size weights

WORKLOAD_HIDDEN, WORKLOAD_EXPERTS, WORKLOAD_INTER, WORKLOAD_TOP_K = 4096, 256, 1024, 8


def random_bf16_bits(rng, size, scale_log2):
    """size bf16 bit patterns of random sign and mantissa, magnitudes in [2^(s-1), 2^(s+1))."""
    bits = rng.integers(0, 2**16, size=size, dtype=np.uint16)
    exponent = ((bits >> np.uint16(7)) & np.uint16(1)) + np.uint16(126 + scale_log2)
    return (bits & np.uint16(0x807F)) | (exponent << np.uint16(7))


@pytest.fixture(scope="module")
def workload_layer():
    """An MoE of the reference workload's 6 GiB of bf16 weights, copied from the host a few experts
    at a time (no kernel runs, so this stays quick under compute-sanitizer too); each group of
    experts is a different window of one random pool, so no two experts are equal."""
    experts, hidden, inter = WORKLOAD_EXPERTS, WORKLOAD_HIDDEN, WORKLOAD_INTER
    rng = np.random.default_rng(0)
    step, shift = 16, 4099  # experts per copy; pool offset between groups (not a row multiple)
    weights = []
    for shape, scale_log2 in (((experts, 2 * inter, hidden), -6), ((experts, hidden, inter), -5)):  # ~1/sqrt(K)
        w = cupy.empty(shape, BF16)
        group = (step,) + shape[1:]
        size = int(np.prod(group))
        pool = random_bf16_bits(rng, size + shift * (experts // step), scale_log2)
        for g, e in enumerate(range(0, experts, step)):
            w[e:e + step].view(cupy.uint16).set(pool[g * shift:g * shift + size].reshape(group))
        weights.append(w)
    yield cupymoe.MoE(*weights)
    weights.clear()
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("routing", ["uniform", "zipf"])
@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
def test_reference_workload(workload_layer, tokens, routing):
    """route, fused_experts and the layer at the benchmark's sizes: the layer gives fused_experts'
    bits, and the first and last tokens match the NumPy reference run on the experts they use."""
    layer = workload_layer
    rng = np.random.default_rng([tokens, routing == "zipf"])
    log_popularity = np.zeros(WORKLOAD_EXPERTS)
    if routing == "zipf":  # expert popularity ~ 1 / rank^1.2, as in the suite
        log_popularity = -1.2 * np.log(np.arange(1, WORKLOAD_EXPERTS + 1))[rng.permutation(WORKLOAD_EXPERTS)]
    logits = (log_popularity + rng.gumbel(size=(tokens, WORKLOAD_EXPERTS))).astype(np.float32)
    weights, ids = cupymoe.route(cupy.asarray(logits), WORKLOAD_TOP_K)
    x = rng.standard_normal((tokens, WORKLOAD_HIDDEN), dtype=np.float32).astype(BF16)
    gx = cupy.asarray(x)
    got = cupymoe.fused_experts(gx, layer.w13, layer.w2, ids, weights, out=poison(cupy.empty_like(gx)))
    np.testing.assert_array_equal(host_bits(layer(gx, ids, weights, check_ids=False)), host_bits(got))
    rows = sorted({0, tokens - 1})
    host_ids, host_weights = cupy.asnumpy(ids)[rows], cupy.asnumpy(weights)[rows]
    used = np.unique(host_ids)
    w13, w2 = cupy.asnumpy(layer.w13[cupy.asarray(used)]), cupy.asnumpy(layer.w2[cupy.asarray(used)])
    local_ids = np.searchsorted(used, host_ids).astype(np.int32)
    want = reference.fused_experts(x[rows], w13, w2, local_ids, host_weights, np.empty_like(x[rows]))
    assert rel_l2(cupy.asnumpy(got)[rows], want) < REFERENCE_TOL
