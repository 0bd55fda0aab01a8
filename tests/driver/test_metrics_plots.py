"""Metric sinks and the plot command on a synthetic run directory."""

from pathlib import Path

import pytest
from tb_events import tensorboard_scalars

from megatron_gigpo.cli import main
from megatron_gigpo.config import load_config
from megatron_gigpo.run.metrics import MetricsLogger, read_metrics

pytestmark = pytest.mark.unit

SMOKE = Path(__file__).resolve().parents[2] / "recipes" / "smoke" / "cpu.yaml"


def test_logger_writes_jsonl_tensorboard_and_plots(tmp_path, capsys):
    cfg = load_config(SMOKE)
    logger = MetricsLogger(cfg, tmp_path)
    for step in range(3):
        logger.log({"episode/sokoban/success_rate": 0.1 * step, "episode/return_mean": step,
                    "step_group/hist_1": 3, "step_group/hist_2-4": step + 1, "step_group/hist_10+": 1}, step)
    logger.close()
    # A resumed run re-logs step 2: the latest record wins.
    logger = MetricsLogger(cfg, tmp_path, resume_step=2)
    logger.log({"episode/sokoban/success_rate": 0.9}, 2)
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["episode/sokoban/success_rate"] == 0.9
    # TensorBoard shows the same values: the resumed writer purged the first run's step 2.
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    success = scalars["episode/sokoban/success_rate"]
    assert [step for step, _ in success] == [0, 1, 2]
    assert [value for _, value in success] == pytest.approx([0.0, 0.1, 0.9])
    assert scalars["step_group/hist_2-4"] == [(0, 1.0), (1, 2.0)]  # not re-logged at step 2
    assert main(["plot", str(tmp_path)]) == 0
    for name in ("success_rate.png", "reward.png", "step_group_sizes.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_non_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in"):
        read_metrics(tmp_path)


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(SMOKE, ["logging.wandb=true", "logging.wandb_mode=offline", "logging.tensorboard=false"])
    logger = MetricsLogger(cfg, tmp_path)
    logger.log({"actor/pg_loss": 0.5}, 1)
    logger.close()
    runs = [p.name for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(runs) == 1
    assert read_metrics(tmp_path)[0]["actor/pg_loss"] == 0.5
