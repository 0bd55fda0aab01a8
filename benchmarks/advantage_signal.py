"""How much task signal one iteration's policy gradient carries, per parameter group, for GiGPO and GRPO.

    python benchmarks/advantage_signal.py --model runs/sokoban-cpu/sft/hf [--recipe recipes/cpu/sokoban.yaml]
                                          [--batches 8] [overrides ...]

1. ``--batches`` training batches are collected from ``--model`` with the recipe's own collector (vLLM engine,
   Sokoban environments, ``env.num_groups`` x ``rollout.n`` episodes each), all from the same policy.
2. Each batch gets three per-row advantages: GiGPO and GRPO as the recipe computes them
   (:func:`megatron_gigpo.algo.advantages.compute_advantages`), and an *oracle*: 1 for a move that the
   shortest-path solver (:mod:`megatron_gigpo.envs.sokoban_solver`) finds optimal in that state, 0 otherwise,
   minus the batch mean (Sokoban only).
3. Per batch and advantage, the policy gradient of the token-mean objective sum_i A_i log pi(y_i | x_i) / tokens
   (the direction of one plain update; Hugging Face ``transformers`` in float32 on CPU: the same weights the
   actor holds).

Printed, per parameter group (input/output embedding, each decoder layer, final norm, all):
- ``agree``: mean cosine between the gradients of two different batches. Two independent estimates of one
  expected gradient agree by about signal / (signal + noise); 0 means a batch's gradient is noise there.
- ``to_oracle``: mean cosine between a batch's gradient and the oracle gradient of the *other* batches: how
  much one update moves the policy toward the solver's moves on states it was not computed on.
Ends with ``gigpo_oracle_alignment=<cos> grpo_oracle_alignment=<cos>`` (all parameters).

A diagnostic, not a test: 10-20 minutes on a 2-core machine with the defaults (collection ~2 minutes, the
24 gradients the rest).
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def collect(recipe: str, model: str, batches: int, overrides: list[str]) -> list[dict]:
    """``batches`` training batches from ``model``: prompt and response ids, GiGPO / GRPO / oracle advantages."""
    from megatron_gigpo.algo.advantages import compute_advantages
    from megatron_gigpo.builders import RunContext
    from megatron_gigpo.config import load_config
    from megatron_gigpo.envs.sokoban_solver import optimal_moves

    cfg = load_config(recipe, [f"model.path={model}", "model.init=pretrained", "sft.enabled=false",
                               "trainer.experiment_name=advantage-signal", "trainer.val_before_train=false",
                               "logging.progress_bars=false", "checkpoint.save_every=0", *overrides])
    if cfg.env.name != "sokoban":
        raise ValueError(f"advantage_signal: env.name={cfg.env.name!r}; the solver oracle exists for sokoban only")
    out = []
    with RunContext(cfg) as run:
        for it in range(batches):
            batch, metrics = run.collect_train_batch(it)
            best = {grid: optimal_moves(grid) for grid in set(batch.anchor)}  # states recur across rows
            optimal = np.array([a in best[g] for a, g in zip(batch.extras["actions"], batch.anchor)], float)
            adv = {est: compute_advantages(est, batch.advantage_inputs(), cfg.algorithm).advantage.double()
                   for est in ("gigpo", "grpo")}
            adv["oracle"] = torch.from_numpy(optimal - optimal.mean())
            out.append({"prompt_ids": batch.prompt_ids, "response_ids": batch.response_ids, "adv": adv})
            corr = {e: float(np.corrcoef(adv[e].numpy(), optimal)[0, 1]) for e in ("gigpo", "grpo")}
            success = metrics.get("episode/sokoban/success_rate", float("nan"))
            print(f"batch {it}: {batch.num_rows} rows, success {success:.3f}, optimal moves "
                  f"{optimal.mean():.3f}, corr(A, optimal) gigpo {corr['gigpo']:+.3f} grpo {corr['grpo']:+.3f}",
                  flush=True)
    return out


def policy_gradient(model: torch.nn.Module, rows: dict, weights: torch.Tensor, chunk: int = 96) -> torch.Tensor:
    """Flat gradient (float32, one entry per parameter) of sum_i w_i sum_t log pi(y_it | x_i, y_i<t) / tokens."""
    model.zero_grad()
    total = sum(len(r) for r in rows["response_ids"])
    idx = [i for i in range(len(weights)) if weights[i] != 0]
    for s in range(0, len(idx), chunk):
        part = idx[s:s + chunk]
        seqs = [torch.cat([rows["prompt_ids"][i], rows["response_ids"][i]]) for i in part]
        width = max(len(x) for x in seqs)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        w = torch.zeros(len(part), width)
        for j, i in enumerate(part):
            n, p = len(seqs[j]), len(rows["prompt_ids"][i])
            ids[j, :n], mask[j, :n], w[j, p:n] = seqs[j], 1, float(weights[i])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(logp * w[:, 1:]).sum() / total).backward()
    return -torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def parameter_groups(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Boolean masks over the flat gradient: embedding, each decoder layer, final norm, all."""
    labels, sizes = [], []
    for name, p in model.named_parameters():
        layer = re.search(r"layers\.(\d+)\.", name)
        labels.append(f"layer {layer.group(1)}" if layer else "embedding" if "embed" in name else
                      "final norm" if "norm" in name else "output layer")
        sizes.append(p.numel())
    groups = {g: torch.cat([torch.full((n,), g == label) for label, n in zip(labels, sizes)])
              for g in dict.fromkeys(labels)}
    return groups | {"all": torch.ones(sum(sizes), dtype=torch.bool)}


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm() + 1e-30))


def report(grads: dict[str, torch.Tensor], groups: dict[str, torch.Tensor]) -> dict[str, float]:
    """Print the table; return the all-parameter oracle alignment per estimator."""
    k = grads["oracle"].shape[0]
    print(f"{'parameters':14s} {'size':>8s}  " + "  ".join(f"{e + ' agree':>12s}" for e in grads)
          + "  " + "  ".join(f"{e + ' to_oracle':>16s}" for e in ("gigpo", "grpo")))
    result = {}
    for group, mask in groups.items():
        g = {e: v[:, mask] for e, v in grads.items()}
        agree = {e: np.mean([_cos(v[i], v[j]) for i, j in itertools.combinations(range(k), 2)]) for e, v in g.items()}
        to_oracle = {e: np.mean([_cos(g[e][i], g["oracle"].sum(0) - g["oracle"][i]) for i in range(k)])
                     for e in ("gigpo", "grpo")}
        print(f"{group:14s} {int(mask.sum()):8d}  " + "  ".join(f"{agree[e]:+12.3f}" for e in g)
              + "  " + "  ".join(f"{to_oracle[e]:+16.3f}" for e in to_oracle))
        if group == "all":
            result = to_oracle
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face directory of the policy (e.g. an SFT export)")
    parser.add_argument("--recipe", default=str(ROOT / "recipes/cpu/sokoban.yaml"))
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    args = parser.parse_args()
    if args.batches < 2:
        parser.error(f"--batches={args.batches}: at least 2 are needed to compare batches")
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    batches = collect(args.recipe, args.model, args.batches, args.overrides)
    torch.set_num_threads(threads)  # the engine's start may lower this process's torch thread count
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    grads = {e: torch.stack([policy_gradient(model, b, b["adv"][e]) for b in batches])
             for e in ("gigpo", "grpo", "oracle")}
    result = report(grads, parameter_groups(model))
    print(f"gigpo_oracle_alignment={result['gigpo']:.3f} grpo_oracle_alignment={result['grpo']:.3f}")


if __name__ == "__main__":
    main()
