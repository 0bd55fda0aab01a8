"""Retriever backends by name: :func:`build_retriever` and its per-process cache :func:`shared_retriever`.

Four backends, all returning :class:`~megatron_gigpo.envs.search_qa.passages.Passage` lists
(:class:`~megatron_gigpo.envs.search_qa.retriever.Retriever` subclasses):

* ``bm25`` (default): an in-process tantivy BM25 index (:mod:`.bm25`), no server.
* ``elasticsearch``: an Elasticsearch (or API-compatible) server through the official client (:mod:`.elastic`).
* ``dense``: sentence embeddings + a faiss inner-product index (:mod:`.dense`); needs the optional
  ``dense`` extra (``sentence-transformers``, ``faiss-cpu``), imported only when this backend is built.
* ``http``: a Search-R1-style retrieval server (``POST {url}`` with ``{"queries": [...], "topk": k}``) as in
  the GiGPO paper's search setting (:mod:`.http_retriever`); ``tools/retrieval_server.py`` serves any of the
  backends above that way.

Each backend module is imported when that backend is built, so importing this module needs neither a server
nor the optional dense-retrieval extra.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from megatron_gigpo.envs.search_qa.retriever import Retriever

BACKENDS = ("bm25", "elasticsearch", "dense", "http")

# Per-process cache for shared_retriever: every environment slot of a worker reuses one index/client.
_SHARED: dict[str, Retriever] = {}
_SHARED_LOCK = threading.Lock()


def build_retriever(backend: str, **kwargs: Any) -> Retriever:
    """Build a retriever by backend name.

    Args:
        backend: one of :data:`BACKENDS`.
        **kwargs: passed to the backend's constructor:

            * ``bm25``: :meth:`.bm25.Bm25Retriever.from_corpus` (``corpus_path``, optional ``index_dir``)
              when ``corpus_path`` is given, else :meth:`.bm25.Bm25Retriever.open` (``index_dir``).
            * ``elasticsearch``: :class:`.elastic.ElasticsearchRetriever` (``url``, ``index``, ...).
            * ``dense``: :meth:`.dense.DenseRetriever.from_corpus` (``corpus_path``, ``model_name_or_path``,
              ...) when ``corpus_path`` is given, else :meth:`.dense.DenseRetriever.open` (``index_dir``, ...).
            * ``http``: :class:`.http_retriever.HttpRetriever` (``url``, ``request_timeout``, ...).

    Raises:
        ValueError: unknown backend, or neither of the keyword arguments that select how to build it.
        TypeError: a keyword argument the backend does not take.
        ImportError: ``dense`` without the optional dependencies installed.
        RetrieverUnavailableError: the Elasticsearch or retrieval-server URL cannot be reached.
        RuntimeError: the ``http`` URL answers but not as a retrieval server.
    """
    if backend == "bm25":
        from megatron_gigpo.envs.search_qa.bm25 import Bm25Retriever

        if "corpus_path" in kwargs:
            return Bm25Retriever.from_corpus(**kwargs)
        if "index_dir" in kwargs:
            return Bm25Retriever.open(**kwargs)
        raise ValueError(f"bm25 retriever needs 'corpus_path' or 'index_dir', got {sorted(kwargs)}")
    if backend == "elasticsearch":
        from megatron_gigpo.envs.search_qa.elastic import ElasticsearchRetriever

        return ElasticsearchRetriever(**kwargs)
    if backend == "dense":
        from megatron_gigpo.envs.search_qa.dense import DenseRetriever

        if "corpus_path" in kwargs:
            return DenseRetriever.from_corpus(**kwargs)
        if "index_dir" in kwargs:
            return DenseRetriever.open(**kwargs)
        raise ValueError(
            f"dense retriever needs 'corpus_path' and 'model_name_or_path', or 'index_dir'; got {sorted(kwargs)}"
        )
    if backend == "http":
        from megatron_gigpo.envs.search_qa.http_retriever import HttpRetriever

        return HttpRetriever(**kwargs)
    raise ValueError(f"unknown retriever backend {backend!r}; choose one of {BACKENDS}")


def shared_retriever(backend: str, **kwargs: Any) -> Retriever:
    """:func:`build_retriever`, memoised per process on ``(backend, kwargs)``.

    Environments built from a recipe (plain data, no objects) call this, so that the N environment slots
    of one rollout worker share a single in-memory index or client instead of building N of them.
    ``kwargs`` are plain data (str/Path, numbers; the key is their JSON form with ``str()`` for other
    values); the retriever lives until the process ends.

    Raises:
        the errors of :func:`build_retriever`.
    """
    key = json.dumps([backend, kwargs], sort_keys=True, default=str)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = build_retriever(backend, **kwargs)
        return _SHARED[key]
