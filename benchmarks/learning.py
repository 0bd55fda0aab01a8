"""Learning benchmark: GiGPO against GRPO at an equal budget, from one cold start, on held-out tasks.

    python benchmarks/learning.py [--recipe recipes/cpu/sokoban.yaml] [--seeds 3] [--iterations N]
                                  [--methods gigpo,grpo,...] [--out runs/learning-benchmark] [overrides ...]

1. One cold start (``megatron-gigpo sft`` on the recipe's expert demonstrations) gives the starting policy.
2. From it, each method trains ``--iterations`` RL iterations (default: the recipe's
   ``trainer.total_iterations``; the main job's 20 take ~3 hours for five methods at 3 seeds, so the run in
   docs/benchmarks.md uses ``--iterations 5``) on each of ``--seeds`` seeds (``trainer.seed`` and
   ``env.seed``), with the same groups, group size and step limit, so every run takes the same number of
   environment episodes (``gigpo_dynamic`` at least as many):

   ==========================  ===========================================================================
   ``gigpo``                   GiGPO, ``mode: mean_std_norm`` (the paper's default)
   ``gigpo_mean_norm``         GiGPO without the std division (``mode: mean_norm``)
   ``gigpo_no_step``           GiGPO with omega = 0: the paper's "w/o A^S" ablation (episode advantage only)
   ``grpo``                    GRPO (group-relative episode advantage, verl's estimator)
   ``gigpo_rollout_logp``      GiGPO with the engines' sampling log-probs as the PPO ratio's denominator
                               (``trainer.old_log_probs: rollout``, ``rollout_correction.mode: mis``): no
                               old-log-prob pass; compared with ``gigpo`` (issue #41 item 2)
   ``gigpo_dynamic``           GiGPO with dynamic sampling (``algorithm.dynamic_sampling``: groups of equal
                               returns dropped, up to 4 generation rounds per iteration); it trains on as
                               many groups as the others but may play more episodes
                               (``dynamic_sampling/rounds`` in its metrics)
   ==========================  ===========================================================================

3. Success on the recipe's held-out validation rooms (never in the demonstrations nor the RL tasks), sampled
   at the recipe's ``rollout.val_temperature`` (the main job: 1.0, the policy RL trains; 0: greedy), is
   measured before RL and every ``trainer.val_every`` iterations.

Prints a table of held-out success per validation point and one of training success per iteration (mean +-
std over seeds), the step-group size histogram of the first and last iteration of the GiGPO runs (the paper's
Figure 7 view), writes ``<out>/learning.png`` (both curves) and ``<out>/step_groups.png`` and a
``<out>/summary.json``, and ends with ``gigpo_minus_grpo=<points>``: the final held-out success of GiGPO minus
that of GRPO, in percentage points (mean over seeds). Runs that wrote per-episode validation records
(``<run>/validation/step_<N>.jsonl``) also get 95% intervals at the last iteration: a bootstrap over seeds and
held-out tasks, paired on tasks and seeds (:func:`paired_bootstrap`), for each method and its difference to GRPO
(``gigpo_rollout_logp``: to ``gigpo``). It is a benchmark, not a test. Measured on a 2-core
machine (2026-12-05, a slow day: ~90 s per iteration of the main job's recipe, ~55 s per 512-room validation):
the four methods at 3 seeds and 5 iterations took ~110 minutes for their 12 runs (6-11 minutes each) after a
13-minute cold start; on a normal day of that machine (~45 s per iteration) about 70 minutes in all. An existing ``--out`` folder's cold start
and finished runs are reused, and an unfinished run resumes from its last checkpoint (one kept, every ``--save-every``
iterations, default 5), so change ``--out`` when the recipe or the iteration count changes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# GiGPO as the paper runs it; the variants below change one thing each.
_GIGPO = ["algorithm.adv_estimator=gigpo", "algorithm.mode=mean_std_norm", "algorithm.step_advantage_w=1.0"]
METHODS: dict[str, list[str]] = {
    "gigpo": _GIGPO,
    "gigpo_mean_norm": [*_GIGPO, "algorithm.mode=mean_norm"],  # a later override wins
    "gigpo_no_step": [*_GIGPO, "algorithm.step_advantage_w=0.0"],
    "grpo": ["algorithm.adv_estimator=grpo", "algorithm.mode=mean_std_norm"],
    # Issue #41 item 2: the PPO ratio's denominator from the engines' sampling log-probs, no recompute pass.
    "gigpo_rollout_logp": [*_GIGPO, "trainer.old_log_probs=rollout", "algorithm.rollout_correction.mode=mis"],
    "gigpo_dynamic": [*_GIGPO, "algorithm.dynamic_sampling.enabled=true",
                      "algorithm.dynamic_sampling.criterion=episode_return", "algorithm.dynamic_sampling.max_rounds=4"],
}


def _cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "megatron_gigpo.cli", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def _records(run_dir: Path) -> list[dict]:
    from megatron_gigpo.run.metrics import read_metrics

    return read_metrics(run_dir)


def _curve(records: list[dict], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in records if key in r}


def _hist(record: dict) -> dict[str, float]:
    return {k.removeprefix("step_group/hist_"): v for k, v in record.items() if k.startswith("step_group/hist_")}


def run(args: argparse.Namespace) -> dict:
    from megatron_gigpo.config import load_config

    out = Path(args.out).resolve()
    # Every method recomputes the old log-probs (the recipe's default until 2026-12-07, when the main job began to
    # take the engine's), as the recorded runs did; gigpo_rollout_logp overrides it.
    base = [f"trainer.output_dir={out}", "logging.progress_bars=false", "trainer.old_log_probs=recompute",
            *args.overrides]
    cfg = load_config(args.recipe, base + ["trainer.experiment_name=cold-start"])
    env = cfg.env.name
    iterations = cfg.trainer.total_iterations if args.iterations is None else args.iterations
    _cli("sft", args.recipe, *base, "trainer.experiment_name=cold-start")
    model = out / "cold-start" / "sft" / "hf"
    val_key, train_key = f"val/episode/{env}/success_rate", f"episode/{env}/success_rate"
    curves: dict[str, list[dict[int, float]]] = {m: [] for m in args.methods}
    train_curves: dict[str, list[dict[int, float]]] = {m: [] for m in args.methods}
    hists: dict[str, list[tuple[dict, dict]]] = {m: [] for m in args.methods}
    for seed in range(1, args.seeds + 1):
        for method in args.methods:
            overrides = METHODS[method]
            name = f"{method}-seed{seed}"
            if not (out / name / "metrics.jsonl").is_file() or len(_records(out / name)) <= iterations:
                # The checkpoint keys come before the user's overrides (a checkpoint.keep_last=N there wins).
                _cli("train", args.recipe, f"checkpoint.save_every={args.save_every}", "checkpoint.keep_last=1",
                     *base, f"trainer.experiment_name={name}", f"model.path={model}",
                     "model.init=pretrained", "sft.enabled=false", f"trainer.total_iterations={iterations}",
                     f"trainer.seed={seed}", f"env.seed={seed}", "trainer.val_before_train=true", *overrides)
            records = _records(out / name)
            curves[method].append(_curve(records, val_key))
            train_records = [r for r in records if r["step"] > 0]
            train_curves[method].append(_curve(train_records, train_key))
            hists[method].append((_hist(train_records[0]), _hist(train_records[-1])))
    return {"env": env, "curves": curves, "train_curves": train_curves, "hists": hists, "out": str(out),
            "measure": _measure(cfg.rollout.val_temperature)}


def _measure(temperature: float) -> str:
    return "held-out greedy success" if temperature == 0 else f"held-out success at temperature {temperature:g}"


def _table(curves: dict[str, list[dict[int, float]]], title: str) -> dict[str, dict[int, tuple[float, float]]]:
    """Mean and std over seeds of each method's curve at the steps every run has; printed under ``title``."""
    steps = sorted(set.intersection(*(set(c) for cs in curves.values() for c in cs)))
    print(f"\n{title}, mean +- std over seeds, by iteration")
    print(f"{'method':<18}" + "".join(f"{s:>14}" for s in steps))
    table: dict[str, dict[int, tuple[float, float]]] = {}
    for method, cs in curves.items():
        table[method] = {s: (float(np.mean([c[s] for c in cs])), float(np.std([c[s] for c in cs]))) for s in steps}
        print(f"{method:<18}" + "".join(f"{m:>8.3f}+-{sd:<4.2f}" for m, sd in table[method].values()))
    return table


def summarize(result: dict) -> float:
    out = Path(result["out"])
    table = _table(result["curves"], f"{result['measure']} ({result['env']})")
    steps = sorted(next(iter(table.values())))
    # Training rooms, sampled at rollout.temperature: every iteration, but on the tasks RL trains on.
    train_table = _table(result["train_curves"], f"training success ({result['env']}, the iteration's own episodes)")
    print("\nstep-group sizes (GiGPO runs, summed over seeds): bucket: first iteration -> last iteration")
    first = [h[0] for h in result["hists"]["gigpo"]]
    last = [h[1] for h in result["hists"]["gigpo"]]
    for bucket in first[0]:
        print(f"  size {bucket:>6}: {sum(h.get(bucket, 0) for h in first):6.0f} -> {sum(h.get(bucket, 0) for h in last):6.0f}")
    _plots(table, train_table, result, out)
    final = steps[-1]
    delta = 100.0 * (table["gigpo"][final][0] - table["grpo"][final][0])
    intervals = _intervals(result, final)
    (out / "summary.json").write_text(json.dumps({"steps": steps, "table": _jsonable(table),
                                                  "train_table": _jsonable(train_table), "gigpo_minus_grpo": delta,
                                                  "paired_bootstrap": intervals}, indent=1))
    return delta


def _jsonable(table: dict) -> dict:
    return {method: {str(step): value for step, value in points.items()} for method, points in table.items()}


def _plots(table: dict, train_table: dict, result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, tab, ylabel in ((axes[0], table, result["measure"]), (axes[1], train_table, "training success")):
        for method, points in tab.items():
            xs = list(points)
            mean = np.array([points[s][0] for s in xs])
            std = np.array([points[s][1] for s in xs])
            ax.plot(xs, mean, marker="o", label=method)
            ax.fill_between(xs, mean - std, mean + std, alpha=0.15)
        ax.set(xlabel="RL iteration", ylabel=ylabel, title=f"{result['env']}: GiGPO vs GRPO, {ylabel}")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "learning.png", dpi=120)
    plt.close(fig)
    first = [h[0] for h in result["hists"]["gigpo"]]
    last = [h[1] for h in result["hists"]["gigpo"]]
    buckets = list(first[0])
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(buckets))
    ax.bar(x - 0.2, [sum(h.get(b, 0) for h in first) for b in buckets], 0.4, label="first iteration")
    ax.bar(x + 0.2, [sum(h.get(b, 0) for h in last) for b in buckets], 0.4, label="last iteration")
    ax.set_xticks(x, buckets)
    ax.set(xlabel="step-group size", ylabel="step groups", title="GiGPO anchor-state groups (Figure 7 view)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_groups.png", dpi=120)
    plt.close(fig)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, draws: int = 10_000, seed: int = 0) -> dict[str, list[float]]:
    """95% percentile-bootstrap intervals for the mean held-out success of two methods and their difference.

    Args:
        a, b: ``(seeds, tasks)`` arrays of 0/1 outcomes on the same held-out tasks (columns aligned by task id),
            row ``s`` of both from seed ``s`` (the same cold start, task order and environment seed).
        draws: bootstrap resamples.

    Each draw resamples seeds and tasks with replacement, the same indices for both methods (paired: a task
    hard for one method is hard for the other, which narrows the difference's interval). Returns
    ``{"a": [mean, low, high], "b": [...], "a_minus_b": [...]}`` as fractions.

    Raises:
        ValueError: the arrays differ in shape or are empty.
    """
    if a.shape != b.shape or a.ndim != 2 or a.size == 0:
        raise ValueError(f"paired_bootstrap: need two equal (seeds, tasks) arrays, got {a.shape} and {b.shape}")
    rng = np.random.default_rng(seed)
    n_seeds, n_tasks = a.shape
    stats = np.empty((draws, 3))
    for i in range(draws):
        rows, cols = rng.integers(n_seeds, size=n_seeds), rng.integers(n_tasks, size=n_tasks)
        ma, mb = a[rows][:, cols].mean(), b[rows][:, cols].mean()
        stats[i] = ma, mb, ma - mb
    point = (a.mean(), b.mean(), a.mean() - b.mean())
    low, high = np.percentile(stats, [2.5, 97.5], axis=0)
    return {key: [float(point[k]), float(low[k]), float(high[k])] for k, key in enumerate(("a", "b", "a_minus_b"))}


def _outcomes(out: Path, method: str, seeds: int, step: int) -> np.ndarray | None:
    """``(seeds, tasks)`` outcomes of ``method``'s validation at ``step`` (tasks sorted by id), or None when a run
    has no per-episode records (runs before 2026-12-06)."""
    from megatron_gigpo.run.metrics import read_validation_episodes

    rows = []
    for seed in range(1, seeds + 1):
        try:
            records = read_validation_episodes(out / f"{method}-seed{seed}", step)
        except FileNotFoundError:
            return None
        rows.append([float(r["won"]) for r in sorted(records, key=lambda r: r["task_id"])])
    return np.array(rows)


# The method each one's difference is measured against (default: GRPO).
REFERENCE = {"gigpo_rollout_logp": "gigpo"}


def _intervals(result: dict, final: int) -> dict | None:
    """The paired bootstrap of each method against its reference (:data:`REFERENCE`, default GRPO) at step
    ``final``; printed. Keys ``<method>`` (against GRPO) or ``<method>_vs_<reference>``."""
    out, seeds = Path(result["out"]), len(result["curves"]["grpo"])
    outcomes = {method: _outcomes(out, method, seeds, final) for method in result["curves"]}  # read once each
    if outcomes["grpo"] is None:
        print(f"\nno per-episode validation records at step {final} in every GRPO run: no interval (runs of "
              "megatron-gigpo before 2026-12-06 wrote none)")
        return None
    print(f"\n95% intervals at iteration {final} (paired bootstrap over {seeds} seed(s) and the held-out tasks)")
    found = {}
    for method in result["curves"]:
        reference = REFERENCE.get(method, "grpo")
        if method == reference or reference not in outcomes:
            continue
        other, base = outcomes[method], outcomes[reference]
        if other is None or base is None:
            continue
        key = method if reference == "grpo" else f"{method}_vs_{reference}"
        found[key] = paired_bootstrap(other, base)
        m, d = found[key]["a"], found[key]["a_minus_b"]
        print(f"  {method:<18} {m[0]:.3f} [{m[1]:.3f}, {m[2]:.3f}]   minus {reference}: {100 * d[0]:+.1f} points "
              f"[{100 * d[1]:+.1f}, {100 * d[2]:+.1f}]")
    return found


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--iterations {text!r}: a whole number >= 1")
    return int(text)


def _methods(text: str) -> list[str]:
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not {"gigpo", "grpo"} <= set(methods):
        raise argparse.ArgumentTypeError(f"--methods {text!r}: choose from {','.join(METHODS)}, with gigpo and grpo")
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes/cpu/sokoban.yaml"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=_positive, default=None, help="RL iterations (default: the recipe's)")
    parser.add_argument("--methods", type=_methods, default=list(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (gigpo and grpo are required)")
    parser.add_argument("--out", default=str(ROOT / "runs/learning-benchmark"))
    parser.add_argument("--save-every", type=int, default=5,
                        help="checkpoint every N iterations (0: never): a stopped run resumes from its last one")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    args = parser.parse_args()
    delta = summarize(run(args))
    print(f"gigpo_minus_grpo={delta:.1f}")


if __name__ == "__main__":
    main()
