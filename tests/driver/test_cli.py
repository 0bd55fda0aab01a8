"""The command line: validate every recipe; broken recipes fail before any process starts."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gigpo.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_validate_smoke_recipe(capsys):
    assert main(["validate", str(ROOT / "recipes/smoke/cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "TP1 x PP2 x DP1" in out


def _broken(tmp_path, extra):
    data = yaml.safe_load((ROOT / "recipes/smoke/cpu.yaml").read_text())
    data["base"] = str(ROOT / "recipes/_base/gigpo.yaml")
    for section, values in extra.items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"trainer": {"devices_per_nod": 2}}, "unknown key 'trainer.devices_per_nod'; did you mean 'trainer.devices_per_node'"),
        ({"parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}},
         "attention heads (9) and KV heads (3)"),
    ],
)
def test_train_with_broken_recipe_fails_before_starting(tmp_path, capsys, extra, message):
    recipe = _broken(tmp_path, extra)
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "runs").exists()


def test_missing_data_dir_fails_preflight(tmp_path, capsys):
    recipe = ROOT / "recipes/smoke/alfworld-cpu.yaml"
    assert main(["validate", str(recipe), f"env.data_dir={tmp_path / 'nowhere'}", "--preflight"]) == 2
    err = capsys.readouterr().err
    assert "preflight failed" in err and "alfworld-download" in err and "nowhere" in err


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "megatron_gigpo.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("train", "eval", "validate", "convert", "plot"):
        assert command in out


@pytest.mark.parametrize("argv", [[], ["demos"], ["sft"], ["train"], ["eval"], ["validate"], ["plot"],
                                  ["convert"]], ids=lambda a: a[0] if a else "main")
def test_help_is_plain_text(argv, capsys):
    """--help is read in a terminal: no reStructuredText markup from docstrings."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "usage: megatron-gigpo" in out and "``" not in out and ":class:" not in out, out


@pytest.mark.integration
def test_convert_round_trip_through_the_cli(tmp_path):
    from safetensors.torch import load_file
    from tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model(tmp_path, arch="llama", tie=True)
    cli = [sys.executable, "-m", "megatron_gigpo.cli", "convert"]
    subprocess.run([*cli, "hf-to-megatron", "--hf-dir", str(hf), "--out", str(tmp_path / "mcore")], check=True,
                   capture_output=True, cwd=tmp_path)
    subprocess.run([*cli, "megatron-to-hf", "--megatron-dir", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")],
                   check=True, capture_output=True, cwd=tmp_path)
    original = load_file(str(hf / "model.safetensors"))
    back = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        back |= load_file(str(f))
    assert original.keys() == back.keys()
    assert all(original[k].equal(back[k]) for k in original)


def _fake_checkpoint(root: Path, iteration: int) -> Path:
    """A folder that looks complete to the checkpoint resolver (it only reads meta.json's presence)."""
    folder = root / f"iter_{iteration:08d}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text("{}")
    return folder


def test_checkpoint_folder_or_root_resolves(tmp_path):
    from megatron_gigpo.actor.checkpoint_layout import resolve_checkpoint

    root = tmp_path / "checkpoints"
    first, second = _fake_checkpoint(root, 1), _fake_checkpoint(root, 2)
    (root / "iter_00000003").mkdir()  # no meta.json: an unfinished save
    assert resolve_checkpoint(root) == (2, second)
    assert resolve_checkpoint(first) == (1, first)  # one folder: that checkpoint, not the newest
    assert resolve_checkpoint(root / "iter_00000003") is None
    assert resolve_checkpoint(tmp_path / "nowhere") is None


def test_a_checkpoint_named_wrong_is_found_beside(tmp_path, capsys):
    """`iter_20` where the folder is `iter_00000020`: eval and convert say the folder does not exist and list
    the complete checkpoints beside it; the run's checkpoints/ folder means its newest."""
    from megatron_gigpo.actor.checkpoint_layout import checkpoint_from_cli
    from megatron_gigpo.actor.convert import main_megatron_to_hf

    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 10), _fake_checkpoint(root, 20)
    wrong = str(root / "iter_20")
    listing = "complete checkpoints in " + str(root) + ": iter_00000010, iter_00000020 (or pass " + str(root)
    assert main(["eval", str(ROOT / "recipes/smoke/cpu.yaml"), "--checkpoint", wrong]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {wrong} does not exist; {listing}" in err, err
    with pytest.raises(FileNotFoundError, match=f"--megatron-dir {wrong} does not exist; complete checkpoints"):
        main_megatron_to_hf(["--megatron-dir", wrong, "--out", str(tmp_path / "out")])
    assert checkpoint_from_cli(root, "--x") == (20, root / "iter_00000020")
    # A folder hf-to-megatron wrote (no iter_N, no meta.json) converts as is; eval needs a run's checkpoint.
    assert checkpoint_from_cli(tmp_path, "--x", other_folders=True) == (None, tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        checkpoint_from_cli(tmp_path, "--x")


def test_eval_and_plot_name_missing_paths_before_starting(tmp_path, capsys):
    recipe = str(ROOT / "recipes/smoke/cpu.yaml")
    assert main(["eval", recipe, "--checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint" in err and "nope" in err and "Traceback" not in err
    assert main(["plot", str(tmp_path / "no_run")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_eval_of_a_cold_started_run_loads_its_sft_export(tmp_path, capsys):
    """eval scores a run on the model its RL started from (the SFT export), not the recipe's random init: a
    LoRA checkpoint's base is that model (``from_cold_start``)."""
    from megatron_gigpo.config import load_config
    from megatron_gigpo.sft.cold_start import from_cold_start

    recipe = str(ROOT / "recipes/cpu/sokoban.yaml")  # sft.enabled, model.init: random
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.experiment_name=cold"]
    assert main(["eval", recipe, *overrides, "--checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "sft/hf" in err and "Traceback" not in err
    export = tmp_path / "cold" / "sft" / "hf"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    cfg = from_cold_start(load_config(recipe, overrides))
    assert (cfg.model.path, cfg.model.init) == (str(export.resolve()), "pretrained")


def test_train_of_a_finished_run_returns_at_once(tmp_path, capsys):
    recipe = str(ROOT / "recipes/smoke/cpu.yaml")
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.experiment_name=done", "trainer.total_iterations=3"]
    _fake_checkpoint(tmp_path / "done" / "checkpoints", 3)
    assert main(["train", recipe, *overrides]) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert not (tmp_path / "done" / "metrics.jsonl").exists()
