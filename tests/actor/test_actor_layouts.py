"""PolicyActor across Megatron layouts on gloo: log-probs agree with Hugging Face and each other, chunking and
micro-batching do not change them, one update lowers the loss and every layout takes the same step.

One spawn of two ranks runs TP2, PP2 and DP2 (+ DistributedOptimizer) one after the other, then a tiny Qwen3 at
TP2 without and with sequence parallelism (q/k norm gains replicated over TP, their gradients summed over TP by
Megatron's ``finalize_model_grads``), then a tiny Qwen3-MoE at EP2; a four-rank spawn runs TP2 x PP2. The model ties its embeddings, so PP also exercises Megatron's embedding-group
gradient sync.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from actor_helpers import (
    actor_config,
    export_full_weights,
    hf_log_probs_and_entropy,
    make_batch,
    response_log_probs_and_entropy,
    row_advantages,
    start_rank,
)
from multiproc import spawn
from tiny_models import make_tiny_hf_model
from torch.nn.utils.rnn import pad_sequence

LAYOUTS = {"tp2": (2, 1, False), "pp2": (1, 2, False), "dp2_distopt": (1, 1, True)}
MOE_ROWS = 7


def _run_layout(model_dir, tp: int, pp: int, distributed_optimizer: bool, *, extra: bool, rows: int = 8,
                **settings) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor

    batch = make_batch(rows)
    config = actor_config(model_dir, tp=tp, pp=pp, use_distributed_optimizer=distributed_optimizer, **settings)
    # Adam's first step is lr * g / (|g| + eps): with the default eps, parameters whose gradient is rounding
    # noise (e.g. k_proj.bias, which softmax ignores) move by +-lr in a layout-dependent direction. A larger
    # eps keeps the step continuous in g, so layouts can be compared weight by weight.
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, lr=1e-4, adam_eps=1e-3))
    actor = PolicyActor(config)
    out = {}
    out["log_probs"], out["entropy"] = actor.compute_log_probs_and_entropy(batch)
    if extra:  # one micro-batch, one output-layer chunk
        actor.config = actor.config.replace(trainer={"logprob_chunk_size": 10**6, "log_prob_micro_batch_tokens": 10**6})
        out["log_probs_unchunked"] = actor.compute_log_probs(batch)
    out["ref_log_probs"] = actor.compute_log_probs(batch, reference=True)
    adv = row_advantages(batch)
    out["first"], _ = actor.update(batch, adv, out["log_probs"], out["ref_log_probs"])
    # same behaviour log-probs: the loss at the updated weights, before the second step
    out["second"], _ = actor.update(batch, adv, out["log_probs"], out["ref_log_probs"])
    out["weights"] = export_full_weights(actor)
    del actor
    distributed.destroy()
    return out


def _two_rank_layouts(rank: int, world_size: int, model_dir, qwen3_dir, moe_dir) -> dict:
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor

    start_rank()
    results = {
        name: _run_layout(model_dir, tp, pp, distopt, extra=name == "tp2")
        for name, (tp, pp, distopt) in LAYOUTS.items()
    }
    results["qwen3_tp2"] = _run_layout(qwen3_dir, 2, 1, False, extra=False)
    results["qwen3_tp2_sp"] = _run_layout(qwen3_dir, 2, 1, False, extra=False, sequence_parallel=True)
    # 7 rows, one per micro-batch: 4 micro-batches on one rank, 3 and a stand-in on the other
    results["qwen3_moe_ep2"] = _run_layout(moe_dir, 1, 1, False, extra=False, rows=MOE_ROWS,
                                           expert_model_parallel_size=2, micro_batch_tokens=1,
                                           log_prob_micro_batch_tokens=1)
    results["micro_batching"] = [_seq_mean_update(model_dir, budget) for budget in (24, 10**6)]
    try:  # THD packing with Megatron's local attention spec (the CPU spec)
        PolicyActor(actor_config(model_dir, tp=2, sequence_packing=True))
        results["packing_error"] = None
    except ValueError as exc:
        results["packing_error"] = str(exc)
    distributed.destroy()
    return results


def _seq_mean_update(model_dir, micro_batch_tokens: int) -> dict:
    """One ``seq-mean-token-mean`` update at DP2 with the given micro-batch token budget."""
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor

    config = actor_config(model_dir, micro_batch_tokens=micro_batch_tokens)
    config = dataclasses.replace(
        config,
        optim=dataclasses.replace(config.optim, lr=1e-4, adam_eps=1e-3),
        loss=dataclasses.replace(config.loss, loss_agg_mode="seq-mean-token-mean"),
    )
    actor = PolicyActor(config)
    batch = make_batch()
    old = actor.compute_log_probs(batch)
    metrics, _ = actor.update(batch, row_advantages(batch), old, actor.compute_log_probs(batch, reference=True))
    weights = export_full_weights(actor)
    del actor
    distributed.destroy()
    return {"metrics": metrics, "weights": weights}


def _packed_vs_padded(rank: int, world_size: int, model_dir) -> dict:
    from megatron_gigpo.actor.policy import PolicyActor

    start_rank()
    batch = make_batch()
    actor = PolicyActor(actor_config(model_dir, sequence_packing=True, params_dtype="float32"))
    packed = actor.compute_log_probs(batch)
    actor.config = actor.config.replace(trainer={"sequence_packing": False})
    return {"packed": packed, "padded": actor.compute_log_probs(batch)}


def _tp2_pp2(rank: int, world_size: int, model_dir) -> dict:
    start_rank()
    return _run_layout(model_dir, 2, 2, False, extra=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("actor_layouts"), tie=True, vocab_size=511)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("actor_layouts"), "qwen3", tie=True, vocab_size=511, seed=4)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("actor_layouts"), "qwen3_moe", tie=True, vocab_size=511, seed=4)


@pytest.fixture(scope="module")
def hf_reference(model_dir):
    return hf_log_probs_and_entropy(model_dir, make_batch())


@pytest.fixture(scope="module")
def two_rank_runs(model_dir, qwen3_dir, moe_dir):
    return spawn(_two_rank_layouts, 2, model_dir, qwen3_dir, moe_dir, timeout=900)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.multiprocess
def test_log_probs_match_hugging_face_in_every_layout(two_rank_runs, hf_reference):
    hf_lp, hf_ent = hf_reference
    for rank_results in two_rank_runs:
        for name, run in rank_results.items():
            if name not in LAYOUTS:
                continue
            assert [t.shape for t in run["log_probs"]] == [t.shape for t in hf_lp], name
            assert _max_diff(run["log_probs"], hf_lp) < 1e-4, name
            assert _max_diff(run["entropy"], hf_ent) < 1e-4, name
            # the frozen reference is the same checkpoint (its parameters are not in DDP's flat buffers, so
            # kernels may round differently at the last bit)
            assert _max_diff(run["ref_log_probs"], run["log_probs"]) < 1e-5, name
    assert _max_diff(two_rank_runs[0]["tp2"]["log_probs"], two_rank_runs[1]["tp2"]["log_probs"]) == 0.0


@pytest.mark.multiprocess
def test_chunked_micro_batched_log_probs_equal_one_pass(two_rank_runs):
    run = two_rank_runs[0]["tp2"]
    assert _max_diff(run["log_probs"], run["log_probs_unchunked"]) < 1e-5


@pytest.mark.multiprocess
def test_one_update_lowers_the_loss(two_rank_runs):
    for name in LAYOUTS:
        run = two_rank_runs[0][name]
        assert run["first"]["actor/num_optimizer_steps"] == 1.0
        assert run["first"]["actor/update_skipped"] == 0.0
        assert run["first"]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7), name
        assert run["second"]["actor/loss"] < run["first"]["actor/loss"] - 1e-3, name


@pytest.mark.multiprocess
def test_layouts_take_the_same_step(two_rank_runs):
    """DP2 with the DistributedOptimizer, PP2 and TP2 (DP1) end with the same weights after one step."""
    runs = two_rank_runs[0]
    reference = runs["tp2"]
    for name in ("pp2", "dp2_distopt"):
        for key in ("actor/loss", "actor/grad_norm", "actor/pg_loss", "actor/entropy"):
            assert runs[name]["first"][key] == pytest.approx(reference["first"][key], abs=1e-5), (name, key)
        assert runs[name]["weights"].keys() == reference["weights"].keys()
        for hf_name, tensor in reference["weights"].items():
            # one Adam step moves weights by up to lr = 1e-4; a wrong or missing step shows far above 1e-6
            torch.testing.assert_close(runs[name]["weights"][hf_name], tensor, atol=1e-6, rtol=0, msg=hf_name)
    assert "lm_head.weight" not in reference["weights"]  # tied embeddings


@pytest.mark.multiprocess
def test_micro_batch_budget_does_not_change_the_step(two_rank_runs):
    """Per-sequence loss means are taken over the whole mini-batch, not per micro-batch."""
    many, one = two_rank_runs[0]["micro_batching"]
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert many["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), key
    for hf_name, tensor in one["weights"].items():
        torch.testing.assert_close(many["weights"][hf_name], tensor, atol=1e-6, rtol=0, msg=hf_name)


def _hf_first_step(model_dir, batch, config) -> tuple[float, float]:
    """The first update's policy loss and gradient norm, from ``transformers``: log-probs and entropies of each
    row's response tokens, the row advantage on each of them, then :func:`compute_actor_loss` (its own parity
    with verl is tested in tests/algo) with the actor's loss settings, on-policy (old = reference = current)."""
    from transformers import AutoModelForCausalLM

    from megatron_gigpo.algo.losses import compute_actor_loss

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = response_log_probs_and_entropy(model, batch, torch.float32)
    log_prob, entropy = (pad_sequence(t, batch_first=True) for t in rows)  # (B, R_max), zero-padded
    lengths = torch.tensor([r.numel() for r in batch.response_ids])
    mask = (torch.arange(log_prob.shape[1]) < lengths.unsqueeze(1)).float()  # (B, R_max)
    loss = config.loss
    value, metrics = compute_actor_loss(
        log_prob, log_prob.detach(), row_advantages(batch).unsqueeze(1) * mask, mask,
        policy_loss=loss.policy_loss, clip_ratio_low=loss.clip_ratio_low, clip_ratio_high=loss.clip_ratio_high,
        clip_ratio_c=loss.clip_ratio_c, loss_agg_mode=loss.loss_agg_mode, entropy=entropy,
        entropy_coeff=loss.entropy_coeff, ref_log_prob=log_prob.detach(), kl_loss_type=loss.kl_loss_type,
        kl_loss_coef=loss.kl_loss_coef,
    )
    value.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    return float(metrics["pg_loss"]), float(grad_norm)


@pytest.mark.multiprocess
def test_first_step_matches_the_loss_on_hugging_face(two_rank_runs, model_dir):
    """Every layout's first update reports the policy loss and gradient norm of the same objective written on
    ``transformers``' log-probs: each row's advantage on exactly its response tokens. A scatter or a label
    shifted by one token, or advantages on the wrong rows, change them (the learning test cannot see a one-token
    shift: after a cold start the shifted token is a format token of probability ~1, whose gradient is ~0)."""
    pg_loss, grad_norm = _hf_first_step(model_dir, make_batch(), actor_config(model_dir))
    for name in LAYOUTS:
        first = two_rank_runs[0][name]["first"]
        assert first["actor/pg_loss"] == pytest.approx(pg_loss, rel=1e-5, abs=1e-6), name
        assert first["actor/grad_norm"] == pytest.approx(grad_norm, rel=2e-5), name  # measured 1.4e-6


def _assert_runs_match_hugging_face(two_rank_runs, key: str, model_dir, rows: int = 8) -> None:
    """Every rank's ``key`` run: log-probs and entropies within 1e-4 of transformers' on ``make_batch(rows)``, the
    first update's pg_loss and grad norm the objective's on transformers' log-probs, and a lower second loss."""
    hf_lp, hf_ent = hf_log_probs_and_entropy(model_dir, make_batch(rows))
    pg_loss, grad_norm = _hf_first_step(model_dir, make_batch(rows), actor_config(model_dir))
    for rank_results in two_rank_runs:
        run = rank_results[key]
        assert _max_diff(run["log_probs"], hf_lp) < 1e-4 and _max_diff(run["entropy"], hf_ent) < 1e-4
        assert run["first"]["actor/pg_loss"] == pytest.approx(pg_loss, rel=1e-5, abs=1e-6)
        assert run["first"]["actor/grad_norm"] == pytest.approx(grad_norm, rel=2e-5)
        assert run["second"]["actor/loss"] < run["first"]["actor/loss"] - 1e-3


@pytest.mark.multiprocess
def test_qwen3_at_tp2_matches_hugging_face_log_probs_and_first_step(two_rank_runs, qwen3_dir):
    """Qwen3 (q/k norms, head_dim apart from hidden / heads) through the actor at TP2: log-probs and entropies equal
    transformers', and the first update's loss and gradient norm are the objective's on transformers' log-probs
    (the q/k norm gains' gradients are summed over the TP ranks, each of which holds half of the heads)."""
    _assert_runs_match_hugging_face(two_rank_runs, "qwen3_tp2", qwen3_dir)
    assert "model.layers.0.self_attn.q_norm.weight" in two_rank_runs[0]["qwen3_tp2"]["weights"]


@pytest.mark.multiprocess
def test_qwen3_moe_at_ep2_matches_hugging_face_log_probs_and_first_step(two_rank_runs, moe_dir):
    """Tiny Qwen3-MoE through the actor with its 4 experts split over two expert-parallel ranks (which are its two
    data-parallel ranks, each with its own rows: 4 micro-batches on one, 3 and a stand-in on the other, since every
    MoE layer's token dispatch is a collective of both): log-probs and entropies equal transformers', the first
    update's loss and gradient norm are the objective's on transformers' log-probs (expert gradients from both
    ranks' tokens, averaged as the dense ones), and the second update's loss is lower. The export after the two
    updates (on rank 0) has every HF tensor with its shape, and every expert's weights moved, also those of the
    experts held by the other expert-parallel rank."""
    from safetensors.torch import load_file

    _assert_runs_match_hugging_face(two_rank_runs, "qwen3_moe_ep2", moe_dir, MOE_ROWS)
    weights, original = two_rank_runs[0]["qwen3_moe_ep2"]["weights"], load_file(str(moe_dir / "model.safetensors"))
    assert not two_rank_runs[1]["qwen3_moe_ep2"]["weights"]
    assert sorted(weights) == sorted(original)
    for name, tensor in original.items():
        assert weights[name].shape == tensor.shape, name
        if ".mlp.experts." in name:
            assert not torch.equal(weights[name], tensor), f"{name} did not move in two updates"


@pytest.mark.multiprocess
def test_qwen3_with_sequence_parallelism_takes_the_tp2_step(two_rank_runs):
    """With ``sequence_parallel`` the q/k norms are sequence-parallel norms too (torch's wrapper refuses the
    setting); log-probs, the first update and the updated weights equal plain TP2's."""
    plain, sp = two_rank_runs[0]["qwen3_tp2"], two_rank_runs[0]["qwen3_tp2_sp"]
    assert _max_diff(sp["log_probs"], plain["log_probs"]) < 1e-5
    for key in ("actor/loss", "actor/grad_norm", "actor/pg_loss", "actor/entropy"):
        assert sp["first"][key] == pytest.approx(plain["first"][key], abs=1e-5), key
    for hf_name, tensor in plain["weights"].items():
        torch.testing.assert_close(sp["weights"][hf_name], tensor, atol=1e-6, rtol=0, msg=hf_name)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tp2_pp2_four_ranks(model_dir, hf_reference, two_rank_runs):
    runs = spawn(_tp2_pp2, 4, model_dir, timeout=900)
    hf_lp, _ = hf_reference
    for run in runs:
        assert _max_diff(run["log_probs"], hf_lp) < 1e-4
    reference = two_rank_runs[0]["tp2"]
    assert runs[0]["first"]["actor/loss"] == pytest.approx(reference["first"]["actor/loss"], abs=1e-5)
    for hf_name, tensor in reference["weights"].items():
        torch.testing.assert_close(runs[0]["weights"][hf_name], tensor, atol=1e-6, rtol=0, msg=hf_name)


@pytest.mark.multiprocess
def test_sequence_packing_is_refused_by_the_local_attention_spec(two_rank_runs):
    """Megatron's local DotProductAttention asserts ``packed_seq_params is None``; the actor says so upfront."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the model may use Transformer-Engine attention")
    assert "needs Transformer-Engine attention" in two_rank_runs[0]["packing_error"]


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_sequence_packing_matches_padding_on_gpu(model_dir, hf_reference):
    pytest.importorskip("transformer_engine")
    run = spawn(_packed_vs_padded, 1, model_dir, timeout=900)[0]
    assert _max_diff(run["packed"], run["padded"]) < 1e-4
    assert _max_diff(run["packed"], hf_reference[0]) < 1e-3  # TE kernels (TF32 / flash) on the GPU


def _moe_on_gpu(rank: int, world_size: int, moe_dir) -> dict:
    start_rank()
    return _run_layout(moe_dir, 1, 1, False, extra=False, rows=MOE_ROWS)


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_qwen3_moe_on_gpu_takes_megatron_cores_grouped_gemm_path(moe_dir):
    """The GPU path as megatron-core intends it (Transformer-Engine grouped GEMM experts behind the all-to-all
    dispatcher, chosen by models/builder.py when TE is usable): log-probs within TF32 noise of transformers', and
    the first update lowers the loss. Runs only on a lent device (``scripts/device_check.sh``)."""
    pytest.importorskip("transformer_engine")
    from transformers import AutoConfig

    from megatron_gigpo.models.builder import moe_settings

    settings = moe_settings(AutoConfig.from_pretrained(moe_dir), expert_model_parallel_size=1)
    assert settings["moe_grouped_gemm"] and settings["moe_token_dispatcher_type"] == "alltoall", settings
    run = spawn(_moe_on_gpu, 1, moe_dir, timeout=900)[0]
    hf_lp, _ = hf_log_probs_and_entropy(moe_dir, make_batch(MOE_ROWS))
    assert _max_diff(run["log_probs"], hf_lp) < 1e-3  # TE kernels (TF32) on the GPU
    assert run["second"]["actor/loss"] < run["first"]["actor/loss"]
