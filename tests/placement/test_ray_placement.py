"""Every shipped recipe's placement plan, executed on a Ray cluster of stand-in GPUs.

Two Ray nodes on this machine (``ray start --num-gpus=8``: Ray advertises GPUs that do not exist, and assigns
them like real ones; the second node on its own loopback address, as the Slurm tests emulate nodes). For each
distinct plan among the recipes (recipes with the same layout share one), the run's own placement code
(:func:`~megatron_gigpo.cluster.placement.create_placement_groups`, :func:`~megatron_gigpo.cluster.placement.slot_options`,
:func:`~megatron_gigpo.cluster.placement.engine_options`) starts lightweight stand-in actors for the actor ranks and
engines — TP > 1 engines start their workers as vLLM's Ray executor does — and each reports its Ray node, its
placement group and bundle, and ``CUDA_VISIBLE_DEVICES``, which must be exactly what the plan says. All of a
plan's actors hold their shares at the same time, so a plan that over-books a bundle would not be placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_gigpo.config import load_config
from megatron_gigpo.cluster.placement import (
    PlacementPlan,
    create_placement_groups,
    engine_options,
    format_plan,
    plan_placement,
    remove_placement_groups,
    slot_options,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~1-2.5 min on 2 cores (actor start-up)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RECIPES = REPO / "recipes"
NODES, GPUS_PER_NODE, CPUS_PER_NODE = 2, 8, 20
TIMEOUT_S = 120.0
# A layout no recipe ships: disaggregated GPU engines (whole GPUs) with a TP-2 engine beside the ranks.
DISAGGREGATED = ("sokoban/qwen2.5-1.5b-instruct.yaml",
                 ["trainer.devices_per_node=4", "rollout.weight_sync_mode=disaggregated", "rollout.num_engines=1",
                  "rollout.tensor_parallel_size=2"])


@dataclass(frozen=True)
class Layout:
    name: str
    plan: PlacementPlan


def _layouts() -> list[Layout]:
    """One layout per distinct plan of the shipped recipes (named by its recipes), plus :data:`DISAGGREGATED`."""
    by_plan: dict[str, tuple[PlacementPlan, list[str]]] = {}
    recipes = sorted(p for p in RECIPES.rglob("*.yaml") if p.name != "base.yaml" and "_base" not in p.parts)
    for recipe in recipes:
        plan = plan_placement(load_config(recipe))
        by_plan.setdefault(format_plan(plan), (plan, []))[1].append(str(recipe.relative_to(RECIPES)))
    layouts = [Layout("+".join(names), plan) for plan, names in by_plan.values()]
    recipe, overrides = DISAGGREGATED
    layouts.append(Layout(f"{recipe}[disaggregated]", plan_placement(load_config(RECIPES / recipe, overrides))))
    return layouts


LAYOUTS = _layouts()


@pytest.fixture(scope="module")
def stand_in_cluster():
    """A two-node Ray cluster with 8 stand-in GPUs per node; the test process is its driver."""
    from stand_in_cluster import stand_in_cluster as cluster

    with cluster(NODES, CPUS_PER_NODE, GPUS_PER_NODE, [REPO, HERE], TIMEOUT_S):
        yield


def _check(slot, report: dict, group_ids: list[str], group_nodes: list[str]) -> None:
    what = f"{slot.role} {slot.index}" + (f" worker {slot.worker}" if slot.role == "engine_worker" else "")
    assert report["placement_group"] == group_ids[slot.node], f"{what}: wrong placement group"
    assert report["bundles"] == [slot.bundle], f"{what}: bundle {report['bundles']}, plan {slot.bundle}"
    assert report["node_id"] == group_nodes[slot.node], f"{what}: not on its node's Ray node"
    assert report["gpu_ids"] == list(slot.gpus), f"{what}: GPUs {report['gpu_ids']}, plan {slot.gpus}"
    if slot.gpus:
        assert report["cuda_visible_devices"] == ",".join(map(str, slot.gpus)), what


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_stand_ins_run_where_the_plan_says(stand_in_cluster, layout):
    import ray
    from ray.util.placement_group import placement_group_table
    from stand_ins import StandIn, StandInEngine

    plan = layout.plan
    groups = create_placement_groups(plan, timeout_s=TIMEOUT_S)
    actors = []
    try:
        group_ids = [g.id.hex() for g in groups]
        bundle_nodes = [set(placement_group_table(g)["bundles_to_node_id"].values()) for g in groups]
        assert all(len(nodes) == 1 for nodes in bundle_nodes), "a node's placement group spans Ray nodes"
        group_nodes = [nodes.pop() for nodes in bundle_nodes]
        assert len(set(group_nodes)) == len(plan.bundles), "two plan nodes share a Ray node"

        ranks = [ray.remote(StandIn).options(**slot_options(groups, s)).remote() for s in plan.ranks]
        engines = [ray.remote(StandInEngine).options(**engine_options(groups, e)).remote(e.executor)
                   for e in plan.engines]
        actors = ranks + engines
        rank_reports = ray.get([a.report.remote() for a in ranks], timeout=TIMEOUT_S)
        engine_reports = ray.get([a.report.remote(TIMEOUT_S) for a in engines], timeout=2 * TIMEOUT_S)

        for slot, report in zip(plan.ranks, rank_reports):
            _check(slot, report, group_ids, group_nodes)
        for engine, report in zip(plan.engines, engine_reports):
            _check(engine.host, report, group_ids, group_nodes)
            assert report["env"]["VLLM_RAY_BUNDLE_INDICES"] == engine.env_vars.get("VLLM_RAY_BUNDLE_INDICES")
            assert len(report["workers"]) == len(engine.workers)
            for slot, worker_report in zip(engine.workers, report["workers"]):
                _check(slot, worker_report, group_ids, group_nodes)
            # The GPUs the engine's vLLM workers see are the ones the plan gives the engine.
            seen = [g for r in (report["workers"] or [report]) for g in r["gpu_ids"]]
            assert seen == (list(engine.gpus) if plan.cluster.device == "cuda" else [])
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_groups(groups)
