"""A capped validation split covers every task kind (envs.registry.validation_subset), on the real shared
ALFWorld games and search-QA question files."""

from __future__ import annotations

import pytest

from megatron_gigpo.envs.registry import validation_subset
from megatron_gigpo.envs.base import Task

pytestmark = pytest.mark.unit


def test_capped_alfworld_validation_keeps_every_task_type(shared_dir):
    from megatron_gigpo.envs.alfworld import load_tasks

    tasks = load_tasks("val", shared_dir / "data" / "alfworld", split_dir="valid_seen")
    kinds = {t.payload["task_type"] for t in tasks}
    assert len(kinds) == 6
    prefix_kinds = {t.payload["task_type"] for t in tasks[:16]}
    assert len(prefix_kinds) < 6  # the sorted list is grouped by type: a prefix misses some
    subset = validation_subset(tasks, 16)
    assert len(subset) == 16 and {t.payload["task_type"] for t in subset} == kinds
    assert subset == sorted(subset, key=tasks.index)  # file order kept
    assert validation_subset(tasks, 16) == subset  # deterministic
    assert validation_subset(tasks, len(tasks) + 5) == tasks


def test_capped_search_validation_mixes_the_datasets(shared_dir):
    from megatron_gigpo.envs.search_qa.datasets import load_tasks

    folder = shared_dir / "data" / "search_qa"
    files = [folder / "nq_test_1k.jsonl", folder / "hotpotqa_dev.jsonl", folder / "bamboogle_test.jsonl"]
    tasks = load_tasks("val", files)
    subset = validation_subset(tasks, 9)
    sources = [t.payload["data_source"] for t in subset]
    assert len(set(sources)) == 3 and all(sources.count(s) == 3 for s in set(sources))


def test_tasks_without_kinds_are_a_prefix_and_bad_sizes_fail():
    tasks = [Task(env="sokoban", task_id=str(i), split="val", payload={"room_seed": i}) for i in range(10)]
    assert validation_subset(tasks, 4) == tasks[:4]
    with pytest.raises(ValueError, match="env.val_num_groups"):
        validation_subset(tasks, 0)
