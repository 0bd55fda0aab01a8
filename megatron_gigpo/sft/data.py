"""Demonstrations for supervised fine-tuning: JSONL chat rows -> (prompt, response) token ids.

One row per line::

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}], ...}

Other keys are ignored; blank lines are skipped. The LAST message is the target and must have role
``assistant``; at least one message precedes it. The prompt is every earlier message rendered by the
tokenizer's chat template with the generation prompt appended, through the same function the rollout
collector uses (:func:`megatron_gigpo.episodes.prompts.encode_chat_prompt`), so a demonstration has exactly
the token layout of an RL step prompt. The response is the target's text tokens followed by the tokenizer's
``eos_token_id``: the token the rollout engine stops on, and the last token of a vLLM response that ended
by EOS, so the policy learns to end its reply as RL will sample it.

A row is invalid when it is not JSON, has no usable ``messages`` list, its last message is not the
assistant's, the chat template rejects it, or prompt + response exceed ``max_length`` tokens. An invalid row
stops loading with :class:`SFTDataError` naming ``file:line`` and the reason, unless ``skip_invalid_rows``:
then it is left out and counted in the returned :class:`LoadReport` (the caller reports it).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from megatron_gigpo.episodes.prompts import encode_chat_prompt
from megatron_gigpo.sft import SFTDataError

__all__ = ["SFTDataError", "SFTRows", "LoadReport", "encode_example", "load_sft_rows", "split_held_out"]

log = logging.getLogger(__name__)


class _RowError(ValueError):
    """One invalid row; ``kind`` is a short category counted when rows are skipped."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class SFTRows:
    """Tokenized demonstrations, read by :meth:`PolicyActor.update` / ``compute_log_probs`` like a
    :class:`~megatron_gigpo.episodes.batch.TrainingBatch` (only ``prompt_ids`` and ``response_ids``).

    Attributes:
        prompt_ids: per row, int64 (P_i,), P_i >= 1: the rendered chat prompt.
        response_ids: per row, int64 (R_i,), R_i >= 1: the target's tokens and the end token.
        sources: per row, ``"file:line"`` it came from.
    """

    prompt_ids: list[torch.Tensor]
    response_ids: list[torch.Tensor]
    sources: list[str] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.prompt_ids)

    def num_tokens(self) -> int:
        """Prompt + response tokens of all rows."""
        return int(sum(p.numel() + r.numel() for p, r in zip(self.prompt_ids, self.response_ids)))

    def num_response_tokens(self) -> int:
        return int(sum(r.numel() for r in self.response_ids))

    def select(self, index: Sequence[int]) -> "SFTRows":
        """The rows ``index`` (in that order)."""
        idx = [int(i) for i in index]
        return SFTRows([self.prompt_ids[i] for i in idx], [self.response_ids[i] for i in idx],
                       [self.sources[i] for i in idx] if self.sources else [])


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_sft_rows` read.

    Attributes:
        path: the file.
        rows: valid rows kept.
        skipped: invalid rows left out (0 unless ``skip_invalid_rows``).
        skipped_by_kind: per reason category (``json``, ``format``, ``template``, ``too_long``), the count.
        examples: up to five ``file:line: reason`` messages of skipped rows.
    """

    path: str
    rows: int
    skipped: int
    skipped_by_kind: dict[str, int]
    examples: list[str]


def _end_token(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise SFTDataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos_token_id: the "
                           "response's end token (the token the rollout engine stops on) is unknown")
    return int(eos)


def _messages(row: Any) -> list[dict[str, str]]:
    """The validated message list of one parsed row."""
    if not isinstance(row, dict):
        raise _RowError("format", f"a row must be a JSON object, got {type(row).__name__}")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _RowError("format", "no non-empty 'messages' list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise _RowError("format", f"messages[{i}] needs a string 'role' and a string 'content'")
    if messages[-1]["role"] != "assistant":
        raise _RowError("format", f"the last message has role {messages[-1]['role']!r}; it must be the "
                                  "'assistant' target")
    if len(messages) < 2:
        raise _RowError("format", "no message before the assistant target (the prompt would be empty)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_example(
    tokenizer: Any, messages: Sequence[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
) -> tuple[list[int], list[int]]:
    """``(prompt_ids, response_ids)`` of one demonstration (layout in the module docstring).

    Args:
        tokenizer: Hugging Face tokenizer with a chat template and an ``eos_token_id``.
        messages: the chat; the last message is the assistant target.
        chat_template_kwargs: as the rollout collector's (``apply_chat_template`` extras).

    Raises:
        SFTDataError: the tokenizer has no ``eos_token_id``.
    """
    prompt = encode_chat_prompt(tokenizer, messages[:-1], chat_template_kwargs)
    response = list(tokenizer.encode(messages[-1]["content"], add_special_tokens=False)) + [_end_token(tokenizer)]
    return prompt, response


def _encode_line(line: str, tokenizer: Any, max_length: int, kwargs: dict[str, Any] | None) -> tuple[list, list]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _RowError("json", f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    messages = _messages(row)
    try:
        prompt, response = encode_example(tokenizer, messages, kwargs)
    except SFTDataError:
        raise
    except Exception as exc:  # noqa: BLE001 - the chat template (Jinja) raises its own types on bad chats
        raise _RowError("template", f"the chat template rejected the messages: {exc}") from None
    if len(prompt) + len(response) > max_length:
        raise _RowError("too_long", f"prompt ({len(prompt)}) + response ({len(response)}) = "
                                    f"{len(prompt) + len(response)} tokens > sft.max_length={max_length}")
    return prompt, response


def load_sft_rows(
    path: str | Path,
    tokenizer: Any,
    *,
    max_length: int,
    skip_invalid_rows: bool,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[SFTRows, LoadReport]:
    """Read and tokenize a demonstration file.

    Args:
        path: JSONL file (format in the module docstring).
        tokenizer: the policy's Hugging Face tokenizer.
        max_length: most tokens of prompt + response (end token included).
        skip_invalid_rows: leave invalid rows out and count them instead of raising.
        chat_template_kwargs: as the rollout collector's.

    Returns:
        ``(rows, report)``; ``report.skipped`` is also logged as a warning when > 0.

    Raises:
        SFTDataError: the file is missing or holds no valid row, or (without ``skip_invalid_rows``) the
            first invalid row, as ``"<file>:<line>: <reason>"``.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise SFTDataError(f"demonstration file {path} not found")
    prompts, responses, sources = [], [], []
    skipped: Counter[str] = Counter()
    examples: list[str] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                prompt, response = _encode_line(line, tokenizer, max_length, chat_template_kwargs)
            except _RowError as exc:
                where = f"{path}:{number}: {exc}"
                if not skip_invalid_rows:
                    raise SFTDataError(where + " (sft.skip_invalid_rows: true counts and skips such rows)") from None
                skipped[exc.kind] += 1
                if len(examples) < 5:
                    examples.append(where)
                continue
            prompts.append(torch.tensor(prompt, dtype=torch.int64))
            responses.append(torch.tensor(response, dtype=torch.int64))
            sources.append(f"{path}:{number}")
    report = LoadReport(str(path), len(prompts), sum(skipped.values()), dict(skipped), examples)
    if report.skipped:
        log.warning("%s: skipped %d invalid row(s) (%s), e.g. %s", path, report.skipped,
                    ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items())), examples[0])
    if not prompts:
        raise SFTDataError(f"{path}: no valid demonstration rows ({report.skipped} invalid)")
    return SFTRows(prompts, responses, sources), report


def split_held_out(rows: SFTRows, fraction: float, seed: int) -> tuple[SFTRows, SFTRows]:
    """Deterministic ``(train, held_out)`` split: ``round(fraction * n)`` rows (at least one when
    ``fraction > 0``, at most ``n - 1``) drawn by a permutation seeded by ``seed``; both keep file order.

    Raises:
        ValueError: ``fraction`` outside [0, 1).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction={fraction} must be in [0, 1)")
    n = rows.num_rows
    count = 0 if fraction == 0 else min(max(1, round(fraction * n)), n - 1)
    held = set(np.random.default_rng([seed, 7919]).permutation(n)[:count].tolist())
    return rows.select([i for i in range(n) if i not in held]), rows.select(sorted(held))
