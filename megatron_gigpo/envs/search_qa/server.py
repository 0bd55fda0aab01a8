"""Serve one of our retrievers over Search-R1's retrieval API, batching concurrent requests.

``POST {path}`` (default ``/retrieve``) takes Search-R1's batched body ``{"queries": [str, ...], "topk": int,
"return_scores": bool}`` or verl-agent's single-query body ``{"query": str, ...}`` (``topk`` defaults to the
server's ``--topk``, ``return_scores`` to false) and answers ``{"result": [hits_of_query_1, ...]}``, a hit being
``{"document": {"id": str, "contents": "\\"Title\\"\\ntext"}, "score": float}`` with ``return_scores``, else the
bare document (see :mod:`.http_retriever`, the client). ``GET /stats`` reports request, query and batch counts.

Batching: requests wait in a queue; a loop takes every queued request (up to ``max_batch_size`` queries, waiting
at most ``max_wait_s`` for more) and runs one ``Retriever.batch_search`` per distinct ``topk`` in a single worker
thread, so the retriever sees one call at a time and a dense encoder + faiss search get whole batches.

Needs the ``server`` extra (``fastapi``, ``uvicorn``), imported only by :func:`create_app` and :func:`main`.
The command line is ``tools/retrieval_server.py`` / ``megatron-gigpo serve-retriever`` (usage there).
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint's parameter annotations at run time,
# and the request model is local to create_app, where string annotations could not be resolved.

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from megatron_gigpo.envs.search_qa.backends import build_retriever
from megatron_gigpo.envs.search_qa.passages import Passage
from megatron_gigpo.envs.search_qa.retriever import Retriever, RetrieverUnavailableError, import_extra, redact_url

SERVED_BACKENDS = ("bm25", "dense", "elasticsearch")


def _import_server_dependencies() -> tuple[Any, Any]:
    """``(fastapi, uvicorn)``, or an ImportError that names the extra to install."""
    fastapi, uvicorn = import_extra("server", "the retrieval server (fastapi, uvicorn)", "fastapi", "uvicorn")
    return fastapi, uvicorn


@dataclass
class _Pending:
    queries: list[str]
    top_k: int
    future: asyncio.Future


class RequestBatcher:
    """Coalesces concurrent searches into ``retriever.batch_search`` calls (see the module docstring).

    Args:
        retriever: any :class:`Retriever`; called from one worker thread, one call at a time.
        max_batch_size: queries per ``batch_search`` call before a batch is closed (a larger request is
            still served whole).
        max_wait_s: seconds a batch stays open for more requests after its first one arrived.

    Create and :meth:`run` it inside the serving event loop.
    """

    def __init__(self, retriever: Retriever, *, max_batch_size: int, max_wait_s: float):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self._retriever = retriever
        self._max_batch_size = max_batch_size
        self._max_wait_s = max_wait_s
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever")
        self.stats = {"requests": 0, "queries": 0, "batches": 0}

    async def search(self, queries: list[str], top_k: int) -> list[list[Passage]]:
        """The ``top_k`` passages of each query (in order), once the batch holding them has run.

        Raises:
            whatever the retriever raised for that batch.
        """
        self.stats["requests"] += 1
        if not queries:
            return []
        pending = _Pending(queries, top_k, asyncio.get_running_loop().create_future())
        await self._queue.put(pending)
        return await pending.future

    async def run(self) -> None:
        """Serve the queue until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            size = len(batch[0].queries)
            deadline = loop.time() + self._max_wait_s
            while size < self._max_batch_size:
                remaining = deadline - loop.time()
                try:
                    if remaining <= 0:
                        item = self._queue.get_nowait()
                    else:
                        item = await asyncio.wait_for(self._queue.get(), remaining)
                except (asyncio.QueueEmpty, TimeoutError):
                    break
                batch.append(item)
                size += len(item.queries)
            await self._execute(batch)

    async def _execute(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        by_top_k: dict[int, list[_Pending]] = {}
        for item in batch:
            by_top_k.setdefault(item.top_k, []).append(item)
        for top_k, items in by_top_k.items():
            flat = [query for item in items for query in item.queries]
            self.stats["batches"] += 1
            self.stats["queries"] += len(flat)
            try:
                results = await loop.run_in_executor(self._executor, self._retriever.batch_search, flat, top_k)
            except Exception as exc:  # noqa: BLE001 - handed to the waiting requests, the server goes on
                for item in items:
                    if not item.future.done():  # a client that disconnected cancelled its future
                        item.future.set_exception(exc)
                continue
            start = 0
            for item in items:
                if not item.future.done():
                    item.future.set_result(results[start : start + len(item.queries)])
                start += len(item.queries)

    def close(self) -> None:
        """Stop the worker thread (after the batch it runs, if any)."""
        self._executor.shutdown(wait=True)


def _hits(passages: list[Passage], return_scores: bool) -> list[dict[str, Any]]:
    docs = [{"id": p.id, "contents": p.contents} for p in passages]
    if not return_scores:
        return docs
    return [{"document": doc, "score": p.score} for doc, p in zip(docs, passages, strict=True)]


def create_app(
    retriever: Retriever,
    *,
    default_top_k: int = 3,
    path: str = "/retrieve",
    max_batch_size: int = 512,
    max_wait_s: float = 0.005,
) -> Any:
    """A FastAPI app serving ``retriever`` at ``POST {path}`` (API in the module docstring).

    Bad bodies get HTTP 422 naming the field; a retriever error gets HTTP 500 with its message. The caller
    keeps ownership of ``retriever`` (close it after the server stops).

    Raises:
        ImportError: fastapi is not installed.
    """
    fastapi, _ = _import_server_dependencies()
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field

    class RetrieveRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        queries: list[str] | None = None
        query: str | None = None
        topk: int | None = Field(default=None, ge=1)
        return_scores: bool = False

    state: dict[str, RequestBatcher] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any):
        batcher = RequestBatcher(retriever, max_batch_size=max_batch_size, max_wait_s=max_wait_s)
        state["batcher"] = batcher
        task = asyncio.create_task(batcher.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            batcher.close()

    app = fastapi.FastAPI(title=f"megatron-gigpo {retriever.backend} retrieval server", lifespan=lifespan)

    @app.post(path)
    async def retrieve(request: RetrieveRequest) -> Any:
        if (request.queries is None) == (request.query is None):
            raise fastapi.HTTPException(
                status_code=422, detail="give exactly one of 'queries' (list of str) and 'query' (str)"
            )
        queries = request.queries if request.queries is not None else [request.query]
        top_k = request.topk if request.topk is not None else default_top_k
        try:
            results = await state["batcher"].search(queries, top_k)
        except Exception as exc:  # noqa: BLE001 - reported to the client, the server goes on
            raise fastapi.HTTPException(status_code=500, detail=f"retriever failed: {type(exc).__name__}: {exc}")
        return JSONResponse({"result": [_hits(r, request.return_scores) for r in results]})

    @app.get("/stats")
    async def stats() -> Any:
        return {"backend": retriever.backend, **state["batcher"].stats}

    return app


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="retrieval_server", description="Serve a search-QA retriever over Search-R1's HTTP retrieval API."
    )
    parser.add_argument("--backend", required=True, choices=SERVED_BACKENDS)
    parser.add_argument("--index-path", help="index directory (bm25, dense; tools/build_search_index.py)")
    parser.add_argument("--corpus", help="passage .jsonl to index in memory at start (bm25, without --index-path)")
    parser.add_argument("--model", help="encoder path instead of the one recorded in the dense index (dense)")
    parser.add_argument("--device", default="cpu", help="torch device of the query encoder (dense), e.g. cuda")
    parser.add_argument("--encode-batch-size", type=int, default=256, help="queries per encoder batch (dense)")
    parser.add_argument("--url", help="Elasticsearch URL (elasticsearch)")
    parser.add_argument("--index", help="Elasticsearch index name (elasticsearch)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--path", default="/retrieve", help="endpoint path")
    parser.add_argument("--topk", type=int, default=3, help="passages per query when a request gives no topk")
    parser.add_argument("--max-batch-size", type=int, default=512, help="queries per retriever call")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0, help="ms a batch waits for more requests")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    args = parser.parse_args(argv)
    if args.backend == "bm25" and (args.index_path is None) == (args.corpus is None):
        parser.error("--backend bm25 needs exactly one of --index-path and --corpus")
    if args.backend == "dense" and args.index_path is None:
        parser.error("--backend dense needs --index-path (tools/build_search_index.py --backend dense)")
    if args.backend == "elasticsearch" and (args.url is None or args.index is None):
        parser.error("--backend elasticsearch needs --url and --index")
    if args.topk < 1:
        parser.error(f"--topk must be >= 1, got {args.topk}")
    return args


def _retriever_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "bm25":
        return {"index_dir": args.index_path} if args.index_path is not None else {"corpus_path": args.corpus}
    if args.backend == "dense":
        kwargs = {"index_dir": args.index_path, "device": args.device, "batch_size": args.encode_batch_size}
        if args.model is not None:
            kwargs["model_name_or_path"] = args.model
        return kwargs
    return {"url": args.url, "index": args.index}


def main(argv: Sequence[str] | None = None) -> int:
    """Build the retriever, then serve it until interrupted. Exit status 1 (one line on stderr) when the
    retriever cannot be built: missing index or corpus, unreachable Elasticsearch, missing extra."""
    args = parse_args(argv)
    try:
        _, uvicorn = _import_server_dependencies()
        retriever = build_retriever(args.backend, **_retriever_kwargs(args))
    except (ImportError, FileNotFoundError, ValueError, RetrieverUnavailableError) as exc:
        print(f"retrieval_server: {exc}", file=sys.stderr)
        return 1
    app = create_app(
        retriever,
        default_top_k=args.topk,
        path=args.path,
        max_batch_size=args.max_batch_size,
        max_wait_s=args.batch_wait_ms / 1000.0,
    )
    where = redact_url(args.url) if args.backend == "elasticsearch" else (args.index_path or args.corpus)
    print(f"retrieval_server: {args.backend} ({where}) on http://{args.host}:{args.port}{args.path}",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        retriever.close()
    return 0
