"""Expert parallelism (cupymoe.distributed, cupymoe.launch): the partition and the exchange plan
against brute force; a world of R ranks simulated in one process with NumPy moving the rows,
bitwise equal to one layer of all experts; the launcher ending every rank when one fails or the
job times out; on a GPU with NCCL, a world of one rank, bitwise equal to fused_experts."""
import sys

import numpy as np
import pytest

import cupymoe
from cupymoe import distributed, launch, reference
from helpers import BF16, host_bits, random_problem


def test_contiguous_partition_and_local_indices():
    p = distributed.ExpertPartition.contiguous(10, 4)
    assert p.owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert p.local.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    assert p.experts_of(2).tolist() == [6, 7]
    given = distributed.ExpertPartition.from_owner([1, 0, 1, 0], 2)
    assert given.local.tolist() == [0, 0, 1, 1] and given.experts_of(1).tolist() == [0, 2]
    with pytest.raises(ValueError, match="ranks: expected at most num_experts = 3"):
        distributed.ExpertPartition.contiguous(3, 4)
    with pytest.raises(ValueError, match=r"owner: expected every rank of \[0, 3\) to own an expert"):
        distributed.ExpertPartition.from_owner([0, 0, 2], 3)


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_exchange_plan_against_brute_force(ranks):
    rng = np.random.default_rng(ranks)
    part = distributed.ExpertPartition.contiguous(16, ranks)
    ids = rng.integers(-1, 16, (37, 4)).astype(np.int32)
    ids[3] = 99  # out of range: nowhere
    plan = distributed.plan_exchange(ids, part)
    flat = ids.reshape(-1)
    want = [s for r in range(ranks) for s in range(flat.size) if 0 <= flat[s] < 16 and part.owner[flat[s]] == r]
    assert plan.send_slots.tolist() == want
    assert plan.send_counts.tolist() == [sum(part.owner[flat[s]] == r for s in want) for r in range(ranks)]
    assert plan.local_ids.tolist() == [part.local[flat[s]] for s in want]
    assert [plan.slot_rows[s] for s in want] == list(range(len(want)))
    assert all(plan.slot_rows[s] == -1 for s in range(flat.size) if s not in set(want))


def row_experts(x_rows, local_ids, w13, w2):
    """Each row through its expert alone (a row's result independent of the batch, as on the GPU)."""
    y = np.empty((x_rows.shape[0], w2.shape[1]), x_rows.dtype)
    for r in range(x_rows.shape[0]):
        _, offsets, sorted_slots, _ = reference.dispatch_arrays(local_ids[r:r + 1, None], w13.shape[0])
        y[r] = reference.expert_outputs(x_rows[r:r + 1], w13, w2, 1, offsets, sorted_slots)[0]
    return y


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_simulated_world_is_bitwise_one_layer(ranks):
    """Every rank's tokens planned, their rows moved to the experts' ranks and back (NumPy doing what
    NCCL does), combined at home: the bits of the one-layer forward with every expert."""
    rng = np.random.default_rng(ranks)
    experts, hidden, inter = 8, 64, 64
    _, w13, w2, _, _ = random_problem(rng, 1, hidden, experts, inter, 2)
    part = distributed.ExpertPartition.contiguous(experts, ranks)
    world = []  # each rank's tokens: x, ids (one -1 among them), weights
    for tokens in (5, 0, 9, 1)[:ranks]:
        x, _, _, ids, weights = random_problem(rng, tokens, hidden, experts, inter, 3)
        ids[:1, 1] = -1
        world.append((x, ids, weights))
    plans = [distributed.plan_exchange(ids, part) for _, ids, _ in world]
    received = []  # per destination: (rows, local ids) from every source in rank order
    for dest in range(ranks):
        pieces = []
        for (x, ids, _), plan in zip(world, plans):
            at = np.concatenate([[0], np.cumsum(plan.send_counts)])
            slots = plan.send_slots[at[dest]:at[dest + 1]]
            pieces.append((x[slots // ids.shape[1]], plan.local_ids[at[dest]:at[dest + 1]]))
        received.append(pieces)
    outputs = [[row_experts(rows, local, w13[part.experts_of(dest)], w2[part.experts_of(dest)])
                for rows, local in received[dest]] for dest in range(ranks)]
    for home, ((x, ids, weights), plan) in enumerate(zip(world, plans)):
        back = np.concatenate([outputs[dest][home] for dest in range(ranks)])
        got = reference.combine(back, plan.slot_rows, weights, np.empty_like(x))
        flat = ids.reshape(-1)
        y = row_experts(x[np.arange(flat.size) // ids.shape[1]], np.maximum(flat, 0), w13, w2)
        positions = np.where(flat >= 0, np.arange(flat.size), -1).astype(np.int32)
        want = reference.combine(y, positions, weights, np.empty_like(x))
        assert np.array_equal(host_bits(got), host_bits(want))


def test_launcher_stops_every_rank_when_one_fails(capsys):
    script = ("import os, sys, time; r = int(os.environ['CUPYMOE_RANK']); "
              "sys.exit(3) if r == 1 else time.sleep(60)")
    started = __import__("time").monotonic()
    assert launch.run(3, [sys.executable, "-c", script], nccl_id="[]") == 3
    assert __import__("time").monotonic() - started < 30
    assert "rank 1 exited with code 3; stopping the other ranks" in capsys.readouterr().err


def test_launcher_times_out_and_passes_the_world(tmp_path, capsys):
    assert launch.run(2, [sys.executable, "-c", "import time; time.sleep(60)"], timeout=1, nccl_id="[]") == 124
    assert "still running after 1 s" in capsys.readouterr().err
    out = tmp_path / "ranks"
    script = (f"import os; open({str(out)!r} + os.environ['CUPYMOE_RANK'], 'w')"
              ".write(os.environ['CUPYMOE_WORLD_SIZE'] + os.environ['CUPYMOE_NCCL_ID'])")
    assert launch.run(2, [sys.executable, "-c", script], nccl_id="[7]") == 0
    assert [(tmp_path / f"ranks{r}").read_text() for r in range(2)] == ["2[7]", "2[7]"]


@pytest.mark.gpu
@pytest.mark.parametrize("on_input", [False, True])
def test_world_of_one_rank_is_bitwise_fused_experts(on_input):
    import cupy
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("NCCL is not installed for CuPy")
    x, w13, w2, ids, weights = (cupy.asarray(a) for a in random_problem(np.random.default_rng(1), 300, 256, 16, 128, 4))
    ids[0, 0] = -1
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    layer = distributed.ExpertParallelMoE(w13, w2, distributed.ExpertPartition.contiguous(16, 1), comm, 0,
                                          apply_router_weight_on_input=on_input)
    want = cupymoe.fused_experts(x, w13, w2, ids, weights, apply_router_weight_on_input=on_input)
    assert np.array_equal(host_bits(layer(x, ids, weights)), host_bits(want))
