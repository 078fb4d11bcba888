"""The suite's cases (``cases.json`` beside this module): the layer sizes, the inputs drawn in the
documented order, and the speed-of-light formula. NumPy only, so tests reuse them without a GPU."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DEFAULT_CASES = Path(__file__).with_name("cases.json")


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


def sol_ms(model: Model, tokens: int, active: int, read_bw: float, matmul_rate: float, weight_bytes: int = 2) -> float:
    """Speed of light of one forward in ms: max(bytes / read_bw, flops / matmul_rate).

    bytes = active*3*H*I*weight_bytes (expert weights: 2 bf16, 1 FP8, whose block scales add
    1/4096 and are left out) + 2*T*H*2 (x and out) + T*k*8 (ids and weights); flops = 6*T*k*H*I.
    ``read_bw`` in bytes/s, ``matmul_rate`` in FLOP/s (of the weights' precision).
    """
    h, i, k = model.hidden, model.intermediate, model.top_k
    moved = active * 3 * h * i * weight_bytes + 2 * tokens * h * 2 + tokens * k * 8
    flops = 6 * tokens * k * h * i
    return max(moved / read_bw, flops / matmul_rate) * 1e3
