"""A target for ncu: two eager MoE layer calls at each T of the reference model (uniform routing),
with block-scaled FP8 or bf16 weights, optionally in a forced plan (a name in cupymoe.plans, such
as PERSISTENT_FP8_TWO_ACCUMULATORS). For example:

    ncu -k regex:expert_gemm_ws -c 8 --metrics gpu__time_duration.sum \\
        python benchmarks/probes/layer_calls.py --tokens 4096 8192 --weights fp8
"""
import argparse
import contextlib

import cupy
import numpy as np

import cupymoe
from cupymoe import plans
from cupymoe.bench import cases, measure


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--weights", choices=["fp8", "bf16"], nargs="+", default=["fp8", "bf16"])
    parser.add_argument("--plan", help="a plan of cupymoe.plans to force, by name")
    args = parser.parse_args()
    chosen = getattr(plans, args.plan) if args.plan else None
    if args.plan and not isinstance(chosen, plans.Plan):
        parser.error(f"--plan: {args.plan} is not a plan of cupymoe.plans")
    model = cases.Model(hidden=4096, experts=256, intermediate=1024, top_k=8)
    w13, w2 = measure.expert_weights(model)
    q13, s13, q2, s2 = measure.fp8_weights(w13, w2)
    for tokens in args.tokens:
        rng = np.random.default_rng(tokens)
        x = cupy.asarray(rng.standard_normal((tokens, model.hidden), dtype=np.float32).astype(cases.BF16))
        ids = cupy.asarray(cases.uniform_ids(rng, tokens, model.experts, model.top_k).astype(np.int32))
        weights = cupy.asarray(cases.softmax(rng.standard_normal((tokens, model.top_k))).astype(np.float32))
        for kind in args.weights:
            with plans.forced(chosen) if chosen else contextlib.nullcontext():
                layer = cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2) if kind == "fp8" else cupymoe.MoE(w13, w2)
                for _ in range(2):
                    layer(x, ids, weights, check_ids=False)
            cupy.cuda.runtime.deviceSynchronize()
            print(kind, tokens, "done", flush=True)


if __name__ == "__main__":
    main()
