"""What one ``generate`` call takes and returns: sampling settings, one response, the tokenizer's facts.

Plain dataclasses (no torch or vLLM import at module level); :mod:`megatron_gigpo.rollout.engine` re-exports them.
Upstream API: vLLM ``SamplingParams`` (vllm 0.32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SamplingConfig", "GenerationResult", "TokenizerInfo"]

@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one ``generate`` call (mirrors vLLM ``SamplingParams``).

    Attributes:
        temperature: >= 0; 0 is greedy (deterministic, for evaluation).
        top_p: nucleus mass in (0, 1].
        top_k: -1 (or 0) for all tokens, else >= 1.
        max_tokens: new tokens per prompt, >= 1.
        stop: stop strings; the returned text excludes them, ``response_ids`` end with the token that
            completed one.
        seed: None for fresh randomness; else prompt i of a batch samples with seed ``seed + i``.
        logprobs: return the log-prob of each sampled token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: Sequence[str] = ()
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k={self.top_k} must be -1, 0 or >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens={self.max_tokens} must be >= 1")
        if isinstance(self.stop, str):
            raise ValueError(f"SamplingConfig.stop={self.stop!r} must be a list of strings, not a string")

    @classmethod
    def greedy(cls, max_tokens: int, stop: Sequence[str] = ()) -> "SamplingConfig":
        """Deterministic decoding for evaluation (temperature 0)."""
        return cls(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens, stop=tuple(stop), seed=0)

    def to_vllm(self, index: int):
        """``vllm.SamplingParams`` for the prompt at global batch position ``index``."""
        from vllm import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_tokens=self.max_tokens,
            stop=list(self.stop) or None,
            seed=None if self.seed is None else self.seed + index,
            logprobs=0 if self.logprobs else None,
        )


@dataclass
class GenerationResult:
    """One response.

    Attributes:
        response_ids: generated token ids (R,).
        log_probs: log-prob of each generated token under the engine's weights, float (R,) (empty when
            ``SamplingConfig.logprobs`` is False); raw model log-probs unless the engine's
            ``logprobs_mode`` is ``processed_logprobs`` (after temperature / top-k / top-p).
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"``.
        text: detokenized response without the stop string.
        weight_version: the policy version whose weights sampled the response: vLLM's weight version of the
            output tokens (``CompletionOutput.weight_versions``, set by ``finish_weight_update(weight_version)``;
            ``"default"``, the start checkpoint, is 0). Were a response sampled across a weight update, the oldest
            version that sampled any of its tokens.
        routed_experts: with the engine's ``return_routed_experts`` (routing replay), the experts each MoE layer
            routed every token the engine ran through the model to: uint8 (or uint16 past 256 experts) numpy
            (P + R - 1, layers, top-k), the prompt's tokens then the response's but the last (vLLM
            ``CompletionOutput.routed_experts``); None otherwise.
        engine: index of the engine that sampled it in its :class:`~megatron_gigpo.rollout.engine_group.RolloutEngineGroup`
            (0 for a lone engine).
    """

    response_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    text: str
    weight_version: int = 0
    routed_experts: np.ndarray | None = None
    engine: int = 0


@dataclass(frozen=True)
class TokenizerInfo:
    """What callers need to build prompts for this engine."""

    name_or_path: str
    vocab_size: int
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None
