"""Actor ranks on CPU compute with the thread count the driver gives them, not Ray's default.

Ray starts an actor with ``OMP_NUM_THREADS`` set to its ``num_cpus`` (1 for a CPU rank slot), and torch reads
it when it is imported, which happens before ``ActorWorker.__init__`` sees the driver's variables. Until the
worker set torch's pool itself, every CPU rank trained on one thread while the other cores idled (measured:
the main job's update 45 s with one thread, 32 s with two)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_rank_worker_uses_the_driver_thread_count():
    import ray

    from megatron_gigpo.actor.group import ActorWorker
    from megatron_gigpo.cluster.ray_setup import local_ray_env

    with local_ray_env() as env:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
        try:
            worker = ray.remote(ActorWorker).options(num_cpus=1).remote(0, 1, {"OMP_NUM_THREADS": "2"})
            threads = ray.get(worker.__ray_call__.remote(lambda self: __import__("torch").get_num_threads()),
                              timeout=300)
        finally:
            ray.shutdown()
    assert threads == 2
