"""The benchmark suite's GPU-free parts (cupymoe.bench): the case file, the inputs drawn in its
documented order, the SOL formula, the table and the command line."""
import json
from pathlib import Path

import numpy as np
import pytest

from cupymoe import plans
from cupymoe.bench import cases, suite

CASES = cases.DEFAULT_CASES
# Active experts per case in the peers' table (benchmarks/PERF.md, "Peers"): the inputs they were timed on.
PEER_ACTIVE_EXPERTS = {"u1": 8, "u4": 31, "u8": 61, "u16": 100, "u32": 161, "u64": 222, "u128": 252,
                       "u256": 255, "u512": 256, "u1024": 256, "u2048": 256, "u4096": 256, "u8192": 256,
                       "z64": 123, "z512": 243, "z4096": 256}
PEER_READ, PEER_MATMUL = 4.45e12, 770e12  # the ceilings of that table's SOL column
SMALL = cases.Model(hidden=64, experts=16, intermediate=32, top_k=4)


def reference_suite():
    return cases.load_suite(CASES)


def test_the_case_file_is_the_reference_workload():
    model, suite_cases = reference_suite()
    assert model == cases.Model(hidden=4096, experts=256, intermediate=1024, top_k=8)
    assert [c.id for c in suite_cases] == list(PEER_ACTIVE_EXPERTS)
    assert all(c.routing == ("zipf" if c.id.startswith("z") else "uniform") and c.tokens == int(c.id[1:])
               for c in suite_cases)


def test_an_unknown_routing_is_refused(tmp_path):
    spec = json.loads(CASES.read_text())
    spec["cases"][0]["routing"] = "round-robin"
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="round-robin"):
        cases.load_suite(path)


@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_inputs_follow_the_documented_draw_order(routing):
    """cases.json "data", written out again: x, then the routing, then the logits, from one generator."""
    case = cases.Case("c", 37, routing, 5)
    x, ids, weights = cases.make_case_inputs(case, SMALL)
    rng = np.random.default_rng(5)
    want_x = rng.standard_normal((37, SMALL.hidden), dtype=np.float32)
    if routing == "uniform":
        want_ids = np.argsort(rng.random((37, SMALL.experts)), axis=1, kind="stable")[:, :SMALL.top_k]
    else:
        rank = rng.permutation(SMALL.experts)
        g = rng.gumbel(size=(37, SMALL.experts))
        want_ids = np.argsort(-(-1.2 * np.log(rank + 1) + g), axis=1, kind="stable")[:, :SMALL.top_k]
    logits = rng.standard_normal((37, SMALL.top_k))
    want_weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert x.dtype == cases.BF16 and ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(x.view(np.uint16), want_x.astype(cases.BF16).view(np.uint16))
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    assert all(len(set(row)) == SMALL.top_k for row in ids.tolist())
    np.testing.assert_allclose(weights.sum(axis=1), 1, rtol=1e-6)


def test_the_suite_draws_the_inputs_the_peers_were_timed_on():
    model, suite_cases = reference_suite()
    for case in suite_cases:
        _, ids, _ = cases.make_case_inputs(case, model)
        assert cases.active_experts(ids) == PEER_ACTIVE_EXPERTS[case.id], case.id


@pytest.mark.parametrize("case_id,tokens,active,want_ms", [
    ("u1", 1, 8, 0.045), ("u512", 512, 256, 1.450), ("u4096", 4096, 256, 1.463), ("u8192", 8192, 256, 2.142)])
def test_sol_is_the_peer_tables_column(case_id, tokens, active, want_ms):
    model, _ = reference_suite()
    assert cases.sol_ms(model, tokens, active, PEER_READ, PEER_MATMUL) == pytest.approx(want_ms, abs=5e-4)


def test_sol_counts_bytes_below_the_crossover_and_flops_above():
    h, i, k = SMALL.hidden, SMALL.intermediate, SMALL.top_k
    moved = 3 * 3 * h * i * 2 + 2 * 10 * h * 2 + 10 * k * 8
    assert cases.sol_ms(SMALL, 10, 3, 1e9, 1e30) == pytest.approx(moved / 1e9 * 1e3)
    assert cases.sol_ms(SMALL, 10, 3, 1e30, 1e9) == pytest.approx(6 * 10 * k * h * i / 1e9 * 1e3)


def test_fp8_sol_streams_one_byte_per_weight():
    h, i, k = SMALL.hidden, SMALL.intermediate, SMALL.top_k
    moved = 3 * 3 * h * i + 2 * 10 * h * 2 + 10 * k * 8
    assert cases.sol_ms(SMALL, 10, 3, 1e9, 1e30, weight_bytes=1) == pytest.approx(moved / 1e9 * 1e3)


@pytest.mark.gpu
def test_fp8_suite_weights_are_fp8_quantize_weights():
    import cupy

    from cupymoe import fp8
    from cupymoe.bench import measure

    model = cases.Model(hidden=256, experts=20, intermediate=128, top_k=2)  # two chunks of experts
    weights = measure.SuiteWeights(model, "fp8")
    q13, s13, q2, s2 = weights.fp8
    for (q, s), w in zip(((q13, s13), (q2, s2)), weights.bf16):
        want_q, want_s = fp8.quantize_weights(w.get(), "block")
        np.testing.assert_array_equal(q.get(), want_q.view(np.uint8))
        np.testing.assert_array_equal(s.get(), want_s)
    w13, w2 = weights.expert(7)
    np.testing.assert_array_equal(w13.get(), fp8.dequantize_weights(q13.get()[7:8], s13.get()[7:8])[0])
    np.testing.assert_array_equal(w2.get(), fp8.dequantize_weights(q2.get()[7:8], s2.get()[7:8])[0])
    assert weights.layer().scales is not None and weights.tolerance == 6e-2


def test_select_cases_keeps_suite_order_and_names_unknown_ids():
    _, suite_cases = reference_suite()
    assert [c.id for c in cases.select_cases(suite_cases, "z64, u1")] == ["u1", "z64"]
    assert cases.select_cases(suite_cases, None) == suite_cases
    with pytest.raises(ValueError, match="u3"):
        cases.select_cases(suite_cases, "u1,u3")


@pytest.mark.parametrize("name,tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("Some GPU", "gpu")])
def test_device_short_name(name, tag):
    assert suite.device_short_name(name) == tag


def row(case_id, sol, ms, peer_ms=None, rel_err=3e-3, peer_rel_err=None):
    """A row as run_case makes it; ``ms`` None as check_and_time leaves a failed check."""
    return {"id": case_id, "T": int(case_id[1:]), "routing": "uniform", "active_experts": 8, "sol_ms": sol,
            "ms_graph": ms, "ms_eager": None if ms is None else ms * 1.1, "rel_err": rel_err,
            "passed": rel_err < 1e-2, "peak_mem_MiB": 1.0, "peer_ms_graph": peer_ms, "peer_ms_eager": None,
            "peer_rel_err": peer_rel_err, "peer_passed": None if peer_rel_err is None else peer_rel_err < 1e-2}


def test_suite_figures_are_the_mean_and_the_ratio_of_sums():
    rows = [row("u1", 1.0, 2.0), row("u2", 3.0, 4.0)]
    assert suite.suite_figures(rows, "ms_graph") == (3.0, pytest.approx(4.0 / 6.0))
    assert suite.suite_figures(rows, "peer_ms_graph") == (None, None)


def test_the_table_shows_share_speedup_and_failures():
    rows = [row("u1", 0.5, 1.0, peer_ms=2.0, peer_rel_err=4e-3), row("u2", 1.0, None, rel_err=0.5),
            row("u4", 1.0, 2.0, peer_rel_err=0.5)]
    result = {"device": "NVIDIA H200", "headline": "ms_graph", "read_bw_TBps": 4.5, "matmul_TFLOPs": 780.0,
              "peer": "torch", "cases": rows, "sol_mean_ms": 0.75, "mean_ms": None, "sol_efficiency": None,
              "peer_mean_ms": None, "peer_sol_efficiency": None, "peak_mem_MiB": 1.0}
    lines = suite.format_table(result).splitlines()
    assert len(lines) == 3 + len(rows) + 1
    assert lines[3] == "| u1 | 1 | 8 | 0.500 | 1.000 | 50% | 1.100 | 2.000 | 2.00 | 1.0 | 3.0e-03 |"
    assert lines[4] == "| u2 | 2 | 8 | 1.000 | FAIL | - | FAIL | - | - | 1.0 | 5.0e-01 |"
    assert lines[5] == "| u4 | 4 | 8 | 1.000 | 2.000 | 50% | 2.200 | FAIL | - | 1.0 | 3.0e-03 |"
    assert lines[-1].startswith("suite (graph): SOL mean 0.750 ms | cupymoe mean - ms, sum(sol)/sum(ms) -")
    assert "FAILED the check" in suite.progress_line(2, 3, rows[1], 1.0)
    assert "FAILED" not in suite.progress_line(1, 3, rows[0], 1.0)


def test_an_eager_only_peer_is_compared_eager_with_eager():
    rows = [row("u1", 0.5, 1.0, peer_rel_err=4e-3)]
    rows[0]["peer_ms_eager"] = 3.3
    result = {"device": "NVIDIA H200", "headline": "ms_graph", "read_bw_TBps": 4.5, "matmul_TFLOPs": 780.0,
              "peer": "torch", "cases": rows, "sol_mean_ms": 0.5, "mean_ms": 1.0, "sol_efficiency": 0.5,
              "peer_headline": "ms_eager", "peer_mean_ms": 3.3, "peer_sol_efficiency": 0.5 / 3.3, "peak_mem_MiB": 1.0}
    lines = suite.format_table(result).splitlines()
    assert "| peer eager ms | speedup (peer/cupymoe, eager) |" in lines[1]
    assert lines[3] == "| u1 | 1 | 8 | 0.500 | 1.000 | 50% | 1.100 | 3.300 | 3.00 | 1.0 | 3.0e-03 |"
    assert "peer (eager) mean 3.300 ms" in lines[-1]


def test_command_line_defaults_and_errors(capsys):
    args, model, chosen = suite.parse_args(["--only", "u1,z64"])
    assert (args.reps, args.no_peer, args.no_graph, args.weights) == (25, False, False, "bf16")
    assert suite.parse_args(["--weights", "fp8"])[0].weights == "fp8"
    assert args.cases == CASES  # the suite shipped inside the package
    assert [c.id for c in chosen] == ["u1", "z64"] and model.experts == 256
    for bad in (["--cases", str(CASES), "--reps", "0"], ["--cases", str(CASES), "--only", "u3"],
                ["--cases", str(CASES.with_name("missing.json"))], ["--weights", "int4"]):
        with pytest.raises(SystemExit):
            suite.parse_args(bad)
    assert "--reps must be at least 1" in capsys.readouterr().err


def test_a_plan_is_forced_by_name_for_its_weights(capsys):
    args = suite.parse_args(["--weights", "fp8", "--plan", "PERSISTENT_FP8_128"])[0]
    assert args.plan == "PERSISTENT_FP8_128" and suite.parse_args([])[0].plan is None
    assert suite.forced_plan("PERSISTENT_FP8_128", "fp8") is plans.PERSISTENT_FP8_128
    for bad, why in ((["--plan", "NO_SUCH_PLAN"], "not a plan"), (["--plan", "FP8_PLANS"], "not a plan"),
                     (["--plan", "PERSISTENT_FP8_128"], "FP8 weights"),
                     (["--weights", "fp8", "--plan", "LARGE"], "FP8 weights run their own plans")):
        with pytest.raises(SystemExit):
            suite.parse_args(bad)
        assert why in capsys.readouterr().err


def test_main_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(suite, "gpu_available", lambda: False)
    assert suite.main(["--cases", str(CASES)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
