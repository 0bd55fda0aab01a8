"""Estimators against the loop oracle, invariances (hypothesis), numerics and input errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from algo_batches import RowLists, random_rows, row_lists
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_gigpo.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_RELATIVE_ESTIMATORS,
    AdvantageInputs,
    check_params,
    compute_advantages,
    episode_relative_advantage,
    get_advantage_estimator,
    register_advantage_estimator,
)
from megatron_gigpo.algo.oracle import oracle_advantages
from megatron_gigpo.config import AlgorithmConfig

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=40, deadline=None)
MODES = ["mean_norm", "mean_std_norm"]
STATS = ["trajectory", "per_step_row"]


def _params(**kw) -> AlgorithmConfig:
    """The recipe's algorithm section; ``invalid_action_penalty_coef=None`` turns the penalty off."""
    base = dict(gamma=0.9, step_advantage_w=1.0, mode="mean_std_norm", episode_stats="trajectory",
                enable_similarity=False, similarity_thresh=0.95, epsilon=1e-6, invalid_action_penalty_coef=0.1)
    base.update(kw)
    if base["invalid_action_penalty_coef"] is None:
        base.update(invalid_action_penalty=False, invalid_action_penalty_coef=0.0)
    return AlgorithmConfig(**base)


def _oracle(name: str, rows: RowLists, params: AlgorithmConfig) -> dict:
    return oracle_advantages(name, rows.uid, rows.traj_id, rows.step_index, rows.anchor, rows.env_reward,
                             rows.action_valid, params)


def _same_partition(a, b) -> bool:
    a, b = list(a), list(b)
    return len(set(zip(a, b))) == len(set(a)) == len(set(b))


def _assert_matches_oracle(name: str, rows: RowLists, params: AlgorithmConfig) -> None:
    out = compute_advantages(name, rows.inputs(), params)
    ref = _oracle(name, rows, params)
    # The oracle sums in another order, so scores may differ by a few ulps; a group whose std is far below
    # epsilon divides that difference by epsilon (returns 19.8 and 19.799999999999997 -> A^S 3.6e-9 and 0).
    scale = max(np.abs(ref["step_returns"]).max(initial=0.0), np.abs(ref["episode_score"]).max(initial=0.0))
    normalised_atol = 1e-9 + 8 * np.finfo(np.float64).eps * scale / params.epsilon
    for field in ("episode_advantage", "step_advantage", "step_returns", "episode_score"):
        mine = getattr(out, field)
        assert mine.dtype == torch.float64, field
        atol = normalised_atol if field.endswith("advantage") else 1e-9
        np.testing.assert_allclose(mine.numpy(), ref[field], rtol=1e-9, atol=atol, err_msg=field)
    np.testing.assert_allclose(out.advantage.numpy(), ref["advantage"], rtol=1e-6, atol=1e-6)
    assert out.advantage.dtype == torch.float32 and out.advantage.shape == (len(rows),)
    if name == "gigpo":
        assert _same_partition(out.step_group_id.tolist(), ref["step_group"])
        assert out.step_group_size.tolist() == [ref["step_group"].count(g) for g in ref["step_group"]]
    else:
        assert out.step_group_id is None and out.step_group_size is None


@pytest.mark.parametrize("name", ["gigpo", "grpo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stats", STATS)
@pytest.mark.parametrize("penalty", [None, 0.1])
def test_estimators_match_oracle(name, mode, stats, penalty):
    rng = np.random.default_rng(hash((name, mode, stats, penalty)) % 2**32)
    rows = random_rows(rng, num_uids=4, trajs=5, max_steps=7)
    perm = rng.permutation(len(rows)).tolist()
    params = _params(mode=mode, episode_stats=stats, invalid_action_penalty_coef=penalty, step_advantage_w=0.7)
    _assert_matches_oracle(name, rows.permuted(perm), params)


@pytest.mark.parametrize("stats", STATS)
def test_rloo_matches_oracle(stats):
    rows = random_rows(np.random.default_rng(3), num_uids=4, trajs=4, max_steps=5)
    _assert_matches_oracle("rloo", rows, _params(mode="mean_norm", episode_stats=stats))


def test_rloo_refuses_std_normalisation():
    rows = random_rows(np.random.default_rng(0), 1, 2, 2)
    with pytest.raises(ValueError, match="mean_norm"):
        compute_advantages("rloo", rows.inputs(), _params(mode="mean_std_norm"))


@SETTINGS
@given(rows=row_lists(), mode=st.sampled_from(MODES), stats=st.sampled_from(STATS),
       w=st.sampled_from([0.0, 0.5, 1.0]), gamma=st.sampled_from([0.1, 0.9, 1.0]))
# Equal returns 19.8 (oracle) and 19.799999999999997 (ours) in a step group whose std is far below epsilon.
@example(rows=RowLists(["u0"] * 5, ["t0"] * 5, [0, 1, 2, 3, 4], ["k", "k.", "k", "k.", "k."],
                       [0.0, -0.1, 10.0, 10.0, -0.1], [True, False, False, False, False]),
         mode="mean_std_norm", stats="trajectory", w=0.0, gamma=1.0)
# One trajectory, every action invalid: the oracle's per-row values differ by ~1e-15, over std + epsilon.
@example(rows=RowLists(["u0"] * 3, ["t0"] * 3, [0, 1, 2], ["a", "b", "c"], [1.0, 10.0, -0.1], [False] * 3),
         mode="mean_std_norm", stats="per_step_row", w=0.0, gamma=0.1)
def test_paper_and_parity_modes_match_oracle(rows, mode, stats, w, gamma):
    _assert_matches_oracle("gigpo", rows, _params(mode=mode, episode_stats=stats, step_advantage_w=w, gamma=gamma))


@SETTINGS
@given(rows=row_lists(), seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(MODES),
       stats=st.sampled_from(STATS))
def test_row_permutation_changes_nothing(rows, seed, mode, stats):
    params = _params(mode=mode, episode_stats=stats)
    perm = np.random.default_rng(seed).permutation(len(rows)).tolist()
    base = compute_advantages("gigpo", rows.inputs(), params)
    moved = compute_advantages("gigpo", rows.permuted(perm).inputs(), params)
    # Sums run in another order: float64 parts agree to rounding, the float32 advantage to one ulp.
    for field in ("episode_advantage", "step_advantage", "step_returns"):
        torch.testing.assert_close(getattr(moved, field), getattr(base, field)[perm], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moved.advantage, base.advantage[perm], rtol=1e-6, atol=1e-6)
    assert torch.equal(moved.step_group_size, base.step_group_size[perm])
    assert _same_partition(moved.step_group_id.tolist(), base.step_group_id[perm].tolist())


@SETTINGS
@given(rows=row_lists(max_uids=2), other=row_lists(max_uids=2, prefix="v"), stats=st.sampled_from(STATS))
def test_rows_of_other_uids_do_not_change_a_uid(rows, other, stats):
    params = _params(episode_stats=stats)
    alone = compute_advantages("gigpo", rows.inputs(), params)
    mixed = compute_advantages("gigpo", (rows + other).inputs(), params)
    n = len(rows)
    torch.testing.assert_close(mixed.advantage[:n], alone.advantage, rtol=0, atol=0)
    torch.testing.assert_close(mixed.step_group_size[:n], alone.step_group_size)


@SETTINGS
@given(rows=row_lists(), mode=st.sampled_from(MODES), stats=st.sampled_from(STATS))
def test_zero_step_weight_is_episode_only(rows, mode, stats):
    params = _params(mode=mode, episode_stats=stats, step_advantage_w=0.0)
    gigpo = compute_advantages("gigpo", rows.inputs(), params)
    grpo = compute_advantages("grpo", rows.inputs(), params)
    torch.testing.assert_close(gigpo.advantage, grpo.advantage, rtol=0, atol=0)
    torch.testing.assert_close(gigpo.advantage.double(), gigpo.episode_advantage.float().double())


@SETTINGS
@given(rows=row_lists(), stats=st.sampled_from(STATS))
def test_grpo_is_gigpo_without_steps_in_mean_std_norm(rows, stats):
    params = _params(mode="mean_std_norm", episode_stats=stats)
    grpo = compute_advantages("grpo", rows.inputs(), params)
    gigpo = compute_advantages("gigpo", rows.inputs(), dataclasses.replace(params, step_advantage_w=0.0))
    torch.testing.assert_close(grpo.advantage, gigpo.advantage, rtol=0, atol=0)


@st.composite
def equal_trajectories(draw) -> RowLists:
    """Every trajectory of every uid has the same length and the same reward at each step; one anchor per
    step index, so each step group holds rows with equal returns."""
    steps = draw(st.integers(1, 5))
    rewards = draw(st.lists(st.sampled_from([0.0, 0.1, 0.7, -0.3, 10.0]), min_size=steps, max_size=steps))
    rows = RowLists([], [], [], [], [], [])
    for u in range(draw(st.integers(1, 3))):
        for t in range(draw(st.integers(1, 6))):
            for s in range(steps):
                rows.uid.append(f"u{u}")
                rows.traj_id.append(f"u{u}/t{t}")
                rows.step_index.append(s)
                rows.anchor.append(f"s{s}")
                rows.env_reward.append(rewards[s])
                rows.action_valid.append(True)
    return rows


@SETTINGS
@given(rows=equal_trajectories(), mode=st.sampled_from(MODES), stats=st.sampled_from(STATS),
       gamma=st.sampled_from([0.95, 1.0]))
def test_equal_returns_give_exactly_zero(rows, mode, stats, gamma):
    """Rewards like 0.1 make float sums inexact; no residue may leak into the advantages. (The parity
    option's one-row episode group keeps its raw score by definition and is left out.)"""
    out = compute_advantages("gigpo", rows.inputs(), _params(mode=mode, episode_stats=stats, gamma=gamma))
    counted = torch.tensor([stats == "trajectory" or rows.uid.count(u) > 1 for u in rows.uid])
    assert torch.all(out.episode_advantage[counted] == 0)
    assert torch.all(out.step_advantage == 0)
    assert torch.all(out.advantage[counted] == 0)


def test_identical_returns_in_large_groups_are_exactly_zero():
    # fp32 statistics leave residues ~1e-8 here, which 1/(0 + 1e-6) would amplify to ~1e-2.
    n = 64
    rows = RowLists(["u"] * n, [f"t{i}" for i in range(n)], [0] * n, ["s"] * n, [0.1 + 0.2] * n, [True] * n)
    out = compute_advantages("gigpo", rows.inputs(), _params())
    assert torch.all(out.advantage == 0)


def test_singleton_rules():
    rows = RowLists(["solo", "pair", "pair"], ["a", "b", "c"], [0, 0, 0], ["x", "y", "z"], [10.0, 10.0, 0.0],
                    [True] * 3)
    paper = compute_advantages("gigpo", rows.inputs(), _params(mode="mean_norm"))
    assert paper.episode_advantage.tolist() == [0.0, 5.0, -5.0]  # one trajectory -> 0
    assert paper.step_advantage.tolist() == [0.0, 0.0, 0.0]  # step groups of one -> 0
    parity = compute_advantages("gigpo", rows.inputs(), _params(mode="mean_norm", episode_stats="per_step_row"))
    assert parity.episode_advantage.tolist() == [10.0, 5.0, -5.0]  # one row keeps its raw score


def test_penalty_hits_only_the_invalid_row():
    rows = RowLists(["u"] * 3, ["t"] * 3, [0, 1, 2], ["a", "b", "c"], [0.0, 0.0, 1.0], [True, False, True])
    on = compute_advantages("gigpo", rows.inputs(), _params(gamma=0.5, invalid_action_penalty_coef=0.25))
    off = compute_advantages("gigpo", rows.inputs(), _params(gamma=0.5, invalid_action_penalty_coef=None))
    torch.testing.assert_close(off.step_returns, torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(on.step_returns, torch.tensor([0.25, 0.25, 1.0], dtype=torch.float64))
    torch.testing.assert_close(on.episode_score, torch.tensor([1.0, 0.75, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("stats", STATS)
def test_extreme_finite_input_stays_finite_and_bounded(stats):
    rng = np.random.default_rng(7)
    rows = random_rows(rng, 3, 4, 6)
    rows.env_reward = [float(x) for x in rng.choice([-1e300, 1e300, 1e-300, 0.0, 3.0], len(rows))]
    rows.env_reward = [r / 1e10 for r in rows.env_reward]  # sums stay finite
    out = compute_advantages("gigpo", rows.inputs(), _params(episode_stats=stats, invalid_action_penalty_coef=1.0))
    assert torch.isfinite(out.episode_advantage).all() and torch.isfinite(out.step_advantage).all()
    if stats == "trajectory":
        # |A_E| <= sqrt((N - 1) * len(tau)) in mean_std_norm, whatever the penalty does within trajectories
        assert out.episode_advantage.abs().max() <= np.sqrt(3 * 6) + 1e-9


def test_registry():
    assert set(ADVANTAGE_ESTIMATORS) >= {"gigpo", "grpo", "rloo"}
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo'"):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gigpo")(lambda inputs, params: None)


def _inputs(**override) -> dict:
    base = dict(uid=["u", "u"], traj_id=["a", "b"], step_index=torch.tensor([0, 0]), anchor=["x", "x"],
                env_reward=torch.tensor([1.0, 0.0], dtype=torch.float64), action_valid=torch.tensor([True, True]))
    base.update(override)
    return base


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(uid=["u"]), "uid has 1 rows"),
        (dict(anchor=["x"]), "anchor"),
        (dict(env_reward=torch.tensor([1.0, float("nan")], dtype=torch.float64)), "env_reward must be finite"),
        (dict(env_reward=torch.tensor([1.0, float("inf")], dtype=torch.float64)), "env_reward must be finite"),
        (dict(env_reward=torch.tensor([1.0, 0.0])), "env_reward must be torch.float64"),
        (dict(step_index=torch.tensor([0, 0], dtype=torch.int32)), "step_index must be torch.int64"),
        (dict(action_valid=torch.tensor([1, 1])), "action_valid must be torch.bool"),
        (dict(step_index=[0, 0]), "step_index must be a 1-D torch tensor"),
    ],
)
def test_bad_inputs_are_named(override, match):
    with pytest.raises(ValueError, match=match):
        AdvantageInputs(**_inputs(**override))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(traj_id=["a", "a"]), "trajectory 'a' has step_index 0 more than once"),
        (dict(step_index=torch.tensor([0, 2])), "trajectory 'b' has 1 rows but row 1 has step_index 2"),
        (dict(step_index=torch.tensor([0, -1])), "step_index must be >= 0"),
        (dict(uid=["u", "v"], traj_id=["a", "a"], step_index=torch.tensor([0, 1])), "more than one uid"),
    ],
)
def test_bad_trajectories_are_named(override, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages("gigpo", AdvantageInputs(**_inputs(**override)), _params())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("mode", "mean", "algorithm.mode='mean' is not one of mean_norm, mean_std_norm"),
        ("episode_stats", "rows", "algorithm.episode_stats='rows' is not one of trajectory, per_step_row"),
        ("similarity_thresh", 0.0, r"similarity_thresh=0.0 must be in \(0, 1\)"),
        ("similarity_thresh", 1.0, r"similarity_thresh=1.0 must be in \(0, 1\)"),
        ("gamma", 1.5, r"algorithm.gamma=1.5 must be in \(0, 1\]"),
        ("gamma", 0.0, r"algorithm.gamma=0.0 must be in \(0, 1\]"),
        ("epsilon", 0.0, "epsilon=0.0 must be > 0"),
        ("step_advantage_w", float("nan"), "step_advantage_w=nan must be >= 0"),
        ("invalid_action_penalty_coef", -0.1, "invalid_action_penalty_coef=-0.1 must be >= 0"),
    ],
)
def test_bad_params_are_named(field, value, match):
    """The estimators run the recipe field's own check (the one `validate` runs): one range per setting."""
    rows = RowLists(["u"] * 2, ["t", "s"], [0, 0], ["a", "a"], [0.0, 1.0], [True, True])
    with pytest.raises(ValueError, match=match):
        compute_advantages("gigpo", rows.inputs(), _params(**{field: value}))


def test_the_penalty_switch_turns_the_coefficient_off():
    rows = RowLists(["u"] * 2, ["t"] * 2, [0, 1], ["a", "b"], [0.0, 1.0], [False, True])
    on = compute_advantages("gigpo", rows.inputs(), _params(invalid_action_penalty_coef=0.5))
    off = compute_advantages("gigpo", rows.inputs(), _params(invalid_action_penalty=False, invalid_action_penalty_coef=0.5))
    assert float(on.episode_score[0]) == 0.5 and float(off.episode_score[0]) == 1.0


def test_training_batch_advantage_inputs():
    from megatron_gigpo.episodes.batch import TrainingBatch

    n = 3
    batch = TrainingBatch(
        prompt_ids=[torch.tensor([1, 2])] * n,
        response_ids=[torch.tensor([3])] * n,
        rollout_log_probs=[torch.tensor([-0.5])] * n,
        uid=["u", "u", "u"],
        traj_id=["a", "a", "b"],
        step_index=torch.tensor([0, 1, 0]),
        anchor=["s0", "s1", "s0"],
        env_reward=torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64),
        action_valid=torch.tensor([True, True, False]),
    )
    out = compute_advantages("gigpo", batch.advantage_inputs(), _params(mode="mean_norm"))
    assert out.step_group_id.tolist() == [0, 1, 0]
    assert out.advantage.shape == (n,)



@pytest.mark.parametrize("similarity", [False, True])
@pytest.mark.parametrize("name", ["gigpo", "grpo", "rloo"])
def test_empty_and_single_row_batches(name, similarity):
    params = _params(mode="mean_norm", enable_similarity=similarity)
    empty = RowLists([], [], [], [], [], [])
    out = compute_advantages(name, empty.inputs(), params)
    assert out.advantage.shape == (0,) and out.advantage.dtype == torch.float32
    one = RowLists(["u"], ["t"], [0], ["s"], [1.0], [True])
    out = compute_advantages(name, one.inputs(), params)
    assert out.advantage.tolist() == [0.0]


def test_register_records_the_estimator_and_its_group_relative_flag():
    def fn(inputs, params):
        return None

    saved = dict(ADVANTAGE_ESTIMATORS), list(GROUP_RELATIVE_ESTIMATORS)
    try:
        assert register_advantage_estimator("_grouped")(fn) is fn
        register_advantage_estimator("_single", group_relative=False)(fn)
        assert get_advantage_estimator("_grouped") is fn and get_advantage_estimator("_single") is fn
        assert GROUP_RELATIVE_ESTIMATORS == saved[1] + ["_grouped"]
    finally:
        ADVANTAGE_ESTIMATORS.clear()
        ADVANTAGE_ESTIMATORS.update(saved[0])
        GROUP_RELATIVE_ESTIMATORS[:] = saved[1]


def test_check_params_lists_every_bad_field():
    with pytest.raises(ValueError, match=r"^algorithm.gamma=0.0 must be in \(0, 1\]; algorithm.epsilon=0.0 must be > 0$"):
        check_params(_params(gamma=0.0, epsilon=0.0))


@pytest.mark.parametrize(
    ("field", "short"),
    [("traj_id", ["a"]), ("anchor", ["x"]), ("step_index", torch.tensor([0])),
     ("env_reward", torch.tensor([1.0], dtype=torch.float64)), ("action_valid", torch.tensor([True]))],
)
def test_length_errors_name_the_field(field, short):
    with pytest.raises(ValueError, match=rf"^AdvantageInputs: uid has 2 rows but \{{'{field}': 1\}}$"):
        AdvantageInputs(**_inputs(**{field: short}))


@pytest.mark.parametrize("field", ["step_index", "env_reward", "action_valid"])
def test_non_1d_tensor_errors_name_the_field(field):
    two_d = _inputs()[field].reshape(2, 1)
    with pytest.raises(ValueError, match=rf"^AdvantageInputs\.{field} must be a 1-D torch tensor \(rows,\)"):
        AdvantageInputs(**_inputs(**{field: two_d}))


def test_tensors_on_two_devices_are_refused():
    # The meta device stands in for a second device on a CPU-only machine.
    with pytest.raises(ValueError, match=r"^AdvantageInputs: step_index, env_reward and action_valid are on \{"):
        AdvantageInputs(**_inputs(step_index=torch.zeros(2, dtype=torch.int64, device="meta")))


def test_non_finite_rewards_name_the_first_five_rows():
    n = 7
    rewards = torch.tensor([1.0] + [float("nan")] * (n - 1), dtype=torch.float64)
    kw = dict(uid=["u"] * n, traj_id=list(range(n)), step_index=torch.zeros(n, dtype=torch.int64), anchor=["x"] * n,
              env_reward=rewards, action_valid=torch.ones(n, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^AdvantageInputs.env_reward must be finite; rows \[1, 2, 3, 4, 5\] are not$"):
        AdvantageInputs(**kw)


@pytest.mark.parametrize(
    ("traj_id", "step_index", "env_reward", "gamma", "match"),
    [
        # rows a0 b0 c0 b1 c1: both 'b' and 'c' sum past float64's max; the first such row is 'b''s.
        (["a", "b", "c", "b", "c"], [0, 0, 0, 1, 1], [1.0] + [1e308] * 4, 0.9,
         "the episode return of trajectory 'b' overflows float64"),
        # -1e308 + 1e308 + 1e308 is finite, but the return from step 1 (1e308 + 1e308) is not.
        (["a"] * 3, [0, 1, 2], [-1e308, 1e308, 1e308], 1.0,
         "the discounted step return of trajectory 'a' overflows float64"),
    ],
)
def test_overflow_names_the_first_trajectory(traj_id, step_index, env_reward, gamma, match):
    n = len(traj_id)
    rows = RowLists(["u"] * n, traj_id, step_index, ["x"] * n, env_reward, [True] * n)
    with pytest.raises(ValueError, match=rf"^{match} \(rewards too large\)$"):
        compute_advantages("grpo", rows.inputs(), _params(gamma=gamma))


def test_unknown_episode_stats_is_named():
    score, index = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^unknown episode_stats 'rows'; expected one of \('trajectory', 'per_step_row'\)$"):
        episode_relative_advantage(score, index, index, mode="mean_norm", episode_stats="rows", epsilon=1e-6)
