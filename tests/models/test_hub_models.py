"""Hub model ids as ``model.path`` (issue #38 item 2), on a local Hugging Face cache laid out as the hub writes
it (blobs, refs, snapshots), offline: a cached id validates, preflights and resolves to its snapshot; a revision
pin picks its snapshot; a missing id fails with the command that fetches it; and every command hands its readers
the snapshot directory, resolved once (after which the id no longer resolves here, so a reader that resolved it
again would fail)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_gigpo.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "recipes" / "smoke" / "cpu.yaml")
REPO = "TinyOrg/Tiny-Instruct"
MAIN, V1 = "a" * 40, "b" * 40  # commits: main, and a tag v1 whose config has 3 layers


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    from tiny_models import add_to_hub_cache, make_tiny_hf_model

    root = tmp_path_factory.mktemp("hub")
    model = make_tiny_hf_model(root / "src", arch="qwen2", num_hidden_layers=2, vocab_size=1024)
    add_to_hub_cache(root / "cache", REPO, model, MAIN)
    three = root / "three"
    shutil.copytree(model, three)
    config = json.loads((three / "config.json").read_text())
    (three / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    add_to_hub_cache(root / "cache", REPO, three, V1, refs=("v1",))
    return root / "cache"


@pytest.fixture
def offline_cache(cache, monkeypatch) -> Path:
    """HF_HUB_CACHE=cache, HF_HUB_OFFLINE=1, in the environment and as huggingface_hub read it at import."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _snapshot(cache: Path, commit: str) -> Path:
    return cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / commit


def test_a_cached_id_validates_preflights_and_resolves_to_its_snapshot(offline_cache, capsys):
    from megatron_gigpo.config import load_config
    from megatron_gigpo.models.hub import is_hub_id, with_local_model

    assert main(["validate", SMOKE, f"model.path={REPO}", "--preflight"]) == 0
    captured = capsys.readouterr()
    assert f"ok — model {REPO}," in captured.out
    assert f"model.path {REPO} (revision main): {_snapshot(offline_cache, MAIN)}" in captured.err
    cfg = with_local_model(load_config(SMOKE, [f"model.path={REPO}"]), download=False)
    assert cfg.model.path == str(_snapshot(offline_cache, MAIN)) and cfg.model.revision is None
    assert is_hub_id(REPO) and not is_hub_id(cfg.model.path) and not is_hub_id("builtin:smollm2-135m-instruct")
    assert not is_hub_id("./Org/Name") and not is_hub_id("/abs/dir") and not is_hub_id("runs/x/sft/hf")


@pytest.mark.parametrize("revision", ["v1", V1])
def test_a_revision_pin_picks_its_snapshot(offline_cache, revision, capsys):
    """The tag (through refs/v1) and the full commit hash both select the 3-layer snapshot: its config.json is the
    one the layout check reads (PP2 does not divide 3 layers), and the one the run gets."""
    from megatron_gigpo.config import load_config
    from megatron_gigpo.models.hub import with_local_model

    assert main(["validate", SMOKE, f"model.path={REPO}", f"model.revision={revision}"]) == 2
    assert "pipeline_model_parallel_size=2 must divide the model's 3 layers" in capsys.readouterr().err
    overrides = [f"model.path={REPO}", f"model.revision={revision}", "parallel.pipeline_model_parallel_size=1",
                 "trainer.devices_per_node=1"]
    assert main(["validate", SMOKE, *overrides, "--preflight"]) == 0
    assert with_local_model(load_config(SMOKE, overrides), download=False).model.path == str(
        _snapshot(offline_cache, V1))


@pytest.mark.parametrize("path, revision", [("Qwen/Qwen2.5-0.5B-Instruct", None), ("Qwen/Qwen2.5-0.5B-Instruct", "v2")])
def test_a_missing_id_fails_preflight_with_the_command(offline_cache, path, revision, capsys):
    """A known id validates from its built-in facts (no weights needed) but is not cached: the preflight (the
    sbatch script's check on the allocation) refuses it, naming the revision, the cache, the offline state and the
    command."""
    argv = ["validate", SMOKE, f"model.path={path}", *([f"model.revision={revision}"] if revision else [])]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--preflight"]) == 2
    err = capsys.readouterr().err
    pinned = f"model.revision={revision}" if revision else "revision main (model.revision unset)"
    assert f"model.path '{path}' ({pinned}) is not in the Hugging Face cache {offline_cache} (HF_HUB_OFFLINE=1)" in err
    assert f"`hf download {path}{f' --revision {revision}' if revision else ''} --cache-dir {offline_cache}`" in err


@pytest.mark.parametrize("path, revision", [("NoOrg/NoModel", None), (REPO, "v2")])
def test_an_unknown_uncached_id_fails_validate_naming_the_cache(offline_cache, path, revision, capsys):
    """No config.json to check the layout against: an unknown id, or a cached one at a revision not cached."""
    pin = [f"model.revision={revision}"] if revision else []
    assert main(["validate", SMOKE, f"model.path={path}", *pin]) == 2
    err = capsys.readouterr().err
    assert f"model.path '{path}' ({f'model.revision={revision}' if revision else 'revision main (model.revision unset)'}) " \
           f"is not in the Hugging Face cache {offline_cache}" in err and f"hf download {path}" in err, err
    assert "not a known model id" in err


def test_revision_on_a_local_directory_is_refused(offline_cache, capsys):
    local = _snapshot(offline_cache, MAIN)
    assert main(["validate", SMOKE, f"model.path={local}", "model.revision=v1"]) == 2
    assert "model.revision='v1' pins a Hugging Face hub id" in capsys.readouterr().err


def test_online_a_missing_id_is_downloaded_and_a_failed_download_is_named(offline_cache, monkeypatch, capsys,
                                                                          tmp_path):
    """Not offline: `train` tries the download (here to an endpoint that refuses the connection) and names it.
    (``model.init=random``: the layout is checked against ``model.architecture``, so the unknown id validates.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert main(["train", SMOKE, "model.path=NoOrg/NoModel", "model.init=random",
                 f"trainer.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.path 'NoOrg/NoModel'" in err and "(HF_HUB_OFFLINE unset), and downloading it failed:" in err, err


@pytest.fixture
def resolved_once(offline_cache, tmp_path, monkeypatch) -> list:
    """After the command line's one resolution the id no longer resolves (the cache huggingface_hub reads is
    emptied): a reader that resolved ``model.path`` again instead of using the snapshot directory would fail."""
    from huggingface_hub import constants

    from megatron_gigpo.models import hub

    calls = []
    real = hub.with_local_model

    def once(cfg, *, download):
        out = real(cfg, download=download)
        calls.append(out.model.path)
        (tmp_path / "empty-cache").mkdir(exist_ok=True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        return out

    monkeypatch.setattr(hub, "with_local_model", once)
    return calls


def _consume(cfg) -> None:
    """What the run's readers do with the config: the actor's and engines' model directory, the tokenizer, the
    architecture (layout checks, model spec, memory plan)."""
    from transformers import AutoTokenizer

    from megatron_gigpo.cluster.memory import policy_hf_config
    from megatron_gigpo.models.random_init import resolve_model
    from megatron_gigpo.models.specs import hf_config_for

    model_dir = resolve_model(cfg.model)
    assert AutoTokenizer.from_pretrained(str(model_dir)).vocab_size > 0
    assert hf_config_for(cfg.model.path, cfg.model.revision)["num_hidden_layers"] == 2
    assert policy_hf_config(cfg)["num_hidden_layers"] == 2


@pytest.mark.parametrize("command", ["train", "eval", "sft"])
def test_every_command_hands_its_readers_the_snapshot(command, offline_cache, resolved_once, monkeypatch, tmp_path):
    from megatron_gigpo import driver
    from megatron_gigpo.sft import trainer

    seen = []

    def run(cfg, *args, **kwargs):
        _consume(cfg)
        seen.append(cfg.model.path)
        return {}

    monkeypatch.setattr(driver, "train", run)
    monkeypatch.setattr(driver, "evaluate", run)
    monkeypatch.setattr(trainer, "run_sft", run)
    (tmp_path / "ckpt" / "iter_00000001").mkdir(parents=True)
    (tmp_path / "ckpt" / "iter_00000001" / "meta.json").write_text("{}")
    extra = {"eval": ["--checkpoint", str(tmp_path / "ckpt")], "sft": [f"sft.train_file={tmp_path / 'x.jsonl'}"]}
    overrides = [f"model.path={REPO}", f"trainer.output_dir={tmp_path}"]
    assert main([command, SMOKE, *overrides, *extra.get(command, [])]) == 0
    assert seen == resolved_once == [str(_snapshot(offline_cache, MAIN))]


def test_demos_tokenize_with_the_snapshot(offline_cache, resolved_once, tmp_path, capsys):
    """A real reader end to end: the demonstration writer loads the policy's tokenizer for its prompts."""
    out = tmp_path / "demos.jsonl"
    assert main(["demos", SMOKE, "--out", str(out), "--num-episodes", "1", f"model.path={REPO}",
                 "env.max_steps=3"]) == 0
    assert out.is_file() and resolved_once == [str(_snapshot(offline_cache, MAIN))]
    assert json.loads(out.read_text().splitlines()[0])["messages"][0]["role"] == "user"


def test_the_plan_reads_a_cached_ids_config(offline_cache, capsys):
    """`validate --plan` on GPU: the memory estimate reads the cached snapshot's config.json (an id it has no
    built-in facts for)."""
    assert main(["validate", SMOKE, f"model.path={REPO}", "trainer.device=cuda", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "no estimate" not in out, out


def test_the_converters_take_a_cached_id(offline_cache, tmp_path):
    """`convert hf-to-megatron --hf-dir Org/Name [--revision R]` and `--base-dir`: the cached snapshot (each
    torchrun rank resolves it, so never downloaded); a missing id fails before any process group starts."""
    from megatron_gigpo.actor.convert import _cached, main_hf_to_megatron
    from megatron_gigpo.models.hub import ModelNotCachedError

    assert _cached(REPO) == str(_snapshot(offline_cache, MAIN))
    assert _cached(REPO, "v1") == str(_snapshot(offline_cache, V1))
    assert _cached(str(tmp_path)) == str(tmp_path) and _cached(None) is None
    with pytest.raises(ModelNotCachedError, match="hf download NoOrg/NoModel --revision r1"):
        main_hf_to_megatron(["--hf-dir", "NoOrg/NoModel", "--revision", "r1", "--out", str(tmp_path / "out")])
