"""Megatron GPTModel built from HF configs matches transformers, and HF weights survive every layout.

Tiny random Qwen2 (tied; untied with a 500-token vocabulary that Megatron pads to 512; GQA, QKV bias), Llama
(llama3 RoPE scaling) and Qwen3 (per-head q/k RMSNorm, head_dim 32 apart from hidden / heads = 16) models.
One 2-process run checks TP1 (DP2), TP2 and PP2; one 4-process run checks TP2xPP2. In each layout and for each model:
logits equal transformers' (fp32, atol 1e-4), and ``export_hf_weights`` returns the HF tensors bit-exactly
(exact names, no ``lm_head.weight`` when tied, bucket budget respected), also cast to bf16 on export, with the
same names and bits whether each parameter has a bucket of its own or the whole model fits in one;
``export_metadata`` lists exactly what rank 0 receives, in order, on every rank, and ``destination="all"`` gives
every rank rank 0's tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from multiproc import spawn
from tiny_models import make_tiny_hf_model

ATOL = 1e-4
BUCKET_BYTES = 140_000  # above the largest tensor (embedding, 131 kB): ~6 buckets per tiny model
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("tiny")
    return [
        make_tiny_hf_model(root, "qwen2", tie=True, seed=1),
        make_tiny_hf_model(root, "qwen2", tie=False, seed=2, vocab_size=500),
        make_tiny_hf_model(
            root, "llama", tie=False, seed=3, rope_parameters=LLAMA3_ROPE, max_position_embeddings=16384
        ),
        make_tiny_hf_model(root, "qwen3", tie=True, seed=4),
    ]


@pytest.fixture(scope="module")
def wrong_shape_dir(tiny_dirs, tmp_path_factory) -> Path:
    """The tied Qwen2 model with layer 1's up_proj cut to 96 rows (config unchanged)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("wrong") / "qwen2-bad-up-proj"
    shutil.copytree(tiny_dirs[0], out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:96].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))  # (B, T)


@pytest.fixture(scope="module")
def hf_logits(tiny_dirs, tokens) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    out = []
    for path in tiny_dirs:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            out.append(model(tokens).logits)  # (B, T, V)
    return out


@pytest.fixture(scope="module")
def hf_names(tiny_dirs) -> list[set[str]]:
    from safetensors import safe_open

    names = []
    for path in tiny_dirs:
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
            names.append(set(handle.keys()))
    assert "lm_head.weight" not in names[0] and "lm_head.weight" in names[1]  # tied / untied
    return names


def _megatron_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """HF-vocab logits on the last pipeline stage (None elsewhere), through Megatron's schedules."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, seq)

    def forward_step(data_iterator, module):
        output = module(next(data_iterator), positions, None)  # (B, T, V/TP) on the last stage

        def collect(logits, non_loss_data=True):
            return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]  # (B, T, V)

        return output, collect

    with torch.no_grad():
        data = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
            seq_length=seq, micro_batch_size=batch, forward_only=True, collect_non_loss_data=True,
        )
    return data[0] if ps.is_pipeline_last_stage() else None


def _check_export(model, model_dir: Path, destination: str) -> dict:
    """Export in small buckets; compare what this rank receives with the HF file bit by bit."""
    from safetensors.torch import load_file

    from megatron_gigpo.models.weights import export_hf_weights

    buckets = list(export_hf_weights(model, bucket_size_bytes=BUCKET_BYTES, destination=destination))
    received = [item for bucket in buckets for item in bucket]
    reference = load_file(str(model_dir / "model.safetensors")) if received else {}
    sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets]
    # Cast on export, with one parameter per bucket and with the whole model in one bucket.
    cast = {}
    for size in (1, 2**40):
        bf16 = list(export_hf_weights(model, bucket_size_bytes=size, dtype=torch.bfloat16, destination=destination))
        cast[size] = [item for bucket in bf16 for item in bucket]
    return {
        "buckets": len(buckets),
        "names": [name for name, _ in received],
        "meta": [(name, t.dtype, tuple(t.shape)) for name, t in received],
        "cast_meta": [(name, t.dtype, tuple(t.shape)) for name, t in cast[1]],
        "mismatched": [n for n, t in received if n not in reference or not torch.equal(t, reference[n])],
        "oversized": [size for size in sizes if size > BUCKET_BYTES],
        "cast_names": {size: [name for name, _ in items] for size, items in cast.items()},
        "cast_mismatched": [
            (size, n) for size, items in cast.items() for n, t in items
            if t.dtype != torch.bfloat16 or not torch.equal(t, reference[n].to(torch.bfloat16))
        ],
    }


def _check_all_and_metadata(model, model_dir: Path) -> dict:
    """``export_metadata`` (native and bf16) and what this rank receives with ``destination="all"``."""
    from safetensors.torch import load_file

    from megatron_gigpo.models.weights import export_hf_weights, export_metadata

    reference = load_file(str(model_dir / "model.safetensors"))
    buckets = list(export_hf_weights(model, bucket_size_bytes=BUCKET_BYTES, destination="all"))
    received = [item for bucket in buckets for item in bucket]
    return {
        "metadata": export_metadata(model),
        "metadata_bf16": export_metadata(model, dtype=torch.bfloat16),
        "buckets": len(buckets),
        "names": [name for name, _ in received],
        "mismatched": [n for n, t in received if n not in reference or not torch.equal(t, reference[n])],
    }


def _load_error(model_dir: str, other_dir: str) -> str:
    """The message of the error raised when loading ``other_dir`` into a model built for ``model_dir``."""
    from megatron_gigpo.models.builder import build_gpt_model, load_hf_config
    from megatron_gigpo.models.mapping import WeightShapeError
    from megatron_gigpo.models.weights import load_hf_weights

    model = build_gpt_model(load_hf_config(model_dir))
    try:
        load_hf_weights(model, other_dir)
    except WeightShapeError as error:
        return str(error)
    return "no error"


def _run_layouts(rank: int, world_size: int, layouts, model_dirs, tokens, bad_loads=()) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_gigpo.actor import distributed
    from megatron_gigpo.models.builder import build_gpt_model, load_hf_config
    from megatron_gigpo.models.weights import load_hf_weights

    results = {}
    for tp, pp in layouts:
        distributed.initialize(tp, pp)
        for index, model_dir in enumerate(model_dirs):
            hf_config = load_hf_config(model_dir)
            model = build_gpt_model(hf_config)
            load_hf_weights(model, model_dir)
            model.eval()
            logits = _megatron_logits(model, tokens, hf_config.vocab_size)
            results[(tp, pp, index)] = {
                "logits": logits if ps.get_tensor_model_parallel_rank() == 0 else None,
                "rank0": _check_export(model, Path(model_dir), "rank0"),
                "pp_stage": _check_export(model, Path(model_dir), "pp_stage") if pp > 1 else None,
                "all": _check_all_and_metadata(model, Path(model_dir)),
            }
        if (tp, pp) == layouts[-1]:
            results["errors"] = [_load_error(model_dir, other_dir) for model_dir, other_dir in bad_loads]
        distributed.destroy(process_group=False)
    return results


def _assert_export(reports: list[dict], hf_names: set[str], receivers: int, where: str) -> None:
    assert len({r["buckets"] for r in reports}) == 1, f"{where}: ranks yielded different bucket counts"
    assert reports[0]["buckets"] > 1, where
    got = [r["names"] for r in reports if r["names"]]
    assert len(got) == receivers, f"{where}: {len(got)} ranks received tensors, expected {receivers}"
    names = [name for names in got for name in names]
    assert sorted(names) == sorted(hf_names), f"{where}: exported names differ from the HF file"
    for report in reports:
        assert not report["mismatched"] and not report["oversized"], (where, report)
        assert not report["cast_mismatched"], (where, report["cast_mismatched"])
        assert report["cast_names"][1] == report["cast_names"][2**40] == report["names"], where


def _assert_all_and_metadata(runs: list[dict], where: str) -> None:
    """Every rank's ``export_metadata`` is rank 0's ``(name, dtype, shape)`` sequence of the ``"rank0"`` export;
    with ``destination="all"`` every rank (other TP/PP ranks, other DP replicas) gets rank 0's tensors, bit-equal."""
    sender = runs[0]["rank0"]
    assert sender["meta"], where
    for rank, run in enumerate(runs):
        assert run["all"]["metadata"] == sender["meta"], f"{where} rank {rank}: metadata differs from the export"
        assert run["all"]["metadata_bf16"] == sender["cast_meta"], f"{where} rank {rank}: bf16 metadata"
        assert run["all"]["buckets"] == sender["buckets"], where
        assert run["all"]["names"] == sender["names"], f"{where} rank {rank}: destination='all' names"
        assert not run["all"]["mismatched"], (where, rank, run["all"]["mismatched"])


def _assert_layouts(per_rank: list[dict], hf_logits, hf_names, layouts) -> None:
    for tp, pp in layouts:
        for index, expected in enumerate(hf_logits):
            where = f"TP{tp} PP{pp} model {index}"
            runs = [r[(tp, pp, index)] for r in per_rank]
            logits = [run["logits"] for run in runs if run["logits"] is not None]
            assert logits, f"no logits for {where}"
            for got in logits:
                torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=where)
            _assert_export([run["rank0"] for run in runs], hf_names[index], 1, where)
            _assert_all_and_metadata(runs, where)
            if pp > 1:  # with DP > 1 only replica 0 receives
                _assert_export([run["pp_stage"] for run in runs], hf_names[index], pp, where + " per stage")


@pytest.mark.multiprocess
def test_logits_export_and_load_errors_tp1_tp2_pp2(tiny_dirs, tokens, hf_logits, hf_names, wrong_shape_dir):
    layouts = [(1, 1), (1, 2), (2, 1)]
    dirs = [str(p) for p in tiny_dirs]
    bad_loads = [(dirs[0], str(wrong_shape_dir)), (dirs[0], dirs[2])]
    per_rank = spawn(_run_layouts, 2, layouts, dirs, tokens, bad_loads, timeout=600)
    _assert_layouts(per_rank, hf_logits, hf_names, layouts)
    for errors in (r["errors"] for r in per_rank):  # loaded at TP2: each rank checks the full shapes
        shape_error, arch_error = errors
        assert "'model.layers.1.mlp.up_proj.weight'" in shape_error, shape_error
        assert "[96, 64]" in shape_error and "[128, 64]" in shape_error, shape_error
        assert "model_type='llama'" in arch_error and "model_type='qwen2'" in arch_error, arch_error


def _run_moe_layouts(rank: int, world_size: int, layouts, model_dir: str, tokens: torch.Tensor) -> dict:
    """Per (TP, PP, EP, expert TP, token dispatcher) layout: this data-parallel rank's logits of its own row of
    ``tokens`` (so the expert-parallel ranks route different tokens), and the export checks (rank 0, per stage with
    PP, ``destination="all"`` and ``export_metadata``)."""
    from megatron.core import parallel_state as ps

    from megatron_gigpo.actor import distributed
    from megatron_gigpo.models.builder import build_gpt_model, load_hf_config
    from megatron_gigpo.models.weights import load_hf_weights

    results = {}
    for tp, pp, ep, etp, dispatcher in layouts:
        distributed.initialize(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        hf_config = load_hf_config(model_dir)
        model = build_gpt_model(hf_config, moe_token_dispatcher_type=dispatcher)
        load_hf_weights(model, model_dir)
        model.eval()
        row = ps.get_data_parallel_rank() % tokens.shape[0]
        logits = _megatron_logits(model, tokens[row : row + 1], hf_config.vocab_size)
        results[(tp, pp, ep, etp, dispatcher)] = {
            "row": row,
            "logits": logits if ps.get_tensor_model_parallel_rank() == 0 else None,
            "rank0": _check_export(model, Path(model_dir), "rank0"),
            "pp_stage": _check_export(model, Path(model_dir), "pp_stage") if pp > 1 else None,
            "all": _check_all_and_metadata(model, Path(model_dir)),
        }
        distributed.destroy(process_group=False)
    return results


@pytest.mark.multiprocess
def test_qwen3_moe_logits_ep1_ep2_tp2_pp2(tmp_path_factory, tokens):
    """Tiny Qwen3-MoE (4 experts, top-2 renormalised, every layer MoE) through megatron-core's MoE layer on two gloo
    ranks: EP1 (DP2), EP2 (two experts per rank, each rank routing its own tokens) with the all-gather and the
    all-to-all dispatcher (the latter through cpu_compat's host-side splits), TP2 (experts split over TP too, or
    not: expert TP 1), TP2 x EP2 (expert TP 1) and PP2 give transformers' logits, and the export returns every
    expert's HF tensors bit-exactly in each (at EP2 each gathered from the EP rank that holds it)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", tie=True, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(tokens).logits  # (B, T, V)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    layouts = [(1, 1, 1, 1, "allgather"), (1, 1, 2, 1, "allgather"), (1, 1, 2, 1, "alltoall"),
               (2, 1, 1, 2, "allgather"), (2, 1, 1, 1, "allgather"), (2, 1, 2, 1, "allgather"),
               (1, 2, 1, 1, "allgather")]
    per_rank = spawn(_run_moe_layouts, 2, layouts, str(model_dir), tokens, timeout=600)
    _assert_moe_layouts(per_rank, layouts, expected, names)
    # EP2: the ranks routed different tokens
    assert {run[(1, 1, 2, 1, "alltoall")]["row"] for run in per_rank} == {0, 1}


def _assert_moe_layouts(per_rank: list[dict], layouts, expected: torch.Tensor, names: set[str]) -> None:
    for layout in layouts:
        runs = [r[layout] for r in per_rank]
        where = "TP{} PP{} EP{} expert-TP{} {}".format(*layout)
        assert [run["logits"] is not None for run in runs].count(True) >= 1, where
        for run in runs:
            if run["logits"] is not None:
                torch.testing.assert_close(run["logits"], expected[run["row"] : run["row"] + 1], atol=ATOL, rtol=0,
                                           msg=where)
        _assert_export([run["rank0"] for run in runs], names, 1, where)
        _assert_all_and_metadata(runs, where)
        if layout[1] > 1:
            _assert_export([run["pp_stage"] for run in runs], names, layout[1], where + " per stage")


@pytest.fixture(scope="module")
def moe8_dir(tmp_path_factory) -> Path:
    """A tiny random untied Qwen3-MoE with 8 experts (top-2)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("moe8"), "qwen3_moe", tie=False, seed=6, num_experts=8)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_qwen3_moe_export_ep2_with_tp2_and_pp2(moe8_dir):
    """Four gloo ranks, tiny Qwen3-MoE with 8 experts (untied): EP2 x TP2 with expert TP 1 (each expert gathered from
    expert-data-parallel rank 0 of two) and with expert TP 2 (experts split over the tensor-parallel ranks too),
    EP2 x PP2, and EP4: transformers' logits, and the HF tensors bit-exactly from every export destination."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 500, (4, 12), generator=torch.Generator().manual_seed(1))  # (B, T): a row per DP rank
    hf = AutoModelForCausalLM.from_pretrained(str(moe8_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(tokens).logits  # (B, T, V)
    with safe_open(str(moe8_dir / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    layouts = [(2, 1, 2, 1, "allgather"), (2, 1, 2, 2, "allgather"), (1, 2, 2, 1, "allgather"),
               (1, 1, 4, 1, "alltoall")]
    per_rank = spawn(_run_moe_layouts, 4, layouts, str(moe8_dir), tokens, timeout=900)
    _assert_moe_layouts(per_rank, layouts, expected, names)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_logits_and_export_tp2xpp2(tiny_dirs, tokens, hf_logits, hf_names):
    layouts = [(2, 2)]
    per_rank = spawn(_run_layouts, 4, layouts, [str(p) for p in tiny_dirs], tokens, timeout=600)
    _assert_layouts(per_rank, hf_logits, hf_names, layouts)
