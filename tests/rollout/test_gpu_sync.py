"""GPU weight sync on vLLM's weight-transfer protocol (skipped without CUDA): ``mgigpo_ipc`` (vLLM's CUDA IPC,
actor rank and engine on one GPU) and ``mgigpo_nccl`` (vLLM's NCCL broadcast; NCCL refuses two ranks of one
group on one GPU, so this case needs a second GPU). Each, around sleep / wake-up as a run does it: new weights
give transformers' log-probs with them (fp32 engine, atol 1e-3) and set the version; a tampered checksum and a
trainer-side error keep the served weights and version; the next sync works."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_gigpo.config import RolloutConfig
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.vllm_plugin import IPC_BACKEND, NCCL_BACKEND
from rollout_testlib import hf_log_probs, random_prompts

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(find_spec("vllm") is None or find_spec("ray") is None,
                                 reason="needs the GPU install: vLLM >= 0.32 (CUDA) and Ray (docs/gpu-install.md)")]


class GpuRank:
    """A stand-in trainer rank on a GPU (wrap with ``ray.remote``): pushes an HF state dict from GPU memory through
    the product's ``push_weights``; ``tamper=True`` (after a first sync built this rank's trainer engine) swaps that
    engine's client for one whose commit carries another checksum than that of the bytes sent (what corruption on
    the way looks like to the engine)."""

    def push(self, plan, weights: dict[str, torch.Tensor], tamper: bool = False):
        from megatron_gigpo.rollout import weight_sync
        from megatron_gigpo.rollout.transfer.client import EngineGroupClient

        class TamperingClient(EngineGroupClient):
            def update_weights(self, update_info):
                if isinstance(update_info, dict) and "commit" in update_info:
                    update_info = {"commit": "0" * 64}
                super().update_weights(update_info)

        bucket = [(name, t.cuda()) for name, t in weights.items()]  # one export bucket of full tensors (rank 0)
        trainer = weight_sync._TRAINERS[plan.group_key] if tamper else None
        client = trainer.client if tamper else None
        if tamper:
            trainer.client = TamperingClient(plan.engines, plan.engine_workers, plan.timeout_s)
        try:
            metadata = [(name, t.dtype, tuple(t.shape)) for name, t in bucket]  # mgigpo_nccl's source.metadata()
            return weight_sync.push_weights(iter([bucket]), plan, metadata=metadata)
        finally:
            if tamper:
                trainer.client = client


def plan_placement_env(backend: str) -> dict[str, str]:
    """The engine environment the run's placement plan gives an engine of ``backend`` (one GPU engine, TP 1)."""
    from megatron_gigpo.cluster.placement import ClusterShape, plan_placement
    from megatron_gigpo.config import load_config

    mode = "colocated" if backend == IPC_BACKEND else "disaggregated"
    cfg = load_config(RECIPES / "alfworld/qwen2.5-1.5b-instruct.yaml",
                      [f"rollout.weight_sync_mode={mode}", "rollout.num_engines=1", "rollout.tensor_parallel_size=1",
                       "trainer.devices_per_node=2", "parallel.tensor_model_parallel_size=1"])
    (engine,) = plan_placement(cfg, ClusterShape(1, 2)).engines
    return dict(engine.env_vars)


@pytest.fixture(scope="module", params=[IPC_BACKEND, NCCL_BACKEND])
def gpu_sync(request, ray_session, tiny_qwen_dir):
    """``(group, rank)``: one engine of ``request.param`` and a trainer rank; IPC: both on GPU 0 (Ray GPU shares,
    as the colocated plan gives them), NCCL: one GPU each."""
    from megatron_gigpo.rollout.engine_group import RolloutEngineGroup

    ipc = request.param == IPC_BACKEND
    if not ipc and torch.cuda.device_count() < 2:
        pytest.skip("mgigpo_nccl: NCCL refuses two ranks of one communicator on one GPU ('Duplicate GPU "
                    "detected', NCCL >= 2.5); needs a second GPU")
    rollout = RolloutConfig(num_engines=1, prompt_length=128, response_length=128, gpu_memory_utilization=0.2)
    group = RolloutEngineGroup(str(tiny_qwen_dir), rollout, dtype="float32", enable_sleep_mode=True, seed=0,
                               weight_transfer_backend=request.param, ray_options={"num_gpus": 0.4 if ipc else 1},
                               env_vars=plan_placement_env(request.param))
    rank = ray_session.remote(GpuRank).options(num_gpus=0.5 if ipc else 1, num_cpus=0).remote()
    yield group, rank
    ray_session.kill(rank)
    group.shutdown()


def test_sync_loads_new_weights_and_failed_syncs_keep_them(gpu_sync, ray_session, tiny_qwen_dir):
    from megatron_gigpo.rollout.weight_sync import prepare_sync, weights_checksum

    group, rank = gpu_sync
    base = load_file(str(tiny_qwen_dir / "model.safetensors"))
    sequences = random_prompts(3, seed=40)

    def sync(weights, version, **kwargs):
        group.sleep()  # as a run: the engine sleeps while the actor trains, the sync wakes its weights
        plan = prepare_sync(group, version=version, bucket_size_bytes=1 << 16)
        try:
            return ray_session.get(rank.push.remote(plan, weights, **kwargs))
        finally:
            group.wake_up()

    def check_serves(weights, version):
        checksum = weights_checksum(weights.items(), torch.float32)
        assert group.weights_version() == [(version, checksum)]
        for got, ref in zip(group.compute_log_probs(sequences), hf_log_probs(tiny_qwen_dir, weights, sequences),
                            strict=True):
            torch.testing.assert_close(torch.tensor(got), ref, atol=1e-3, rtol=0)

    first = {n: t * 1.2 for n, t in base.items()}  # other weights than the engine holds: the sync must load them
    report = sync(first, 1)
    assert report.checksum == weights_checksum(first.items(), torch.float32)
    check_serves(first, 1)
    # a tampered checksum (every byte arrived, the commit does not match them): refused, nothing loaded
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        sync({n: t * 1.4 for n, t in base.items()}, 2, tamper=True)
    check_serves(first, 1)
    # a trainer-side error (a weight missing from the export): aborted, nothing loaded
    with pytest.raises(WeightSyncError, match="were not sent"):
        sync({n: t * 1.4 for n, t in list(base.items())[:-1]}, 2)
    check_serves(first, 1)
    second = {n: t * 1.4 for n, t in base.items()}
    sync(second, 2)
    check_serves(second, 2)
