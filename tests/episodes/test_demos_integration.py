"""Demonstrations against the real parts: the RL collector's prompts (vLLM, Ray) and ALFWorld's games."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from episode_engines import engine_group_on

from megatron_gigpo.builders import _build_collector, step_prompt_settings
from megatron_gigpo.config import load_config
from megatron_gigpo.demos.experts import Expert, ExpertMove, ExpertUnavailable
from megatron_gigpo.demos.writer import demo_tasks, write_demos
from megatron_gigpo.envs.alfworld import ALFWORLD_READ_ONLY, ALFWORLD_READ_ONLY_PREFIXES
from megatron_gigpo.demos.writer import play_episode
from megatron_gigpo.envs.registry import env_kwargs, load_task_list
from megatron_gigpo.envs.registry import make_env
from megatron_gigpo.episodes.prompts import StepPromptState, step_prompt_renderer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


class ReplayExpert(Expert):
    """Replays a fixed action list (the actions the collector executed), then has no move."""

    def __init__(self, actions: list[str]) -> None:
        self.actions, self.next = actions, 0

    def next_move(self, state: StepPromptState) -> ExpertMove:
        if self.next >= len(self.actions):
            raise ExpertUnavailable("replay finished")
        return ExpertMove(self.actions[self.next], self.actions[self.next :])

    def taken(self, action: str, by_expert: bool) -> None:
        self.next += 1

    def describe(self, move: ExpertMove) -> str:
        return ""


@pytest.fixture(scope="module")
def engine_group(ray_local, tiny_model_dir):
    with engine_group_on(tiny_model_dir, prompt_length=1024, response_length=1024) as group:
        yield group


@pytest.mark.parametrize("style", ["compact", "verl_agent"])
def test_demo_prompts_are_the_collectors_prompts(tiny_tokenizer, engine_group, style):
    """The recipe's collector (builders._build_collector) and the demo writer's path render the same ids."""
    cfg = load_config(ROOT / "recipes/smoke/cpu.yaml", [
        f"env.prompt_template={style}", "env.sokoban.dim_room=[6,6]", "env.max_steps=3", "env.history_length=2",
        "rollout.response_length=16",
    ])
    tasks = load_task_list(cfg.env, "train")[:2]
    with _build_collector(cfg, tiny_tokenizer, engine_group) as collector:
        assert collector.renderer.template.style == style
        batch, _ = collector.collect(tasks, iteration=0)
    renderer = step_prompt_renderer(cfg.env.name, tiny_tokenizer, **step_prompt_settings(cfg))
    env = make_env(cfg.env.name, **env_kwargs(cfg.env))
    by_traj: dict[str, list[int]] = {}
    for i, traj in enumerate(batch.traj_id):
        by_traj.setdefault(traj, []).append(i)
    assert len(by_traj) == 4 and max(len(idx) for idx in by_traj.values()) > 1  # histories are rendered too
    for traj, idx in by_traj.items():
        task = tasks[int(traj.split("-g")[1].split("-")[0])]
        actions = [batch.extras["actions"][i] for i in idx]
        episode = play_episode(env, ReplayExpert(actions), renderer, task, reset_seed=0, max_steps=cfg.env.max_steps,
                               epsilon=0.0, rng=random.Random(0), reasoning="none")
        assert [r["action"] for r in episode.rows] == actions
        for row, i in zip(episode.rows, idx):
            ids = renderer.encode_messages(row["messages"][:-1])
            assert ids == batch.prompt_ids[i].tolist() and row["prompt_tokens"] == len(ids)
    env.close()


@pytest.fixture(scope="module")
def alfworld_cfg(shared_dir):
    data = shared_dir / "data" / "alfworld"
    if not (data / "valid_unseen").is_dir() or not (data / "valid_seen").is_dir():
        pytest.skip("shared ALFWorld games not found")
    # The shared folder holds validation games only: train on valid_unseen, validate on valid_seen.
    return load_config(ROOT / "recipes/smoke/alfworld-cpu.yaml", [
        f"env.data_dir={data}", "env.alfworld.train_split_dir=valid_unseen", "env.max_steps=50",
        "env.prompt_template=compact", "rollout.prompt_length=4096", "trainer.micro_batch_tokens=8192",
        "trainer.log_prob_micro_batch_tokens=8192",
    ])


def _episodes(path: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        out.setdefault(row["episode"], []).append(row)
    return out


def test_alfworld_walkthrough_demos_win(alfworld_cfg, tiny_tokenizer, tmp_path):
    out = tmp_path / "alfworld.jsonl"
    stats = write_demos(alfworld_cfg, out, num_episodes=3, epsilon=0.0, seed=0, tokenizer=tiny_tokenizer)
    assert stats.episodes == 3 and stats.success_rate == 1.0 and stats.end_reasons == {"won": 3}
    val_ids = {t.task_id for t in load_task_list(alfworld_cfg.env, "val")}
    for episode in _episodes(out).values():
        assert episode[0]["task_id"] not in val_ids and episode[0]["task_id"].startswith("valid_unseen/")
        for row in episode:
            user, reply = row["messages"]
            assert f'"{row["action"]}"' in user["content"].split("\n\nActions: [", 1)[1]  # an admissible action
            assert reply["content"].startswith("<think>Plan: ") and reply["content"].endswith(f"<action>{row['action']}</action>")


def test_alfworld_epsilon_stops_where_the_walkthrough_no_longer_applies(alfworld_cfg, tiny_tokenizer, tmp_path):
    out = tmp_path / "eps.jsonl"
    stats = write_demos(alfworld_cfg, out, num_episodes=3, epsilon=0.5, seed=1, tokenizer=tiny_tokenizer)
    assert stats.random_steps > 0 and set(stats.end_reasons) <= {"won", "expert_unavailable", "step_limit"}
    for episode in _episodes(out).values():
        for k, row in enumerate(episode):
            read_only = row["action"] in ALFWORLD_READ_ONLY or row["action"].startswith(ALFWORLD_READ_ONLY_PREFIXES)
            if not row["expert"] and not read_only:
                assert k == len(episode) - 1  # a state-changing random action is the episode's last row


def test_alfworld_training_tasks_that_are_validation_tasks_are_refused(alfworld_cfg):
    alfworld_cfg.env.alfworld.train_split_dir = alfworld_cfg.env.alfworld.val_split_dir
    try:
        with pytest.raises(ValueError, match="training task\\(s\\) are also validation tasks"):
            demo_tasks(alfworld_cfg, 2, seed=0)
    finally:
        alfworld_cfg.env.alfworld.train_split_dir = "valid_unseen"


def test_demos_stopped_by_sigterm_keep_their_episodes_and_resume(tmp_path):
    """A time limit's SIGTERM during `megatron-gigpo demos`: the finished episodes stay in OUT.partial, the
    command says so and exits 143; the same arguments again resume after them and write exactly the file an
    uninterrupted run writes (epsilon draws included: the RNG state is part of the resume point)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = ["--num-episodes", "400", "--epsilon", "0.3", "--seed", "5"]
    overrides = ["env.sokoban.dim_room=[6,6]", "env.max_steps=15"]
    out = tmp_path / "demos.jsonl"
    meta = tmp_path / "demos.jsonl.partial.json"
    cmd = [sys.executable, "-m", "megatron_gigpo.cli", "demos", str(ROOT / "recipes/smoke/cpu.yaml"), "--out",
           str(out), *args, *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (meta.is_file() and json.loads(meta.read_text())["next_index"] >= 50):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    done = json.loads(meta.read_text())["next_index"]
    assert 50 <= done < 400 and not out.exists(), done
    assert f"stopped after {done} of 400 episodes; their rows are kept in {out}.partial" in stderr, stderr[-3000:]
    assert "demos: 40/400 episodes (" in stderr, stderr[-3000:]  # progress lines reach a log file
    kept = [json.loads(line)["episode"] for line in (tmp_path / "demos.jsonl.partial").read_text().splitlines()]
    assert kept and max(kept) < done

    cfg = load_config(ROOT / "recipes/smoke/cpu.yaml", overrides)
    resumed = write_demos(cfg, out, 400, 0.3, 5)  # the same arguments: resumes after `done` episodes
    reference = write_demos(cfg, tmp_path / "reference.jsonl", 400, 0.3, 5)
    assert out.read_bytes() == (tmp_path / "reference.jsonl").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["demos.jsonl", "reference.jsonl"]  # no partial or temp file left
    for key in ("episodes", "skipped", "rows", "won", "random_steps", "end_reasons"):
        assert getattr(resumed, key) == getattr(reference, key), key
