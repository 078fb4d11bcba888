"""Each FP8 plan and trial plan (plans.FP8_TRIAL_PLANS) forced at T from 1 to 8192 (the reference
model, uniform routing, block-scaled weights), w8a8 and weight-only (w8a16): median ms of an eager
MoE layer call, and whether its bits equal the first plan's of its mode on the same tokens (batch
invariance across plans); the bf16 layer's own plan beside them."""
import argparse

import cupy
import numpy as np

import cupymoe
from cupymoe import plans
from cupymoe.bench import cases, measure


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    model = cases.Model(hidden=4096, experts=256, intermediate=1024, top_k=8)
    w13, w2 = measure.expert_weights(model)
    q13, s13, q2, s2 = measure.fp8_weights(w13, w2)
    stream = cupy.cuda.Stream(non_blocking=True)
    flush = cupy.empty(64 * 2**20, np.int32)
    names = {id(p): n for n, p in vars(plans).items() if isinstance(p, plans.Plan)}
    runs = ([("w8a8", p) for p in plans.FP8_PLANS + plans.FP8_TRIAL_PLANS]
            + [("w8a16", p) for p in plans.WEIGHT_ONLY_PLANS])
    print("T", *[f"{mode}:{names[id(p)]}" for mode, p in runs], "bf16", "bits equal (w8a8 | w8a16)", sep="\t")
    for tokens in args.tokens:
        rng = np.random.default_rng(tokens)
        x = cupy.asarray(rng.standard_normal((tokens, model.hidden), dtype=np.float32).astype(cases.BF16))
        ids = cupy.asarray(cases.uniform_ids(rng, tokens, model.experts, model.top_k).astype(np.int32))
        weights = cupy.asarray(cases.softmax(rng.standard_normal((tokens, model.top_k))).astype(np.float32))
        row, outs = [tokens], {"w8a8": [], "w8a16": []}
        for mode, p in runs:
            with plans.forced(p):  # a fresh layer: its workspace for this T takes the forced plan
                layer = cupymoe.MoE(q13, q2, w13_scale=s13, w2_scale=s2, fp8_compute=mode)
                run = lambda: layer(x, ids, weights, check_ids=False)
                outs[mode].append(run().view(cupy.uint16).get())
            row.append(f"{measure.time_call(run, stream, flush, args.reps):.3f}")
        layer = cupymoe.MoE(w13, w2)
        run = lambda: layer(x, ids, weights, check_ids=False)
        row.append(f"{measure.time_call(run, stream, flush, args.reps):.3f}")
        row.append(" | ".join(" ".join(str(int(np.array_equal(o, same[0]))) for o in same[1:]) for same in outs.values()))
        print(*row, sep="\t", flush=True)


if __name__ == "__main__":
    main()
