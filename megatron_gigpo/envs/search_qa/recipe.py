"""Search-QA's recipe hooks: the ``env.search`` settings and their mapping onto :class:`.env.SearchQAEnv`, its
retriever and question files, and the checks of the retriever's index, corpus or service before a run
(:class:`megatron_gigpo.envs.recipe.EnvRecipe`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gigpo.envs.base import Task
from megatron_gigpo.envs.recipe import EnvRecipe, env_path
from megatron_gigpo.episodes.templates import COMPACT_LAYOUT, PromptTemplate
from megatron_gigpo.envs.search_qa.backends import BACKENDS, build_retriever
from megatron_gigpo.envs.search_qa.env import MAX_TURNS, TOP_K
from megatron_gigpo.envs.search_qa.passages import INFORMATION_FORMATS
from megatron_gigpo.envs.search_qa.retriever import RetrieverUnavailableError
from megatron_gigpo.fields import choice, num


@dataclass
class SearchConfig:
    """``env.search``: the retriever, the passages it returns and the question files."""

    # bm25 (embedded tantivy) | elasticsearch | dense | http (a Search-R1-style retrieval server at `url`)
    retriever: str = choice("bm25", BACKENDS)
    passages_path: str | None = None  # jsonl of {id, contents}; the bm25 index is built from it
    index_path: str | None = None
    url: str = "http://127.0.0.1:9200"  # Elasticsearch node, or the http server's endpoint (.../retrieve)
    index_name: str = "wiki"
    top_k: int = num(TOP_K, ge=1)
    # search_r1: `Doc i(Title: t) text` lines | verl_agent: {"result": "Doc i: contents"} JSON (the paper's code)
    information_format: str = choice(INFORMATION_FORMATS[0], INFORMATION_FORMATS)
    train_file: str | None = None  # questions (jsonl or parquet, Search-R1's layout)
    val_file: str | None = None


def retriever_settings(env: Any) -> dict[str, Any]:
    """``{"backend": ..., **kwargs}`` of :func:`.backends.build_retriever` for ``env.search``.

    Raises:
        ValueError: the path the local retriever needs is not set (the message names the key).
    """
    s = env.search
    if s.retriever == "elasticsearch":
        return {"backend": "elasticsearch", "url": s.url, "index": s.index_name}
    if s.retriever == "http":
        return {"backend": "http", "url": s.url}
    if s.index_path is not None:
        return {"backend": s.retriever, "index_dir": env_path(s.index_path, "env.search.index_path")}
    return {"backend": s.retriever, "corpus_path": env_path(s.passages_path, "env.search.passages_path")}


def _env_kwargs(env: Any) -> dict[str, Any]:
    return {"retriever": retriever_settings(env), "top_k": env.search.top_k, "max_turns": env.max_steps,
            "information_format": env.search.information_format}


def _task_list(env: Any, split: str) -> list[Task]:
    from megatron_gigpo.envs.search_qa.datasets import load_tasks

    key = "env.search.train_file" if split == "train" else "env.search.val_file"
    file = env.search.train_file if split == "train" else env.search.val_file
    return load_tasks(split, paths=[env_path(file, key)])


def _check_resources(env: Any) -> list[str]:
    """The question files, and the retriever: its server answers, or its local index / corpus exists."""
    problems: list[str] = []
    for key, file in (("env.search.train_file", env.search.train_file), ("env.search.val_file", env.search.val_file)):
        if file is None or not Path(file).expanduser().is_file():
            problems.append(f"{key}={file!r}: question file not found (jsonl or parquet)")
    if env.search.retriever == "http":
        problems += _check_retrieval_server(env.search.url)
    elif env.search.retriever == "elasticsearch":
        settings = retriever_settings(env)
        try:
            build_retriever(settings.pop("backend"), **settings).close()
        except RetrieverUnavailableError as exc:
            problems.append(f"env.search.url: {exc}")
    else:
        problems += _check_local_retriever(env)
    return problems


def _check_retrieval_server(url: str) -> list[str]:
    """Whether a retrieval server answers at ``env.search.url`` (one request, a few seconds at most)."""
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


def _check_local_retriever(e: Any) -> list[str]:
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


SEARCH_QA_TEMPLATE = PromptTemplate(
    env="search_qa",
    preamble="You are an expert agent answering a question step by step with the help of a search engine.",
    task_label="Your question",
    history_intro=(
        "each as your action (a query inside <search> </search>) and what the search engine returned "
        "(inside <information> </information>)"
    ),
    instruction=(
        "Now it is your turn to respond for the current step. First reason step by step; this reasoning MUST "
        "be enclosed in <think> </think> tags. After the reasoning, do exactly one of the following, never "
        "both:\n"
        "(1) if some knowledge is missing, search for it by writing a query inside <search> </search> tags; "
        "the results will come back inside <information> </information> tags;\n"
        "(2) if you can answer confidently, give the final answer inside <answer> </answer> tags as a short "
        "phrase without explanation, for example <answer>Paris</answer>."
    ),
    history_style="action_result",
    show_initial_observation=False,
)

COMPACT_SEARCH_QA_TEMPLATE = PromptTemplate(
    env="search_qa",
    preamble="Answer the question; a search engine can help.",
    task_label="Question",
    history_intro="",
    instruction=(
        "Reply <think>reasoning</think> then either <search>query</search> (results come back in "
        "<information></information>) or <answer>short answer</answer>."
    ),
    history_style="action_result",
    show_initial_observation=False,
    layout=COMPACT_LAYOUT,
)


RECIPE = EnvRecipe(section="search", settings=SearchConfig, env_kwargs=_env_kwargs, task_list=_task_list,
                   check_resources=_check_resources, templates=(SEARCH_QA_TEMPLATE, COMPACT_SEARCH_QA_TEMPLATE),
                   step_limit=MAX_TURNS)
