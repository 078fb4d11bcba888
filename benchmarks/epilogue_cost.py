"""What each expert option costs: the suite's cases (cupymoe/bench/cases.json) timed with plain
SwiGLU and, in the same run on the same inputs, with each other activation, with both biases, and
with the routing weight on the input (eager calls, L2 flushed, median of --reps); then the
router's time (route() alone and MoEBlock's router GEMM plus route) at T = 1, 64 and 8192 for
E = 256, softmax and DeepSeek-V3's grouped sigmoid. Prints two tables; --out writes JSON.

    python benchmarks/epilogue_cost.py [--cases u1,u64] [--reps 20] [--out cost.json]
"""
import argparse
import json
from pathlib import Path

import cupy
import numpy as np

import cupymoe
from cupymoe.bench.cases import load_suite, make_case_inputs, select_cases
from cupymoe.bench.measure import FLUSH_BYTES, expert_weights, time_call

CASES = Path(cupymoe.bench.__file__).with_name("cases.json")
VARIANTS = {
    "silu": {}, "gelu": dict(activation="gelu"), "gelu_tanh": dict(activation="gelu_tanh"),
    "swigluoai": dict(activation="swigluoai"), "silu+biases": "biases", "swigluoai+biases": "oai-biases",
    "weight-on-input": dict(apply_router_weight_on_input=True),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated case ids (default: all)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, cases = load_suite(CASES)
    cases = select_cases(cases, args.cases)
    stream = cupy.cuda.Stream(non_blocking=True)
    result = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cases": [], "router": []}
    with stream:
        flush = cupy.empty(FLUSH_BYTES // 4, cupy.int32)
        w13, w2 = expert_weights(model)
        rng = cupy.random.default_rng(1)
        b13 = (0.5 * rng.standard_normal((model.experts, 2 * model.intermediate), dtype=cupy.float32)).astype(w13.dtype)
        b2 = (0.5 * rng.standard_normal((model.experts, model.hidden), dtype=cupy.float32)).astype(w13.dtype)
        variants = {}
        for name, v in VARIANTS.items():
            if v == "biases":
                v = dict(w13_bias=b13, w2_bias=b2)
            elif v == "oai-biases":
                v = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2)
            variants[name] = v
        print("| case | T | " + " | ".join(f"{n} ms" for n in variants) + " |")
        print("|---|---|" + "---|" * len(variants))
        for case in cases:
            x, ids, weights = (cupy.asarray(a) for a in make_case_inputs(case, model))
            row = {"case": case.id, "tokens": case.tokens}
            for name, options in variants.items():
                out = cupy.empty_like(x)
                run = lambda: cupymoe.fused_experts(x, w13, w2, ids, weights, out=out, check_ids=False,  # noqa: E731
                                                    **options)
                row[name] = time_call(run, stream, flush, args.reps)
            result["cases"].append(row)
            base = row["silu"]
            print(f"| {case.id} | {case.tokens} | " + " | ".join(
                f"{row[n]:.3f}" + ("" if n == "silu" else f" ({row[n] / base - 1:+.1%})") for n in variants) + " |")
        total = {n: sum(r[n] for r in result["cases"]) for n in variants}
        print("| sum | | " + " | ".join(f"{total[n]:.3f}" + ("" if n == "silu" else f" ({total[n] / total['silu'] - 1:+.1%})")
                                       for n in variants) + " |")
        result["sum_ms"] = total
        hidden, experts = 7168, 256
        router_weight = (rng.standard_normal((experts, hidden), dtype=cupy.float32) / hidden**0.5).astype(w13.dtype)
        bias = (0.05 * rng.standard_normal(experts, dtype=cupy.float32))
        # experts of I = 64 beside the router: only the router is timed
        small13 = cupy.zeros((experts, 128, hidden), w13.dtype)
        small2 = cupy.zeros((experts, hidden, 64), w13.dtype)
        print("\n| router | T | route() ms | router GEMM + route ms |\n|---|---|---|---|")
        for label, kwargs in (("softmax k8", dict(top_k=8)),
                              ("sigmoid 8 groups k8", dict(top_k=8, scoring="sigmoid", num_groups=8, topk_groups=4,
                                                           correction_bias=bias, scaling_factor=2.5))):
            block = cupymoe.MoEBlock(router_weight, small13, small2, router_logits_dtype="float32", **kwargs)
            for tokens in (1, 64, 8192):
                logits = rng.standard_normal((tokens, experts), dtype=cupy.float32)
                x = cupy.asarray(np.random.default_rng(tokens).standard_normal((tokens, hidden), dtype=np.float32)
                                 .astype(w13.dtype))
                route_ms = time_call(lambda: cupymoe.route(logits, **kwargs), stream, flush, args.reps)
                gemm_ms = time_call(lambda: cupymoe.route(block.router_logits(x), **kwargs), stream, flush, args.reps)
                result["router"].append({"router": label, "tokens": tokens, "route_ms": route_ms, "with_gemm_ms": gemm_ms})
                print(f"| {label} | {tokens} | {route_ms:.4f} | {gemm_ms:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
