"""The reference benchmark suite (``benchmarks/cases.json``): cupymoe against its roofline and a peer.

Run ``python -m cupymoe.bench`` or ``python benchmarks/suite.py``; ``--help`` lists the options.

For every case the inputs are generated in the draw order that cases.json documents, the
output is checked against a float32 reference (relative L2 error below 1e-2), and then eager
calls and CUDA-graph replays are timed: before each rep the L2 cache is flushed by writing
256 MiB and the device is synchronised, CUDA events bracket one call, and the median over the
reps (after a warm-up) is reported. The speed of light (SOL) of a case comes from two ceilings
measured in the same run: streaming-read bandwidth (``kernels_cu/stream_read.cu``) and the bf16
matmul rate. When torch is importable, the torch ``grouped_mm`` pipeline of peers-h200.md runs
on the same inputs (shared zero-copy through DLPack) as a peer. The suite prints one table and
writes ``suite-<device>.json`` and ``suite-<device>.png``.

The case generators and the SOL formula need only NumPy, so tests can reuse them.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from . import _compile
from .layer import MoE

BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_NAN_BITS = 0x7FC0  # outputs are poisoned with this before every checked run
TOLERANCE = 1e-2  # relative L2 error allowed against the float32 reference
WARMUP = 3  # untimed reps before every timing
FLUSH_BYTES = 256 << 20  # written before every rep to evict the L2 cache
READ_BYTES = 4 << 30  # buffer of the streaming-read probe
READ_BLOCK = 512  # threads per block of the probe
READ_BLOCKS_PER_SM = (4, 8, 16)  # grid sizes tried; the best one counts
READ_REPS = 20
MATMUL_N = 8192  # the matmul probe is N x N x N in bf16
MATMUL_REPS = 10
WEIGHT_CHUNK = 16  # experts drawn at once: bounds the float32 scratch to 512 MiB
DEFAULT_CASES = Path(__file__).resolve().parent.parent / "benchmarks" / "cases.json"
DEFAULT_OUT = Path("benchmarks") / "results"


# ----------------------------------------------------------------------------- cases (NumPy only)


@dataclasses.dataclass(frozen=True)
class Model:
    """The layer sizes shared by every case (cases.json ``model``)."""

    hidden: int  # H
    experts: int  # E
    intermediate: int  # I
    top_k: int  # k


@dataclasses.dataclass(frozen=True)
class Case:
    """One entry of cases.json ``cases``."""

    id: str
    tokens: int  # T
    routing: str  # a key of ROUTINGS
    seed: int  # seeds numpy.random.default_rng for this case's inputs


def uniform_ids(rng, tokens, experts, top_k):
    """k distinct experts per token, uniformly at random: int64 [T, k]."""
    return np.argsort(rng.random((tokens, experts)), axis=1, kind="stable")[:, :top_k]


def zipf_ids(rng, tokens, experts, top_k):
    """k distinct experts per token, Gumbel-top-k over log-weights -1.2*log(rank+1): int64 [T, k]."""
    rank = rng.permutation(experts)
    noise = rng.gumbel(size=(tokens, experts))
    return np.argsort(-(-1.2 * np.log(rank + 1) + noise), axis=1, kind="stable")[:, :top_k]


ROUTINGS = {"uniform": uniform_ids, "zipf": zipf_ids}


def load_suite(path) -> tuple[Model, list[Case]]:
    """Read a cases.json file; return its Model and its Cases in file order."""
    spec = json.loads(Path(path).read_text())
    m = spec["model"]
    model = Model(m["hidden_size"], m["num_experts"], m["intermediate_size"], m["top_k"])
    cases = [Case(c["id"], c["tokens"], c["routing"], c["seed"]) for c in spec["cases"]]
    for case in cases:
        if case.routing not in ROUTINGS:
            raise ValueError(f"case {case.id}: routing must be one of {sorted(ROUTINGS)}, got {case.routing!r}")
    return model, cases


def select_cases(cases, only):
    """The cases named in ``only`` (comma-separated ids, None for all), in suite order."""
    if only is None:
        return list(cases)
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    known = {case.id for case in cases}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise ValueError(f"unknown case ids {unknown}; the suite has {[case.id for case in cases]}")
    return [case for case in cases if case.id in wanted]


def softmax(logits):
    """Row-wise softmax of a 2-d array."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def make_case_inputs(case: Case, model: Model):
    """The inputs of one case, drawn from ``numpy.random.default_rng(case.seed)`` in the documented order.

    Returns
    -------
    (x, topk_ids, topk_weights) : NumPy arrays
        x bfloat16 [T, H]; topk_ids int32 [T, k], distinct experts per token;
        topk_weights float32 [T, k], each row a softmax of N(0, 1) logits.
    """
    rng = np.random.default_rng(case.seed)
    x = rng.standard_normal((case.tokens, model.hidden), dtype=np.float32)
    ids = ROUTINGS[case.routing](rng, case.tokens, model.experts, model.top_k)
    weights = softmax(rng.standard_normal((case.tokens, model.top_k)))
    return x.astype(BF16), ids.astype(np.int32), weights.astype(np.float32)


def active_experts(topk_ids) -> int:
    """How many distinct experts the routing uses."""
    return int(np.unique(topk_ids).size)


def sol_ms(model: Model, tokens: int, active: int, read_bw: float, matmul_rate: float) -> float:
    """Speed of light of one forward in ms: max(bytes / read_bw, flops / matmul_rate).

    bytes = active*3*H*I*2 (expert weights) + 2*T*H*2 (x and out) + T*k*8 (ids and weights);
    flops = 6*T*k*H*I. ``read_bw`` in bytes/s, ``matmul_rate`` in FLOP/s.
    """
    h, i, k = model.hidden, model.intermediate, model.top_k
    moved = active * 3 * h * i * 2 + 2 * tokens * h * 2 + tokens * k * 8
    flops = 6 * tokens * k * h * i
    return max(moved / read_bw, flops / matmul_rate) * 1e3


def device_short_name(name: str) -> str:
    """A file-name tag for a GPU: its first word with a digit, lower case ('NVIDIA H200' -> 'h200')."""
    for word in re.split(r"[\s_-]+", name):
        if any(ch.isdigit() for ch in word):
            return re.sub(r"[^a-z0-9]", "", word.lower())
    return "gpu"


# ----------------------------------------------------------------------------- GPU measurement


def time_call(run, stream, flush, reps) -> float:
    """Median ms of ``run()`` over ``reps`` reps after WARMUP untimed ones.

    Each rep writes ``flush`` (evicting L2), synchronises the device, then records CUDA
    events on ``stream`` around one ``run()``. ``stream`` is CuPy's current stream meanwhile;
    work that ``run`` sends elsewhere (a torch stream) must go to the same CUDA stream.
    """
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    with stream:
        for rep in range(WARMUP + reps):
            flush.fill(rep)
            cupy.cuda.runtime.deviceSynchronize()
            start.record(stream)
            run()
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times[WARMUP:]))


def streaming_reads(device_id) -> dict:
    """For each grid size of READ_BLOCKS_PER_SM (blocks per SM), a callable that enqueues one
    streaming read of a READ_BYTES buffer."""
    import cupy

    kernel = _compile.kernel("stream_read.cu", "stream_read", ("stream_read",), device_id)
    src = cupy.random.default_rng(1).random(READ_BYTES // 4, dtype=cupy.float32)
    sink = cupy.zeros(1, cupy.uint64)
    sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    args = (src, np.uint64(READ_BYTES // 16), sink)
    return {per_sm: functools.partial(kernel, (sms * per_sm,), (READ_BLOCK,), args) for per_sm in READ_BLOCKS_PER_SM}


def read_bandwidth(stream, flush, device_id) -> float:
    """Streaming-read bandwidth in bytes/s: the best grid size, median of READ_REPS reads of 4 GiB."""
    reads = streaming_reads(device_id).values()
    best_ms = min(time_call(read, stream, flush, READ_REPS) for read in reads)
    return READ_BYTES / (best_ms * 1e-3)


def matmul_rate(stream, flush) -> float:
    """bf16 matmul rate in FLOP/s: MATMUL_N^3 through cupy.matmul (cuBLAS), median of MATMUL_REPS."""
    import cupy

    rng = cupy.random.default_rng(2)
    a, b = (rng.standard_normal((MATMUL_N, MATMUL_N), dtype=cupy.float32).astype(BF16) for _ in range(2))
    ms = time_call(lambda: cupy.matmul(a, b), stream, flush, MATMUL_REPS)
    return 2 * MATMUL_N**3 / (ms * 1e-3)


def expert_weights(model: Model, seed: int = 0):
    """w13 ~ N(0,1)/sqrt(H) [E, 2I, H] and w2 ~ N(0,1)/sqrt(I) [E, H, I], bf16 CuPy arrays.

    Drawn with ``cupy.random.default_rng(seed)`` in float32, WEIGHT_CHUNK experts at a time.
    """
    import cupy

    rng = cupy.random.default_rng(seed)
    e, h, i = model.experts, model.hidden, model.intermediate
    w13 = cupy.empty((e, 2 * i, h), BF16)
    w2 = cupy.empty((e, h, i), BF16)
    for w, fan_in in ((w13, h), (w2, i)):
        for lo in range(0, e, WEIGHT_CHUNK):
            block = rng.standard_normal((min(WEIGHT_CHUNK, e - lo),) + w.shape[1:], dtype=cupy.float32)
            block *= np.float32(1 / np.sqrt(fan_in))
            w[lo:lo + block.shape[0]] = block.astype(BF16)
    return w13, w2


def reference_output(x, topk_ids, topk_weights, w13, w2):
    """The float32 MoE output [T, H] on the GPU, one active expert at a time.

    ``x``, ``w13``, ``w2`` are the bf16 CuPy inputs (upcast here); ``topk_ids`` and
    ``topk_weights`` are the NumPy routing arrays.
    """
    import cupy

    tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    flat = topk_ids.ravel()
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(w13.shape[0] + 1))
    rows = cupy.asarray(order // top_k)
    scales = cupy.asarray(topk_weights.ravel()[order])[:, None]
    x32 = x.astype(cupy.float32)
    out = cupy.zeros((tokens, w2.shape[1]), cupy.float32)
    for e in np.flatnonzero(np.diff(bounds)):
        lo, hi = bounds[e], bounds[e + 1]
        xs = x32[rows[lo:hi]]
        w = w13[e].astype(cupy.float32)
        gate, up = xs @ w[:inter].T, xs @ w[inter:].T
        h = gate / (1 + cupy.exp(-gate)) * up
        # A token's k experts are distinct, so rows[lo:hi] has no repeats and += is exact.
        out[rows[lo:hi]] += scales[lo:hi] * (h @ w2[e].astype(cupy.float32).T)
    return out


def _as_cupy(a):
    import cupy

    return a if isinstance(a, cupy.ndarray) else cupy.from_dlpack(a)


def poison(out) -> None:
    """Fill a bf16 output (CuPy or DLPack array) with NaN so that unwritten elements fail the check."""
    _as_cupy(out).view(np.uint16).fill(BF16_NAN_BITS)


def rel_l2(got, want) -> float:
    """||got - want|| / ||want|| with ``got`` a bf16 CuPy or DLPack array, ``want`` float32 CuPy."""
    import cupy

    diff = _as_cupy(got).astype(cupy.float32) - want
    return float(cupy.linalg.norm(diff) / cupy.linalg.norm(want))


def check_and_time(eager, capture, ref, stream, flush, reps) -> dict:
    """Check one contender's outputs against ``ref``, then time it.

    ``eager()`` runs one forward on ``stream`` and returns its output; ``capture()`` records
    one forward in a CUDA graph and returns ``(replay, output)``, or ``capture`` is None to
    skip graphs. Outputs are poisoned before each checked run. Returns ``rel_err`` (the worse
    of eager and graph), ``ms_eager`` and ``ms_graph``; the times are None when the check fails.
    """
    poison(eager())
    errors = [rel_l2(eager(), ref)]
    replay = None
    if capture is not None:
        replay, out = capture()
        poison(out)
        replay()
        errors.append(rel_l2(out, ref))
    err = float(np.max(errors))
    passed = err < TOLERANCE
    return {
        "rel_err": err,
        "ms_eager": time_call(eager, stream, flush, reps) if passed else None,
        "ms_graph": time_call(replay, stream, flush, reps) if passed and replay else None,
    }


# ----------------------------------------------------------------------------- contenders


def bench_cupymoe(w13, w2, inputs, ref, stream, flush, reps, graph) -> dict:
    """cupymoe on one case: peak memory of its first call, then :func:`check_and_time`.

    ``peak_mem_MiB`` is the growth of CuPy's default memory pool (emptied of cached blocks
    first) over the first call of a fresh ``MoE``: workspace, output and temporaries.
    """
    import cupy

    moe = MoE(w13, w2)

    def eager():
        return moe(*inputs, check_ids=False)

    def capture():
        with stream:
            stream.begin_capture()
            out = eager()
            cuda_graph = stream.end_capture()
        return functools.partial(cuda_graph.launch, stream), out

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    eager()  # allocates the workspace and compiles the kernels
    peak = (pool.total_bytes() - before) / 2**20
    result = check_and_time(eager, capture if graph else None, ref, stream, flush, reps)
    return {"peak_mem_MiB": peak, **result}


def load_torch_peer():
    """``(torch, grouped_mm, label)`` for the peer, or None after printing why it is skipped.

    grouped_mm is ``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``.
    """
    try:
        import torch
    except ImportError:
        print("peer skipped: torch is not importable", flush=True)
        return None
    if not torch.cuda.is_available():
        print("peer skipped: torch sees no CUDA device", flush=True)
        return None
    for owner, name in ((torch.nn.functional, "nn.functional.grouped_mm"), (torch, "_grouped_mm")):
        grouped_mm = getattr(owner, name.rpartition(".")[2], None)
        if grouped_mm is not None:
            return torch, grouped_mm, f"torch {torch.__version__} {name}"
    print(f"peer skipped: torch {torch.__version__} has neither nn.functional.grouped_mm "
          "nor _grouped_mm", flush=True)
    return None


class TorchGroupedMM:
    """The torch grouped_mm pipeline of peers-h200.md on the suite's weights (shared zero-copy).

    Its work runs on ``stream`` (a CuPy stream, wrapped as a torch ExternalStream) so the
    same CUDA events time it.
    """

    def __init__(self, torch, grouped_mm, name, w13, w2, stream):
        self.torch = torch
        self.grouped_mm = grouped_mm
        self.name = name
        self.w13 = torch.from_dlpack(w13).transpose(1, 2)  # [E, H, 2I], column-major per expert
        self.w2 = torch.from_dlpack(w2).transpose(1, 2)  # [E, I, H]
        self.stream = torch.cuda.ExternalStream(stream.ptr)

    def forward(self, x, topk_ids, topk_weights):
        """Argsort by expert, gather, grouped_mm gate/up, silu*up, grouped_mm down, weighted index_add_."""
        torch = self.torch
        experts, _, two_i = self.w13.shape
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount syncs
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = order // topk_ids.shape[1]
        gate_up = self.grouped_mm(x.index_select(0, rows), self.w13, offs=offs)
        h = torch.nn.functional.silu(gate_up[:, : two_i // 2]) * gate_up[:, two_i // 2:]
        down = self.grouped_mm(h, self.w2, offs=offs)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, rows, down * topk_weights.reshape(-1)[order].unsqueeze(1))
        return out.to(x.dtype)

    def bench(self, inputs, ref, stream, flush, reps, graph) -> dict:
        """:func:`check_and_time` on one case's CuPy inputs (CuPy's current stream must be
        ``stream``); keys prefixed ``peer_``."""
        torch = self.torch
        args = tuple(torch.from_dlpack(a) for a in inputs)

        def eager():
            return self.forward(*args)

        def capture():
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                out = eager()
            return cuda_graph.replay, out

        with torch.cuda.stream(self.stream):
            result = check_and_time(eager, capture if graph else None, ref, stream, flush, reps)
        return {f"peer_{key}": value for key, value in result.items()}


# ----------------------------------------------------------------------------- the suite


def run_case(case, model, weights, peer, ceilings, stream, flush, args) -> dict:
    """Generate, check and time one case on ``stream`` (CuPy's current stream); return its row."""
    import cupy

    x_host, ids_host, weights_host = make_case_inputs(case, model)
    inputs = tuple(cupy.asarray(a) for a in (x_host, ids_host, weights_host))
    ref = reference_output(inputs[0], ids_host, weights_host, *weights)
    active = active_experts(ids_host)
    row = {
        "id": case.id,
        "T": case.tokens,
        "routing": case.routing,
        "active_experts": active,
        "sol_ms": sol_ms(model, case.tokens, active, *ceilings),
    }
    graph = not args.no_graph
    row.update(bench_cupymoe(*weights, inputs, ref, stream, flush, args.reps, graph))
    row.update(peer_rel_err=None, peer_ms_eager=None, peer_ms_graph=None)
    if peer is not None:
        try:
            row.update(peer.bench(inputs, ref, stream, flush, args.reps, graph))
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
    if not row["rel_err"] < TOLERANCE:
        line += " FAILED the check"
    if row["peer_rel_err"] is not None:
        line += (f" | peer graph {_fmt(row['peer_ms_graph'], '.3f')} "
                 f"eager {_fmt(row['peer_ms_eager'], '.3f')} ms err {row['peer_rel_err']:.1e}")
        if not row["peer_rel_err"] < TOLERANCE:
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
        ceilings = (read_bandwidth(stream, flush, device_id), matmul_rate(stream, flush))
        cupy.get_default_memory_pool().free_all_blocks()
        print(f"read {ceilings[0] / 1e12:.2f} TB/s, bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s; "
              "drawing the expert weights ...", flush=True)
        weights = expert_weights(model)
        torch_peer = None if args.no_peer else load_torch_peer()
        peer = TorchGroupedMM(*torch_peer, *weights, stream) if torch_peer else None
        rows = []
        for n, case in enumerate(cases, 1):
            started = time.perf_counter()
            rows.append(run_case(case, model, weights, peer, ceilings, stream, flush, args))
            print(progress_line(n, len(cases), rows[-1], time.perf_counter() - started), flush=True)
    headline = "ms_eager" if args.no_graph else "ms_graph"
    mean_ms, efficiency = suite_figures(rows, headline)
    peer_mean_ms, peer_efficiency = suite_figures(rows, f"peer_{headline}") if peer else (None, None)
    return {
        "device": device,
        "cases_file": str(args.cases),
        "model": dataclasses.asdict(model),
        "headline": headline,
        "reps": args.reps,
        "read_bw_TBps": ceilings[0] / 1e12,
        "matmul_TFLOPs": ceilings[1] / 1e12,
        "peer": peer.name if peer else None,
        "cases": rows,
        "sol_mean_ms": float(np.mean([row["sol_ms"] for row in rows])),
        "mean_ms": mean_ms,
        "sol_efficiency": efficiency,
        "peer_mean_ms": peer_mean_ms,
        "peer_sol_efficiency": peer_efficiency,
        "peak_mem_MiB": max(row["peak_mem_MiB"] for row in rows),
    }


# ----------------------------------------------------------------------------- report


def format_table(result) -> str:
    """The results as a Markdown table with the suite figures below it."""
    key = result["headline"]
    kind = "graph" if key == "ms_graph" else "eager"
    lines = [
        f"{result['device']}: read {result['read_bw_TBps']:.2f} TB/s, bf16 matmul "
        f"{result['matmul_TFLOPs']:.0f} TFLOP/s; peer: {result['peer'] or 'none'}",
        "| case | T | active experts | SOL ms | cupymoe graph ms | %SOL | cupymoe eager ms "
        "| peer graph ms | speedup (peer/cupymoe) | peak mem MiB | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["cases"]:
        ms, peer_ms = row[key], row[f"peer_{key}"]
        share = row["sol_ms"] / ms if ms else None
        speedup = peer_ms / ms if ms and peer_ms else None
        missing = "-" if row["rel_err"] < TOLERANCE else "FAIL"
        peer_missing = "FAIL" if row["peer_rel_err"] is not None and not row["peer_rel_err"] < TOLERANCE else "-"
        lines.append(
            f"| {row['id']} | {row['T']} | {row['active_experts']} | {row['sol_ms']:.3f} "
            f"| {_fmt(row['ms_graph'], '.3f', missing)} | {_fmt(share, '.0%')} "
            f"| {_fmt(row['ms_eager'], '.3f', missing)} | {_fmt(row['peer_ms_graph'], '.3f', peer_missing)} "
            f"| {_fmt(speedup, '.2f')} | {row['peak_mem_MiB']:.1f} | {row['rel_err']:.1e} |"
        )
    lines.append(
        f"suite ({kind}): SOL mean {result['sol_mean_ms']:.3f} ms | cupymoe mean "
        f"{_fmt(result['mean_ms'], '.3f')} ms, sum(sol)/sum(ms) {_fmt(result['sol_efficiency'], '.1%')} "
        f"| peer mean {_fmt(result['peer_mean_ms'], '.3f')} ms, sum(sol)/sum(ms) "
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
    series = [("SOL", "sol_ms", "black", "--"), ("cupymoe", key, "C0", "-o"),
              ("torch grouped_mm", f"peer_{key}", "C1", "-s")]
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


# ----------------------------------------------------------------------------- command line


def parse_args(argv):
    """The command line; ``--cases`` defaults to the checkout's benchmarks/cases.json."""
    parser = argparse.ArgumentParser(
        prog="python -m cupymoe.bench",
        description="The cupymoe benchmark suite: every case of cases.json checked against a float32 "
                    "reference, then timed (eager and CUDA graph) against the roofline and the torch "
                    "grouped_mm peer.",
    )
    parser.add_argument("--cases", type=Path, help=f"suite definition (default: {DEFAULT_CASES}, when present)")
    parser.add_argument("--only", help="comma-separated case ids to run, e.g. u1,z64 (default: all)")
    parser.add_argument("--reps", type=int, default=25,
                        help="timed reps per measurement; the median is reported (default: 25)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder for the JSON and PNG, created if needed "
                             f"(default: {DEFAULT_OUT}, under the working directory)")
    parser.add_argument("--no-peer", action="store_true", help="skip the torch grouped_mm peer")
    parser.add_argument("--no-graph", action="store_true", help="time eager calls only (they become the headline)")
    args = parser.parse_args(argv)
    if args.cases is None:
        if not DEFAULT_CASES.is_file():
            parser.error(f"{DEFAULT_CASES} does not exist; pass --cases PATH")
        args.cases = DEFAULT_CASES
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    try:
        model, cases = load_suite(args.cases)
        cases = select_cases(cases, args.only)
    except (OSError, KeyError, ValueError) as err:
        parser.error(f"{args.cases}: {type(err).__name__}: {err}")
    return args, model, cases


def main(argv=None) -> int:
    """Run the suite; 0 when every case passed its check, 1 when one failed, 2 without a GPU."""
    args, model, cases = parse_args(argv)
    if not _compile.gpu_available():
        print("cupymoe.bench needs a CUDA GPU, and CuPy sees none", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = run_suite(model, cases, args)
    print(format_table(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"suite-{device_short_name(result['device'])}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    written = [stem.with_suffix(".json")]
    if plot(result, stem.with_suffix(".png")):
        written.append(stem.with_suffix(".png"))
    print(f"wrote {', '.join(map(str, written))} in {time.perf_counter() - started:.0f} s", flush=True)
    return 0 if all(row["rel_err"] < TOLERANCE for row in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
