"""GPU paths of the rollout engine (skipped without CUDA): sleep / wake-up around training, colocated sync
through CUDA IPC handles and disaggregated sync through an NCCL broadcast, each pushing other weights than
the engine holds and checked against the HF state dict that was pushed (fp32 engine, atol 1e-3)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_gigpo.config import RolloutConfig
from megatron_gigpo.rollout.engine import RolloutEngineGroup, SamplingConfig
from megatron_gigpo.rollout.weight_sync import prepare_sync, weights_checksum
from rollout_testlib import hf_log_probs, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def gpu_group(ray_session, tiny_qwen_dir):
    rollout = RolloutConfig(num_engines=1, prompt_length=128, response_length=128, gpu_memory_utilization=0.2)
    group = RolloutEngineGroup(str(tiny_qwen_dir), rollout, dtype="float32", enable_sleep_mode=True, seed=0)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def gpu_sender(ray_session):
    from megatron_rank import StateDictRank

    actor = ray_session.remote(StateDictRank).options(num_gpus=0.1, num_cpus=0).remote()
    yield actor
    ray_session.kill(actor)


def _max_diff(got: list[list[float]], reference: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(g) - r).abs().max()) for g, r in zip(got, reference, strict=True))


def test_sleep_then_sync_then_wake(gpu_group, gpu_sender, ray_session, tiny_qwen_dir):
    base = load_file(str(tiny_qwen_dir / "model.safetensors"))
    sequences = random_prompts(3, seed=40)
    served = gpu_group.compute_log_probs(sequences)  # the checkpoint's weights
    # Each transport pushes other weights than the engine holds, so each sync must load to pass.
    for version, (transport, scale) in enumerate([("cuda_ipc", 1.2), ("broadcast", 1.4)], start=1):
        weights = {n: t * scale for n, t in base.items()}
        reference = hf_log_probs(tiny_qwen_dir, weights, sequences)
        assert _max_diff(served, reference) > 0.1, f"{transport}: the pushed weights barely change the outputs"
        gpu_group.sleep()
        plan = prepare_sync(gpu_group, version=version, bucket_size_bytes=1 << 16, transport=transport,
                            backend="nccl")
        report = ray_session.get(gpu_sender.push_weights.remote(plan, {n: t.cuda() for n, t in weights.items()}))
        assert report.checksum == weights_checksum(weights.items(), torch.float32)
        assert gpu_group.weights_version() == [(version, report.checksum)]
        gpu_group.wake_up()
        served = gpu_group.compute_log_probs(sequences)
        for got, ref in zip(served, reference, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref, atol=1e-3, rtol=0)
    assert len(gpu_group.generate(sequences, SamplingConfig(max_tokens=4, seed=0))) == 3
