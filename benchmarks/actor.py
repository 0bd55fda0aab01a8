"""Throughput of the Megatron policy actor: tokens/s of the log-prob pass and of the PPO update, per layout.

Builds a random ~50M-parameter Qwen2-shaped model (hidden 512, 8 layers, FFN 1536, vocabulary 24576, untied
head), a batch of random rows, and for every layout (TP1 = all ranks data-parallel, TP2 = tensor-parallel
pairs) starts ``--nproc`` ranks that time ``compute_log_probs`` and ``update`` (one optimizer step over the
whole batch). Tokens are prompt + response tokens of all rows. Prints one line per layout and the ratio of
each layout to the first.

``--lora off,on`` runs every layout without and with LoRA adapters (``--lora-rank``, alpha = 2 x rank, all four
target layers; :mod:`megatron_gigpo.actor.lora`) and prints rank 0's trainable parameters and optimizer-state
bytes (Adam moments, plus fp32 master copies for bf16) next to the throughput, and the LoRA / full ratios.

CPU (gloo, float32): ``python benchmarks/actor.py``.
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


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per layout (GPUs on CUDA)")
    parser.add_argument("--layouts", default="tp1,tp2", help="comma-separated tpN entries (TP size N)")
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


def _make_model(out: Path) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MODEL_SHAPE))
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


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


def _rank_main(rank: int, world_size: int, port: int, tp: int, lora: bool, model_dir: str, args,
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
            model_dir, params_dtype=dtype, tensor_model_parallel_size=tp, lr=1e-6, use_kl_loss=False, entropy_coeff=0.0,
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


def _run_layout(tp: int, lora: bool, model_dir: str, args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.nproc, port, tp, lora, model_dir, args, results))
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


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        raise SystemExit(f"--nproc {args.nproc} > {torch.cuda.device_count()} visible GPUs")
    layouts = []
    for entry in args.layouts.split(","):
        if not entry.startswith("tp") or not entry[2:].isdigit():
            raise SystemExit(f"--layouts entry {entry!r} is not tpN")
        layouts.append(int(entry[2:]))
    modes = args.lora.split(",")
    if not modes or any(m not in ("off", "on") for m in modes):
        raise SystemExit(f"--lora {args.lora!r}: use off, on or off,on")
    with tempfile.TemporaryDirectory() as tmp:
        params = _make_model(Path(tmp))
        print(f"model: {params / 1e6:.1f}M parameters; {args.rows} rows x ~{args.prompt_len}+{args.response_len} "
              f"tokens; {args.nproc} ranks on {args.device}")
        measured = {}
        for tp in layouts:
            if args.nproc % tp:
                print(f"TP{tp}: skipped (needs a multiple of {tp} ranks, have {args.nproc})")
                continue
            for mode in modes:
                m = measured[tp, mode] = _run_layout(tp, mode == "on", tmp, args)
                print(f"TP{tp} x DP{args.nproc // tp} lora={mode}: log-prob {m['log_prob']:9.1f} tok/s   "
                      f"update {m['update']:9.1f} tok/s   trainable {m['trainable'] / 1e6:7.3f}M   "
                      f"optimizer {m['optimizer_bytes'] / 2**20:8.2f} MiB (rank 0)")
    _print_ratios(measured)


def _print_ratios(measured: dict) -> None:
    keys = list(measured)
    base = keys[0] if keys else None
    for key in keys[1:]:
        if key[1] == base[1]:
            m, b = measured[key], measured[base]
            print(f"ratio TP{key[0]}/TP{base[0]} (lora={key[1]}): log-prob {m['log_prob'] / b['log_prob']:.2f}   "
                  f"update {m['update'] / b['update']:.2f}")
    for (tp, mode), m in measured.items():
        if mode == "on" and (tp, "off") in measured:
            b = measured[tp, "off"]
            print(f"ratio LoRA/full TP{tp}: trainable {m['trainable'] / b['trainable']:.4f}   optimizer bytes "
                  f"{m['optimizer_bytes'] / b['optimizer_bytes']:.4f}   log-prob {m['log_prob'] / b['log_prob']:.2f}"
                  f"   update {m['update'] / b['update']:.2f}")


if __name__ == "__main__":
    main()
