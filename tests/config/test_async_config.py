"""``rollout.asynchronous`` (asynchronous rollout with bounded staleness, docs/async-rollout-design.md D8): its
defaults, the four refusals of :func:`megatron_gigpo.rollout.config.async_errors` through the recipe check, and
every shipped recipe keeping the synchronous default."""

from pathlib import Path

import pytest

from megatron_gigpo.config import ConfigError, load_config
from megatron_gigpo.rollout.config import AsyncConfig

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CPU_SOKOBAN = RECIPES / "cpu" / "sokoban.yaml"
# A valid asynchronous layout of the CPU recipe: engines of their own, recomputed proximal policy, TIS.
VALID = ["rollout.asynchronous.enabled=true", "rollout.weight_sync_mode=disaggregated",
         "algorithm.rollout_correction.mode=tis", "trainer.old_log_probs=recompute"]  # the recipe takes the engine's


def _recipes() -> list[Path]:
    return sorted(p for p in RECIPES.rglob("*.yaml") if p.name != "base.yaml" and "_base" not in p.parts)


def test_defaults_are_synchronous():
    assert AsyncConfig() == AsyncConfig(enabled=False, max_staleness=1)


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_every_shipped_recipe_stays_synchronous(recipe):
    assert load_config(recipe).rollout.asynchronous == AsyncConfig()


def test_a_valid_asynchronous_recipe_loads():
    cfg = load_config(CPU_SOKOBAN, VALID + ["rollout.asynchronous.max_staleness=2"])
    assert cfg.rollout.asynchronous == AsyncConfig(enabled=True, max_staleness=2)


def test_max_staleness_zero_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.asynchronous.max_staleness=0 must be >= 1"):
        load_config(CPU_SOKOBAN, VALID + ["rollout.asynchronous.max_staleness=0"])


@pytest.mark.parametrize("override, message", [
    ("rollout.weight_sync_mode=colocated",
     "rollout.asynchronous.enabled=true needs rollout.weight_sync_mode=disaggregated, got colocated: colocated "
     "engines share the actor's devices and sleep while it trains, so there is nothing to overlap; set "
     "rollout.weight_sync_mode=disaggregated or rollout.asynchronous.enabled=false"),
    ("trainer.old_log_probs=rollout",
     "rollout.asynchronous.enabled=true with trainer.old_log_probs=rollout: stale groups are clipped around the "
     "recomputed (proximal) policy, not the engine's; set trainer.old_log_probs=recompute"),
    ("algorithm.rollout_correction.mode=none",
     "rollout.asynchronous.enabled=true with algorithm.rollout_correction.mode=none: groups sampled by an older "
     "policy need the behaviour correction; set algorithm.rollout_correction.mode=tis or mis"),
])
def test_each_refusal_names_keys_values_and_fix(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(CPU_SOKOBAN, VALID + [override])
    assert message in str(err.value)
    assert str(err.value).count("rollout.asynchronous.enabled=true") == 1  # this refusal only


def test_router_replay_is_refused():
    """Checked on the sections directly: the recipe check also refuses router replay for the CPU recipe's dense
    model (:func:`~megatron_gigpo.algo.config.router_replay_errors`), and no shipped recipe is a CPU MoE."""
    from megatron_gigpo.rollout.config import async_errors

    cfg = load_config(CPU_SOKOBAN, VALID)
    cfg.algorithm.router_replay = "rollout"
    assert async_errors(cfg.rollout, cfg.trainer, cfg.algorithm) == [
        "rollout.asynchronous.enabled=true with algorithm.router_replay=rollout: not combined yet (untested); set "
        "algorithm.router_replay=off or rollout.asynchronous.enabled=false"]
    cfg.rollout.asynchronous.enabled = False
    assert async_errors(cfg.rollout, cfg.trainer, cfg.algorithm) == []
