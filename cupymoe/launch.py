"""Start one process per GPU for expert parallelism: ``python -m cupymoe.launch -n N script.py [args]``.

Each process gets ``CUPYMOE_RANK`` (0..N-1, also its GPU), ``CUPYMOE_WORLD_SIZE`` and
``CUPYMOE_NCCL_ID`` (the NCCL unique id, made here); ``cupymoe.distributed.init_from_env()`` turns
them into a communicator. A rank that fails, or a job that outlives ``--timeout`` seconds, ends every
rank and the launcher with an error naming it, so nothing hangs. One host only; on several hosts,
start each host's ranks with the same id and world size through your scheduler (mpirun, srun) and
set those variables yourself.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .distributed import NCCL_ID_ENV, RANK_ENV, WORLD_ENV

POLL_S = 0.2


def _nccl_id() -> str:
    from cupy.cuda import nccl

    return json.dumps(list(nccl.get_unique_id()))


def run(nprocs: int, command: list, timeout: float | None = None, nccl_id: str | None = None) -> int:
    """Run ``command`` (argv) as ``nprocs`` ranks; return 0, or the first failing rank's exit code
    after stopping the others (124 on timeout)."""
    env = dict(os.environ, **{WORLD_ENV: str(nprocs), NCCL_ID_ENV: nccl_id if nccl_id is not None else _nccl_id()})
    procs = [subprocess.Popen(command, env=dict(env, **{RANK_ENV: str(r)})) for r in range(nprocs)]
    started = time.monotonic()
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"cupymoe.launch: rank {rank} exited with code {code}; stopping the other ranks",
                      file=sys.stderr)
                return code
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - started > timeout:
                waiting = [r for r, c in enumerate(codes) if c is None]
                print(f"cupymoe.launch: ranks {waiting} still running after {timeout:g} s; stopping them",
                      file=sys.stderr)
                return 124
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupymoe.launch", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="ranks (GPUs) to start")
    parser.add_argument("--timeout", type=float, default=None, help="seconds after which every rank is stopped")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nprocs < 1:
        parser.error(f"--nprocs must be at least 1, got {args.nprocs}")
    return run(args.nprocs, [sys.executable, args.script, *args.args], args.timeout)


if __name__ == "__main__":
    sys.exit(main())
