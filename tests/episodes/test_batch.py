"""The training batch's own operations (``megatron_gigpo.episodes.batch``), one by one: row checks, lengths,
the advantage view, row selection with each kind of per-row extra, group selection with the per-trajectory
extras, and concatenation. Written against the survivors of a mutation run (issue #43 item 3): the dynamic
sampling tests reach these functions only through the group filter."""

import re

import numpy as np
import pytest
import torch

from megatron_gigpo.episodes.batch import ROW_EXTRAS, TrainingBatch, _traj_uid, concat_batches, select_groups

pytestmark = pytest.mark.unit


def _rows(uids: list[str], traj_ids: list[str], lengths: list[int] | None = None, **extras) -> TrainingBatch:
    """One row per uid; row i's response has ``lengths[i]`` tokens (default i + 1) and every field is distinct."""
    n = len(uids)
    lengths = lengths or [i + 1 for i in range(n)]
    return TrainingBatch(
        prompt_ids=[torch.full((2,), i, dtype=torch.int64) for i in range(n)],
        response_ids=[torch.arange(k, dtype=torch.int64) for k in lengths],
        rollout_log_probs=[torch.full((k,), -0.5 * i) for i, k in enumerate(lengths)],
        uid=list(uids), traj_id=list(traj_ids),
        step_index=torch.arange(n, dtype=torch.int64), anchor=[f"s{i}" for i in range(n)],
        env_reward=torch.arange(n, dtype=torch.float64) / 10, action_valid=torch.tensor([i % 2 == 0 for i in range(n)]),
        extras=dict(extras),
    )


def test_row_counts_and_shapes_are_checked_with_the_field_named():
    good = _rows(["g0", "g0"], ["g0-n0", "g0-n1"])
    assert good.num_rows == 2
    for key in ("response_ids", "rollout_log_probs", "uid", "traj_id", "anchor"):
        with pytest.raises(ValueError, match=f"prompt_ids has 2 rows but {{'{key}': 1}}"):
            TrainingBatch(**{**good.__dict__, key: getattr(good, key)[:1]})
    for key in ("step_index", "env_reward", "action_valid"):
        with pytest.raises(ValueError, match=f"'{key}': 3"):
            TrainingBatch(**{**good.__dict__, key: torch.cat([getattr(good, key), getattr(good, key)[:1]])})
    for key in ROW_EXTRAS:
        with pytest.raises(ValueError, match=re.escape(f"{{\"extras['{key}']\": 1}}")):
            TrainingBatch(**{**good.__dict__, "extras": {key: [0]}})
    TrainingBatch(**{**good.__dict__, "extras": {"env_name": "x" * 5}})  # per-batch extras are not counted
    with pytest.raises(ValueError, match=r"row 1: response_ids shape \(2,\) != rollout_log_probs shape \(3,\)"):
        TrainingBatch(**{**good.__dict__, "rollout_log_probs": [torch.zeros(1), torch.zeros(3)]})


def test_response_lengths_and_advantage_inputs_are_the_rows():
    batch = _rows(["a", "a", "b"], ["a-n0", "a-n1", "b-n0"], lengths=[3, 1, 4])
    lengths = batch.response_lengths()
    assert lengths.dtype == torch.int64 and lengths.tolist() == [3, 1, 4]
    empty = _rows([], []).response_lengths()  # no rows: still int64 (torch.tensor([]) alone is float32)
    assert empty.dtype == torch.int64 and empty.shape == (0,)
    inputs = batch.advantage_inputs()
    assert inputs.uid is batch.uid and inputs.traj_id is batch.traj_id and inputs.anchor is batch.anchor
    assert inputs.step_index is batch.step_index and inputs.env_reward is batch.env_reward
    assert inputs.action_valid is batch.action_valid


@pytest.mark.parametrize("kind", ["list", "tensor", "ndarray"])
def test_select_indexes_every_field_and_row_extra_in_the_given_order(kind):
    make = {"list": list, "tensor": torch.tensor, "ndarray": np.array}[kind]
    batch = _rows(["a", "a", "b", "b"], ["a-n0", "a-n1", "b-n0", "b-n1"], actions=make([10, 11, 12, 13]),
                  engine=[0, 1, 0, 1], num_groups=2)
    sub = batch.select(np.array([3, 1]))
    assert sub.uid == ["b", "a"] and sub.traj_id == ["b-n1", "a-n1"] and sub.anchor == ["s3", "s1"]
    assert sub.step_index.tolist() == [3, 1] and sub.env_reward.tolist() == [0.3, 0.1]
    assert sub.action_valid.tolist() == [False, False]
    assert [p.tolist() for p in sub.prompt_ids] == [[3, 3], [1, 1]]
    assert [len(r) for r in sub.response_ids] == [4, 2] and sub.rollout_log_probs[0][0].item() == -1.5
    assert type(sub.extras["actions"]) is type(batch.extras["actions"])
    assert list(sub.extras["actions"]) == [13, 11] and sub.extras["engine"] == [1, 1]
    assert sub.extras["num_groups"] == 2
    assert batch.select(torch.tensor([2])).uid == ["b"] and batch.select([]).num_rows == 0


def test_traj_uid_strips_only_the_last_member_suffix():
    assert _traj_uid("it3-task-n7-n2") == "it3-task-n7"
    assert _traj_uid("g0-n0") == "g0"
    assert _traj_uid("plain") == "plain"


def test_select_groups_keeps_the_groups_in_the_given_order_with_their_trajectory_extras():
    uids = ["it0-t-n1", "it0-t-n1", "it0-u", "it0-u", "it0-v"]
    trajs = ["it0-t-n1-n0", "it0-t-n1-n1", "it0-u-n0", "it0-u-n1", "it0-v-n0"]
    failed = ["it0-t-n1-n2", "it0-u-n2", "it0-v-n1"]
    episodes = [type("E", (), {"uid": u})() for u in ("it0-t-n1", "it0-u", "it0-v")]
    batch = _rows(uids, trajs, actions=list(range(5)), episodes=episodes, failed_traj_ids=failed,
                  failures={t: f"boom {t}" for t in failed}, num_groups=3, env_name="sokoban")
    out = select_groups(batch, ["it0-v", "it0-t-n1"])
    assert out.uid == ["it0-v", "it0-t-n1", "it0-t-n1"] and out.extras["actions"] == [4, 0, 1]
    assert out.step_index.tolist() == [4, 0, 1]
    assert [e.uid for e in out.extras["episodes"]] == ["it0-t-n1", "it0-v"]
    assert out.extras["failed_traj_ids"] == ["it0-t-n1-n2", "it0-v-n1"]
    assert out.extras["failures"] == {"it0-t-n1-n2": "boom it0-t-n1-n2", "it0-v-n1": "boom it0-v-n1"}
    assert out.extras["num_groups"] == 2 and out.extras["env_name"] == "sokoban"
    assert batch.extras["num_groups"] == 3 and len(batch.extras["failed_traj_ids"]) == 3  # source untouched
    bare = select_groups(_rows(["a", "b"], ["a-n0", "b-n0"]), ["b"])
    assert bare.uid == ["b"] and bare.extras == {}
    with pytest.raises(ValueError, match=r"select_groups: repeated uids in \['a', 'a'\]"):
        select_groups(batch, ["a", "a"])


def test_concat_batches_joins_every_kind_of_extra_and_names_what_differs():
    a = _rows(["a"], ["a-n0"], actions=torch.tensor([1]), engine=np.array([0]), failed_traj_ids=["a-n1"],
              failures={"a-n1": "x"}, num_groups=1, env_name="sokoban")
    b = _rows(["b", "b"], ["b-n0", "b-n1"], actions=torch.tensor([2, 3]), engine=np.array([1, 1]),
              failed_traj_ids=[], failures={"b-n2": "y"}, num_groups=2, env_name="sokoban")
    both = concat_batches([a, b])
    assert both.uid == ["a", "b", "b"] and both.traj_id == ["a-n0", "b-n0", "b-n1"]
    assert both.step_index.tolist() == [0, 0, 1] and both.env_reward.tolist() == [0.0, 0.0, 0.1]
    assert both.action_valid.tolist() == [True, True, False] and both.anchor == ["s0", "s0", "s1"]
    assert [len(r) for r in both.response_ids] == [1, 1, 2] and len(both.rollout_log_probs) == 3
    assert [p.tolist() for p in both.prompt_ids] == [[0, 0], [0, 0], [1, 1]]
    assert torch.equal(both.extras["actions"], torch.tensor([1, 2, 3]))
    assert isinstance(both.extras["engine"], np.ndarray) and both.extras["engine"].tolist() == [0, 1, 1]
    assert both.extras["failed_traj_ids"] == ["a-n1"] and both.extras["failures"] == {"a-n1": "x", "b-n2": "y"}
    assert both.extras["num_groups"] == 3 and both.extras["env_name"] == "sokoban"
    assert concat_batches([a]).extras["num_groups"] == 1
    with pytest.raises(ValueError, match="concat_batches: no batch"):
        concat_batches([])
    with pytest.raises(ValueError, match=r"concat_batches: extras\['engine'\] is missing in some batches"):
        concat_batches([a, _rows(["c"], ["c-n0"], actions=torch.tensor([4]), failed_traj_ids=[], failures={},
                                 num_groups=1, env_name="sokoban")])
    b.extras["env_name"] = "alfworld"
    with pytest.raises(ValueError, match=r"per-batch extras\['env_name'\] differ: \['sokoban', 'alfworld'\]"):
        concat_batches([a, b])
