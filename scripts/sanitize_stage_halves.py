"""The 64-slot persistent plan (two K-tiles per stage) on problems where blocks take several stages
of the ring, checked against the NumPy backend; run under compute-sanitizer (racecheck found 3 hazards, run 169)."""
import sys
import numpy as np
import cupy
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
from helpers import random_problem  # noqa: E402
import cupymoe  # noqa: E402
from cupymoe import experts, _compile  # noqa: E402

H, I, E, K = 512, 256, 8, 2
for tokens, routing in [(4000, "uniform"), (301, "sparse")]:
    fitted = experts.fitted(experts._PERSISTENT_64, H, I, _compile.shared_memory_limit(0))
    experts.plan = lambda *a, p=fitted: p
    problem = random_problem(np.random.default_rng(tokens), tokens, H, E, I, K, routing=routing)
    out = cupymoe.fused_experts(*[cupy.asarray(a) for a in problem]).get().astype(np.float32)
    want = cupymoe.fused_experts(*problem).astype(np.float32)  # the NumPy backend
    err = float(np.linalg.norm(out - want) / np.linalg.norm(want))
    print(f"T={tokens} {routing}: rel err {err:.2e}", flush=True)
    assert err < 1e-2
