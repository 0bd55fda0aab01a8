"""Fuzz of `validate`: every numeric setting has a stated range and a value outside it is refused naming the key
and the range; every choice setting refuses an unknown value naming the valid ones; values on an inclusive
bound are accepted. The settings are enumerated from the dataclasses, so a new field without a range (or a new
string field that is neither a choice nor declared free text) fails here."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest

from megatron_gigpo.config import ConfigError, Range, field_choices, load_config, recipe_fields

pytestmark = pytest.mark.unit

SMOKE = Path(__file__).resolve().parents[2] / "recipes" / "smoke" / "cpu.yaml"

# String settings that name things (paths, URLs, names) rather than pick from a list.
FREE_TEXT = {
    "model.path", "model.revision", "env.data_dir", "env.search.passages_path", "env.search.index_path", "env.search.url",
    "env.search.index_name", "env.search.train_file", "env.search.val_file", "env.alfworld.train_split_dir",
    "env.alfworld.val_split_dir", "rollout.stop", "trainer.output_dir", "trainer.project_name",
    "trainer.experiment_name", "checkpoint.dir", "sft.train_file", "sft.val_file", "env.webshop.items_file",
    "env.webshop.attributes_file", "env.webshop.spacy_model",
}


def _base_type(tp):
    """int / float / str / bool of a field type, looking through ``X | None`` and ``list[X]``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list or (args and len(args) == 1):
        return _base_type(args[0])
    return tp


def _is_list(tp) -> bool:
    return typing.get_origin(tp) is list


FIELDS = list(recipe_fields())
NUMERIC = [(k, f, tp) for k, f, tp in FIELDS if _base_type(tp) in (int, float)]
CHOICE = [(k, f, tp) for k, f, tp in FIELDS if field_choices(f) is not None]


def _outside(rng: Range, integer: bool) -> list[float]:
    """Values just outside each finite bound of ``rng``."""
    step = 1 if integer else 1e-3
    out = []
    if rng.ge is not None:
        out.append(rng.ge - step)
    if rng.gt is not None:
        out.append(rng.gt)
    if rng.le is not None:
        out.append(rng.le + step)
    if rng.lt is not None:
        out.append(rng.lt)
    return [int(v) if integer else v for v in out]


def _override(key: str, tp, value) -> str:
    if _is_list(tp):
        return f"{key}=[{value}, {value}]"
    return f"{key}={value}"


def test_the_enumeration_sees_the_tree():
    keys = {k for k, _, _ in FIELDS}
    assert {"algorithm.clip_ratio_c", "rollout.top_p", "env.sokoban.dim_room", "trainer.timeouts.env_call_s",
            "model.architecture.hidden_size", "trainer.logprob_chunk_size", "trainer.shuffle",
            "trainer.sequence_packing", "algorithm.policy_loss", "env.webshop.items_file",
            "env.webshop.spacy_model", "env.search.top_k"} <= keys
    assert len(NUMERIC) > 60 and len(CHOICE) >= 15


def test_choice_lists_come_from_the_registries():
    from megatron_gigpo.algo.advantages import ADVANTAGE_ESTIMATORS
    from megatron_gigpo.algo.losses import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
    from megatron_gigpo.envs.registry import ENVIRONMENTS

    by_key = {k: f for k, f, _ in FIELDS}
    assert field_choices(by_key["algorithm.adv_estimator"]) == tuple(ADVANTAGE_ESTIMATORS)
    assert field_choices(by_key["algorithm.policy_loss"]) == tuple(POLICY_LOSSES)
    assert field_choices(by_key["algorithm.kl_loss_type"]) == KL_ESTIMATORS
    assert field_choices(by_key["algorithm.loss_agg_mode"]) == field_choices(by_key["sft.loss_agg_mode"]) == LOSS_AGG_MODES
    assert field_choices(by_key["env.name"]) == tuple(ENVIRONMENTS)


@pytest.mark.parametrize("key, f, tp", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_every_numeric_field_states_a_range(key, f, tp):
    rng = f.metadata.get("range")
    assert isinstance(rng, Range), f"{key} has no range: declare it with config.num(default, ge=/gt=/le=/lt=)"
    assert any(b is not None for b in (rng.ge, rng.gt, rng.le, rng.lt)), f"{key}: the range has no bound"


@pytest.mark.parametrize("key, f, tp", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_out_of_range_values_are_refused_naming_key_and_range(key, f, tp):
    rng = f.metadata["range"]
    integer = _base_type(tp) is int
    values = _outside(rng, integer) + ([] if integer else ["nan", "inf", "-inf"])
    assert values
    for value in values:
        with pytest.raises(ConfigError) as info:
            load_config(SMOKE, [_override(key, tp, value)])
        message = str(info.value)
        shown = f"{key}[0]=" if _is_list(tp) else f"{key}="
        assert re.search(re.escape(shown) + r"\S+ must be " + re.escape(str(rng)), message), (value, message)


@pytest.mark.parametrize("key, f, tp", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_inclusive_bounds_pass_the_field_check(key, f, tp):
    """A value on a closed end is in range (other settings may still conflict with it: cross-field checks)."""
    rng = f.metadata["range"]
    for bound in (rng.ge, rng.le):
        if bound is None:
            continue
        value = int(bound) if _base_type(tp) is int else bound
        try:
            load_config(SMOKE, [_override(key, tp, value)])
        except ConfigError as exc:
            shown = f"{key}[0]=" if _is_list(tp) else f"{key}="
            assert not re.search(re.escape(shown) + r"\S+ must be " + re.escape(str(rng)), str(exc)), (value, str(exc))


@pytest.mark.parametrize("key, f, tp", CHOICE, ids=[k for k, _, _ in CHOICE])
def test_unknown_choice_names_the_valid_ones(key, f, tp):
    bad = f"no-such-{key.rsplit('.', 1)[1]}"
    with pytest.raises(ConfigError) as info:  # a list setting is checked item by item
        load_config(SMOKE, [f"{key}=[{bad}]" if _is_list(tp) else f"{key}={bad}"])
    valid = field_choices(f)
    shown = f"{key}[0]" if _is_list(tp) else key
    assert f"{shown}='{bad}' is not one of {', '.join(valid)}" in str(info.value)


def test_every_string_field_is_a_choice_or_declared_free_text():
    strings = {k for k, f, tp in FIELDS if _base_type(tp) is str}
    by_key = {k: f for k, f, _ in FIELDS}
    undecided = sorted(k for k in strings if field_choices(by_key[k]) is None and k not in FREE_TEXT)
    assert not undecided, f"string settings without choices and not declared free text: {undecided}"
    assert FREE_TEXT <= strings, f"stale FREE_TEXT entries: {sorted(FREE_TEXT - strings)}"


@pytest.mark.parametrize("override, message", [
    ("algorithm.clip_ratio_c=0.5", "algorithm.clip_ratio_c=0.5 must be > 1"),
    ("algorithm.kl_loss_coef=-1", "algorithm.kl_loss_coef=-1.0 must be >= 0"),
    ("algorithm.entropy_coeff=-5", "algorithm.entropy_coeff=-5.0 must be >= 0"),
    ("rollout.temperature=-1", "rollout.temperature=-1.0 must be > 0"),
    ("rollout.top_p=2", "rollout.top_p=2.0 must be in (0, 1]"),
    ("env.sokoban.dim_room=[6]", "env.sokoban.dim_room=[6] must have 2 items"),
    ("env.val_num_groups=0", "env.val_num_groups=0 must be >= 1"),
])
def test_values_of_issue_12_are_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(SMOKE, [override])


def test_range_text():
    assert str(Range(gt=0, le=1)) == "in (0, 1]"
    assert str(Range(ge=0, lt=1)) == "in [0, 1)"
    assert str(Range(ge=1)) == ">= 1" and str(Range(gt=0.5)) == "> 0.5"
    assert 1 in Range(gt=0, le=1) and 0 not in Range(gt=0, le=1) and math.nan not in Range(ge=0)
    assert math.inf not in Range(gt=0) and -math.inf not in Range(le=1) and 10**400 in Range(ge=1)
