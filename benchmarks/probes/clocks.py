"""The SM clock and board power while one workload runs back to back for a few seconds: a suite
case's CUDA graph (`python benchmarks/clocks.py u8192`), cuBLAS bf16 8192^3 (`... matmul`) or the
suite's streaming read of 4 GiB (`... read`). `nvidia-smi` samples every 100 ms; the first five
samples are dropped. Throttle reason 0x4 is the software power cap. docs/notes-archive.md has the results: from
u2048 up the layer runs at the power cap (v13), and what a FLOP and a DRAM byte cost there (v25).
"""
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # run from a checkout without installing

from cupymoe import MoE  # noqa: E402
from cupymoe.bench import cases, measure  # noqa: E402

SECONDS = 4
SMI_QUERY = "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def workload(name, stream):
    """A callable that enqueues one run of `name` on `stream`, and what one run does: (FLOPs, None)
    for the matmul, (None, bytes) for the read, (None, None) for a case."""
    import cupy

    if name == "matmul":
        n = measure.MATMUL_N  # the size of the suite's matmul ceiling probe
        a = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cases.BF16)
        b = a.T.copy()
        return (lambda: cupy.matmul(a, b)), (2 * n**3, None)
    if name == "read":  # the suite's probe at its smallest grid
        read = measure.streaming_reads(cupy.cuda.Device().id)[measure.READ_BLOCKS_PER_SM[0]]
        return read, (None, measure.READ_BYTES)
    model, suite_cases = cases.load_suite(cases.DEFAULT_CASES)
    (case,) = [c for c in suite_cases if c.id == name]
    x, ids, w = cases.make_case_inputs(case, model)
    inputs = tuple(cupy.asarray(v) for v in (x, ids, w))
    moe = MoE(*measure.expert_weights(model))
    moe(*inputs, check_ids=False)
    stream.begin_capture()
    moe(*inputs, check_ids=False)
    graph = stream.end_capture()
    return (lambda: graph.launch(stream)), (None, None)


def main(name) -> int:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run, (flop, nbytes) = workload(name, stream)
        for _ in range(20):
            run()
        stream.synchronize()
        smi = subprocess.Popen(["nvidia-smi", SMI_QUERY, "--format=csv,noheader,nounits", "-lms", "100"],
                               stdout=subprocess.PIPE, text=True)
        start, calls = time.time(), 0
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        while time.time() - start < SECONDS:
            for _ in range(10):
                run()
            calls += 10
            stream.synchronize()
        end.record(stream)
        end.synchronize()
        smi.terminate()
        samples = [line.split(",") for line in smi.communicate()[0].strip().splitlines()[5:]]
    ms = cupy.cuda.get_elapsed_time(begin, end) / calls
    clock = np.median([float(s[0]) for s in samples])
    power = np.median([float(s[1]) for s in samples])
    reasons = sorted({s[3].strip() for s in samples})
    rate = f", {flop / ms / 1e9:.0f} TFLOP/s" if flop else f", {nbytes / ms / 1e9:.2f} TB/s" if nbytes else ""
    print(f"{name}: {ms:.3f} ms per call{rate} | SM clock median {clock:.0f} MHz, power {power:.0f} W, "
          f"{samples[-1][2].strip()} C, throttle reasons {reasons}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "u8192"))
