"""Search-augmented QA: answers, question files, retrievers (tantivy, Elasticsearch on noida-db), env.

Dense retrieval (build, open, adopting Search-R1-style faiss files) is in test_search_qa_dense.py.

The Elasticsearch tests talk to a real ES-compatible server: the one answering at $MEGATRON_GIGPO_ES_URL
(default http://127.0.0.1:9200), else a noida-db that the session fixture starts with scripts/es_up.sh and
stops with scripts/es_down.sh.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from megatron_gigpo.envs.base import ProjectedAction, Task
from megatron_gigpo.envs.search_qa import (
    Passage,
    RetrieverUnavailableError,
    SearchQAEnv,
    build_retriever,
    exact_match,
    exact_match_reward,
    format_information,
    load_tasks,
    normalize_answer,
    project_search_action,
    read_passages,
    read_qa_file,
)
from megatron_gigpo.envs.search_qa.bm25 import Bm25Retriever
from megatron_gigpo.envs.search_qa.retriever import Retriever

REPO = Path(__file__).resolve().parents[2]
BUILD_TOOL = REPO / "tools" / "build_search_index.py"
# Passages whose title names a person or place that the rest of the sample does not mention much.
GOLD_PASSAGE_IDS = ("0", "1", "2", "10", "100", "500", "999")


# ---------------------------------------------------------------- fixtures (search_qa_ prefix: shared dir)




def _es_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/", timeout=2) as response:
            return "version" in json.load(response)
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="session")
def search_qa_es_url(tmp_path_factory: pytest.TempPathFactory):
    """URL of a live ES-compatible server; starts noida-db through scripts/es_up.sh when none answers."""
    url = os.environ.get("MEGATRON_GIGPO_ES_URL", "http://127.0.0.1:9200")
    if _es_answers(url):
        yield url
        return
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        pytest.fail(f"no Elasticsearch at {url} and es_up.sh only starts one on 127.0.0.1:<port>")
    env = dict(os.environ, ES_PORT=str(parts.port), ES_STATE_DIR=str(tmp_path_factory.mktemp("noida")))
    started = subprocess.run(["bash", str(REPO / "scripts" / "es_up.sh")], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"scripts/es_up.sh failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield url
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "es_down.sh")], env=env, check=True, capture_output=True)


@pytest.fixture(scope="session")
def search_qa_es_index(search_qa_es_url: str, search_qa_wiki18: Path):
    """A fresh index of the 1,000 wiki-18 passages, built with tools/build_search_index.py, deleted after."""
    from elasticsearch import Elasticsearch

    index = f"mgigpo-test-wiki18-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, str(BUILD_TOOL), "--backend", "elasticsearch", "--corpus", str(search_qa_wiki18)]
    built = subprocess.run(cmd + ["--url", search_qa_es_url, "--index", index], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert "of 1000 passages" in built.stdout
    try:
        yield index
    finally:
        with Elasticsearch(search_qa_es_url) as client:
            client.options(ignore_status=404).indices.delete(index=index)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _task(question: str, answers: list[str], task_id: str = "t/0") -> Task:
    payload = {"question": question, "golden_answers": answers}
    return Task(env="search_qa", task_id=task_id, split="val", payload=payload)


def _title_question(passage: Passage) -> tuple[str, str]:
    """(query, gold answer) built from a passage: its title words plus the first words of its text."""
    title = passage.title.strip('"')
    return f"{title} {' '.join(passage.text.split()[:8])}", title


# ---------------------------------------------------------------- answers and reward


@pytest.mark.unit
@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   Apple, a day ", "apple day"),
        ("Theatre of the Absurd", "theatre of absurd"),  # 'the' only as a whole word
        ("U.S.A.", "usa"),
        ("Titan IIIE", "titan iiie"),
        ("", ""),
    ],
)
def test_normalize_answer_follows_squad(raw: str, normalised: str):
    assert normalize_answer(raw) == normalised


@pytest.mark.unit
def test_exact_match_reward_against_any_gold_answer():
    gold = ["Mark Twain", "Samuel Clemens"]
    assert exact_match_reward("mark twain.", gold) == 1.0
    assert exact_match_reward("The Samuel Clemens", gold) == 1.0
    assert exact_match_reward("Twain", gold) == 0.0
    assert exact_match("1999", ["1999"])
    with pytest.raises(ValueError, match="golden_answers"):
        exact_match("x", [])
    with pytest.raises(ValueError, match="golden_answers"):
        exact_match("x", "x")
    with pytest.raises(TypeError, match="answer must be a str"):
        normalize_answer(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- action projection


@pytest.mark.unit
@pytest.mark.parametrize(
    ("response", "action", "valid"),
    [
        ("<think>need facts</think><search> Evan Morris </search>", "<search>Evan Morris</search>", True),
        ("<think>know it</think>\n<answer>James Madison</answer> Done.", "<answer>James Madison</answer>", True),
        ("<THINK>x</THINK><Answer>Paris</Answer>", "<answer>Paris</answer>", True),
        # verl-agent's search rule has no think-block or CJK check.
        ("<search>no thinking</search>", "<search>no thinking</search>", True),
        ("<search>q</search><think>late</think>", "<search>q</search>", True),
        ("<think>\u60f3</think><answer>\u5df4\u9ece</answer>", "<answer>\u5df4\u9ece</answer>", True),
        ("<think>x</think><answer>  </answer>", "<answer></answer>", True),
        # No complete block: "" is sent (a no-op turn) and the step is penalised.
        ("<think>x</think>just text", "", False),
        ("<think>x</think><search>unclosed", "", False),
        # Both kinds, or two of a kind: the first search block is extracted, the step is penalised.
        ("<think>x</think><answer>b</answer><search>a</search>", "<search>a</search>", False),
        ("<think>x</think><search>a</search><search>b</search>", "<search>a</search>", False),
        ("<think>x</think><answer>a</answer><answer>b</answer>", "<answer>a</answer>", False),
    ],
)
def test_project_search_action(response: str, action: str, valid: bool):
    projected = project_search_action(response)
    assert (projected.action, projected.valid) == (action, valid)


# ---------------------------------------------------------------- question files


@pytest.mark.unit
def test_question_files_in_verl_and_flashrag_form(search_qa_data: Path):
    verl = read_qa_file(search_qa_data / "bamboogle_test.jsonl")
    assert len(verl) == 125
    assert verl[0].question.startswith("Who was president of the United States")
    assert verl[0].golden_answers == ("james madison",)
    assert verl[0].data_source == "chiayewken/bamboogle"
    flashrag = read_qa_file(search_qa_data / "triviaqa_test_1k.jsonl")
    assert len(flashrag) == 1000 and "Mark Twain" in flashrag[0].golden_answers
    files = [search_qa_data / "bamboogle_test.jsonl", search_qa_data / "nq_test_1k.jsonl"]
    tasks = load_tasks("train", files)
    assert len(tasks) == 1125
    assert [t.task_id for t in tasks] == [t.task_id for t in load_tasks("train", files)]
    assert tasks[0].task_id == "bamboogle_test/0" and tasks[125].task_id == "nq_test_1k/test_3283"
    assert tasks[125].payload == {
        "question": "who told the story of the prodigal son",
        "golden_answers": ["Jesus Christ"],
        "data_source": "nq_test_1k",
    }
    assert len(load_tasks("val", files, limit=3)) == 3


@pytest.mark.unit
def test_question_files_in_parquet(tmp_path: Path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    verl_rows = [  # Search-R1's own parquet layout: ground truth {"target": [...]}, templated prompt
        {
            "data_source": "nq",
            "prompt": [{"role": "user", "content": "Answer... Question: who wrote hamlet?"}],
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare", "W. Shakespeare"]}},
            "extra_info": {"split": "train", "index": 7, "question": "who wrote hamlet?"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(verl_rows), tmp_path / "nq_train.parquet")
    flashrag_rows = [{"id": "q1", "question": "capital of france?", "golden_answers": ["Paris"]}]
    pq.write_table(pa.Table.from_pylist(flashrag_rows), tmp_path / "fr.parquet")
    tasks = load_tasks("train", [tmp_path / "nq_train.parquet", tmp_path / "fr.parquet"])
    assert [t.task_id for t in tasks] == ["nq_train/7", "fr/q1"]
    assert tasks[0].payload["golden_answers"] == ["Shakespeare", "W. Shakespeare"]
    assert tasks[0].payload["question"] == "who wrote hamlet?"
    assert tasks[1].payload["golden_answers"] == ["Paris"]


@pytest.mark.unit
def test_bad_question_files_name_the_problem(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "golden_answers": ["a"]}\n{"query": "q2"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl row 1: unknown row layout"):
        read_qa_file(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1, "question": "q", "golden_answers": ["a"]}\n' * 2)
    with pytest.raises(ValueError, match="duplicate task id 'dup/1'"):
        load_tasks("train", [dup])
    with pytest.raises(ValueError, match="split"):
        load_tasks("test", [dup])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_qa_file(tmp_path / "missing.jsonl")


@pytest.mark.unit
def test_question_and_passage_files_report_bad_jsonl_lines_alike(tmp_path: Path):
    question = '{"question": "q", "golden_answers": ["a"]}'
    passage = '{"id": "1", "contents": "\\"T\\"\\ntext"}'
    bad = tmp_path / "bad.jsonl"
    for good, read in ((question, read_qa_file), (passage, lambda path: list(read_passages(path)))):
        bad.write_text(f"{good}\n\n{{not json\n")  # line numbers count the blank line
        with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:3: invalid JSON \(Expecting property name"):
            read(bad)
        bad.write_text(f"{good}\n[1, 2]\n")
        with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:2: expected a JSON object, got list$"):
            read(bad)
    # Question rows are numbered without the blank lines.
    bad.write_text(f'{question}\n\n{{"query": "q2"}}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl row 1: unknown row layout"):
        read_qa_file(bad)


# ---------------------------------------------------------------- environment mechanics (tiny real index)


@pytest.fixture
def search_qa_tiny_env() -> SearchQAEnv:
    passages = [
        Passage("a", '"Ada Lovelace"', "Ada Lovelace wrote the first published algorithm for the Analytical Engine."),
        Passage("b", '"Charles Babbage"', "Charles Babbage designed the Analytical Engine in London."),
        Passage("c", '"Alan Turing"', "Alan Turing proposed the Turing machine in 1936."),
    ]
    return SearchQAEnv(Bm25Retriever.from_passages(passages), top_k=2, max_turns=4)


@pytest.mark.unit
def test_episode_search_then_answer(search_qa_tiny_env: SearchQAEnv):
    env = search_qa_tiny_env
    reset = env.reset(_task("Who designed the Analytical Engine?", ["Charles Babbage"]), seed=0)
    assert reset.observation == reset.anchor == reset.task_description == "Who designed the Analytical Engine?"
    step = env.step("<search>who designed the analytical engine</search>")
    assert step.action_valid and not step.done and step.reward == 0.0
    assert step.observation.startswith('<information>Doc 1(Title: "Charles Babbage") Charles Babbage designed')
    assert step.anchor == step.observation and step.info["retrieved_ids"][0] == "b"
    final = env.step("<answer>charles babbage</answer>")
    assert (final.reward, final.done, final.won, final.action_valid) == (1.0, True, True, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("<answer>again</answer>")


@pytest.mark.unit
def test_wrong_answer_scores_zero(search_qa_tiny_env: SearchQAEnv):
    env = search_qa_tiny_env
    env.reset(_task("Who designed the Analytical Engine?", ["Charles Babbage"]), seed=0)
    final = env.step("<answer>Ada Lovelace</answer>")
    assert (final.reward, final.done, final.won, final.info["exact_match"]) == (0.0, True, False, False)


@pytest.mark.unit
def test_four_turn_limit(search_qa_tiny_env: SearchQAEnv):
    env = search_qa_tiny_env
    env.reset(_task("Who proposed the Turing machine?", ["Alan Turing"]), seed=0)
    for turn in range(1, 4):
        step = env.step("<search>turing machine</search>")
        assert not step.done and step.info["turn"] == turn
    last = env.step("<search>turing machine</search>")
    assert last.done and not last.won and last.reward == 0.0 and last.info["truncated"]
    with pytest.raises(RuntimeError):
        env.step("<answer>Alan Turing</answer>")


@pytest.mark.unit
def test_invalid_format_is_a_noop_turn(search_qa_tiny_env: SearchQAEnv):
    env = search_qa_tiny_env
    env.reset(_task("Who proposed the Turing machine?", ["Alan Turing"]), seed=0)
    projected = env.project_action("I think it is Alan Turing.", None)
    assert projected.valid is False and projected.action == ""
    step = env.step(projected.action)
    assert step.action_valid is False and not step.done and step.reward == 0.0
    assert "<search>" in step.observation and step.info["action_type"] == "invalid"
    # A well-formed but empty block is not penalised by the projection; the environment has nothing to run.
    empty = env.project_action("<answer> </answer>", None)
    assert empty.valid and not env.step(empty.action).action_valid
    assert env.step("<answer>Alan Turing</answer>").reward == 1.0


@pytest.mark.unit
def test_step_before_reset_and_bad_payload(search_qa_tiny_env: SearchQAEnv):
    with pytest.raises(RuntimeError, match="before reset"):
        search_qa_tiny_env.step("<search>x</search>")
    with pytest.raises(ValueError, match="golden_answers"):
        search_qa_tiny_env.reset(Task(env="search_qa", task_id="x", split="val", payload={"question": "q"}), seed=0)
    with pytest.raises(ValueError, match="not 'search_qa'"):
        search_qa_tiny_env.reset(Task(env="sokoban", task_id="x", split="val"), seed=0)


@pytest.mark.unit
def test_information_format_and_retriever_arguments():
    passages = [Passage("1", '"T1"', "text one"), Passage("2", '"T2"', "text two")]
    expected = '<information>Doc 1(Title: "T1") text one\nDoc 2(Title: "T2") text two</information>'
    assert format_information(passages) == expected
    assert format_information([]) == "<information>No passages found.</information>"
    # verl-agent's layout (the GiGPO paper's code): a JSON object whose result lists the stripped contents.
    verl = format_information(passages, "verl_agent")
    assert verl == '<information>{"result": "Doc 1: \\"T1\\"\\ntext one\\nDoc 2: \\"T2\\"\\ntext two\\n"}</information>'
    assert json.loads(verl[len("<information>"):-len("</information>")]) == {
        "result": 'Doc 1: "T1"\ntext one\nDoc 2: "T2"\ntext two\n'}
    assert format_information([], "verl_agent") == '<information>{"result": "No search results found."}</information>'
    with pytest.raises(ValueError, match="unknown information_format 'xml'"):
        format_information(passages, "xml")
    with pytest.raises(ValueError, match="unknown retriever backend 'solr'"):
        build_retriever("solr")
    with pytest.raises(ValueError, match="corpus_path"):
        build_retriever("bm25")
    retriever = Bm25Retriever.from_passages(passages)
    with pytest.raises(ValueError, match="top_k"):
        retriever.search("text", 0)
    assert retriever.search("the of and", 3) == []  # only stop words: nothing to match


@pytest.mark.unit
def test_dense_backend_without_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "faiss", None)  # as if faiss-cpu were not installed
    with pytest.raises(ImportError, match=r"megatron-gigpo\[dense\]"):
        build_retriever("dense", index_dir=tmp_path)


@pytest.mark.unit
def test_registry_builds_env_from_recipe_settings(search_qa_data: Path, search_qa_wiki18: Path):
    from megatron_gigpo.envs import registry

    settings = {"backend": "bm25", "corpus_path": str(search_qa_wiki18)}
    first = registry.make_env("search_qa", retriever=settings, top_k=2, max_turns=3)
    second = registry.make_env("search_qa", retriever=dict(settings), top_k=2, max_turns=3)
    assert first.retriever is second.retriever  # one index per process, shared by the env slots
    tasks = registry.load_tasks("search_qa", "val", paths=[search_qa_data / "bamboogle_test.jsonl"], limit=4)
    assert [t.task_id for t in tasks] == [f"bamboogle_test/{i}" for i in range(4)]
    assert first.reset(tasks[3], seed=0).observation == tasks[3].payload["question"]
    with pytest.raises(ValueError, match="'backend'"):
        registry.make_env("search_qa", retriever={"corpus_path": str(search_qa_wiki18)})
    with pytest.raises(ValueError, match="unknown information_format 'json'"):
        registry.make_env("search_qa", retriever=settings, information_format="json")


# ---------------------------------------------------------------- gold passages on wiki-18 (real backends)


def _assert_gold_episodes(retriever, passages: dict[str, Passage]) -> None:
    """For each gold passage: the title query retrieves it, the observation shows it, the title answer wins."""
    env = SearchQAEnv(retriever, top_k=3, max_turns=4)
    for pid in GOLD_PASSAGE_IDS:
        query, answer = _title_question(passages[pid])
        env.reset(_task(f"What is the subject of: {query}?", [answer], task_id=f"wiki/{pid}"), seed=0)
        step = env.step(f"<search>{query}</search>")
        assert pid in step.info["retrieved_ids"], (pid, step.info["retrieved_ids"])
        assert f"(Title: {passages[pid].title}) {passages[pid].text}" in step.observation
        final = env.step(f"<answer>{answer.upper()}</answer>")
        assert (final.reward, final.won) == (1.0, True)


@pytest.mark.integration
def test_bm25_env_returns_gold_passage(search_qa_bm25: Bm25Retriever, search_qa_passages: dict[str, Passage]):
    assert search_qa_bm25.num_passages == 1000
    _assert_gold_episodes(search_qa_bm25, search_qa_passages)


@pytest.mark.integration
def test_bm25_index_built_by_tool_matches_in_memory(
    tmp_path: Path, search_qa_wiki18: Path, search_qa_bm25: Bm25Retriever, search_qa_passages
):
    out = tmp_path / "wiki18_bm25"
    cmd = [sys.executable, str(BUILD_TOOL), "--backend", "bm25", "--corpus", str(search_qa_wiki18)]
    cmd += ["--output", str(out)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    on_disk = build_retriever("bm25", index_dir=out)
    queries = [_title_question(search_qa_passages[pid])[0] for pid in GOLD_PASSAGE_IDS]
    assert on_disk.batch_search(queries, 3) == search_qa_bm25.batch_search(queries, 3)
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 1 and "already exists" in again.stderr


@pytest.mark.integration
def test_elasticsearch_env_returns_gold_passage(
    search_qa_es_url: str, search_qa_es_index: str, search_qa_passages: dict[str, Passage]
):
    with build_retriever("elasticsearch", url=search_qa_es_url, index=search_qa_es_index) as retriever:
        _assert_gold_episodes(retriever, search_qa_passages)
        # noida-db answers a few searches per second on this machine: keep the batch small.
        queries = [_title_question(search_qa_passages[pid])[0] for pid in GOLD_PASSAGE_IDS[:3]] + ["   "]
        batched = retriever.batch_search(queries, 3)
        assert batched == [retriever.search(q, 3) for q in queries]
        assert batched[-1] == []


@pytest.mark.integration
def test_elasticsearch_missing_index_is_named(search_qa_es_url: str):
    with pytest.raises(ValueError, match="index 'no-such-index' not found at http://127.0.0.1"):
        build_retriever("elasticsearch", url=search_qa_es_url, index="no-such-index")


@pytest.mark.integration
def test_unreachable_retriever_url_is_named(tmp_path: Path, search_qa_wiki18: Path):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(RetrieverUnavailableError, match=f"{url} is unreachable"):
        build_retriever("elasticsearch", url=url, index="wiki18", max_retries=0)
    cmd = [sys.executable, str(BUILD_TOOL), "--backend", "elasticsearch", "--corpus", str(search_qa_wiki18)]
    built = subprocess.run(cmd + ["--url", url, "--index", "wiki18"], capture_output=True, text=True)
    assert built.returncode == 1 and url in built.stderr
    secret = f"http://user:hunter2@127.0.0.1:{_free_port()}"
    with pytest.raises(RetrieverUnavailableError) as excinfo:
        build_retriever("elasticsearch", url=secret, index="wiki18", max_retries=0)
    assert "hunter2" not in str(excinfo.value) and "127.0.0.1" in str(excinfo.value)


class _CountingRetriever(Retriever):
    """The real BM25 retriever, counting how it is called (to see the worker batch its slots' searches)."""

    backend = "bm25"

    def __init__(self, inner: Bm25Retriever) -> None:
        self.inner, self.searches, self.batches = inner, 0, []

    def search(self, query: str, top_k: int) -> list[Passage]:
        self.searches += 1
        return self.inner.search(query, top_k)

    def batch_search(self, queries, top_k: int) -> list[list[Passage]]:
        self.batches.append(len(queries))
        return self.inner.batch_search(queries, top_k)


@pytest.mark.integration
def test_worker_batches_the_searches_of_its_slots(search_qa_bm25: Bm25Retriever):
    from megatron_gigpo.episodes.workers import EnvWorker

    counting = _CountingRetriever(search_qa_bm25)
    worker = EnvWorker(lambda: SearchQAEnv(counting, top_k=3, max_turns=4), worker_index=0)
    queries = ["Charles Babbage", "Analytical Engine", "Alan Turing machine"]
    tasks = [_task(f"Q{i}?", ["x"], task_id=f"q/{i}") for i in range(4)]
    assert all(o.ok for o in worker.reset([(slot, task, 0) for slot, task in enumerate(tasks)]))
    texts = [f"<think>t</think><search>{q}</search>" for q in queries] + ["<answer>x</answer>"]
    outcomes = worker.step(list(enumerate(texts)))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert counting.batches == [3] and counting.searches == 0  # one batched request for the three searches
    for query, outcome in zip(queries, outcomes):
        assert outcome.result.observation == format_information(search_qa_bm25.search(query, 3))
    assert outcomes[3].result.done and outcomes[3].result.won
    # A step without prepare_steps (the environment used directly) searches on its own, same result.
    env = SearchQAEnv(counting, top_k=3, max_turns=4)
    env.reset(tasks[0], seed=0)
    assert env.step(f"<search>{queries[0]}</search>").observation == outcomes[0].result.observation
    assert counting.searches == 1


class _RaisingProjection(SearchQAEnv):
    """Search QA whose projection raises on responses holding ``PROJFAIL`` (a broken environment)."""

    def project_action(self, response_text: str, admissible_actions: list[str] | None) -> ProjectedAction:
        if "PROJFAIL" in response_text:
            raise ValueError("injected projection fault")
        return super().project_action(response_text, admissible_actions)


@pytest.mark.integration
def test_worker_reports_a_slot_dropped_by_its_second_request(search_qa_bm25: Bm25Retriever):
    # A slot listed twice whose second projection raises is dropped before the steps: each request gets an
    # error outcome instead of the whole call raising KeyError, and the other slot still steps.
    from megatron_gigpo.episodes.workers import EnvWorker

    worker = EnvWorker(lambda: _RaisingProjection(search_qa_bm25, top_k=3, max_turns=4), worker_index=0)
    tasks = [_task(f"Q{i}?", ["x"], task_id=f"q/{i}") for i in range(2)]
    assert all(o.ok for o in worker.reset([(slot, task, 0) for slot, task in enumerate(tasks)]))
    outcomes = worker.step([(0, "<search>Charles Babbage</search>"), (0, "PROJFAIL"), (1, "<answer>x</answer>")])
    assert [o.ok for o in outcomes] == [False, False, True]
    assert "KeyError" in outcomes[0].error and "injected projection fault" in outcomes[1].error
    assert outcomes[2].result.won


class _NoBatchRetriever(_CountingRetriever):
    """The real BM25 retriever whose batched call fails (a server without batch support, say)."""

    def batch_search(self, queries, top_k: int) -> list[list[Passage]]:
        raise ConnectionError("batch endpoint down")


@pytest.mark.integration
def test_failed_batch_falls_back_to_one_search_per_slot(search_qa_bm25: Bm25Retriever, caplog):
    from megatron_gigpo.episodes.workers import EnvWorker

    retriever = _NoBatchRetriever(search_qa_bm25)
    worker = EnvWorker(lambda: SearchQAEnv(retriever, top_k=3, max_turns=4), worker_index=0)
    tasks = [_task(f"Q{i}?", ["x"], task_id=f"q/{i}") for i in range(2)]
    worker.reset([(slot, task, 0) for slot, task in enumerate(tasks)])
    with caplog.at_level("WARNING", logger="megatron_gigpo.episodes.workers"):
        outcomes = worker.step([(0, "<search>Charles Babbage</search>"), (1, "<search>Alan Turing</search>")])
    assert all(o.ok for o in outcomes) and retriever.searches == 2
    assert outcomes[1].result.observation == format_information(search_qa_bm25.search("Alan Turing", 3))
    assert "prepare_steps raised" in caplog.text  # warned once, so a lasting failure is visible
