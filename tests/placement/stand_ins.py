"""Lightweight stand-ins for the run's Ray actors that report where Ray put them (tests/placement).

Imported by name in the Ray workers of the stand-in cluster (its nodes start with this folder on PYTHONPATH).

- :class:`StandIn` takes an actor rank's (or a TP-1 engine's) place and reports it.
- :class:`StandInEngine` takes an engine actor's place and, like vLLM's Ray executor
  (vllm/v1/executor/ray_executor.py ``_init_workers_ray``), starts one :class:`StandIn` per bundle listed in
  ``VLLM_RAY_BUNDLE_INDICES`` of its own placement group, each asking ``VLLM_RAY_PER_WORKER_GPUS`` GPUs and no
  CPU. (vLLM also sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` on its workers and then exports the
  node's assigned GPU ids itself; the stand-in keeps Ray's own ``CUDA_VISIBLE_DEVICES`` to check the assignment.)
"""

from __future__ import annotations

import os
import re
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Ray's placement-group resource names: "<resource>_group_<bundle index>_<group id hex>".
_BUNDLE_RESOURCE = re.compile(r"^\w+?_group_(\d+)_([0-9a-f]+)$")


def where() -> dict[str, Any]:
    """Ray node id, placement group id, bundle indices (from the resources Ray assigned to this worker),
    ``CUDA_VISIBLE_DEVICES`` (None when unset) and Ray's GPU ids of this process."""
    ctx = ray.get_runtime_context()
    assigned = ray._private.worker.global_worker.core_worker.resource_ids()  # raw: names carry the bundle
    bundles = sorted({int(m.group(1)) for name in assigned if (m := _BUNDLE_RESOURCE.match(name))})
    return {"node_id": ctx.get_node_id(), "placement_group": ctx.get_placement_group_id(), "bundles": bundles,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()]}


class StandIn:
    def report(self) -> dict[str, Any]:
        return where()


class StandInEngine:
    """An engine actor; with ``VLLM_RAY_BUNDLE_INDICES`` set it starts its workers as vLLM's Ray executor does."""

    def __init__(self, executor: str | None):
        self.executor = executor
        self.workers = []
        indices = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "")
        if executor == "ray":
            group = get_current_placement_group()
            if group is None or not indices:
                raise RuntimeError(f"a ray-executor engine needs a placement group ({group}) and bundle indices "
                                   f"({indices!r})")
            share = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
            self.workers = [
                ray.remote(StandIn).options(
                    num_cpus=0, num_gpus=share,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_capture_child_tasks=True, placement_group_bundle_index=int(b)),
                ).remote()
                for b in indices.split(",")
            ]

    def report(self, timeout_s: float) -> dict[str, Any]:
        """This actor's :func:`where`, its environment for vLLM and its workers' reports (TP rank order)."""
        out = where()
        out["env"] = {k: os.environ.get(k) for k in ("VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS")}
        out["workers"] = ray.get([w.report.remote() for w in self.workers], timeout=timeout_s)
        return out
