"""The benchmark suite: every case checked, then timed against its roofline and the torch peer;
a table, a JSON file and a plot. ``python -m cupymoe.bench --help`` lists the options."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from .. import plans
from .._compile import gpu_available
from .cases import DEFAULT_CASES, active_experts, load_suite, make_case_inputs, select_cases, sol_ms
from .contenders import (TorchGroupedMM, TorchScaledMM, bench_cupymoe, load_torch_fp8_peer, load_torch_peer,
                          reference_output)
from .measure import FLUSH_BYTES, SuiteWeights, fp8_matmul_rate, matmul_rate, read_bandwidth

DEFAULT_OUT = Path("benchmarks") / "results"


def device_short_name(name: str) -> str:
    """A file-name tag for a GPU: its first word with a digit, lower case ('NVIDIA H200' -> 'h200')."""
    for word in re.split(r"[\s_-]+", name):
        if any(ch.isdigit() for ch in word):
            return re.sub(r"[^a-z0-9]", "", word.lower())
    return "gpu"


def run_case(case, model, weights, peer, ceilings, stream, flush, args) -> dict:
    """Generate, check and time one case on ``stream`` (CuPy's current stream); return its row.
    ``weights``: a SuiteWeights; ``ceilings``: (read bytes/s, matmul FLOP/s of its precision)."""
    import cupy

    x_host, ids_host, weights_host = make_case_inputs(case, model)
    inputs = tuple(cupy.asarray(a) for a in (x_host, ids_host, weights_host))
    ref = reference_output(inputs[0], ids_host, weights_host, weights.expert)
    active = active_experts(ids_host)
    row = {
        "id": case.id,
        "T": case.tokens,
        "routing": case.routing,
        "active_experts": active,
        "sol_ms": sol_ms(model, case.tokens, active, *ceilings, weights.weight_bytes),
    }
    graph = not args.no_graph
    row.update(bench_cupymoe(weights, inputs, ref, stream, flush, args.reps, graph))
    row["passed"] = row["rel_err"] < weights.tolerance
    row.update(peer_rel_err=None, peer_ms_eager=None, peer_ms_graph=None, peer_passed=None)
    if peer is not None:
        try:
            row.update(peer.bench(inputs, ref, stream, flush, args.reps, graph, weights.tolerance))
            row["peer_passed"] = row["peer_rel_err"] < weights.tolerance
        except Exception as err:  # the peer is optional: report it and keep the suite going
            print(f"peer failed on {case.id}: {type(err).__name__}: {err}", flush=True)
    return row


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def progress_line(n, total, row, seconds) -> str:
    """One line per finished case."""
    line = (f"[{n:2d}/{total}] {row['id']:<6} T={row['T']:<5d} active={row['active_experts']:<3d} "
            f"SOL {row['sol_ms']:.3f} ms | cupymoe graph {_fmt(row['ms_graph'], '.3f')} "
            f"eager {_fmt(row['ms_eager'], '.3f')} ms err {row['rel_err']:.1e} "
            f"mem {row['peak_mem_MiB']:.1f} MiB")
    if not row["passed"]:
        line += " FAILED the check"
    if row["peer_rel_err"] is not None:
        line += (f" | peer graph {_fmt(row['peer_ms_graph'], '.3f')} "
                 f"eager {_fmt(row['peer_ms_eager'], '.3f')} ms err {row['peer_rel_err']:.1e}")
        if not row["peer_passed"]:
            line += " FAILED the check"
    return f"{line} | {seconds:.1f} s"


def suite_figures(rows, key):
    """(mean ms, sum(sol_ms) / sum(ms)) over the rows, or (None, None) if any row lacks ``key``."""
    times = [row[key] for row in rows]
    if not times or any(t is None for t in times):
        return None, None
    return float(np.mean(times)), sum(row["sol_ms"] for row in rows) / sum(times)


def run_suite(model, cases, args) -> dict:
    """Measure the ceilings, then every case; return the results (the JSON document).

    All GPU work, CuPy's and the peer's, goes to one non-blocking stream.
    """
    import cupy

    device_id = cupy.cuda.Device().id
    device = cupy.cuda.runtime.getDeviceProperties(device_id)["name"].decode()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        flush = cupy.empty(FLUSH_BYTES // 4, cupy.int32)
        print(f"{device}: measuring the ceilings ...", flush=True)
        read_bw, bf16_rate = read_bandwidth(stream, flush, device_id), matmul_rate(stream, flush)
        fp8_rate = fp8_matmul_rate(stream, flush) if args.weights == "fp8" else None
        # without a measured FP8 rate, twice bf16's (Hopper's dense FP8 peak), and the JSON says so
        rate = bf16_rate if args.weights == "bf16" else fp8_rate or 2 * bf16_rate
        cupy.get_default_memory_pool().free_all_blocks()
        print(f"read {read_bw / 1e12:.2f} TB/s, bf16 matmul {bf16_rate / 1e12:.0f} TFLOP/s"
              + (f", fp8 matmul {_fmt(fp8_rate and fp8_rate / 1e12, '.0f', 'not measured')} TFLOP/s"
                 if args.weights == "fp8" else "") + f"; drawing the {args.weights} expert weights ...", flush=True)
        weights = SuiteWeights(model, args.weights)
        peer = None
        if args.weights == "fp8" and not args.no_peer:
            torch = load_torch_fp8_peer()
            peer = TorchScaledMM(torch, *weights.fp8, stream) if torch else None
        elif not args.no_peer:
            torch_peer = load_torch_peer()
            peer = TorchGroupedMM(*torch_peer, *weights.bf16, stream) if torch_peer else None
        rows = []
        for n, case in enumerate(cases, 1):
            started = time.perf_counter()
            rows.append(run_case(case, model, weights, peer, (read_bw, rate), stream, flush, args))
            print(progress_line(n, len(cases), rows[-1], time.perf_counter() - started), flush=True)
    headline = "ms_eager" if args.no_graph else "ms_graph"
    mean_ms, efficiency = suite_figures(rows, headline)
    peer_headline = headline if peer is None or peer.graphs else "ms_eager"  # the peer's own best mode
    peer_mean_ms, peer_efficiency = suite_figures(rows, f"peer_{peer_headline}") if peer else (None, None)
    return {
        "device": device,
        "cases_file": str(args.cases),
        "model": dataclasses.asdict(model),
        "headline": headline,
        "reps": args.reps,
        "weights": args.weights,
        "tolerance": weights.tolerance,
        "read_bw_TBps": read_bw / 1e12,
        "matmul_TFLOPs": bf16_rate / 1e12,
        "fp8_matmul_TFLOPs": fp8_rate and fp8_rate / 1e12,  # None: not measured
        "sol_matmul_TFLOPs": rate / 1e12,  # the rate of the weights' precision that the SOL uses
        "peer": peer.name if peer else None,
        "cases": rows,
        "sol_mean_ms": float(np.mean([row["sol_ms"] for row in rows])),
        "mean_ms": mean_ms,
        "sol_efficiency": efficiency,
        "peer_headline": peer_headline,
        "peer_mean_ms": peer_mean_ms,
        "peer_sol_efficiency": peer_efficiency,
        "peak_mem_MiB": max(row["peak_mem_MiB"] for row in rows),
    }


def format_table(result) -> str:
    """The results as a Markdown table with the suite figures below it."""
    key = result["headline"]
    kind = "graph" if key == "ms_graph" else "eager"
    peer_key = result.get("peer_headline", key)  # an eager-only peer is compared eager with eager
    peer_kind = "graph" if peer_key == "ms_graph" else "eager"
    weights = result.get("weights", "bf16")
    lines = [
        f"{result['device']}, {weights} weights: read {result['read_bw_TBps']:.2f} TB/s, bf16 matmul "
        f"{result['matmul_TFLOPs']:.0f} TFLOP/s"
        + (f", SOL at {result['sol_matmul_TFLOPs']:.0f} TFLOP/s" if weights != "bf16" else "")
        + (f", plan {result['plan']} forced" if result.get("plan") else "")
        + f"; peer: {result['peer'] or 'none'}",
        "| case | T | active experts | SOL ms | cupymoe graph ms | %SOL | cupymoe eager ms "
        f"| peer {peer_kind} ms | speedup (peer/cupymoe, {peer_kind}) | peak mem MiB | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["cases"]:
        ms, peer_ms = row[key], row[f"peer_{peer_key}"]
        share = row["sol_ms"] / ms if ms else None
        speedup = peer_ms / row[peer_key] if row[peer_key] and peer_ms else None
        missing = "-" if row["passed"] else "FAIL"
        peer_missing = "FAIL" if row["peer_passed"] is False else "-"
        lines.append(
            f"| {row['id']} | {row['T']} | {row['active_experts']} | {row['sol_ms']:.3f} "
            f"| {_fmt(row['ms_graph'], '.3f', missing)} | {_fmt(share, '.0%')} "
            f"| {_fmt(row['ms_eager'], '.3f', missing)} | {_fmt(peer_ms, '.3f', peer_missing)} "
            f"| {_fmt(speedup, '.2f')} | {row['peak_mem_MiB']:.1f} | {row['rel_err']:.1e} |"
        )
    lines.append(
        f"suite ({kind}): SOL mean {result['sol_mean_ms']:.3f} ms | cupymoe mean "
        f"{_fmt(result['mean_ms'], '.3f')} ms, sum(sol)/sum(ms) {_fmt(result['sol_efficiency'], '.1%')} "
        f"| peer ({peer_kind}) mean {_fmt(result['peer_mean_ms'], '.3f')} ms, sum(sol)/sum(ms) "
        f"{_fmt(result['peer_sol_efficiency'], '.1%')} | peak mem {result['peak_mem_MiB']:.1f} MiB"
    )
    return "\n".join(lines)


def plot(result, path) -> bool:
    """Latency vs tokens (log-log): SOL, cupymoe and the peer; uniform cases as lines, zipf as crosses.

    Returns False (after printing a note) when matplotlib is missing.
    """
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not importable", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = result["headline"]
    peer_key = result.get("peer_headline", key)
    peer_label = "peer" + ("" if peer_key == key else " (eager)")
    series = [("SOL", "sol_ms", "black", "--"), ("cupymoe", key, "C0", "-o"),
              (peer_label, f"peer_{peer_key}", "C1", "-s")]
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, column, color, line in series:
        for routing, fmt in (("uniform", line), ("zipf", "x")):
            points = sorted((row["T"], row[column]) for row in result["cases"]
                            if row["routing"] == routing and row[column] is not None)
            if points:
                ax.plot(*zip(*points), fmt, color=color, label=f"{label} ({routing})", markersize=5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"ms ({'graph replay' if key == 'ms_graph' else 'eager call'})")
    ax.set_title(f"MoE layer on {result['device']}: read {result['read_bw_TBps']:.2f} TB/s, "
                 f"matmul {result['matmul_TFLOPs']:.0f} TFLOP/s", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv):
    """The command line; ``--cases`` defaults to the suite shipped as package data."""
    parser = argparse.ArgumentParser(
        prog="python -m cupymoe.bench",
        description="The cupymoe benchmark suite: every case of cases.json checked against a float32 "
                    "reference, then timed (eager and CUDA graph) against the roofline and the torch "
                    "grouped_mm peer.",
    )
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES,
                        help="suite definition (default: the reference suite shipped with cupymoe)")
    parser.add_argument("--only", help="comma-separated case ids to run, e.g. u1,z64 (default: all)")
    parser.add_argument("--reps", type=int, default=25,
                        help="timed reps per measurement; the median is reported (default: 25)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder for the JSON and PNG, created if needed "
                             f"(default: {DEFAULT_OUT}, under the working directory)")
    parser.add_argument("--no-peer", action="store_true", help="skip the torch grouped_mm peer")
    parser.add_argument("--no-graph", action="store_true", help="time eager calls only (they become the headline)")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="the experts' precision: bf16, or fp8 (the bf16 draw quantized to block-scaled "
                             "e4m3, SOL with 1-byte weights and the FP8 matmul rate; default: bf16)")
    parser.add_argument("--plan", help="a tile plan of cupymoe.plans, by name, forced for every case, e.g. a trial "
                                       "plan (plans.FP8_TRIAL_PLANS) against the default (default: none)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.plan is not None:
        try:
            forced_plan(args.plan, args.weights)
        except ValueError as err:
            parser.error(str(err))
    try:
        model, cases = load_suite(args.cases)
        cases = select_cases(cases, args.only)
    except (OSError, KeyError, ValueError) as err:
        parser.error(f"{args.cases}: {type(err).__name__}: {err}")
    return args, model, cases


def forced_plan(name: str, weights: str) -> plans.Plan:
    """The plan of cupymoe.plans called ``name``; ValueError if there is none, or if it does not
    run the suite's ``weights`` (the check of a forward, at Hopper's sizes)."""
    chosen = getattr(plans, name, None)
    if not isinstance(chosen, plans.Plan):
        raise ValueError(f"--plan: {name!r} is not a plan of cupymoe.plans")
    try:
        with plans.forced(chosen):
            plans.plan(1, 8, 256, 4096, 1024, plans.WGMMA_COMPUTE_CAPABILITY, 227 * 1024, fp8=weights == "fp8")
    except ValueError as err:
        raise ValueError(f"--plan {name} with {weights} weights: {err}") from None
    return chosen


def main(argv=None) -> int:
    """Run the suite; 0 when every case passed its check, 1 when one failed, 2 without a GPU."""
    args, model, cases = parse_args(argv)
    if not gpu_available():
        print("cupymoe.bench needs a CUDA GPU, and CuPy sees none", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with plans.forced(forced_plan(args.plan, args.weights)) if args.plan else contextlib.nullcontext():
        result = run_suite(model, cases, args)
    result["plan"] = args.plan
    print(format_table(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tags = ("-fp8" if args.weights == "fp8" else "") + (f"-{args.plan.lower()}" if args.plan else "")
    stem = args.out / f"suite-{device_short_name(result['device'])}{tags}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    written = [stem.with_suffix(".json")]
    if plot(result, stem.with_suffix(".png")):
        written.append(stem.with_suffix(".png"))
    print(f"wrote {', '.join(map(str, written))} in {time.perf_counter() - started:.0f} s", flush=True)
    return 0 if all(row["passed"] for row in result["cases"]) else 1
