"""The retriever interface (:class:`Retriever`) and the helpers its backends share: the error for an unreachable
server, URL redaction, the ``top_k`` check, and imports of optional extras.

The backends (:mod:`.bm25`, :mod:`.elastic`, :mod:`.dense`, :mod:`.http_retriever`) subclass :class:`Retriever`;
:mod:`.backends` builds them by name. This module imports none of them.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from megatron_gigpo.envs.search_qa.passages import Passage


def import_extra(extra: str, purpose: str, *modules: str) -> list[Any]:
    """Import ``modules`` of the optional ``extra``, or raise an ImportError that names the extra to install.

    Raises:
        ImportError: ``"<purpose> needs the optional '<extra>' extra (missing module ...): pip install ..."``.
    """
    try:
        return [importlib.import_module(name) for name in modules]
    except ImportError as exc:
        raise ImportError(
            f"{purpose} needs the optional {extra!r} extra (missing module {exc.name!r}): "
            f"pip install 'megatron-gigpo[{extra}]'"
        ) from exc


class RetrieverUnavailableError(ConnectionError):
    """A retrieval server cannot be reached; the message names its URL (credentials removed)."""


def redact_url(url: str) -> str:
    """``url`` without a ``user:password@`` part, for error messages and logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_top_k(top_k: int) -> None:
    """Raise ValueError unless ``top_k`` is an int >= 1."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")


class Retriever(abc.ABC):
    """Top-k passage retrieval for a text query.

    Implementations are safe to share between the environments of one process (calls are serialised by
    the GIL or by the backend client) but not across processes: build one per process.
    """

    backend: str = ""

    @abc.abstractmethod
    def search(self, query: str, top_k: int) -> list[Passage]:
        """The ``top_k`` best passages for ``query``, best first (fewer when the corpus has fewer matches).

        Raises:
            ValueError: ``top_k`` < 1.
            RetrieverUnavailableError: a remote backend cannot be reached (names the URL).
        """

    def batch_search(self, queries: Sequence[str], top_k: int) -> list[list[Passage]]:
        """:meth:`search` for each query, in order (backends override this with a batched request)."""
        check_top_k(top_k)
        return [self.search(query, top_k) for query in queries]

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing to release
        """Release clients and file handles. Default: nothing."""

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
