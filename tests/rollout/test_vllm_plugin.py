"""The vLLM plugin of the package: backend registration with vLLM's factories, the entry point, the engine's backend
setting. (That a spawned vLLM worker gets the backend through the entry point: test_vllm_protocol.py.)"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from megatron_gigpo.rollout import vllm_plugin

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_plugin_module_imports_neither_torch_nor_vllm():
    code = ("import sys, megatron_gigpo.rollout.vllm_plugin; "
            "print([m for m in ('torch', 'vllm') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout == "[]\n"


def test_register_adds_every_backend_lazily_and_twice_is_harmless(caplog):
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    with caplog.at_level(logging.WARNING, logger=vllm_plugin.__name__):
        vllm_plugin.register()
        vllm_plugin.register()  # vLLM loads the plugins several times in one process
    ours = [r.getMessage() for r in caplog.records if r.name == vllm_plugin.__name__]
    assert not ours, ours
    assert set(vllm_plugin.BACKENDS) <= set(WeightTransferEngineFactory._registry)
    assert set(vllm_plugin.CPU_BACKENDS) <= set(WeightTransferTrainerFactory._registry)
    engines = {b: WeightTransferEngineFactory._registry[b]().__name__ for b in vllm_plugin.CPU_BACKENDS}
    assert engines == {"mgigpo_shm": "SharedMemoryWeightTransferEngine", "mgigpo_gloo": "GlooWeightTransferEngine"}


def test_the_entry_point_is_declared_and_installed(monkeypatch):
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[vllm_plugin.ENTRY_POINT_GROUP] == {vllm_plugin.ENTRY_POINT_NAME: vllm_plugin.ENTRY_POINT}
    assert vllm_plugin.entry_point_error() is None  # else: pip install -e .
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert "VLLM_PLUGINS='lora_filesystem_resolver' leaves out the plugin 'megatron_gigpo'" in \
        vllm_plugin.entry_point_error()


def test_engine_config_refuses_an_unknown_backend(tmp_path):
    from megatron_gigpo.rollout.engine import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps({}))
    assert EngineConfig(model_path=str(tmp_path), dtype="float32").weight_transfer_backend is None
    with pytest.raises(ValueError, match=r"EngineConfig.weight_transfer_backend='nccl'; expected None or one of"):
        EngineConfig(model_path=str(tmp_path), dtype="float32", weight_transfer_backend="nccl")


def test_engine_refuses_to_start_without_its_backends(tmp_path, monkeypatch):
    """Before vLLM starts: a CUDA backend on the CPU, and a plugin vLLM's processes would not load."""
    import torch

    from megatron_gigpo.rollout.engine import EngineConfig, RolloutEngine

    (tmp_path / "config.json").write_text(json.dumps({}))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="weight_transfer_backend='mgigpo_ipc' needs CUDA"):
            RolloutEngine(EngineConfig(model_path=str(tmp_path), dtype="float32", weight_transfer_backend="mgigpo_ipc"))
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(RuntimeError, match="rollout engine: VLLM_PLUGINS=.* leaves out the plugin 'megatron_gigpo'"):
        RolloutEngine(EngineConfig(model_path=str(tmp_path), dtype="float32"))
