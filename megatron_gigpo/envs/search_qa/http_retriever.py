"""Retrieval over HTTP from a Search-R1-style retrieval server (the GiGPO paper's search setting).

GiGPO's search-QA experiments (verl-agent ``examples/gigpo_trainer/run_search.sh``,
``env.search.search_url=http://127.0.0.1:8000/retrieve``) query a retrieval server that holds E5 + faiss on a
GPU and serves every rollout worker. Two request shapes exist, both ``POST {url}`` with a JSON body:

* Search-R1 (``search_r1/search/retrieval_server.py``), batched:
  ``{"queries": [str, ...], "topk": int, "return_scores": bool}``.
* verl-agent (``examples/search/retriever/retrieval_server.py``), one query per request:
  ``{"query": str, "topk": int, "return_scores": bool}``.

Both answer ``{"result": [hits_of_query_1, ...]}``, one list per query (one list for the single-query form),
where a hit is ``{"document": doc, "score": float}`` with ``return_scores`` and the bare ``doc`` without. A
``doc`` is a wiki-18 corpus row, ``{"id": str, "contents": "\\"Title\\"\\ntext"}`` (Search-R1's pyserini BM25
rows carry ``title``/``text``/``contents`` and no ``id``).

:class:`HttpRetriever` sends one batched request per :meth:`HttpRetriever.batch_search` call, and falls back
to one request per query when the server only takes the single-query shape (detected once, at construction).
``tools/retrieval_server.py`` serves any of our backends over both shapes.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from megatron_gigpo.envs.search_qa.passages import Passage, parse_passage_row
from megatron_gigpo.envs.search_qa.retriever import Retriever, RetrieverUnavailableError, check_top_k, redact_url

#: HTTP statuses worth retrying: the server is restarting, overloaded or behind a gateway that timed out.
RETRY_STATUSES = (500, 502, 503, 504)
#: the request shapes: "batch" (Search-R1, ``queries``) and "single" (verl-agent, ``query``).
API_STYLES = ("batch", "single")

HOW_TO_SERVE = (
    "start a retrieval server at that URL, e.g. ours on the adopted E5 index: `python tools/retrieval_server.py "
    "--backend dense --index-path ~/data/search_qa/wiki18_e5 --device cuda --port 8000` (bm25 / elasticsearch "
    "too, see its --help), or Search-R1's search_r1/search/retrieval_server.py; or fix env.search.url"
)


def _split_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without ``user:password@`` and the Basic ``Authorization`` header that carries them instead."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"retrieval server URL must be http(s)://host[:port]/path, got {redact_url(url)!r}")
    if parts.username is None and parts.password is None:
        return url, {}
    token = base64.b64encode(f"{parts.username or ''}:{parts.password or ''}".encode()).decode("ascii")
    return redact_url(url), {"Authorization": f"Basic {token}"}


class _Endpoint:
    """One retrieval URL: JSON POSTs with a per-request timeout and retries on transient failures."""

    def __init__(self, url: str, *, request_timeout: float, max_retries: int, retry_backoff_s: float):
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.url, self._auth = _split_credentials(url)
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s

    def post(self, payload: dict[str, Any]) -> tuple[int, Any]:
        """``(status, decoded JSON body)``; an error status is returned, not raised, once retries are spent.

        Raises:
            RetrieverUnavailableError: no answer (refused, reset, timed out) after ``max_retries`` retries.
            RuntimeError: the answer is not JSON.
        """
        data = json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self._auth}
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                    status, body = response.status, response.read()
            except urllib.error.HTTPError as exc:  # an answer with an error status (subclass of URLError)
                status, body = exc.code, exc.read()
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as exc:
                if attempt < attempts:
                    time.sleep(self.retry_backoff_s * attempt)
                    continue
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                raise RetrieverUnavailableError(
                    f"retrieval server at {self.url} is unreachable ({reason}) after {attempts} attempt(s) of at "
                    f"most {self.request_timeout:g} s; {HOW_TO_SERVE}"
                ) from exc
            if status in RETRY_STATUSES and attempt < attempts:
                time.sleep(self.retry_backoff_s * attempt)
                continue
            try:
                return status, json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RuntimeError(
                    f"retrieval server at {self.url} answered HTTP {status} with a non-JSON body: {body[:300]!r}"
                ) from exc
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover


def _misses_query_field(body: Any) -> bool:
    """Whether a 422 body is FastAPI's "field ``query`` missing" error (verl-agent's single-query server)."""
    if not isinstance(body, dict) or not isinstance(body.get("detail"), list):
        return False
    return any(isinstance(item, dict) and list(item.get("loc", ())) == ["body", "query"] for item in body["detail"])


def detect_api_style(endpoint: _Endpoint) -> str:
    """Which request shape the server at ``endpoint`` takes: ``"batch"`` or ``"single"`` (see module doc).

    Sends an empty batch (``{"queries": []}``), which a batched server answers with ``{"result": []}`` and
    verl-agent's single-query server rejects with HTTP 422 for the missing ``query`` field.

    Raises:
        RetrieverUnavailableError: the server cannot be reached.
        RuntimeError: something answers but is not a retrieval server (status and body excerpt included).
    """
    status, body = endpoint.post({"queries": [], "topk": 1, "return_scores": True})
    if status == 200 and isinstance(body, dict) and body.get("result") == []:
        return "batch"
    if status == 422 and _misses_query_field(body):
        return "single"
    hint = " (the URL must include the endpoint path, e.g. http://127.0.0.1:8000/retrieve)" if status == 404 else ""
    raise RuntimeError(
        f"{endpoint.url} is not a Search-R1-style retrieval server: an empty batch got HTTP {status} "
        f"{json.dumps(body)[:300]}{hint}"
    )


def probe_retrieval_server(url: str, timeout: float = 3.0) -> str:
    """Check once, without retries, that ``url`` is a retrieval server; returns its API style.

    For preflight checks: fails within about ``timeout`` seconds.

    Raises:
        ValueError: ``url`` is not an http(s) URL.
        RetrieverUnavailableError: nothing answers at ``url`` (names it, credentials removed, and how to start
            a server).
        RuntimeError: something answers but not as a retrieval server.
    """
    return detect_api_style(_Endpoint(url, request_timeout=timeout, max_retries=0, retry_backoff_s=0.0))


def _parse_document(doc: Any, score: float, where: str) -> Passage:
    """A :class:`Passage` from one returned corpus row (:func:`parse_passage_row`; the id may be missing).

    Raises:
        RuntimeError: not a document object (the server's answer is wrong, not our input).
    """
    if not isinstance(doc, dict):
        raise RuntimeError(f"{where}: expected a document object, got {json.dumps(doc)[:200]}")
    try:
        return parse_passage_row(doc, where, score=score, require_id=False)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None


def parse_hits(hits: Any, where: str) -> list[Passage]:
    """One query's hits, ``[{"document": doc, "score": s}, ...]`` or ``[doc, ...]``, as passages in rank order.

    Raises:
        RuntimeError: not a list of documents in either shape (names ``where``).
    """
    if not isinstance(hits, list):
        raise RuntimeError(f"{where}: expected a list of hits, got {json.dumps(hits)[:200]}")
    passages = []
    for hit in hits:
        if isinstance(hit, dict) and isinstance(hit.get("document"), dict):
            score = hit["score"] if "score" in hit else 0.0
            if isinstance(score, bool) or not isinstance(score, int | float):
                raise RuntimeError(f"{where}: hit score must be a number, got {score!r}")
            passages.append(_parse_document(hit["document"], float(score), where))
        else:
            passages.append(_parse_document(hit, 0.0, where))
    return passages


class HttpRetriever(Retriever):
    """Top-k retrieval from a Search-R1-style retrieval server (see the module docstring for the API).

    Args:
        url: the endpoint, e.g. ``http://127.0.0.1:8000/retrieve``; ``user:password@`` is sent as HTTP Basic
            auth and never shown in messages.
        request_timeout: seconds per HTTP request (a dense batch on a busy server takes a few seconds).
        max_retries: retries after a refused/reset/timed-out request or an HTTP 500/502/503/504, with a
            linear back-off of ``retry_backoff_s`` x attempt seconds.
        retry_backoff_s: see ``max_retries``.

    Raises (at construction, so a misconfigured run fails before its first rollout):
        ValueError: ``url`` is not http(s), or bad timeout/retry values.
        RetrieverUnavailableError: nothing answers at ``url``.
        RuntimeError: something answers but is not a retrieval server.
    """

    backend = "http"

    def __init__(
        self, url: str, *, request_timeout: float = 60.0, max_retries: int = 3, retry_backoff_s: float = 1.0
    ):
        self._endpoint = _Endpoint(
            url, request_timeout=request_timeout, max_retries=max_retries, retry_backoff_s=retry_backoff_s
        )
        self.url = self._endpoint.url  # credentials removed
        #: "batch" (one request per batch_search call) or "single" (one request per query).
        self.api_style = detect_api_style(self._endpoint)

    def _request(self, payload: dict[str, Any], expected: int) -> list[list[Passage]]:
        status, body = self._endpoint.post(payload)
        if status != 200:
            raise RuntimeError(f"retrieval server at {self.url} answered HTTP {status}: {json.dumps(body)[:300]}")
        results = body.get("result") if isinstance(body, dict) else None
        if not isinstance(results, list) or len(results) != expected:
            raise RuntimeError(
                f"retrieval server at {self.url} answered {json.dumps(body)[:300]}; expected "
                f"{{\"result\": [...]}} with {expected} list(s) of hits"
            )
        return [parse_hits(hits, f"retrieval server at {self.url}") for hits in results]

    def batch_search(self, queries: Sequence[str], top_k: int) -> list[list[Passage]]:
        """The ``top_k`` passages of each query, in query order, best first; one POST for the whole batch
        (one per query against a single-query server). Scores are the server's (E5 cosine, BM25, ...).

        Raises:
            ValueError: ``top_k`` < 1.
            RetrieverUnavailableError: the server stopped answering (after the retries).
            RuntimeError: an error status or a malformed answer (status and body excerpt included).
        """
        check_top_k(top_k)
        if not queries:
            return []
        if self.api_style == "batch":
            return self._request({"queries": list(queries), "topk": top_k, "return_scores": True}, len(queries))
        return [self._request({"query": q, "topk": top_k, "return_scores": True}, 1)[0] for q in queries]

    def search(self, query: str, top_k: int) -> list[Passage]:
        """:meth:`batch_search` of one query."""
        return self.batch_search([query], top_k)[0]
