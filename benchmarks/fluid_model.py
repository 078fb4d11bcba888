"""A fluid model of the persistent gate/up kernel, to try work orders and intake limits without a GPU.

132 SMs claim work items in list order. An item (expert, n-tile, chunk of rows) finishes when it has
had its MMA work (5.66 TFLOP/s per SM, rows padded to 32), its SM intake (its 2 MB weight tile and
8 KB per slot row, at INGEST bytes/s per SM) and, if it is the first item to read its weight tile,
that tile from DRAM (4.45 TB/s shared by the items reading DRAM). Epilogues are not modelled.
NOTES.md v12 has its calibration against the measured kernels and what it predicts.

    python benchmarks/fluid_model.py [INGEST_GBps]
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from cupymoe import bench  # noqa: E402

SMS = 132
MMA_PER_SM = 5.66e12  # FLOP/s, the K-loop of a full item on an SM alone (NOTES v10)
DRAM = 4.45e12
HIDDEN, N_TILES, WEIGHT_ROWS = 4096, 8, 256
WEIGHT_TILE = WEIGHT_ROWS * HIDDEN * 2
SLOT_ROW = HIDDEN * 2
SLOTS = {"u2048": 96, "u4096": 160, "u8192": 160, "z512": 64, "z4096": 160}  # the plan's slots per chunk
MEASURED_US = {"u2048": 1074, "u4096": 1189, "u8192": 1923, "z4096": 1437}  # gate/up, run 56


def chunk_rows(count: int, slots: int) -> list:
    """An expert's chunks as the kernel cuts them (two chunks split about evenly, at a multiple of 32)."""
    chunks = -(-count // slots)
    per = min(slots, -(-(-(-count // 2)) // 32) * 32) if chunks == 2 else slots
    return [min(per, count - i * per) for i in range(chunks)]


def work_items(counts, slots: int) -> list:
    """(expert, n-tile, rows) in claim order: by expert, then n-tile, then chunk (as GROUP_M keeps them)."""
    return [(e, n, rows) for e, count in enumerate(counts) if count
            for n in range(N_TILES) for rows in chunk_rows(int(count), slots)]


def simulate(items, ingest: float, light_ingest: float = None, light_rows: int = 32, dt: float = 0.5e-6) -> float:
    """Seconds until every item is done; items of <= light_rows rows take in light_ingest bytes/s if given."""
    seen = set()
    specs = []
    for e, n, rows in items:
        dram = 0 if (e, n) in seen else WEIGHT_TILE
        seen.add((e, n))
        flops = 2 * WEIGHT_ROWS * (-(-rows // 32) * 32) * HIDDEN
        cap = light_ingest if light_ingest and rows <= light_rows else ingest
        specs.append((flops, WEIGHT_TILE + rows * SLOT_ROW, dram, cap))
    specs = np.array(specs, dtype=np.float64)
    running = -np.ones(SMS, dtype=np.int64)
    progress = np.zeros(SMS)
    claimed = finished = 0
    t = 0.0
    while finished < len(specs):
        for sm in np.flatnonzero(running < 0):
            if claimed == len(specs):
                break
            running[sm], progress[sm] = claimed, 0.0
            claimed += 1
        busy = running >= 0
        flops, intake, dram, cap = specs[running[busy]].T
        rate = np.minimum(MMA_PER_SM / flops, cap / intake)  # fraction of the item per second
        demand = (rate * dram).sum()
        if demand > DRAM:  # the first readers share DRAM
            rate = np.where(dram > 0, rate * DRAM / demand, rate)
        progress[busy] += rate * dt
        done = busy & (progress >= 1.0)
        finished += int(done.sum())
        running[done] = -1
        t += dt
    return t


def main() -> int:
    ingest = float(sys.argv[1]) * 1e9 if len(sys.argv) > 1 else 48e9
    model, cases = bench.load_suite(bench.DEFAULT_CASES)
    for case in cases:
        if case.id not in SLOTS:
            continue
        _, ids, _ = bench.make_case_inputs(case, model)
        counts = np.bincount(np.asarray(ids).ravel(), minlength=model.experts)
        items = work_items(counts, SLOTS[case.id])
        base = simulate(items, ingest)
        faster = simulate(items, ingest, light_ingest=70e9)
        measured = MEASURED_US.get(case.id)
        print(f"{case.id}: {len(items)} items, model {base * 1e6:.0f} us (measured "
              f"{measured if measured else '-'}), with chunks of <= 32 rows at 70 GB/s intake "
              f"{faster * 1e6:.0f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
