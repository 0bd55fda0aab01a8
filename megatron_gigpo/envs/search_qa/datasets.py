"""Question sets for search-augmented QA, read from jsonl or parquet files.

Two row layouts are accepted (both are what the public Search-R1 / FlashRAG releases ship):

* verl form (Search-R1 / verl ``data_preprocess`` output): ``prompt`` (chat messages),
  ``reward_model.ground_truth`` (a str, a list of str, or ``{"target": [...]}``), ``extra_info``
  (``question``, ``index``, ``split``), ``data_source``.
* FlashRAG form: ``question``, ``golden_answers`` (list of str), ``id``.

Each row becomes one :class:`~megatron_gigpo.envs.base.Task` whose payload carries ``question``,
``golden_answers`` and ``data_source``. The task list of a split is the rows of its files, in file order
then row order, so it is identical on every rank and every run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gigpo.envs.base import Task
from megatron_gigpo.envs.search_qa.jsonl import read_jsonl_objects

ENV_NAME = "search_qa"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class QARecord:
    """One question with its accepted answers.

    Attributes:
        record_id: the row's own id (FlashRAG ``id``, verl ``extra_info.index``), else its 0-based row number.
        question: the question text as asked to the agent.
        golden_answers: accepted answers, at least one.
        data_source: dataset name (verl ``data_source``, else the file stem).
    """

    record_id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str


def _iter_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, row dict) of a ``.jsonl`` or ``.parquet`` file; rows are numbered from 0, blank jsonl lines
    not counted.

    Raises:
        ImportError: a ``.parquet`` file without pyarrow installed.
        ValueError: another suffix, or a jsonl line that is not a JSON object (names file and line).
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from exc
        yield from enumerate(pq.read_table(path).to_pylist())
        return
    if suffix != ".jsonl":
        raise ValueError(f"question file {path}: unsupported suffix {suffix!r}; use .jsonl or .parquet")
    yield from enumerate(row for _, row in read_jsonl_objects(path))


def _answers(value: Any, where: str) -> tuple[str, ...]:
    """Accepted answers from a ground-truth field: str, number, list of those, or ``{"target": ...}``."""
    if isinstance(value, dict):
        if "target" not in value:
            raise ValueError(f"{where}: ground-truth dict has no 'target' key (keys: {sorted(value)})")
        value = value["target"]
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        answers = (str(value),)
    elif isinstance(value, (list, tuple)):
        answers = tuple(str(item) for item in value if isinstance(item, (str, int, float)))
        if len(answers) != len(value):
            raise ValueError(f"{where}: answers must be strings or numbers, got {value!r}")
    else:
        raise ValueError(f"{where}: unsupported ground truth {value!r}")
    if not answers or not all(answer.strip() for answer in answers):
        raise ValueError(f"{where}: empty gold answer in {value!r}")
    return answers


def _verl_question(row: dict[str, Any], where: str) -> str:
    """The question of a verl row: ``extra_info.question``, else ``question``, else the single user turn."""
    extra = row.get("extra_info")  # optional column in verl files; its absence is handled below
    if isinstance(extra, dict) and isinstance(extra.get("question"), str):
        return extra["question"]
    if isinstance(row.get("question"), str):
        return row["question"]
    prompt = row["prompt"]
    user_turns = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if len(user_turns) != 1 or not isinstance(user_turns[0].get("content"), str):
        raise ValueError(f"{where}: cannot find the question: no extra_info.question and not one user message")
    return user_turns[0]["content"]


def parse_qa_row(row: dict[str, Any], row_number: int, default_source: str, where: str) -> QARecord:
    """Convert one verl-form or FlashRAG-form row to a :class:`QARecord`.

    Raises:
        ValueError: the row matches neither layout, or a field has the wrong type (names ``where``).
    """
    if "golden_answers" in row and "question" in row:
        answers = _answers(row["golden_answers"], f"{where} golden_answers")
        question = row["question"]
        # Data, not config: FlashRAG rows without an id are numbered by position.
        record_id = row["id"] if "id" in row else row_number  # noqa: SIM401
        source = default_source
    elif "prompt" in row and "reward_model" in row:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise ValueError(f"{where}: reward_model must be an object with a 'ground_truth' key")
        answers = _answers(reward_model["ground_truth"], f"{where} reward_model.ground_truth")
        question = _verl_question(row, where)
        extra = row.get("extra_info")  # optional column; the row number stands in for a missing index
        record_id = extra["index"] if isinstance(extra, dict) and "index" in extra else row_number
        source = row["data_source"] if isinstance(row.get("data_source"), str) else default_source
    else:
        raise ValueError(
            f"{where}: unknown row layout (keys {sorted(row)}); expected FlashRAG 'question'/'golden_answers' "
            "or verl 'prompt'/'reward_model'"
        )
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: question must be a non-empty str, got {question!r}")
    return QARecord(str(record_id), question.strip(), answers, source)


def read_qa_file(path: str | Path) -> list[QARecord]:
    """All questions of one ``.jsonl`` or ``.parquet`` file, in row order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a row is malformed (the message names the file and row).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file not found: {path}")
    return [parse_qa_row(row, n, path.stem, f"{path} row {n}") for n, row in _iter_rows(path)]


def load_tasks(split: str, paths: Sequence[str | Path], limit: int | None = None) -> list[Task]:
    """The deterministic task list of one split (the registry's ``load_tasks("search_qa", split, ...)``).

    Args:
        split: ``train`` or ``val`` (stored on each task).
        paths: question files (``.jsonl`` / ``.parquet``), read in this order.
        limit: keep only the first ``limit`` tasks (None: all).

    Returns:
        ``Task(env="search_qa", task_id="<file stem>/<record id>", split, payload)`` with payload
        ``{"question": str, "golden_answers": list[str], "data_source": str}``.

    Raises:
        ValueError: unknown split, empty ``paths``, ``limit`` < 1, or two rows with the same task id.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(paths, (str, Path)) or len(paths) == 0:
        raise ValueError(f"paths must be a non-empty list of question files, got {paths!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    tasks: list[Task] = []
    seen: dict[str, Path] = {}
    for path in map(Path, paths):
        for record in read_qa_file(path):
            task_id = f"{path.stem}/{record.record_id}"
            if task_id in seen:
                raise ValueError(f"duplicate task id {task_id!r} in {path} (first seen in {seen[task_id]})")
            seen[task_id] = path
            payload = {
                "question": record.question,
                "golden_answers": list(record.golden_answers),
                "data_source": record.data_source,
            }
            tasks.append(Task(env=ENV_NAME, task_id=task_id, split=split, payload=payload))
            if limit is not None and len(tasks) == limit:
                return tasks
    return tasks
