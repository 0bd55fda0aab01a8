"""Metric sinks and the plot command on a synthetic run directory."""

import json
from pathlib import Path

import pytest
from tb_events import tensorboard_scalars

from megatron_gigpo.cli import main
from megatron_gigpo.config import load_config
from megatron_gigpo.run.metrics import MetricsLogger, read_metrics, set_aside_earlier_attempt

pytestmark = pytest.mark.unit

SMOKE = Path(__file__).resolve().parents[2] / "recipes" / "smoke" / "cpu.yaml"


def _raw_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl line by line, as a reader other than read_metrics sees them."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_logger_writes_jsonl_tensorboard_and_plots(tmp_path, capsys):
    cfg = load_config(SMOKE)
    logger = MetricsLogger(cfg, tmp_path)
    for step in range(3):
        logger.log({"episode/sokoban/success_rate": 0.1 * step, "episode/return_mean": step,
                    "step_group/hist_1": 3, "step_group/hist_2-4": step + 1, "step_group/hist_10+": 1}, step)
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    success = scalars["episode/sokoban/success_rate"]
    assert [step for step, _ in success] == [0, 1, 2]
    assert [value for _, value in success] == pytest.approx([0.0, 0.1, 0.2])
    assert main(["plot", str(tmp_path)]) == 0
    for name in ("success_rate.png", "reward.png", "step_group_sizes.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _earlier_attempt(cfg, run_dir: Path, steps: range) -> None:
    """What a run killed (kill -9) after logging ``steps`` leaves: its records, event files, and a torn line."""
    logger = MetricsLogger(cfg, run_dir)
    for step in steps:
        logger.log({"episode/sokoban/success_rate": 0.1 * step}, step)
    logger.close()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "episode/sok')


def test_a_resumed_run_logs_each_step_once(tmp_path, caplog):
    """Killed after step 3, resumed from the checkpoint of step 2: step 3 is logged again, once; the
    checkpoint's own step stays in TensorBoard (purge_step is the step after it)."""
    cfg = load_config(SMOKE)
    _earlier_attempt(cfg, tmp_path, range(4))
    logger = MetricsLogger(cfg, tmp_path, resume_step=2)
    logger.log({"episode/sokoban/success_rate": 0.9}, 3)
    logger.close()
    assert _raw_steps(tmp_path) == [0, 1, 2, 3]
    assert read_metrics(tmp_path)[3]["episode/sokoban/success_rate"] == 0.9
    success = tensorboard_scalars(tmp_path / "tensorboard")["episode/sokoban/success_rate"]
    assert success == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.9))]
    (attempt,) = (tmp_path / "previous_attempts").iterdir()  # nothing is lost: the file as it was
    assert (attempt / "metrics.jsonl").read_text().count("\n") == 5
    assert "an earlier attempt logged steps 3-9" not in caplog.text  # the torn line's step is not read
    assert "an earlier attempt logged steps 3-3 (this run resumes after step 2)" in caplog.text


def test_a_run_started_over_logs_each_step_once(tmp_path, caplog):
    """Killed after step 2 with no checkpoint: the re-run starts over; the earlier records and event files
    move to previous_attempts/ and the run's own show each step once."""
    cfg = load_config(SMOKE)
    _earlier_attempt(cfg, tmp_path, range(3))
    logger = MetricsLogger(cfg, tmp_path)
    logger.log({"episode/sokoban/success_rate": 0.5}, 0)
    logger.log({"episode/sokoban/success_rate": 0.6}, 1)
    logger.close()
    assert _raw_steps(tmp_path) == [0, 1]
    success = tensorboard_scalars(tmp_path / "tensorboard")["episode/sokoban/success_rate"]
    assert success == [(0, 0.5), (1, pytest.approx(0.6))]
    (attempt,) = (tmp_path / "previous_attempts").iterdir()
    assert [step for step, _ in tensorboard_scalars(attempt / "tensorboard")["episode/sokoban/success_rate"]] == [
        0, 1, 2]
    assert "an earlier attempt logged steps 0-2 (no checkpoint to resume from)" in caplog.text
    # A clean directory sets nothing aside.
    assert set_aside_earlier_attempt(tmp_path / "new", 0) is None


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
