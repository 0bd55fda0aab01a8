"""``megatron-gigpo demos``: writes a chat JSONL from a recipe; refuses environments without an expert."""

import json
from pathlib import Path

import pytest

from megatron_gigpo.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "recipes/smoke/cpu.yaml")


def test_demos_writes_a_jsonl_file(tmp_path, capsys):
    from tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path, arch="llama", num_hidden_layers=2, vocab_size=2048)
    out = tmp_path / "out" / "demos.jsonl"
    # Options between the recipe and its overrides, as the usage line writes them.
    argv = ["demos", SMOKE, "--out", str(out), "--num-episodes", "4", "--epsilon", "0", "--reasoning", "none",
            "--seed", "5", f"model.path={model}", "env.max_steps=10", "env.prompt_template=compact"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert {r["episode"] for r in rows} == {0, 1, 2, 3}
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    assert all(r["messages"][1]["content"].startswith("<think></think><action>") for r in rows)
    printed = capsys.readouterr().out
    assert f"wrote {len(rows)} rows of 4 sokoban episodes to {out}" in printed and "success rate 1.000" in printed


def test_demos_refuses_an_environment_without_expert(tmp_path, capsys):
    out = tmp_path / "demos.jsonl"
    assert main(["demos", SMOKE, "--out", str(out), "env.name=webshop", f"env.data_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "env.name='webshop': no expert policy for demonstrations; experts exist for alfworld, sokoban" in err
    assert not out.exists()
    with pytest.raises(SystemExit):
        main(["demos", SMOKE, "--out", str(out), "--reasoning", "long"])
    with pytest.raises(SystemExit):
        main(["demos", SMOKE, "--out", str(out), "--no-such-option"])
