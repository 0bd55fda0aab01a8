"""The JSONL reader of search QA, shared by the question files (:mod:`.datasets`) and the passage corpora
(:mod:`.passages`): one JSON object per non-blank line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_jsonl_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Stream ``(line number, object)`` for each non-blank line of a ``.jsonl`` file, in file order.

    Line numbers count from 1 and include blank lines, so ``f"{path}:{line_number}"`` points at the line.
    The file is opened when the first item is requested (UTF-8).

    Raises:
        FileNotFoundError / OSError: ``path`` cannot be opened.
        ValueError: ``"<path>:<line>: invalid JSON (<reason>)"`` for a line that does not parse, or
            ``"<path>:<line>: expected a JSON object, got <type>"`` for one that is not an object.
    """
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: invalid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
            yield line_number, row
