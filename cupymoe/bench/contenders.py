"""The contenders of a case, each checked against a float32 reference before it is timed: cupymoe
(an ``MoE`` layer, eager and CUDA graph) and, where torch is importable, the torch ``grouped_mm``
pipeline (benchmarks/PERF.md, "Peers"; with FP8 weights, per-expert ``scaled_mm``), on the same
inputs shared zero-copy through DLPack."""
from __future__ import annotations

import functools

import numpy as np

from .._contract import E4M3_MAX, FP8_AMAX_FLOOR, FP8_BLOCK
from .measure import time_call

BF16_NAN_BITS = 0x7FC0  # outputs are poisoned with this before every checked run
def reference_output(x, topk_ids, topk_weights, expert):
    """The float32 MoE output [T, H] on the GPU, one active expert at a time.

    ``x`` is the bf16 CuPy input (upcast here); ``topk_ids`` and ``topk_weights`` are the NumPy
    routing arrays; ``expert(e)`` gives expert e's (w13 [2I, H], w2 [H, I]) in float32.
    """
    import cupy

    tokens, top_k = topk_ids.shape
    experts = int(topk_ids.max()) + 1
    flat = topk_ids.ravel()
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(experts + 1))
    rows = cupy.asarray(order // top_k)
    scales = cupy.asarray(topk_weights.ravel()[order])[:, None]
    x32 = x.astype(cupy.float32)
    out = cupy.zeros(x.shape, cupy.float32)
    for e in np.flatnonzero(np.diff(bounds)):
        lo, hi = bounds[e], bounds[e + 1]
        xs = x32[rows[lo:hi]]
        w13, w2 = expert(int(e))
        inter = w13.shape[0] // 2
        gate, up = xs @ w13[:inter].T, xs @ w13[inter:].T
        h = gate / (1 + cupy.exp(-gate)) * up
        # A token's k experts are distinct, so rows[lo:hi] has no repeats and += is exact.
        out[rows[lo:hi]] += scales[lo:hi] * (h @ w2.T)
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


def check_and_time(eager, capture, ref, stream, flush, reps, tolerance) -> dict:
    """Check one contender's outputs against ``ref``, then time it.

    ``eager()`` runs one forward on ``stream`` and returns its output; ``capture()`` records
    one forward in a CUDA graph and returns ``(replay, output)``, or ``capture`` is None to
    skip graphs. Outputs are poisoned before each checked run. Returns ``rel_err`` (the worse
    of eager and graph), ``ms_eager`` and ``ms_graph``; the times are None when the error is not
    below ``tolerance``.
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
    passed = err < tolerance
    return {
        "rel_err": err,
        "ms_eager": time_call(eager, stream, flush, reps) if passed else None,
        "ms_graph": time_call(replay, stream, flush, reps) if passed and replay else None,
    }


def bench_cupymoe(weights, inputs, ref, stream, flush, reps, graph) -> dict:
    """cupymoe on one case (``weights``: measure.SuiteWeights): peak memory of its first call,
    then :func:`check_and_time`.

    ``peak_mem_MiB`` is the growth of CuPy's default memory pool (emptied of cached blocks
    first) over the first call of a fresh ``MoE``: workspace, output and temporaries.
    """
    import cupy

    moe = weights.layer()

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
    result = check_and_time(eager, capture if graph else None, ref, stream, flush, reps, weights.tolerance)
    return {"peak_mem_MiB": peak, **result}


def _cuda_torch():
    """torch, if it imports and sees a CUDA device; else None after printing why the peer is skipped."""
    try:
        import torch
    except ImportError:
        print("peer skipped: torch is not importable", flush=True)
        return None
    if not torch.cuda.is_available():
        print("peer skipped: torch sees no CUDA device", flush=True)
        return None
    return torch


def load_torch_fp8_peer():
    """``torch`` for the FP8 peer (``torch.nn.functional.scaled_mm`` with block scales), or None
    after printing why it is skipped."""
    torch = _cuda_torch()
    if torch is None:
        return None
    if not all(hasattr(torch.nn.functional, name) for name in ("scaled_mm", "ScalingType", "SwizzleType")):
        print(f"peer skipped: torch {torch.__version__} has no nn.functional.scaled_mm", flush=True)
        return None
    return torch


def load_torch_peer():
    """``(torch, grouped_mm, label)`` for the peer, or None after printing why it is skipped.

    grouped_mm is ``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``.
    """
    torch = _cuda_torch()
    if torch is None:
        return None
    for owner, name in ((torch.nn.functional, "nn.functional.grouped_mm"), (torch, "_grouped_mm")):
        grouped_mm = getattr(owner, name.rpartition(".")[2], None)
        if grouped_mm is not None:
            return torch, grouped_mm, f"torch {torch.__version__} {name}"
    print(f"peer skipped: torch {torch.__version__} has neither nn.functional.grouped_mm "
          "nor _grouped_mm", flush=True)
    return None


class TorchGroupedMM:
    """The torch grouped_mm pipeline (PERF.md, "Peers") on the suite's weights (shared zero-copy).

    Its work runs on ``stream`` (a CuPy stream, wrapped as a torch ExternalStream) so the
    same CUDA events time it.
    """

    graphs = True  # timed as CUDA graph replays too

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

    def bench(self, inputs, ref, stream, flush, reps, graph, tolerance) -> dict:
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
            result = check_and_time(eager, capture if graph else None, ref, stream, flush, reps, tolerance)
        return {f"peer_{key}": value for key, value in result.items()}


class TorchScaledMM:
    """The FP8 peer: per expert, torch ``nn.functional.scaled_mm`` (cuBLASLt) with the suite's
    block-scaled weights (128 x 128) and activations quantized per token and 128-channel group
    (1 x 128), as cupymoe's w8a8: gate/up, silu * up rounded to bf16 and quantized, down, a weighted
    index_add_. The expert groups' sizes come to the host, so it runs eager only (no CUDA graph)."""

    graphs = False
    ROW_ALIGN = 16

    def __init__(self, torch, q13, s13, q2, s2, stream):
        self.torch = torch
        self.name = f"torch {torch.__version__} nn.functional.scaled_mm per expert (block scales, eager)"
        as_e4m3 = lambda q: torch.from_dlpack(q).view(torch.float8_e4m3fn)
        self.q13, self.q2 = as_e4m3(q13), as_e4m3(q2)
        # scaled_mm takes B as [K, N] and its 128 x 128 scales as [K / 128, N / 128], K-major
        self.s13, self.s2 = (torch.from_dlpack(s).transpose(1, 2) for s in (s13, s2))
        self.stream = torch.cuda.ExternalStream(stream.ptr)

    def _quantized(self, a):
        """e4m3 [n, C] and float32 scales [n, C / 128] of ``a`` [n, C] (group amax / 448)."""
        torch = self.torch
        groups = a.float().view(a.shape[0], -1, FP8_BLOCK)
        scale = groups.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR) / E4M3_MAX
        return (groups / scale[..., None]).to(torch.float8_e4m3fn).view(a.shape), scale

    def _matmul(self, q, scale, w, w_scale):
        """[m, N] bf16: q [m, K] e4m3 with its 1 x 128 scales times w [N, K] with its 128 x 128 ones.
        cuBLASLt takes the rows in multiples of ROW_ALIGN (zero rows added, cut off after) and A's
        scales column-major."""
        torch = self.torch
        functional = torch.nn.functional
        kinds, swizzle = functional.ScalingType, functional.SwizzleType.NO_SWIZZLE
        rows = q.shape[0]
        padded = -(-rows // self.ROW_ALIGN) * self.ROW_ALIGN
        a = torch.zeros((padded, q.shape[1]), dtype=torch.uint8, device=q.device)
        a[:rows] = q.view(torch.uint8)
        a_scale = torch.ones((padded, scale.shape[1]), dtype=torch.float32, device=q.device)
        a_scale[:rows] = scale
        a_scale = torch.empty_strided(a_scale.shape, (1, padded), dtype=torch.float32, device=q.device).copy_(a_scale)
        out = functional.scaled_mm(a.view(torch.float8_e4m3fn), w.t(), a_scale, kinds.BlockWise1x128, w_scale,
                                   kinds.BlockWise128x128, swizzle_a=swizzle, swizzle_b=swizzle,
                                   output_dtype=torch.bfloat16)
        return out[:rows]

    def forward(self, x, topk_ids, topk_weights):
        torch = self.torch
        experts, two_i, _ = self.q13.shape
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts).tolist()
        rows = order // topk_ids.shape[1]
        xq, x_scale = self._quantized(x.index_select(0, rows))
        down = torch.empty((rows.shape[0], x.shape[1]), dtype=torch.bfloat16, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if count:
                part = slice(start, start + count)
                gate_up = self._matmul(xq[part], x_scale[part], self.q13[e], self.s13[e])
                h = torch.nn.functional.silu(gate_up[:, : two_i // 2].float()) * gate_up[:, two_i // 2:].float()
                hq, h_scale = self._quantized(h.to(torch.bfloat16))
                down[part] = self._matmul(hq, h_scale, self.q2[e], self.s2[e])
                start += count
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, rows, down.float() * topk_weights.reshape(-1)[order].unsqueeze(1))
        return out.to(x.dtype)

    def bench(self, inputs, ref, stream, flush, reps, graph, tolerance) -> dict:
        """:func:`check_and_time` on one case's CuPy inputs, eager only; keys prefixed ``peer_``."""
        args = tuple(self.torch.from_dlpack(a) for a in inputs)
        with self.torch.cuda.stream(self.stream):
            result = check_and_time(lambda: self.forward(*args), None, ref, stream, flush, reps, tolerance)
        return {f"peer_{key}": value for key, value in result.items()}
