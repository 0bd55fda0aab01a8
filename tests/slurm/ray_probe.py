"""A stand-in driver for slurm/train.sbatch tests: connects to the job's Ray cluster and reports it.

Run by the sbatch script as ``python3 ray_probe.py [--exit-code N] [--hold FILE] RECIPE [overrides]`` (the
arguments a real driver gets) with RAY_ADDRESS set. Prints one line ``RAY_PROBE {json}`` with the arguments,
RAY_ADDRESS, the driver's Ray auth settings, the cluster's alive nodes and resources, and where one task per node
ran (a STRICT_SPREAD placement group puts one bundle on each node): its node id, the SLURM_JOB_ID that its raylet
was started with, and the auth mode and token file (path and permission bits) that the task's worker sees.
With ``--hold FILE`` it then keeps the cluster up until FILE exists (at most 600 s). Then exits with N.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatron_gigpo.cluster.ray_setup import connect_ray


@ray.remote(num_cpus=1)
def where() -> dict[str, str]:
    """Where this task ran: Ray node id, the Slurm job of the raylet that started it, the worker's auth setup."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "slurm_job_id": os.environ["SLURM_JOB_ID"],
            **auth_view()}


def auth_view() -> dict[str, str]:
    """This process's RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH and that file's permission bits (octal)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    mode = oct(stat.S_IMODE(os.stat(path).st_mode)) if path and os.path.exists(path) else ""
    return {"auth_mode": os.environ.get("RAY_AUTH_MODE", ""), "token_path": path, "token_file_mode": mode,
            "token_in_env": "RAY_AUTH_TOKEN" in os.environ}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--exit-code", type=int, default=0, help="exit status after the report")
    parser.add_argument("--hold", default=None, help="keep the cluster up until this file exists")
    parser.add_argument("driver_args", nargs="*", help="the recipe and overrides that train.sbatch passes")
    args = parser.parse_args()
    address = os.environ["RAY_ADDRESS"]
    connect_ray(address, logging_level="ERROR", log_to_driver=False)  # as megatron-gigpo train connects
    alive = [n for n in ray.nodes() if n["Alive"]]
    resources = ray.cluster_resources()
    cpus = int(resources["CPU"])
    pg = placement_group([{"CPU": 1}] * len(alive), strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=120)
    placed = ray.get([
        where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
        for i in range(len(alive))
    ])
    remove_placement_group(pg)
    report = {
        "argv": args.driver_args,
        "ray_address": address,
        "nodes": len(alive),
        "node_ips": sorted(n["NodeManagerAddress"] for n in alive),
        "cpus": cpus,
        "gpus": int(resources["GPU"]) if "GPU" in resources else 0,
        "task_nodes": sorted({p["node_id"] for p in placed}),
        "task_slurm_job_ids": sorted({p["slurm_job_id"] for p in placed}),
        "driver_auth": auth_view(),
        "task_auth": sorted(({k: v for k, v in p.items() if k not in ("node_id", "slurm_job_id")} for p in placed),
                            key=lambda a: a["token_path"]),
    }
    print("RAY_PROBE " + json.dumps(report), flush=True)
    deadline = time.monotonic() + 600
    while args.hold and not os.path.exists(args.hold) and time.monotonic() < deadline:
        time.sleep(0.5)
    ray.shutdown()
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
