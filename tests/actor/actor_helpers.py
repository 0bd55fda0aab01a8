"""Shared pieces of the actor tests: a fixed training batch, Hugging Face reference log-probs, rank set-up and
actor construction inside spawned ranks (``tests/multiproc.spawn``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_gigpo.episodes.batch import TrainingBatch

VOCAB = 511  # not a multiple of TP=2: the padded logit column must be masked


def make_batch(num_rows: int = 8, seed: int = 0, vocab: int = VOCAB) -> TrainingBatch:
    """Rows with prompts of 4-23 and responses of 1-11 tokens (one row of each extreme)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = [int(x) for x in torch.randint(4, 24, (num_rows,), generator=g)]
    response_lens = [int(x) for x in torch.randint(1, 12, (num_rows,), generator=g)]
    response_lens[0] = 1
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in prompt_lens]
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in response_lens]
    return TrainingBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_log_probs=[torch.zeros(n) for n in response_lens],
        uid=[f"g{i // 4}" for i in range(num_rows)],
        traj_id=[f"t{i}" for i in range(num_rows)],
        step_index=torch.zeros(num_rows, dtype=torch.int64),
        anchor=["s"] * num_rows,
        env_reward=torch.zeros(num_rows, dtype=torch.float64),
        action_valid=torch.ones(num_rows, dtype=torch.bool),
    )


def row_advantages(batch: TrainingBatch) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, batch.num_rows)


def response_log_probs_and_entropy(model, batch: TrainingBatch, dtype: torch.dtype) -> tuple[list, list]:
    """Per row, the (R,) log-probs of the response tokens and the (R,) entropies of the ``transformers`` model's
    next-token distributions that predict them, with the softmax in ``dtype``; differentiable when grad is on."""
    log_probs, entropies = [], []
    for prompt, response in zip(batch.prompt_ids, batch.response_ids):
        ids = torch.cat([prompt, response]).unsqueeze(0)
        logits = model(ids).logits[0, prompt.numel() - 1 : ids.shape[1] - 1].to(dtype)  # (R, V)
        logp = torch.log_softmax(logits, dim=-1)
        log_probs.append(logp.gather(-1, response.unsqueeze(-1)).squeeze(-1))
        entropies.append(-(logp.exp() * logp).sum(-1))
    return log_probs, entropies


def hf_log_probs_and_entropy(model_dir: Path, batch: TrainingBatch) -> tuple[list, list]:
    """Reference per-token log-probs and entropies from ``transformers`` (float64 softmax, float32 results)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs, entropies = response_log_probs_and_entropy(model, batch, torch.float64)
    return [t.float() for t in log_probs], [t.float() for t in entropies]


def start_rank() -> None:
    """Join the gloo process group of this spawned rank (owned here, so that switching Megatron layouts with
    ``distributed.destroy()`` keeps it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    np.random.seed(0)


def actor_config(model_dir: Path, *, tp: int = 1, pp: int = 1, params_dtype: str = "float32", **overrides):
    """A small actor: recipe defaults with tiny budgets; ``overrides`` name recipe fields of any section
    (``ppo_mini_batch_size``, ``sequence_packing``, ``lr_decay_style``, ...) or ``lr_decay_steps``."""
    from megatron_gigpo.actor.config import ActorConfig

    settings = dict(lr=1e-3, weight_decay=0.01, clip_grad=1.0, use_kl_loss=True, kl_loss_type="low_var_kl",
                    kl_loss_coef=0.1, entropy_coeff=0.01, ppo_mini_batch_size=8, ppo_epochs=1, micro_batch_tokens=64,
                    log_prob_micro_batch_tokens=64, logprob_chunk_size=4, shuffle=True, seed=3)
    lr_decay_steps = overrides.pop("lr_decay_steps", 1)
    return ActorConfig.build(model_dir, params_dtype=params_dtype, lr_decay_steps=lr_decay_steps,
                             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **(settings | overrides))


def export_full_weights(actor) -> dict[str, torch.Tensor]:
    """All HF-named weights on global rank 0 (empty elsewhere); collective."""
    return {name: t.clone() for bucket in actor.export_weights(1 << 20) for name, t in bucket}


def adam_steps(actor) -> tuple[list[float], bool]:
    """Each parameter's Adam ``step`` and whether every parameter has its own step tensor."""
    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    steps = [st["step"] for opt in inner for st in opt.optimizer.state.values()]
    return [float(s) for s in steps], len({id(s) for s in steps}) == len(steps)
