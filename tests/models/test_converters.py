"""tools/convert_*.py on real files: HF -> Megatron (TP2) -> HF (PP2) is bit-exact; mismatches are clear errors.

The model is a tiny Qwen3 (q/k norm gains replicated over TP in the Megatron checkpoint, head_dim apart from
hidden / heads); the converters' only family-specific part is the mapping, whose Qwen2 q/k/v biases and Llama
tensors the export checks of test_hf_megatron_equivalence.py cover bit by bit in every layout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import make_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]
ARCH = "qwen3"


def _run_tool(script: str, nproc: int, *args: str | Path) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = (launcher if nproc > 1 else [sys.executable]) + [str(REPO / "tools" / script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def _load_all(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.slow
def test_hf_megatron_hf_round_trip_is_bit_exact(tmp_path):
    source = make_tiny_hf_model(tmp_path, ARCH, tie=False, seed=5, vocab_size=500)
    ckpt, back = tmp_path / "megatron", tmp_path / "hf-back"

    done = _run_tool("convert_hf_to_megatron.py", 2, "--hf-dir", source, "--out", ckpt, "--tp", "2", "--pp", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    assert (ckpt / "hf" / "tokenizer.json").is_file() and (ckpt / "megatron_gigpo.json").is_file()

    # Reshard TP2 -> PP2 on the way back; 100 kB shards force several files plus an index.
    done = _run_tool(
        "convert_megatron_to_hf.py", 2, "--megatron-dir", ckpt, "--out", back, "--tp", "1", "--pp", "2",
        "--max-shard-size", "100kB",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    original, converted = _load_all(source), _load_all(back)
    assert sorted(original) == sorted(converted)
    assert all(torch.equal(original[name], converted[name]) for name in original)
    assert (back / "model.safetensors.index.json").is_file()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (back / name).read_bytes() == (source / name).read_bytes(), name

    # One process, and an HF config that does not match the checkpoint (FFN 96 instead of 128).
    other = make_tiny_hf_model(tmp_path, ARCH, tie=False, vocab_size=500, intermediate_size=96, name="ffn96")
    done = _run_tool(
        "convert_megatron_to_hf.py", 1, "--megatron-dir", ckpt, "--out", tmp_path / "bad", "--hf-config-dir", other
    )
    assert done.returncode != 0 and not (tmp_path / "bad").exists()
    expected = (
        r"tensor 'decoder\.layers\.mlp\.linear_fc1\.weight' .* global shape \[4, 256, 64\], "
        r"but the model expects \[4, 192, 64\]"
        r"|tensor 'decoder\.layers\.mlp\.linear_fc2\.weight' .* global shape \[4, 64, 128\], "
        r"but the model expects \[4, 64, 96\]"
    )
    assert re.search(expected, done.stderr), done.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.slow
def test_qwen3_moe_round_trip_at_ep2_is_bit_exact(tmp_path):
    """Tiny Qwen3-MoE (8 experts, top-2): HF -> Megatron with --ep 2 (each rank saves its four experts) -> HF with
    --ep 2 (each expert gathered from the rank that holds it) gives every tensor back bit-exactly."""
    source = make_tiny_hf_model(tmp_path, "qwen3_moe", tie=False, seed=6, num_experts=8)
    ckpt, back = tmp_path / "megatron", tmp_path / "hf-back"
    done = _run_tool("convert_hf_to_megatron.py", 2, "--hf-dir", source, "--out", ckpt, "--ep", "2", "--etp", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    done = _run_tool("convert_megatron_to_hf.py", 2, "--megatron-dir", ckpt, "--out", back, "--ep", "2", "--etp", "1",
                     "--max-shard-size", "100kB")
    assert done.returncode == 0, done.stderr[-4000:]
    original, converted = _load_all(source), _load_all(back)
    assert sorted(original) == sorted(converted)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in converted
    assert all(torch.equal(original[name], converted[name]) for name in original)
