"""``megatron-gigpo plot RUN_DIR``: PNG curves of a run from its ``metrics.jsonl``.

Writes ``plots/success_rate.png`` (train and validation success per environment / task type),
``plots/reward.png`` (episode reward and length) and ``plots/step_group_sizes.png``: the share of
anchor-state groups by size over training, the view of the GiGPO paper's Figure 7.
"""

from __future__ import annotations

from pathlib import Path

from megatron_gigpo.run.metrics import read_metrics

HIST_PREFIX = "step_group/hist_"  # bucketed step-group size counts written by the episode collector


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps = [r["step"] for r in records if key in r]
    return steps, [r[key] for r in records if key in r]


def _new_axes(ylabel: str, title: str):
    """A headless figure with an iteration x-axis (integer ticks)."""
    import matplotlib

    matplotlib.use("Agg")  # headless; called only when plotting
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def _save(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")  # legends may sit outside the axes
    plt.close(fig)
    return out


def _line_plot(records: list[dict], keys: list[str], title: str, ylabel: str, out: Path) -> Path:
    fig, ax = _new_axes(ylabel, title)
    for key in keys:
        x, y = _series(records, key)
        ax.plot(x, y, marker="o", markersize=3, label=key)
    if keys:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, out)


def _group_size_plot(records: list[dict], out: Path) -> Path:
    buckets = sorted({k for r in records for k in r if k.startswith(HIST_PREFIX)},
                     key=lambda k: int(k[len(HIST_PREFIX):].split("-")[0].rstrip("+")))
    rows = [r for r in records if any(k in r for k in buckets)]
    steps = [r["step"] for r in rows]
    totals = [sum(r[k] for k in buckets if k in r) or 1.0 for r in rows]
    shares = [[(r[k] if k in r else 0.0) / t for r, t in zip(rows, totals)] for k in buckets]
    fig, ax = _new_axes("share of step groups", "Anchor-state group sizes over training")
    if steps:
        ax.stackplot(steps, shares, labels=[k[len(HIST_PREFIX):] for k in buckets], alpha=0.85)
        ax.legend(title="group size", fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_ylim(0, 1)
    return _save(fig, out)


def plot_run(run_dir: Path) -> list[Path]:
    """Write the run's PNGs into ``run_dir/plots`` and return their paths.

    Raises:
        FileNotFoundError: ``run_dir`` has no metrics.jsonl.
    """
    records = read_metrics(run_dir)
    out = Path(run_dir) / "plots"
    out.mkdir(exist_ok=True)
    keys = sorted({k for r in records for k in r})
    success = [k for k in keys if "success_rate" in k]
    reward = [k for k in keys if k.endswith(("episode/return_mean", "episode/length_mean"))]
    return [
        _line_plot(records, success, "Success rate", "success rate", out / "success_rate.png"),
        _line_plot(records, reward, "Episode reward and length", "value", out / "reward.png"),
        _group_size_plot(records, out / "step_group_sizes.png"),
    ]
