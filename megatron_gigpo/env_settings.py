"""The recipe's ``env`` section mapped onto the environments' constructors and task lists.

Each environment module takes plain keyword arguments (:mod:`megatron_gigpo.envs.registry`); this module is
the one place that knows which recipe keys feed which argument, and which files or services each
environment needs before a run starts (used by :mod:`megatron_gigpo.preflight`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_gigpo.config import EnvConfig
from megatron_gigpo.envs.base import Task

# Training draws ``num_groups`` tasks per iteration from this many procedurally generated Sokoban rooms.
SOKOBAN_TRAIN_ROOMS = 100_000


def _path(value: str | None, key: str) -> str:
    if value is None:
        raise ValueError(f"{key} must be set for this environment")
    return str(Path(value).expanduser())


def _retriever_settings(e: EnvConfig) -> dict[str, Any]:
    s = e.search
    if s.retriever == "elasticsearch":
        return {"backend": "elasticsearch", "url": s.url, "index": s.index_name}
    if s.retriever == "http":
        return {"backend": "http", "url": s.url}
    if s.index_path is not None:
        return {"backend": s.retriever, "index_dir": _path(s.index_path, "env.search.index_path")}
    return {"backend": s.retriever, "corpus_path": _path(s.passages_path, "env.search.passages_path")}


def env_kwargs(e: EnvConfig) -> dict[str, Any]:
    """Keyword arguments of ``make_env(e.name, **kwargs)`` (plain data, picklable to env workers)."""
    if e.name == "sokoban":
        return {"dim_room": list(e.sokoban.dim_room), "num_boxes": e.sokoban.num_boxes, "max_steps": e.max_steps}
    if e.name == "alfworld":
        return {"data_dir": _path(e.data_dir, "env.data_dir"), "max_steps": e.max_steps}
    if e.name == "webshop":
        return {"data_dir": _path(e.data_dir, "env.data_dir"), "num_products": e.webshop.num_products,
                "human_goals": e.webshop.human_goals, "max_steps": e.max_steps}
    if e.name == "search_qa":
        return {"retriever": _retriever_settings(e), "top_k": e.search.top_k, "max_turns": e.max_steps,
                "information_format": e.search.information_format}
    raise ValueError(f"env.name={e.name!r} has no settings mapping")


def load_task_list(e: EnvConfig, split: str) -> list[Task]:
    """The deterministic task list of ``split`` (``train`` or ``val``) for the recipe's environment."""
    from megatron_gigpo.envs.registry import load_tasks

    if e.name == "sokoban":
        count = SOKOBAN_TRAIN_ROOMS if split == "train" else e.val_num_groups
        return load_tasks("sokoban", split, num_tasks=count, first_seed=e.seed)
    if e.name == "alfworld":
        split_dir = e.alfworld.train_split_dir if split == "train" else e.alfworld.val_split_dir
        return load_tasks("alfworld", split, data_dir=_path(e.data_dir, "env.data_dir"), split_dir=split_dir)
    if e.name == "webshop":
        return load_tasks("webshop", split, data_dir=_path(e.data_dir, "env.data_dir"),
                          num_products=e.webshop.num_products, human_goals=e.webshop.human_goals)
    if e.name == "search_qa":
        key = "env.search.train_file" if split == "train" else "env.search.val_file"
        file = e.search.train_file if split == "train" else e.search.val_file
        return load_tasks("search_qa", split, paths=[_path(file, key)])
    raise ValueError(f"env.name={e.name!r} has no task list")


def _task_kind(task: Task) -> str:
    """ALFWorld's task type or search-QA's data source; "" for environments without kinds."""
    for key in ("task_type", "data_source"):
        if key in task.payload:
            return str(task.payload[key])
    return ""


def validation_subset(tasks: list[Task], n: int) -> list[Task]:
    """``n`` validation tasks that cover every task kind (ALFWorld task type, search-QA data source).

    The split files are ordered by kind (ALFWorld's sorted game folders put one task type last; the Search-R1
    test file is grouped by dataset), so a plain prefix of a capped split would drop whole kinds. Tasks are
    taken round-robin over the kinds, each kind in file order, and returned in file order: deterministic,
    and all tasks when ``n`` covers the split.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"env.val_num_groups must be >= 1, got {n}")
    if n >= len(tasks):
        return list(tasks)
    by_kind: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        by_kind.setdefault(_task_kind(task), []).append(i)
    queues = [iter(indices) for indices in by_kind.values()]
    picked: list[int] = []
    while len(picked) < n:
        for queue in queues:
            index = next(queue, None)
            if index is not None and len(picked) < n:
                picked.append(index)
    return [tasks[i] for i in sorted(picked)]


def check_env_resources(e: EnvConfig) -> list[str]:
    """Problems (as messages) that would stop the environment from starting: data and services."""
    problems: list[str] = []
    if e.name in ("alfworld", "webshop"):
        if e.data_dir is None:
            return [f"env.data_dir must be set for {e.name}"]
        for split in ("train", "val"):
            try:
                load_task_list(e, split)
            except (FileNotFoundError, ValueError) as exc:
                problems.append(f"env.data_dir={e.data_dir!r}: {exc}")
                break
    elif e.name == "search_qa":
        for key, file in (("env.search.train_file", e.search.train_file), ("env.search.val_file", e.search.val_file)):
            if file is None or not Path(file).expanduser().is_file():
                problems.append(f"{key}={file!r}: question file not found (jsonl or parquet)")
        if e.search.retriever == "http":
            problems += _check_retrieval_server(e.search.url)
        elif e.search.retriever == "elasticsearch":
            from megatron_gigpo.envs.search_qa import RetrieverUnavailableError, build_retriever

            settings = _retriever_settings(e)
            try:
                build_retriever(settings.pop("backend"), **settings).close()
            except RetrieverUnavailableError as exc:
                problems.append(f"env.search.url: {exc}")
        else:
            problems += _check_local_retriever(e)
    return problems


def _check_retrieval_server(url: str) -> list[str]:
    """Whether a retrieval server answers at ``env.search.url`` (one request, a few seconds at most)."""
    from megatron_gigpo.envs.search_qa import RetrieverUnavailableError
    from megatron_gigpo.envs.search_qa.http_retriever import probe_retrieval_server

    try:
        probe_retrieval_server(url, timeout=3.0)
    except (RetrieverUnavailableError, RuntimeError, ValueError) as exc:
        return [f"env.search.url: {exc}"]
    return []


def _dense_how_to(output: str) -> str:
    """How to get a dense index: adopt Search-R1's E5 retrieval files (no re-encoding)."""
    return ("adopt Search-R1's E5 wiki-18 index with `python tools/build_search_index.py --backend dense "
            "--adopt-faiss e5_Flat.index --corpus wiki-18.jsonl --model <local intfloat/e5-base-v2> "
            f"--output {output}` (files and steps: recipes/search_qa/base.yaml)")


def _check_local_retriever(e: EnvConfig) -> list[str]:
    """Problems with an in-process (bm25 / dense) retriever's index or corpus, and the dense extra."""
    import importlib.util

    s = e.search
    problems: list[str] = []
    if s.retriever == "dense":
        absent = [m for m in ("faiss", "sentence_transformers") if importlib.util.find_spec(m) is None]
        if absent:
            problems.append(f"env.search.retriever=dense needs the 'dense' extra (missing {', '.join(absent)}): "
                            "pip install 'megatron-gigpo[dense]'")
    if s.index_path is None:
        if s.retriever == "dense":  # encoding a corpus at env start has no model setting and takes hours
            problems.append("env.search.retriever=dense needs env.search.index_path (a directory made by "
                            f"tools/build_search_index.py --backend dense); {_dense_how_to('<index dir>')}")
        elif s.passages_path is None or not Path(s.passages_path).expanduser().is_file():
            problems.append(f"env.search.passages_path={s.passages_path!r}: passage jsonl not found")
        return problems
    index_dir = Path(s.index_path).expanduser()
    if s.retriever == "dense":
        from megatron_gigpo.envs.search_qa.dense import missing_index_files

        missing = missing_index_files(index_dir)
        if missing:
            where = "does not exist" if not index_dir.exists() else f"lacks {', '.join(missing)}"
            problems.append(f"env.search.index_path={s.index_path!r}: dense index {index_dir} {where}; "
                            + _dense_how_to(str(index_dir)))
    elif not index_dir.is_dir():
        problems.append(f"env.search.index_path={s.index_path!r}: no {s.retriever} index at {index_dir}; build it "
                        f"with `python tools/build_search_index.py --backend {s.retriever} --corpus wiki-18.jsonl "
                        f"--output {index_dir}`")
    return problems
