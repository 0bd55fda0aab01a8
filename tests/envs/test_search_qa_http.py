"""Search-QA retrieval over HTTP: our retrieval server (tools/retrieval_server.py) and the ``http`` backend.

The server runs as a real subprocess over a tantivy BM25 index of the shared wiki-18 sample; the client's
answers are compared with the in-process BM25 retriever's. A small verl-agent-shaped server (one ``query`` per
request, FastAPI + uvicorn in a thread) checks the client's single-query fallback.
"""

# No `from __future__ import annotations`: FastAPI resolves the test server's endpoint annotations at run time.

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_gigpo.envs.base import Task
from megatron_gigpo.envs.search_qa import Passage, RetrieverUnavailableError, build_retriever
from megatron_gigpo.envs.search_qa.bm25 import Bm25Retriever
from megatron_gigpo.envs.search_qa.http_retriever import HttpRetriever, parse_hits, probe_retrieval_server

REPO = Path(__file__).resolve().parents[2]
SERVER_TOOL = REPO / "tools" / "retrieval_server.py"
RECIPE = REPO / "recipes" / "search_qa" / "qwen2.5-3b-instruct.yaml"
GOLD_PASSAGE_IDS = ("0", "1", "2", "10", "100", "500", "999")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _title_query(passage: Passage) -> str:
    return f"{passage.title.strip(chr(34))} {' '.join(passage.text.split()[:8])}"


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/stats", timeout=30) as response:
        return json.load(response)


def _assert_same_hits(got: list[list[Passage]], want: list[list[Passage]]) -> None:
    assert len(got) == len(want)
    for got_hits, want_hits in zip(got, want, strict=True):
        assert [(p.id, p.title, p.text) for p in got_hits] == [(p.id, p.title, p.text) for p in want_hits]
        assert [p.score for p in got_hits] == pytest.approx([p.score for p in want_hits], abs=1e-6)


# ------------------------------------------- fixtures (search_qa_* shared ones are in tests/envs/conftest.py)


@pytest.fixture(scope="session")
def search_http_index(search_qa_wiki18: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    index_dir = tmp_path_factory.mktemp("search_http") / "wiki18_bm25"
    Bm25Retriever.from_corpus(search_qa_wiki18, index_dir=index_dir)
    return index_dir


@pytest.fixture(scope="session")
def search_http_queries(search_qa_passages: dict[str, Passage]) -> list[str]:
    return [_title_query(search_qa_passages[pid]) for pid in GOLD_PASSAGE_IDS] + ["analytical engine", "the"]


@contextlib.contextmanager
def _serve(index_dir: Path, *extra: str) -> Iterator[str]:
    """Run tools/retrieval_server.py on ``index_dir`` until the caller is done; yields its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/retrieve"
    cmd = [sys.executable, str(SERVER_TOOL), "--backend", "bm25", "--index-path", str(index_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout, whatever the editable install points at
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                probe_retrieval_server(url, timeout=2.0)
                break
            except RetrieverUnavailableError:
                if proc.poll() is not None:
                    pytest.fail(f"retrieval server exited with {proc.returncode}: {proc.stdout.read()}")
                if time.monotonic() > deadline:
                    pytest.fail("retrieval server did not answer within 120 s")
                time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def search_http_url(search_http_index: Path) -> Iterator[str]:
    with _serve(search_http_index) as url:
        yield url


# ---------------------------------------------------------------- client against our server


@pytest.mark.integration
def test_http_backend_matches_in_process_bm25(
    search_http_url: str, search_qa_bm25: Bm25Retriever, search_http_queries: list[str]
):
    with build_retriever("http", url=search_http_url) as retriever:
        assert (retriever.backend, retriever.api_style) == ("http", "batch")
        before = _stats(search_http_url)
        got = retriever.batch_search(search_http_queries, 3)
        after = _stats(search_http_url)
        assert after["requests"] - before["requests"] == 1  # one POST for the whole batch
        _assert_same_hits(got, search_qa_bm25.batch_search(search_http_queries, 3))
        assert got[-1] == []  # a stop-word-only query finds nothing, as in process
        query = search_http_queries[0]
        _assert_same_hits([retriever.search(query, 5)], [search_qa_bm25.search(query, 5)])
        assert retriever.batch_search([], 3) == []
        with pytest.raises(ValueError, match="top_k"):
            retriever.search("hamlet", 0)


@pytest.mark.integration
def test_server_answers_both_request_shapes_and_names_bad_fields(
    search_http_url: str, search_qa_bm25: Bm25Retriever, search_http_queries: list[str]
):
    queries = search_http_queries[:3]
    status, body = _post(search_http_url, {"queries": queries, "topk": 2})  # return_scores defaults to false
    assert status == 200 and len(body["result"]) == 3
    assert all(set(doc) == {"id", "contents"} for hits in body["result"] for doc in hits)
    unscored = [parse_hits(hits, "test") for hits in body["result"]]
    want = search_qa_bm25.batch_search(queries, 2)
    assert [[(p.id, p.title, p.text, p.score) for p in hits] for hits in unscored] == [
        [(p.id, p.title, p.text, 0.0) for p in hits] for hits in want
    ]
    status, body = _post(search_http_url, {"query": queries[0], "return_scores": True})  # verl-agent shape
    assert status == 200 and len(body["result"]) == 1
    _assert_same_hits([parse_hits(body["result"][0], "test")], [search_qa_bm25.search(queries[0], 3)])  # --topk 3
    for bad, field in (({"queries": queries, "top_k": 3}, "top_k"), ({"queries": queries, "topk": 0}, "topk"),
                       ({"queries": "hamlet"}, "queries")):
        status, body = _post(search_http_url, bad)
        assert status == 422 and field in json.dumps(body["detail"]), body
    status, body = _post(search_http_url, {"topk": 3})
    assert status == 422 and "exactly one of 'queries'" in body["detail"]


@pytest.mark.integration
def test_concurrent_requests_are_served_as_one_batch(
    search_http_index: Path, search_qa_bm25: Bm25Retriever, search_http_queries: list[str]
):
    # The batch closes when it holds 16 queries; the long wait only matters if a request were lost.
    with _serve(search_http_index, "--max-batch-size", "16", "--batch-wait-ms", "20000") as url:
        clients = [HttpRetriever(url) for _ in range(8)]
        batches = [[search_http_queries[i % 9], search_http_queries[(i + 3) % 9]] for i in range(8)]
        results: list = [None] * 8
        barrier = threading.Barrier(8)

        def run(i: int) -> None:
            barrier.wait()
            results[i] = clients[i].batch_search(batches[i], 3)

        before = _stats(url)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        after = _stats(url)
        for batch, got in zip(batches, results, strict=True):
            _assert_same_hits(got, search_qa_bm25.batch_search(batch, 3))
        delta = {key: after[key] - before[key] for key in ("requests", "queries", "batches")}
        assert delta == {"requests": 8, "queries": 16, "batches": 1}


@pytest.mark.integration
def test_single_query_server_gets_one_request_per_query(
    search_qa_bm25: Bm25Retriever, search_http_queries: list[str]
):
    """verl-agent's retrieval server takes ``{"query": str, "topk", "return_scores"}`` only."""
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel

    class OneQuery(BaseModel):
        query: str
        topk: int = 3
        return_scores: bool = False

    app = FastAPI()
    seen: list[str] = []

    @app.post("/retrieve")
    def retrieve(request: OneQuery) -> dict:
        seen.append(request.query)
        hits = search_qa_bm25.search(request.query, request.topk)
        docs = [{"id": p.id, "contents": p.contents} for p in hits]
        return {"result": [[{"document": d, "score": p.score} for d, p in zip(docs, hits)] if request.return_scores
                           else docs]}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}/retrieve"
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        retriever = HttpRetriever(url)
        assert retriever.api_style == "single"
        queries = search_http_queries[:4]
        _assert_same_hits(retriever.batch_search(queries, 3), search_qa_bm25.batch_search(queries, 3))
        assert seen == queries
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# ---------------------------------------------------------------- errors and preflight


@pytest.mark.unit
def test_unreachable_url_names_it_and_how_to_start_a_server():
    url = f"http://127.0.0.1:{_free_port()}/retrieve"
    with pytest.raises(RetrieverUnavailableError, match=f"{url} is unreachable") as excinfo:
        HttpRetriever(url, max_retries=1, retry_backoff_s=0.0)
    assert "2 attempt(s)" in str(excinfo.value)
    assert "tools/retrieval_server.py" in str(excinfo.value) and "Search-R1" in str(excinfo.value)
    secret = f"http://user:hunter2@127.0.0.1:{_free_port()}/retrieve"
    with pytest.raises(RetrieverUnavailableError) as excinfo:
        build_retriever("http", url=secret, max_retries=0)
    assert "hunter2" not in str(excinfo.value) and "127.0.0.1" in str(excinfo.value)
    for bad in ("127.0.0.1:8000/retrieve", "ftp://127.0.0.1/retrieve"):
        with pytest.raises(ValueError, match="http"):
            HttpRetriever(bad)


@pytest.mark.integration
def test_wrong_endpoint_path_is_named(search_http_url: str):
    root = search_http_url.rsplit("/", 1)[0] + "/"
    with pytest.raises(RuntimeError, match=r"not a Search-R1-style retrieval server.*HTTP 404.*include the endpoint"):
        HttpRetriever(root)


@pytest.mark.unit
def test_parse_hits_reads_every_documented_shape():
    contents = '"Hamlet"\nHamlet is a tragedy\nby Shakespeare.'
    scored = [{"document": {"id": "7", "contents": contents}, "score": 12.5}]
    assert parse_hits(scored, "t") == [Passage("7", '"Hamlet"', "Hamlet is a tragedy\nby Shakespeare.", 12.5)]
    assert parse_hits([{"id": 7, "contents": contents}], "t") == [Passage.from_contents("7", contents)]
    pyserini = {"title": "Hamlet", "text": "Hamlet is a tragedy\nby Shakespeare.", "contents": contents}
    assert parse_hits([{"document": pyserini, "score": 3}], "t") == [Passage.from_contents("", contents, 3.0)]
    assert parse_hits([{"title": "Hamlet", "text": "A play."}], "t") == [Passage("", "Hamlet", "A play.")]
    with pytest.raises(RuntimeError, match="where: passage needs a str 'contents'"):
        parse_hits([{"id": "1"}], "where")
    with pytest.raises(RuntimeError, match="expected a list of hits"):
        parse_hits({"id": "1"}, "where")
    with pytest.raises(RuntimeError, match="score must be a number"):
        parse_hits([{"document": {"id": "1", "contents": contents}, "score": "high"}], "where")


def _recipe_env(shared_dir: Path, url: str):
    from megatron_gigpo.config import load_config

    questions = shared_dir / "data" / "search_qa" / "nq_test_1k.jsonl"
    overrides = [f"env.search.url={url}", f"env.search.train_file={questions}", f"env.search.val_file={questions}"]
    return load_config(RECIPE, overrides).env


@pytest.mark.unit
def test_preflight_reports_an_unreachable_server(shared_dir: Path):
    from megatron_gigpo.envs.registry import check_env_resources

    url = f"http://127.0.0.1:{_free_port()}/retrieve"
    env = _recipe_env(shared_dir, url)
    assert (env.search.retriever, env.search.top_k) == ("http", 3)
    problems = check_env_resources(env)
    assert len(problems) == 1 and problems[0].startswith(f"env.search.url: retrieval server at {url} is unreachable")
    assert "1 attempt(s) of at most 3 s" in problems[0]
    assert "tools/retrieval_server.py --backend dense" in problems[0] and "Search-R1" in problems[0]


@pytest.mark.integration
def test_recipe_episode_over_http(
    shared_dir: Path, search_http_url: str, search_qa_passages: dict[str, Passage]
):
    from megatron_gigpo.envs.registry import check_env_resources, env_kwargs
    from megatron_gigpo.envs import registry

    env_cfg = _recipe_env(shared_dir, search_http_url)
    assert check_env_resources(env_cfg) == []
    kwargs = env_kwargs(env_cfg)
    assert kwargs["retriever"] == {"backend": "http", "url": search_http_url}
    assert kwargs["information_format"] == "verl_agent"  # the search recipes show hits as verl-agent does
    env = registry.make_env("search_qa", **kwargs)
    for pid in GOLD_PASSAGE_IDS[:3]:
        passage = search_qa_passages[pid]
        answer = passage.title.strip('"')
        payload = {"question": f"What is the subject of: {_title_query(passage)}?", "golden_answers": [answer]}
        env.reset(Task(env="search_qa", task_id=f"wiki/{pid}", split="val", payload=payload), seed=0)
        step = env.step(f"<search>{_title_query(passage)}</search>")
        assert pid in step.info["retrieved_ids"] and not step.done
        hits = json.loads(step.observation.removeprefix("<information>").removesuffix("</information>"))
        assert f"{passage.title}\n{passage.text}".strip() in hits["result"]
        final = env.step(f"<answer>{answer}</answer>")
        assert (final.reward, final.done, final.won) == (1.0, True, True)
