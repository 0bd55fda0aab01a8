"""Retrieved passages: the corpus record, the corpus reader (lines read by :mod:`.jsonl`), and the observation
format.

Corpus files follow the FlashRAG / Search-R1 wiki-18 layout: one JSON object per line with ``id`` and
``contents``, where ``contents`` is the title line, a newline, then the passage text. Rows with separate
``title`` and ``text`` fields (DPR layout) are accepted too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_gigpo.envs.search_qa.jsonl import read_jsonl_objects


@dataclass(frozen=True)
class Passage:
    """One retrieved passage.

    Attributes:
        id: the corpus id (str).
        title: the title line, verbatim (wiki-18 keeps it in double quotes).
        text: the passage body.
        score: the retriever's relevance score (BM25 score, or cosine similarity for dense retrieval);
            0.0 for corpus records that were not retrieved.
    """

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        """``title + "\\n" + text``: the wiki-18 ``contents`` field, the text that is indexed."""
        return f"{self.title}\n{self.text}"

    @classmethod
    def from_contents(cls, passage_id: str, contents: str, score: float = 0.0) -> Passage:
        """Split a wiki-18 ``contents`` string at its first newline into title and text."""
        title, _, text = contents.partition("\n")
        return cls(id=passage_id, title=title, text=text, score=score)


def parse_passage_row(row: dict, where: str, *, score: float = 0.0, require_id: bool = True) -> Passage:
    """A :class:`Passage` from an ``{id, contents}`` or ``{id, title, text}`` object (``contents`` wins and is
    split at its first newline, as in :meth:`Passage.from_contents`).

    Args:
        row: the corpus record.
        where: names the record in errors (file:line, or a server's answer).
        score: the passage's relevance score (0.0 for corpus records).
        require_id: without it, a row with no ``id`` gets ``""`` (retrieval servers may omit ids).
    Raises:
        ValueError: ``id`` is missing (when required), or neither ``contents`` nor ``title``/``text`` is a str
            (names ``where``).
    """
    if require_id and "id" not in row:
        raise ValueError(f"{where}: passage has no 'id' (keys: {sorted(row)})")
    passage_id = str(row["id"]) if "id" in row else ""
    if isinstance(row.get("contents"), str):
        return Passage.from_contents(passage_id, row["contents"], score=score)
    if isinstance(row.get("title"), str) and isinstance(row.get("text"), str):
        return Passage(id=passage_id, title=row["title"], text=row["text"], score=score)
    raise ValueError(f"{where}: passage needs a str 'contents', or str 'title' and 'text' (keys: {sorted(row)})")


def read_passages(path: str | Path) -> Iterator[Passage]:
    """Stream the passages of a corpus ``.jsonl`` file, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a JSON object with the fields above (names file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"passage corpus not found: {path}")
    for line_number, row in read_jsonl_objects(path):
        yield parse_passage_row(row, f"{path}:{line_number}")


#: Layouts of the observation after a search (``env.search.information_format``); the first is the default.
INFORMATION_FORMATS = ("search_r1", "verl_agent")


def format_information(passages: Sequence[Passage], information_format: str = INFORMATION_FORMATS[0]) -> str:
    """The observation after a search; the string is also the step's anchor, so it holds nothing but the
    retrieved text. Passages in rank order.

    - ``search_r1`` (Search-R1, arXiv 2503.09516, Sec. 3.1; its ``_passages2string``):
      ``<information>Doc 1(Title: <title>) <text>\nDoc 2(Title: ...) ...</information>``; an empty result
      says so inside the tags.
    - ``verl_agent`` (verl-agent, the GiGPO paper's code: ``skyrl_gym`` search tool and env): a JSON object
      ``{"result": "Doc 1: <contents>\nDoc 2: ...\n"}`` inside ``<information>`` tags, where ``<contents>`` is
      the wiki-18 record (title line, newline, text) stripped; an empty result is ``"No search results found."``.

    Raises:
        ValueError: unknown ``information_format``.
    """
    if information_format == "search_r1":
        if not passages:
            return "<information>No passages found.</information>"
        docs = "\n".join(f"Doc {rank}(Title: {p.title}) {p.text}" for rank, p in enumerate(passages, start=1))
        return f"<information>{docs}</information>"
    if information_format == "verl_agent":
        result = "".join(f"Doc {rank}: {p.contents.strip()}\n" for rank, p in enumerate(passages, start=1))
        return f"<information>{json.dumps({'result': result or 'No search results found.'})}</information>"
    raise ValueError(f"unknown information_format {information_format!r}; expected one of {INFORMATION_FORMATS}")
