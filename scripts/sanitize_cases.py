#!/usr/bin/env python3
"""Run every GPU entry point over the test shapes and the benchmark's workload, for compute-sanitizer.

scripts/sanitize.sh runs this under memcheck, racecheck, synccheck and initcheck. It is kept
short because each tool slows kernels 10-100x:

- small shapes: T in {0, 1, 3, 64, 257}, E in {8, 64}, k in {1, 2, 8}, H = I = 128, bf16 and
  fp16; then -1 ids, every slot on one expert, experts without tokens, one expert with all of
  them, unchecked out-of-range ids and other widths; on sm_90, each persistent plan forced where
  every block takes many tiles, and the 16-row tiles standing by for the 160-slot plan on 3
  blocks. fused_experts, MoE (with and without out=), dispatch and route are compared with the
  NumPy backend, so the kernels surely ran.
- the benchmark's reference workload: H = 4096, E = 256, I = 1024, k = 8 with full-size weights
  (6 GiB, drawn on the host) at T in {1, 4, 64, 512}, uniform and Zipf routing, routed by
  cupymoe.route; the first and last tokens' rows are compared with the NumPy reference.

Environment:
  SANITIZE_QUICK=1       the small shapes only
  SANITIZE_SMALL=0       the benchmark workload only
  SANITIZE_REF_T=1,4,64  the benchmark workload's token counts (default 1,4,64,512)
  SANITIZE_POOL=1        keep CuPy's memory pool; by default every array is its own cudaMalloc,
                         so memcheck sees exact bounds and initcheck sees fresh memory
  SANITIZE_MATCH=text    only the cases whose name contains text, e.g. "persistent"

Exits 1 when a result is wrong or a case raised.
"""
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this checkout's cupymoe, and tests/helpers.py

import cupy  # noqa: E402

import cupymoe  # noqa: E402
from cupymoe import _compile, reference  # noqa: E402
from cupymoe import experts as experts_module  # noqa: E402
from helpers import BF16, poison, random_problem, rel_l2  # noqa: E402

FP16 = np.dtype(np.float16)
REF_TOL = 3e-3  # vs the NumPy reference: only the fp32 summation order differs
SMALL_TOKENS = (0, 1, 3, 64, 257)
SMALL_EXPERTS_TOP_K = ((8, 1), (8, 2), (8, 8), (64, 1), (64, 2), (64, 8))
SMALL_WIDTH = 128  # H = I
PLAN_HIDDEN, PLAN_INTER = 512, 256  # the persistent kernel's tiles divide both GEMMs
BENCH_HIDDEN, BENCH_EXPERTS, BENCH_INTER, BENCH_TOP_K = 4096, 256, 1024, 8
BENCH_TOKENS = (1, 4, 64, 512)
ZIPF_EXPONENT = 1.2  # expert popularity ~ 1 / rank^s
DISPATCH_FIELDS = ("counts", "offsets", "sorted_slots", "slot_positions")


class Mismatch(Exception):
    """A GPU result that differs from the NumPy one."""


def expect(ok, message):
    if not ok:
        raise Mismatch(message)


def expect_close(label, got, want):
    got = cupy.asnumpy(got)
    expect(got.shape == want.shape and got.dtype == want.dtype,
           f"{label}: got {got.shape} {got.dtype}, want {want.shape} {want.dtype}")
    err = rel_l2(got, want)
    expect(err < REF_TOL, f"{label}: relative L2 error {err:.2e}")


def expect_same_dispatch(gpu_ids, host_ids, experts, check_ids):
    got = cupymoe.dispatch(gpu_ids, experts, check_ids=check_ids)
    want = cupymoe.dispatch(host_ids, experts, check_ids=check_ids)
    for name in DISPATCH_FIELDS:
        expect(np.array_equal(cupy.asnumpy(getattr(got, name)), getattr(want, name)), f"dispatch {name} differs")


def forward_case(problem, check_ids=True):
    """fused_experts, MoE twice (owned output, then out=) and dispatch, each against NumPy."""
    x, w13, w2, ids, weights = problem
    want = cupymoe.fused_experts(*problem, check_ids=check_ids)
    args = [cupy.asarray(a) for a in problem]
    gx, gw13, gw2, gids, gweights = args
    expect_close("fused_experts", cupymoe.fused_experts(*args, out=poison(cupy.empty_like(gx)),
                                                        check_ids=check_ids), want)
    layer = cupymoe.MoE(gw13, gw2)
    expect_close("MoE", layer(gx, gids, gweights, check_ids=check_ids), want)
    expect_close("MoE out=", layer(gx, gids, gweights, out=poison(cupy.empty_like(gx)), check_ids=False), want)
    expect_same_dispatch(gids, ids, w13.shape[0], check_ids)


def plan_case(chosen, problem, one_wave=None):
    """forward_case with the tile plan ``chosen``, whatever T would pick; a plan standing by for
    skewed routing launches ``one_wave`` blocks if given (each claiming many tiles)."""
    fitted = experts_module.fitted(chosen, PLAN_HIDDEN, PLAN_INTER, _compile.shared_memory_limit(cupy.cuda.Device().id))
    heuristic, wave = experts_module.plan, experts_module._one_wave
    experts_module.plan = lambda *args: fitted
    if one_wave is not None:
        experts_module._one_wave = lambda *args: one_wave
    try:
        forward_case(problem)
    finally:
        experts_module.plan, experts_module._one_wave = heuristic, wave


def route_case(logits, top_k):
    for renormalize in (True, False):
        want_weights, want_ids = cupymoe.route(logits, top_k, renormalize=renormalize)
        got_weights, got_ids = cupymoe.route(cupy.asarray(logits), top_k, renormalize=renormalize)
        expect(np.array_equal(cupy.asnumpy(got_ids), want_ids), f"route ids differ (renormalize={renormalize})")
        expect(np.allclose(cupy.asnumpy(got_weights), want_weights, rtol=1e-5, atol=1e-6),
               f"route weights differ (renormalize={renormalize})")


def with_out_of_range(rng, ids, experts):
    """int64 ids with a quarter replaced by values outside [-1, E) (dropped under check_ids=False)."""
    ids = ids.astype(np.int64)
    bad = rng.random(ids.shape) < 0.25
    values = np.array([-2, -5, experts, 300, 2**33, -(2**40), np.iinfo(np.int64).max], np.int64)
    ids[bad] = rng.choice(values, int(bad.sum()))
    return ids


def small_cases():
    """(name, function, args) for the small shapes."""
    width = SMALL_WIDTH
    for dtype, tag in ((BF16, "bf16"), (FP16, "fp16")):
        for experts, top_k in SMALL_EXPERTS_TOP_K:
            for tokens in SMALL_TOKENS:
                rng = np.random.default_rng([tokens, experts, top_k, dtype == BF16])
                problem = random_problem(rng, tokens, width, experts, width, top_k, dtype)
                yield f"forward {tag} T={tokens} E={experts} k={top_k}", forward_case, (problem,)

    for tokens, experts, top_k in ((64, 8, 2), (257, 64, 8)):
        shape = f"T={tokens} E={experts} k={top_k}"
        rng = np.random.default_rng([tokens, experts, top_k])
        x, w13, w2, ids, weights = random_problem(rng, tokens, width, experts, width, top_k)
        minus_one = np.where(rng.random(ids.shape) < 0.3, -1, ids).astype(np.int64)
        minus_one[0] = -1
        yield f"forward -1 ids {shape}", forward_case, ((x, w13, w2, minus_one, weights),)
        yield f"forward every slot on one expert {shape}", forward_case, (
            (x, w13, w2, np.full_like(ids, experts - 1), weights),)
        yield f"forward unchecked out-of-range ids {shape}", forward_case, (
            (x, w13, w2, with_out_of_range(rng, ids, experts), weights), False)
        for routing in ("sparse", "one"):
            problem = random_problem(rng, tokens, width, experts, width, top_k, routing=routing)
            yield f"forward routing={routing} {shape}", forward_case, (problem,)

    # 64 rows per expert: on sm_90 the persistent wgmma kernels run where I % 128 == 0 (gate/up)
    # and H % 256 == 0 (down), the mma.sync ones elsewhere.
    for hidden, inter, dtype, tag in ((64, 64, BF16, "bf16"), (192, 320, BF16, "bf16"), (512, 64, BF16, "bf16"),
                                      (256, 128, FP16, "fp16")):
        problem = random_problem(np.random.default_rng([hidden, inter]), 257, hidden, 8, inter, 2, dtype)
        yield f"forward {tag} H={hidden} I={inter} T=257 E=8 k=2", forward_case, (problem,)

    if _compile.compute_capability(cupy.cuda.Device().id) == 90:
        for index, chosen in enumerate(experts_module.PLANS):
            if chosen.gate_up.kernel != experts_module.PERSISTENT:
                continue
            for tokens, routing in ((4000, "uniform"), (301, "sparse")):  # ~1000 rows per expert; a few
                problem = random_problem(np.random.default_rng([tokens, index]), tokens, PLAN_HIDDEN, 8,
                                         PLAN_INTER, 2, routing=routing)
                yield (f"forward persistent plan {index} (block_m {chosen.gate_up.block_m}) T={tokens} "
                       f"{routing}"), plan_case, (chosen, problem)
        standby = replace(experts_module._SMALL, skewed=experts_module._PERSISTENT_160)
        for routing in ("uniform", "one"):  # under 64 rows per expert the 16-row tiles run, else the 160-slot plan
            problem = random_problem(np.random.default_rng([150, routing == "one"]), 150, PLAN_HIDDEN, 8,
                                     PLAN_INTER, 2, routing=routing)
            yield f"forward standby 16-row plan on 3 blocks T=150 {routing}", plan_case, (standby, problem, 3)

    for dtype, tag in ((np.dtype(np.float32), "f32"), (BF16, "bf16"), (FP16, "f16")):
        for tokens in SMALL_TOKENS:
            for experts, top_k in ((8, 1), (8, 8), (64, 2), (64, 8)):
                rng = np.random.default_rng([tokens, experts, top_k])
                logits = (3 * rng.standard_normal((tokens, experts), dtype=np.float32)).astype(dtype)
                yield f"route {tag} T={tokens} E={experts} k={top_k}", route_case, (logits, top_k)


def random_bf16_bits(rng, size, scale_log2):
    """size bf16 bit patterns of random sign and mantissa, magnitudes in [2^(s-1), 2^(s+1)) for
    s = scale_log2."""
    bits = rng.integers(0, 2**16, size=size, dtype=np.uint16)
    exponent = ((bits >> np.uint16(7)) & np.uint16(1)) + np.uint16(126 + scale_log2)
    return (bits & np.uint16(0x807F)) | (exponent << np.uint16(7))


def bench_weights():
    """Full-size w13 [E, 2I, H] and w2 [E, H, I] in bf16, copied from the host a few experts at a
    time: no kernel runs, so this stays quick under every tool (racecheck slows even elementwise
    kernels enough that generating 6 GiB on the GPU took minutes). Each group of experts is a
    different window of one random pool, so no two experts are equal."""
    experts, hidden, inter = BENCH_EXPERTS, BENCH_HIDDEN, BENCH_INTER
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
    return tuple(weights)


def bench_logits(rng, tokens, routing):
    """Router logits whose top-k is a draw of k distinct experts, uniform or Zipf-popular
    (Gumbel top-k over the log-popularities)."""
    experts = BENCH_EXPERTS
    log_popularity = np.zeros(experts)
    if routing == "zipf":
        log_popularity = -ZIPF_EXPONENT * np.log(np.arange(1, experts + 1))[rng.permutation(experts)]
    return (log_popularity + rng.gumbel(size=(tokens, experts))).astype(np.float32)


def expect_rows_match_reference(got, x, w13, w2, ids, weights, rows):
    """Rows of a benchmark-sized result against the NumPy reference run on just those tokens and
    the experts they use (copying all 6 GiB of weights to the host would take too long)."""
    used = np.unique(ids[rows])
    used = used[used >= 0]
    picked = cupy.asarray(used)
    sub13, sub2 = cupy.asnumpy(w13[picked]), cupy.asnumpy(w2[picked])
    local_ids = np.where(ids[rows] >= 0, np.searchsorted(used, ids[rows]), -1).astype(np.int32)
    want = reference.fused_experts(x[rows], sub13, sub2, local_ids, weights[rows], np.empty_like(x[rows]))
    expect_close(f"rows {list(rows)}", cupy.asnumpy(got)[rows], want)


def bench_case(layer, tokens, routing):
    """route, fused_experts and the layer at the benchmark's sizes; dispatch against NumPy."""
    rng = np.random.default_rng([tokens, routing == "zipf"])
    logits = bench_logits(rng, tokens, routing)
    route_case(logits, BENCH_TOP_K)
    weights, ids = cupymoe.route(cupy.asarray(logits), BENCH_TOP_K)
    x = rng.standard_normal((tokens, BENCH_HIDDEN), dtype=np.float32).astype(BF16)
    gx = cupy.asarray(x)
    got = cupymoe.fused_experts(gx, layer.w13, layer.w2, ids, weights, out=poison(cupy.empty_like(gx)))
    again = layer(gx, ids, weights, check_ids=False)
    expect(np.array_equal(cupy.asnumpy(again).view(np.uint16), cupy.asnumpy(got).view(np.uint16)),
           "MoE and fused_experts differ")
    host_ids, host_weights = cupy.asnumpy(ids), cupy.asnumpy(weights)
    expect_rows_match_reference(got, x, layer.w13, layer.w2, host_ids, host_weights, sorted({0, tokens - 1}))
    expect_same_dispatch(ids, host_ids, BENCH_EXPERTS, True)


def run(name, function, args, failures):
    start = time.perf_counter()
    try:
        function(*args)
        status = "ok"
    except Mismatch as err:
        status = f"FAIL: {err}"
    except Exception:
        traceback.print_exc()
        status = "ERROR"
    if status != "ok":
        failures.append(name)
    print(f"{name}: {status} ({time.perf_counter() - start:.1f} s)", flush=True)


def main():
    if os.environ.get("SANITIZE_POOL") != "1":
        cupy.cuda.set_allocator(None)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"cupymoe {cupymoe.__version__}, CuPy {cupy.__version__}, {props['name'].decode()}", flush=True)
    failures = []
    count = 0
    match = os.environ.get("SANITIZE_MATCH", "")
    for name, function, args in small_cases() if os.environ.get("SANITIZE_SMALL") != "0" else ():
        if match not in name:
            continue
        run(name, function, args, failures)
        count += 1
    if os.environ.get("SANITIZE_QUICK") != "1":
        tokens_list = [int(t) for t in os.environ.get("SANITIZE_REF_T", ",".join(map(str, BENCH_TOKENS))).split(",")]
        bench = [(f"benchmark T={tokens} {routing}", tokens, routing)
                 for tokens in tokens_list for routing in ("uniform", "zipf")]
        bench = [case for case in bench if match in case[0]]
        if bench:
            start = time.perf_counter()
            layer = cupymoe.MoE(*bench_weights())
            print(f"benchmark weights: {time.perf_counter() - start:.1f} s", flush=True)
        for name, tokens, routing in bench:
            run(name, bench_case, (layer, tokens, routing), failures)
            count += 1
    print(f"sanitize_cases: {count} cases, {len(failures)} failed", flush=True)
    for name in failures:
        print(f"  failed: {name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
