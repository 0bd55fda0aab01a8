"""Dynamic sampling (issue #13 part 1): the group filter, row alignment of the filtered batch, the round loop,
and ``TrainingBatch.select`` keeping per-row extras aligned (verl-agent PR #38's bug)."""

import numpy as np
import pytest
import torch

from megatron_gigpo.algo.advantages import compute_advantages
from megatron_gigpo.config import AlgorithmConfig
from megatron_gigpo.config import ConfigError, load_config
from megatron_gigpo.episodes.batch import TrainingBatch, concat_batches, select_groups
from megatron_gigpo.episodes.dynamic_sampling import collect_informative, informative_uids
from megatron_gigpo.episodes.metrics import EpisodeSummary

pytestmark = pytest.mark.unit

PARAMS = AlgorithmConfig(mode="mean_std_norm", step_advantage_w=1.0, invalid_action_penalty_coef=0.1)


def _batch(groups: dict[str, list[list[tuple[str, float]]]], prefix: str = "it0") -> TrainingBatch:
    """Rows from ``{group: [trajectory = [(anchor, reward), ...], ...]}``; every side array is distinct per row."""
    rows = []
    for g, trajs in groups.items():
        for j, traj in enumerate(trajs):
            for t, (anchor, reward) in enumerate(traj):
                rows.append((f"{prefix}-{g}", f"{prefix}-{g}-n{j}", t, anchor, reward))
    n = len(rows)
    summaries = [EpisodeSummary(traj_id=f"{prefix}-{g}-n{j}", uid=f"{prefix}-{g}", task_id=g, task_type=None,
                                length=len(traj), won=False, episode_return=sum(r for _, r in traj), failed=False,
                                hit_step_limit=True, prompt_overflow=False)
                 for g, trajs in groups.items() for j, traj in enumerate(trajs)]
    return TrainingBatch(
        prompt_ids=[torch.arange(i, i + 3) for i in range(n)],
        response_ids=[torch.arange(100 + i, 102 + i) for i in range(n)],
        rollout_log_probs=[torch.full((2,), -float(i)) for i in range(n)],
        uid=[r[0] for r in rows], traj_id=[r[1] for r in rows],
        step_index=torch.tensor([r[2] for r in rows], dtype=torch.int64),
        anchor=[r[3] for r in rows], env_reward=torch.tensor([r[4] for r in rows], dtype=torch.float64),
        action_valid=torch.tensor([not (r[2] == 1 and r[0].endswith("g1")) for r in rows]),
        extras={"env_name": "sokoban", "iteration": 0, "validation": False, "group_size": 2,
                "num_groups": len(groups), "actions": [f"act{i}" for i in range(n)],
                "action_admissible": [i % 2 == 0 for i in range(n)], "episodes": summaries,
                "failed_traj_ids": [], "failures": {}},
    )


# g0: equal returns, both trajectories alike -> no signal at all.
# g1: different returns -> signal under both criteria.
# g2: equal returns (1.0 each) but from the shared start state s0 the step returns differ (1.0 vs 0.95):
#     episode_return drops it, joint keeps it (GiGPO's step-level signal).
GROUPS = {
    "g0": [[("s0", 0.0), ("s1", 0.0)], [("s0", 0.0), ("s1", 0.0)]],
    "g1": [[("s0", 1.0)], [("s0", 0.0), ("s2", 0.0)]],
    "g2": [[("s0", 1.0), ("s1", 0.0)], [("s0", 0.0), ("s2", 1.0)]],
}


def _assert_rows_of(filtered: TrainingBatch, full: TrainingBatch, kept_uids: list[str]) -> None:
    """Every side array of ``filtered`` equals the recomputation from the full batch's rows of ``kept_uids``."""
    idx = [i for u in kept_uids for i, v in enumerate(full.uid) if v == u]
    assert filtered.num_rows == len(idx)
    for name in ("prompt_ids", "response_ids", "rollout_log_probs"):
        assert all(torch.equal(a, getattr(full, name)[i]) for a, i in zip(getattr(filtered, name), idx)), name
    for name in ("uid", "traj_id", "anchor"):
        assert getattr(filtered, name) == [getattr(full, name)[i] for i in idx], name
    for name in ("step_index", "env_reward", "action_valid"):
        assert torch.equal(getattr(filtered, name), getattr(full, name)[idx]), name
    for key in ("actions", "action_admissible"):
        assert filtered.extras[key] == [full.extras[key][i] for i in idx], key
    assert [e.uid for e in filtered.extras["episodes"]] == [e.uid for e in full.extras["episodes"] if e.uid in kept_uids]
    assert filtered.extras["num_groups"] == len(kept_uids)


@pytest.mark.parametrize("criterion, expected", [("episode_return", ["it0-g1"]), ("joint", ["it0-g1", "it0-g2"])])
def test_filter_drops_groups_without_signal_and_keeps_rows_aligned(criterion, expected):
    full = _batch(GROUPS)
    kept = informative_uids(full, criterion, estimator="gigpo", params=PARAMS)
    assert kept == expected
    filtered = select_groups(full, kept)
    _assert_rows_of(filtered, full, kept)
    # Advantages are group-local: the kept rows get the same advantage in the filtered batch as in the full one.
    idx = [i for i, u in enumerate(full.uid) if u in kept]
    a_full = compute_advantages("gigpo", full.advantage_inputs(), PARAMS).advantage
    a_kept = compute_advantages("gigpo", filtered.advantage_inputs(), PARAMS).advantage
    assert torch.allclose(a_kept, a_full[idx], atol=1e-6)
    dropped = [i for i, u in enumerate(full.uid) if u not in kept]
    if criterion == "joint":
        assert a_full[dropped].abs().max() <= 1e-6  # what was dropped really had no signal


def test_joint_filter_follows_the_estimator():
    """g2 carries only step signal: GRPO (no step level) sees none there, GiGPO does. The invalid-action penalty
    is per row, so a flat-return group with an invalid step has signal under ``joint`` (not ``episode_return``)."""
    full = _batch(GROUPS)
    penalised = _batch({"g1": GROUPS["g0"]})  # step 1 of every member invalid (see _batch)
    assert informative_uids(penalised, "joint", params=PARAMS) == ["it0-g1"]
    assert informative_uids(penalised, "episode_return") == []
    assert informative_uids(full, "joint", estimator="grpo", params=PARAMS) == ["it0-g1"]
    no_step = AlgorithmConfig(mode="mean_std_norm", step_advantage_w=0.0, invalid_action_penalty_coef=0.1)
    assert informative_uids(full, "joint", estimator="gigpo", params=no_step) == ["it0-g1"]


def test_episode_return_ignores_failed_members_and_unknown_criterion_is_refused():
    one_left = _batch({"g0": [[("s0", 1.0)]], "g1": [[("s0", 1.0)], [("s0", 2.0)]]})  # g0: one surviving member
    assert informative_uids(one_left, "episode_return") == ["it0-g1"]
    with pytest.raises(ValueError, match="unknown criterion 'std'"):
        informative_uids(one_left, "std")
    with pytest.raises(ValueError, match="needs the advantage params"):
        informative_uids(one_left, "joint")


def test_select_keeps_per_row_extras_aligned():
    full = _batch(GROUPS)
    full.extras["row_weights"] = np.arange(full.num_rows)  # a per-batch extra: shared, not indexed
    sub = full.select([2, 3])
    assert sub.extras["actions"] == ["act2", "act3"] and sub.extras["action_admissible"] == [True, False]
    assert sub.extras["env_name"] == "sokoban" and sub.extras["row_weights"] is full.extras["row_weights"]
    assert len(full.extras["actions"]) == full.num_rows  # the source batch is untouched
    sub.extras["new"] = 1
    assert "new" not in full.extras
    full.extras["actions"] = torch.arange(full.num_rows)  # tensors and arrays index the same way
    assert torch.equal(full.select([4, 0]).extras["actions"], torch.tensor([4, 0]))
    with pytest.raises(ValueError, match="extras\\['actions'\\]"):
        TrainingBatch(**{**full.__dict__, "extras": {"actions": ["only one"]}})


def test_concat_batches_joins_rows_and_trajectory_extras():
    a, b = _batch({"g0": GROUPS["g0"]}), _batch({"g1": GROUPS["g1"]}, prefix="it0-r1")
    both = concat_batches([a, b])
    assert both.uid == a.uid + b.uid and both.extras["actions"] == a.extras["actions"] + b.extras["actions"]
    assert both.extras["num_groups"] == 2 and len(both.extras["episodes"]) == 4
    assert torch.equal(both.env_reward, torch.cat([a.env_reward, b.env_reward]))
    b.extras["iteration"] = 1
    with pytest.raises(ValueError, match="extras\\['iteration'\\] differ"):
        concat_batches([a, b])


def _rounds(schedule: list[dict]):
    """A round function serving ``schedule[k]`` as round k's groups; records the rounds asked for."""
    asked = []

    def collect_round(k: int):
        asked.append(k)
        batch = _batch(schedule[k], prefix=f"it0-r{k}")
        return batch, {"episode/count": 99.0, "timing/collect_s": 1.0, "action/invalid_rate": float(k)}

    return collect_round, asked


def test_rounds_stop_at_num_groups_and_trim_surplus_in_collection_order():
    flat = GROUPS["g0"]
    schedule = [{"g0": flat, "g1": GROUPS["g1"]}, {"g0": GROUPS["g1"], "g1": GROUPS["g1"]}, {"g0": GROUPS["g1"]}]
    fn, asked = _rounds(schedule)
    batch, m = collect_informative(fn, num_groups=2, criterion="episode_return", max_rounds=5)
    assert asked == [0, 1]  # enough after round 1; round 2 is never collected
    assert list(dict.fromkeys(batch.uid)) == ["it0-r0-g1", "it0-r1-g0"]  # round 1's second group is surplus
    assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/round_limit_hit"] == 0
    assert m["dynamic_sampling/filtered_group_frac"] == pytest.approx(1 / 4)
    assert m["dynamic_sampling/informative_groups"] == 3 and m["dynamic_sampling/trained_groups"] == 2
    assert m["dynamic_sampling/trained_rows"] == batch.num_rows == 6
    assert m["timing/collect_s"] == 2.0 and m["action/invalid_rate"] == 0.0  # summed; first round's
    assert m["episode/count"] == 8  # recomputed over every episode of every round
    _assert_rows_of(batch, concat_batches([_batch(s, prefix=f"it0-r{k}") for k, s in enumerate(schedule[:2])]),
                    ["it0-r0-g1", "it0-r1-g0"])


def test_round_limit_is_honoured(caplog):
    fn, asked = _rounds([{"g0": GROUPS["g0"]}] * 5)
    batch, m = collect_informative(fn, num_groups=1, criterion="joint", max_rounds=3, params=PARAMS, iteration=7)
    assert asked == [0, 1, 2] and batch.num_rows == 0 and batch.extras["env_name"] == "sokoban"
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/round_limit_hit"] == 1
    assert m["dynamic_sampling/filtered_group_frac"] == 1.0 and m["dynamic_sampling/trained_rows"] == 0
    assert ("iteration 7: dynamic sampling found 0 informative groups (criterion joint) of 3 collected in 3 "
            "generation rounds (algorithm.dynamic_sampling.max_rounds), 1 wanted (env.num_groups); no update this "
            "iteration") in caplog.text
    # One of two wanted: it trains on what it found and says how many rows that is.
    fn, _ = _rounds([{"g0": GROUPS["g0"], "g1": GROUPS["g1"]}] * 2)
    batch, _ = collect_informative(fn, num_groups=4, criterion="episode_return", max_rounds=2, iteration=8)
    assert ("iteration 8: dynamic sampling found 2 informative groups (criterion episode_return) of 4 collected in "
            f"2 generation rounds (algorithm.dynamic_sampling.max_rounds), 4 wanted (env.num_groups); training on "
            f"their {batch.num_rows} rows") in caplog.text


def test_recipe_keys_and_checks(tmp_path):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes/smoke/cpu.yaml"
    cfg = load_config(recipe)
    assert not cfg.algorithm.dynamic_sampling.enabled and cfg.algorithm.dynamic_sampling.criterion == "episode_return"
    cfg = load_config(recipe, ["algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.criterion=joint",
                               "algorithm.dynamic_sampling.max_rounds=3"])
    assert cfg.algorithm.dynamic_sampling.max_rounds == 3
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling.max_rounds=0 must be >= 1"):
        load_config(recipe, ["algorithm.dynamic_sampling.max_rounds=0"])
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling.criterion='std' is not one of"):
        load_config(recipe, ["algorithm.dynamic_sampling.criterion=std"])
    with pytest.raises(ConfigError, match="did you mean 'algorithm.dynamic_sampling.max_rounds'"):
        load_config(recipe, ["algorithm.dynamic_sampling.max_round=3"])


def test_each_round_gets_its_own_reset_and_sampling_seeds():
    """Round 0 keeps the seeds runs had before rounds existed (resume of old runs stays exact); later rounds
    of the same iteration and group draw new ones."""
    import dataclasses
    import hashlib

    from megatron_gigpo.envs.base import Task
    from megatron_gigpo.episodes.collector import reset_seed, step_sampling
    from megatron_gigpo.rollout.engine import SamplingConfig

    task = Task(env="sokoban", task_id="room-3", split="train")
    old_key = int.from_bytes(hashlib.sha256(b"train/5/2/1/room-3").digest()[:4], "little") & 0x7FFFFFFF
    seeds = [reset_seed(5, task, 1, 2, False, round_index=k) for k in range(3)]
    assert seeds[0] == old_key == reset_seed(5, task, 1, 2, False) and len(set(seeds)) == 3
    assert reset_seed(5, task, 1, 2, True, round_index=0) == reset_seed(5, task, 0, 9, True)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, stop=(), seed=7)
    draws = [step_sampling(sampling, 2, 0, False, round_index=k).seed for k in range(3)]
    assert len(set(draws)) == 3 and draws[0] == step_sampling(sampling, 2, 0, False).seed
    assert dataclasses.replace(sampling, temperature=0.0) == step_sampling(
        dataclasses.replace(sampling, temperature=0.0), 2, 0, False, round_index=1)


# Edges found by mutation testing (issue #43 item 3).


def test_argument_checks_and_a_single_round():
    fn, asked = _rounds([{"g0": GROUPS["g0"], "g1": GROUPS["g1"]}] * 2)
    for num_groups, max_rounds in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match=f"num_groups={num_groups} and max_rounds={max_rounds} must be >= 1"):
            collect_informative(fn, num_groups=num_groups, criterion="episode_return", max_rounds=max_rounds)
    assert asked == []
    batch, m = collect_informative(fn, num_groups=1, criterion="episode_return", max_rounds=1)
    assert asked == [0] and list(dict.fromkeys(batch.uid)) == ["it0-r0-g1"] and m["dynamic_sampling/rounds"] == 1


def test_a_return_spread_of_exactly_return_atol_is_no_signal():
    from megatron_gigpo.episodes.dynamic_sampling import RETURN_ATOL

    batch = _batch({"g0": [[("s0", 0.0)], [("s0", RETURN_ATOL)]], "g1": [[("s0", 0.0)], [("s0", 2 * RETURN_ATOL)]]})
    assert informative_uids(batch, "episode_return") == ["it0-g1"]


def test_rounds_filter_with_the_run_estimator_and_warn_only_when_short(caplog):
    fn, _ = _rounds([GROUPS])
    batch, m = collect_informative(fn, num_groups=1, criterion="joint", max_rounds=1, estimator="grpo", params=PARAMS)
    assert m["dynamic_sampling/informative_groups"] == 1  # g2 has step signal only: GRPO does not see it
    assert [r.getMessage() for r in caplog.records if r.name == "megatron_gigpo.episodes.dynamic_sampling"] == []
    fn, _ = _rounds([GROUPS])
    _, m = collect_informative(fn, num_groups=1, criterion="joint", max_rounds=1, estimator="gigpo", params=PARAMS)
    assert m["dynamic_sampling/informative_groups"] == 2


def test_groups_without_rows_count_as_collected_and_filtered():
    """``extras['num_groups']`` counts groups whose episodes all failed (no rows); an empty round is all filtered."""
    def collect_round(k):
        batch = _batch({"g0": GROUPS["g0"], "g1": GROUPS["g1"]} if k == 0 else {}, prefix=f"it0-r{k}")
        batch.extras["num_groups"] = 3 if k == 0 else 0
        return batch, {}

    _, m = collect_informative(collect_round, num_groups=1, criterion="episode_return", max_rounds=1)
    assert m["dynamic_sampling/filtered_group_frac"] == pytest.approx(1 - 1 / 3)
    _, m = collect_informative(lambda k: collect_round(1), num_groups=1, criterion="episode_return", max_rounds=2)
    assert m["dynamic_sampling/filtered_group_frac"] == 1.0 and m["dynamic_sampling/rounds"] == 2


def test_round_metrics_merge():
    """``timing/*`` and ``workers/*`` are summed over rounds (a key may first appear in a later round), other
    keys are round 0's; ``episode/*`` is recomputed when the batch names its environment, else round 0's."""
    rounds = [{"episode/count": 5.0, "episode/stale": 1.0, "timing/a_s": 1.0, "workers/busy": 2.0, "other": 0.0},
              {"episode/count": 7.0, "timing/a_s": 2.0, "timing/late_s": 4.0, "workers/busy": 3.0, "other": 1.0}]
    flat = {"g0": GROUPS["g0"]}

    def bare_round(k):  # no per-batch extras at all: groups are counted from the uids
        batch = _batch(flat, prefix=f"it0-r{k}")
        batch.extras = {}
        return batch, rounds[k]

    _, m = collect_informative(bare_round, num_groups=1, criterion="episode_return", max_rounds=2)
    assert {k: v for k, v in m.items() if not k.startswith("dynamic_sampling/")} == {
        "episode/count": 5.0, "episode/stale": 1.0, "timing/a_s": 3.0, "workers/busy": 5.0, "other": 0.0,
        "timing/late_s": 4.0}
    assert m["dynamic_sampling/filtered_group_frac"] == 1.0

    _, m = collect_informative(lambda k: (_batch(flat, prefix=f"it0-r{k}"), rounds[k]), num_groups=1,
                               criterion="episode_return", max_rounds=2)
    assert "episode/stale" not in m and m["episode/count"] == 4 and m["episode/sokoban/success_rate"] == 0.0
