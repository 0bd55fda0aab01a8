"""Throughput of the Megatron policy actor: tokens/s of the log-prob pass and of the PPO update, per layout.

Builds a random ~50M-parameter Qwen2-shaped model (hidden 512, 8 layers, FFN 1536, vocabulary 24576, untied
head), a batch of random rows, and for every layout (TP1 = all ranks data-parallel, TP2 = tensor-parallel
pairs) starts ``--nproc`` ranks that time ``compute_log_probs`` and ``update`` (one optimizer step over the
whole batch). Tokens are prompt + response tokens of all rows. Prints one line per layout and the ratio of
each layout to the first.

``--lora off,on`` runs every layout without and with LoRA adapters (``--lora-rank``, alpha = 2 x rank, all four
target layers; :mod:`megatron_gigpo.actor.lora`) and prints rank 0's trainable parameters and optimizer-state
bytes (Adam moments, plus fp32 master copies for bf16) next to the throughput, and the LoRA / full ratios.

Mixture of experts (``--layouts dense,moe-ep1,moe-ep2``): ``dense`` is a random Qwen3 of :data:`QWEN3_SHAPE` with FFN
k x f_e, ``moe-epN`` a random Qwen3-MoE of the same shape whose layers hold E experts of FFN f_e, k per token
(:data:`MOE`): equal active parameters per token (plus the router's E x h per layer), E / k times the expert
weights. All ``--nproc`` ranks are data-parallel (TP1); ``moe-epN`` splits the experts over N of them (expert
parallelism, megatron-core's all-to-all token dispatcher for N > 1, all-gather for N = 1). Prints the ratios
MoE / dense at EP1 and EP2 / EP1.

CPU (gloo, float32): ``python benchmarks/actor.py``; MoE:
``python benchmarks/actor.py --layouts dense,moe-ep1,moe-ep2``.
GPU (NCCL, bfloat16, one rank per GPU): ``python benchmarks/actor.py --device cuda --nproc <GPUs> --rows 256``;
layouts that need more GPUs than ``--nproc`` are skipped.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=24576,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

#: the MoE layouts' models: a Qwen3 (``dense``, FFN ``num_experts_per_tok x moe_intermediate_size``) and a Qwen3-MoE
#: (``moe-epN``) of this shape
QWEN3_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                   vocab_size=MODEL_SHAPE["vocab_size"], max_position_embeddings=4096, tie_word_embeddings=False)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per layout (GPUs on CUDA)")
    parser.add_argument("--layouts", default="tp1,tp2",
                        help="comma-separated entries: tpN (the Qwen2-shaped model at TP size N), dense (Qwen3) and "
                             "moe-epN (Qwen3-MoE of equal active parameters at expert-parallel size N)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes after one warm-up")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--lora", default="off", help="comma-separated off/on: runs without / with LoRA adapters")
    parser.add_argument("--lora-rank", type=int, default=16)
    return parser.parse_args(argv)


def _make_model(out: Path, family: str = "qwen2") -> tuple[int, int]:
    """Save a random ``family`` model (qwen2: :data:`MODEL_SHAPE`; qwen3, qwen3_moe: :data:`QWEN3_SHAPE`) to
    ``out``; return its parameters and those one token goes through (a MoE: the top-k experts of every layer)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    torch.manual_seed(0)
    config = {"qwen2": lambda: Qwen2Config(**MODEL_SHAPE),
              "qwen3": lambda: Qwen3Config(**QWEN3_SHAPE,
                                           intermediate_size=MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"]),
              "qwen3_moe": lambda: Qwen3MoeConfig(**QWEN3_SHAPE, **MOE)}[family]()
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out))
    total = sum(p.numel() for p in model.parameters())
    if family != "qwen3_moe":
        return total, total
    h, layers = QWEN3_SHAPE["hidden_size"], QWEN3_SHAPE["num_hidden_layers"]
    idle = (MOE["num_experts"] - MOE["num_experts_per_tok"]) * 3 * h * MOE["moe_intermediate_size"] * layers
    return total, total - idle


def _make_batch(rows: int, prompt_len: int, response_len: int):
    from megatron_gigpo.episodes.batch import TrainingBatch

    g = torch.Generator().manual_seed(0)
    vocab = MODEL_SHAPE["vocab_size"]
    # lengths vary by +-25% so that micro-batching and padding are exercised as in real batches
    prompts = [torch.randint(0, vocab, (int(prompt_len * (0.75 + 0.5 * i / rows)),), generator=g) for i in range(rows)]
    responses = [
        torch.randint(0, vocab, (int(response_len * (1.25 - 0.5 * i / rows)),), generator=g) for i in range(rows)
    ]
    return TrainingBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_log_probs=[torch.zeros(r.numel()) for r in responses],
        uid=[str(i) for i in range(rows)],
        traj_id=[str(i) for i in range(rows)],
        step_index=torch.zeros(rows, dtype=torch.int64),
        anchor=["s"] * rows,
        env_reward=torch.zeros(rows, dtype=torch.float64),
        action_valid=torch.ones(rows, dtype=torch.bool),
    )


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _optimizer_bytes(actor) -> int:
    """Bytes of every tensor in the optimizer state of this rank (Adam moments, steps, fp32 master params)."""
    total = 0
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in opt.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or []:  # distributed optimizer
            total += sum(p.numel() * p.element_size() for p in group)
        for group in getattr(opt, "fp32_from_float16_groups", None) or []:  # Float16OptimizerWithFloat16Params
            total += sum(p.numel() * p.element_size() for p in group)
    return total


def _rank_main(rank: int, world_size: int, port: int, tp: int, ep: int, lora: bool, model_dir: str, args,
               results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        from megatron_gigpo.actor import distributed
        from megatron_gigpo.actor.config import ActorConfig
        from megatron_gigpo.actor.lora import count_parameters
        from megatron_gigpo.actor.policy import PolicyActor
        from megatron_gigpo.models.config import LoraConfig, ModelConfig

        dtype = args.dtype or ModelConfig(path=str(model_dir)).params_dtype(args.device)  # bf16 on CUDA, fp32 on CPU
        config = ActorConfig.build(
            model_dir, params_dtype=dtype, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, lr=1e-6,
            use_kl_loss=False, entropy_coeff=0.0,
            ppo_mini_batch_size=args.rows, micro_batch_tokens=args.micro_batch_tokens,
            log_prob_micro_batch_tokens=args.micro_batch_tokens, logprob_chunk_size=1024, shuffle=False,
            lora=LoraConfig(enabled=lora, rank=args.lora_rank, alpha=2.0 * args.lora_rank),
        )
        actor = PolicyActor(config)
        batch = _make_batch(args.rows, args.prompt_len, args.response_len)
        tokens = sum(int(p.numel() + r.numel()) for p, r in zip(batch.prompt_ids, batch.response_ids))
        advantages = torch.linspace(-1, 1, batch.num_rows)
        old = actor.compute_log_probs(batch)  # warm-up
        actor.update(batch, advantages, old)
        timings = {"log_prob": 0.0, "update": 0.0}
        for _ in range(args.repeats):
            _synchronize()
            start = time.perf_counter()
            old = actor.compute_log_probs(batch)
            _synchronize()
            timings["log_prob"] += time.perf_counter() - start
            start = time.perf_counter()
            actor.update(batch, advantages, old)
            _synchronize()
            timings["update"] += time.perf_counter() - start
        if rank == 0:
            out = {k: tokens * args.repeats / v for k, v in timings.items()}
            out.update(trainable=count_parameters(actor.model_chunks)["trainable"],
                       optimizer_bytes=_optimizer_bytes(actor))
            results.put(out)
        distributed.destroy()
    except BaseException as exc:  # report to the parent instead of hanging it
        results.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})
        raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_layout(tp: int, ep: int, lora: bool, model_dir: str, args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.nproc, port, tp, ep, lora, model_dir, args, results))
             for r in range(args.nproc)]
    for proc in procs:
        proc.start()
    try:
        result = results.get(timeout=3600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def _layouts(text: str) -> list[tuple[str, str, int, int]]:
    """``--layouts`` as (name, model family, TP, EP) entries."""
    out = []
    for entry in text.split(","):
        if entry.startswith("tp") and entry[2:].isdigit():
            out.append((entry, "qwen2", int(entry[2:]), 1))
        elif entry == "dense":
            out.append((entry, "qwen3", 1, 1))
        elif entry.startswith("moe-ep") and entry[6:].isdigit():
            out.append((entry, "qwen3_moe", 1, int(entry[6:])))
        else:
            raise SystemExit(f"--layouts entry {entry!r} is not tpN, dense or moe-epN")
    return out


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        raise SystemExit(f"--nproc {args.nproc} > {torch.cuda.device_count()} visible GPUs")
    layouts = _layouts(args.layouts)
    modes = args.lora.split(",")
    if not modes or any(m not in ("off", "on") for m in modes):
        raise SystemExit(f"--lora {args.lora!r}: use off, on or off,on")
    if "on" in modes and any(family != "qwen2" for _, family, _, _ in layouts):
        raise SystemExit("--lora on runs the tpN layouts only")
    with tempfile.TemporaryDirectory() as tmp:
        dirs: dict[str, str] = {}
        for family in dict.fromkeys(family for _, family, _, _ in layouts):
            dirs[family] = str(Path(tmp) / family)
            params, active = _make_model(Path(dirs[family]), family)
            print(f"model {family}: {params / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token")
        print(f"{args.rows} rows x ~{args.prompt_len}+{args.response_len} tokens; {args.nproc} ranks on {args.device}")
        measured = {}
        for name, family, tp, ep in layouts:
            if args.nproc % (tp * ep):
                print(f"{name}: skipped (needs a multiple of {tp * ep} ranks, have {args.nproc})")
                continue
            for mode in modes:
                m = measured[name, mode] = _run_layout(tp, ep, mode == "on", dirs[family], args)
                print(f"{name} ({family}, TP{tp} x DP{args.nproc // tp}, EP{ep}) lora={mode}: log-prob "
                      f"{m['log_prob']:9.1f} tok/s   update {m['update']:9.1f} tok/s   trainable "
                      f"{m['trainable'] / 1e6:7.3f}M   optimizer {m['optimizer_bytes'] / 2**20:8.2f} MiB (rank 0)")
    _print_ratios(measured)


def _ratio(measured: dict, key: tuple[str, str], base: tuple[str, str], label: str) -> None:
    m, b = measured[key], measured[base]
    print(f"ratio {label}: log-prob {m['log_prob'] / b['log_prob']:.2f}   update {m['update'] / b['update']:.2f}")


def _print_ratios(measured: dict) -> None:
    tps = [k for k in measured if k[0].startswith("tp")]
    for key in tps[1:]:
        if key[1] == tps[0][1]:
            _ratio(measured, key, tps[0], f"{key[0].upper()}/{tps[0][0].upper()} (lora={key[1]})")
    for (name, mode), m in measured.items():
        if mode == "on" and (name, "off") in measured:
            b = measured[name, "off"]
            print(f"ratio LoRA/full {name.upper()}: trainable {m['trainable'] / b['trainable']:.4f}   optimizer "
                  f"bytes {m['optimizer_bytes'] / b['optimizer_bytes']:.4f}   log-prob "
                  f"{m['log_prob'] / b['log_prob']:.2f}   update {m['update'] / b['update']:.2f}")
    moe = sorted((k for k in measured if k[0].startswith("moe-ep")), key=lambda k: int(k[0][6:]))
    for key in moe:
        if ("dense", key[1]) in measured:
            _ratio(measured, key, ("dense", key[1]), f"MoE/dense at {key[0][4:].upper()} (equal active parameters)")
    for key in moe[1:]:
        _ratio(measured, key, moe[0], f"MoE {key[0][4:].upper()}/{moe[0][0][4:].upper()}")

if __name__ == "__main__":
    main()
