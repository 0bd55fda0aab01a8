"""The collector's rows where states change: a row's anchor is the state its action was taken in.

A walker model (``tiny_models.make_walker_model``: every reply is ``<think></think><action>A</action>``, A
uniform over a fixed list, sampled by the real vLLM engine) moves through real Sokoban rooms and ALFWorld
games; the real collector records the rows. Each trajectory is then replayed on a fresh environment from its
group's reset seed, and every row is checked against the replay: its anchor is the observation *before* its
action; its reward, validity and executed action are its own action's; ``step_index`` counts from 0; only the
last row of a trajectory may end it; members of a group start from one state; groups have distinct uids.
The random tiny model of ``test_collector.py`` rarely moves the player, so an anchor recorded after the action
passed there (issue #43).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from episode_engines import engine_group_on

from megatron_gigpo.builders import _build_collector
from megatron_gigpo.config import load_config
from megatron_gigpo.envs.registry import env_kwargs, load_task_list, make_env
from megatron_gigpo.episodes.collector import reset_seed

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SOKOBAN_MOVES = ["up", "down", "left", "right", "jump"]  # "jump": well-formed reply, invalid move (a no-op)
ALFWORLD_MOVES = ["go to countertop 1", "go to cabinet 1", "go to drawer 1", "go to shelf 1", "go to sidetable 1",
                  "go to diningtable 1", "go to dresser 1", "go to desk 1"]
COMMON = ["trainer.total_iterations=1", "rollout.response_length=8", "rollout.temperature=1.0", "rollout.n=3",
          "env.num_groups=3", "env.num_workers=2"]


@pytest.fixture(scope="module")
def walker_dir(tmp_path_factory) -> Path:
    from tiny_models import make_walker_model

    return make_walker_model(tmp_path_factory.mktemp("walker"), SOKOBAN_MOVES + ALFWORLD_MOVES)


@pytest.fixture(scope="module")
def walker_engine(ray_local, walker_dir):
    with engine_group_on(walker_dir, prompt_length=4096, response_length=8) as group:
        yield group


def _collect(cfg, walker_dir, engine, iteration: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(walker_dir)
    tasks = load_task_list(cfg.env, "train")[: cfg.env.num_groups]
    with _build_collector(cfg, tokenizer, engine) as collector:
        batch, _ = collector.collect(tasks, iteration=iteration)
    return batch, tasks, tokenizer


def check_rows_against_replay(cfg, batch, tasks, tokenizer, iteration: int) -> dict[str, int]:
    """Replay every trajectory of ``batch`` from its group's reset and check each row (the module docstring);
    returns counts: rows, rows whose action changed the state, invalid rows."""
    by_traj: dict[str, list[int]] = {}
    for i, traj in enumerate(batch.traj_id):
        by_traj.setdefault(traj, []).append(i)
    summaries = {e.traj_id: e for e in batch.extras["episodes"]}
    assert not batch.extras["failed_traj_ids"] and len(by_traj) == len(tasks) * cfg.rollout.n
    starts: dict[str, set[str]] = {}
    counts = {"rows": 0, "moved": 0, "invalid": 0}
    env = make_env(cfg.env.name, **env_kwargs(cfg.env))
    try:
        for traj, idx in by_traj.items():
            group = int(traj.split("-g")[1].split("-")[0])
            uid = batch.uid[idx[0]]
            assert {batch.uid[i] for i in idx} == {uid} and uid == f"it{iteration}-g{group}", (traj, uid)
            assert batch.step_index[idx].tolist() == list(range(len(idx))), traj
            state = env.reset(tasks[group], reset_seed(cfg.env.seed, tasks[group], group, iteration, False)).anchor
            starts.setdefault(uid, set()).add(batch.anchor[idx[0]])
            for k, i in enumerate(idx):
                assert batch.anchor[i] == state, f"{traj} step {k}: the anchor is not the state the action was taken in"
                reply = tokenizer.decode(batch.response_ids[i], skip_special_tokens=True)
                projected = env.project_action(reply, None)
                assert batch.extras["actions"][i] == projected.action, (traj, k, reply)
                assert bool(batch.action_valid[i]) == projected.valid, (traj, k, reply)
                result = env.step(projected.action)
                assert float(batch.env_reward[i]) == pytest.approx(result.reward), (traj, k, "reward")
                last = k == len(idx) - 1
                assert last or not result.done, f"{traj} step {k} ended the episode, yet more rows follow"
                counts["moved"] += int(result.anchor != state)
                counts["invalid"] += int(not projected.valid)
                state = result.anchor
            counts["rows"] += len(idx)
            summary = summaries[traj]
            assert summary.length == len(idx) and summary.won == bool(result.won), traj
            assert result.done or len(idx) == cfg.env.max_steps, f"{traj} ended early without done"
    finally:
        env.close()
    assert all(len(anchors) == 1 for anchors in starts.values()), "members of a group started apart"
    assert len(starts) == len(tasks)  # one uid per group, none shared
    return counts


def test_sokoban_rows_follow_the_replay(walker_dir, walker_engine):
    cfg = load_config(ROOT / "recipes/smoke/cpu.yaml", [*COMMON, "env.max_steps=6", "env.sokoban.dim_room=[6,6]"])
    batch, tasks, tokenizer = _collect(cfg, walker_dir, walker_engine, iteration=3)
    counts = check_rows_against_replay(cfg, batch, tasks, tokenizer, iteration=3)
    # The walk changes the state on many steps, and some replies are invalid ("jump"): a shifted anchor,
    # reward or validity would show.
    assert counts["moved"] >= counts["rows"] // 4 and counts["invalid"] >= 1, counts


def test_alfworld_rows_follow_the_replay(walker_dir, walker_engine, shared_dir):
    data = shared_dir / "data" / "alfworld"
    if not (data / "valid_unseen").is_dir():
        pytest.skip("shared ALFWorld games not found")
    cfg = load_config(ROOT / "recipes/smoke/alfworld-cpu.yaml", [
        *COMMON, f"env.data_dir={data}", "env.alfworld.train_split_dir=valid_unseen", "env.max_steps=4",
        "env.prompt_template=compact", "rollout.prompt_length=4096", "trainer.micro_batch_tokens=8192",
        "trainer.log_prob_micro_batch_tokens=8192"])
    batch, tasks, tokenizer = _collect(cfg, walker_dir, walker_engine, iteration=1)
    counts = check_rows_against_replay(cfg, batch, tasks, tokenizer, iteration=1)
    assert counts["moved"] >= counts["rows"] // 4, counts
