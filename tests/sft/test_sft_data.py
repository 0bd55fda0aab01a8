"""SFT demonstrations: rendering through the rollout's prompt code, invalid rows named by file:line or counted,
the held-out split and the per-epoch mini-batches; the recipe's ``sft`` section checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gigpo.episodes.prompts import PromptRenderer, get_prompt_template
from megatron_gigpo.sft.data import SFTDataError, encode_example, load_sft_rows, split_held_out
from megatron_gigpo.sft.trainer import epoch_batches

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tiny_models import make_tiny_tokenizer

    return make_tiny_tokenizer(tmp_path_factory.mktemp("sft_tok"), 2048)


def _chat(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_prompt_is_the_rollout_render_and_the_response_ends_with_eos(tokenizer, tmp_path):
    renderer = PromptRenderer(tokenizer, get_prompt_template("sokoban"), history_length=2, max_prompt_length=4096)
    history = [("# P X O #", "left"), ("# _ P X O", "right")]
    rendered = renderer.render("Push the box onto the target.", history, "# _ _ P X", ["up", "down", "left", "right"])
    reply = "<think>the box is right of me</think><action>right</action>"
    row = {"messages": rendered.messages + [{"role": "assistant", "content": reply}], "meta": {"seed": 3}}
    rows, report = load_sft_rows(_write(tmp_path / "d.jsonl", [row]), tokenizer, max_length=4096,
                                 skip_invalid_rows=False)
    assert report.rows == 1 and report.skipped == 0
    assert rows.prompt_ids[0].tolist() == rendered.token_ids
    target = tokenizer.encode(reply, add_special_tokens=False)
    assert rows.response_ids[0].tolist() == target + [tokenizer.eos_token_id]
    assert tokenizer.decode(rows.response_ids[0][-1:]) == "<|im_end|>"
    assert rows.sources == [f"{tmp_path / 'd.jsonl'}:1"]
    # Earlier assistant turns stay in the prompt; only the last message is the target.
    multi = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
             {"role": "assistant", "content": "d"}]
    prompt, response = encode_example(tokenizer, multi)
    assert prompt == renderer.encode_messages(multi[:3])
    assert response == tokenizer.encode("d", add_special_tokens=False) + [tokenizer.eos_token_id]


BAD_ROWS = [
    ('{"messages": [', "invalid JSON"),
    ({"text": "hi"}, "no non-empty 'messages' list"),
    ({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]},
     "the last message has role 'user'"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "no message before the assistant target"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "messages\\[0\\] needs a string 'role' and a string 'content'"),
    (_chat("word " * 80, "ok"), "> sft.max_length=64"),
]


@pytest.mark.parametrize("bad, reason", BAD_ROWS)
def test_an_invalid_row_names_file_and_line(tokenizer, tmp_path, bad, reason):
    path = _write(tmp_path / "demos.jsonl", [_chat("a", "b"), "", bad, _chat("c", "d")])
    with pytest.raises(SFTDataError, match=rf"{path}:3: .*{reason}"):
        load_sft_rows(path, tokenizer, max_length=64, skip_invalid_rows=False)


def test_skip_invalid_rows_counts_them(tokenizer, tmp_path, caplog):
    lines = [_chat("a", "b")] + [bad for bad, _ in BAD_ROWS] + [_chat("c", "d")]
    path = _write(tmp_path / "demos.jsonl", lines)
    with caplog.at_level("WARNING", logger="megatron_gigpo.sft.data"):
        rows, report = load_sft_rows(path, tokenizer, max_length=64, skip_invalid_rows=True)
    assert rows.num_rows == report.rows == 2
    assert report.skipped == len(BAD_ROWS)
    assert report.skipped_by_kind == {"json": 1, "format": 4, "too_long": 1}
    assert report.examples[0].startswith(f"{path}:2: invalid JSON")
    assert f"skipped {len(BAD_ROWS)} invalid row(s)" in caplog.text
    # Nothing valid at all is an error even when skipping; so is a missing file.
    with pytest.raises(SFTDataError, match="no valid demonstration rows"):
        load_sft_rows(_write(tmp_path / "bad.jsonl", ["{"]), tokenizer, max_length=64, skip_invalid_rows=True)
    with pytest.raises(SFTDataError, match="not found"):
        load_sft_rows(tmp_path / "missing.jsonl", tokenizer, max_length=64, skip_invalid_rows=True)


def test_held_out_split_and_epoch_batches_are_deterministic(tokenizer, tmp_path):
    path = _write(tmp_path / "d.jsonl", [_chat(f"word {i}", f"<action>{i}</action>") for i in range(50)])
    rows, _ = load_sft_rows(path, tokenizer, max_length=64, skip_invalid_rows=False)
    train, val = split_held_out(rows, 0.1, seed=3)
    again, _ = split_held_out(rows, 0.1, seed=3)
    assert (train.num_rows, val.num_rows) == (45, 5)
    assert sorted(train.sources + val.sources) == sorted(rows.sources) and again.sources == train.sources
    assert split_held_out(rows, 0.1, seed=4)[1].sources != val.sources
    assert split_held_out(rows, 0.0, seed=3)[1].num_rows == 0
    batches = epoch_batches(45, 8, seed=1, epoch=2)
    assert batches == epoch_batches(45, 8, seed=1, epoch=2) != epoch_batches(45, 8, seed=1, epoch=3)
    assert sorted(i for b in batches for i in b) == list(range(45))
    assert len(batches) == 6 and {len(b) for b in batches} <= {7, 8}


def test_recipe_sft_section_is_checked():
    from megatron_gigpo.config import ConfigError, load_config

    cfg = load_config(ROOT / "recipes/smoke/cpu.yaml", ["sft.train_file=demos.jsonl"])
    assert cfg.sft.train_file == "demos.jsonl" and cfg.sft.epochs >= 1
    bad = ["sft.val_fraction=1.0", "sft.batch_size=0", "sft.lr_decay_style=step",
           "sft.max_length=1", "sft.save_every=-1", "sft.loss_agg_mode=sum"]
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "recipes/smoke/cpu.yaml", bad)
    for key in ("sft.val_fraction=1.0", "sft.batch_size=0", "sft.lr_decay_style='step'",
                "sft.max_length=1", "sft.save_every=-1", "sft.loss_agg_mode='sum'"):
        assert key in str(err.value), key
    # cross-field checks run once every field is in its range
    with pytest.raises(ConfigError, match=r"sft.min_lr=1.0 must be <= sft.lr="):
        load_config(ROOT / "recipes/smoke/cpu.yaml", ["sft.min_lr=1.0"])
    with pytest.raises(ConfigError, match="unknown key 'sft.epoch'; did you mean 'sft.epochs'"):
        load_config(ROOT / "recipes/smoke/cpu.yaml", ["sft.epoch=2"])


def test_progress_lines_reach_a_log_file_not_a_terminal():
    from megatron_gigpo.sft.trainer import PROGRESS_LINE_S, progress_line_due

    due = [s for s in range(1, 101) if progress_line_due(s, 100, terminal=False, seconds_since_last=1.0)]
    assert due == list(range(5, 101, 5))  # a line per 1/20 of the stage, the last step included
    assert progress_line_due(3, 7, terminal=False, seconds_since_last=0.0)  # fewer steps than lines: each
    assert progress_line_due(1, 1000, terminal=False, seconds_since_last=PROGRESS_LINE_S)  # slow steps: by time
    assert not any(progress_line_due(s, 100, terminal=True, seconds_since_last=1e9) for s in range(1, 101))
