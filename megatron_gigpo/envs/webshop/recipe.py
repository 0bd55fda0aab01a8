"""WebShop's recipe hooks: the ``env.webshop`` settings and their mapping onto :class:`.env.WebShopEnv` and its
task list (:class:`megatron_gigpo.envs.recipe.EnvRecipe`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gigpo.envs.base import Task
from megatron_gigpo.envs.recipe import EnvRecipe, data_dir_problems, env_path
from megatron_gigpo.envs.webshop.catalog import ATTRIBUTES_FILE, HUMAN_GOALS, ITEMS_FILE, NUM_PRODUCTS
from megatron_gigpo.envs.webshop.env import MAX_STEPS, load_tasks
from megatron_gigpo.envs.webshop.reward import SPACY_MODEL
from megatron_gigpo.episodes.templates import COMPACT_LAYOUT, COMPACT_REPLY, THINK_THEN_ACTION, PromptTemplate
from megatron_gigpo.fields import num


@dataclass
class WebShopConfig:
    """``env.webshop``: the catalog under ``env.data_dir`` and the goal set. Defaults: the catalog's
    (:mod:`.catalog`: ``NUM_PRODUCTS``, ``HUMAN_GOALS``, ``ITEMS_FILE``, ``ATTRIBUTES_FILE``) and the reward's
    (:data:`.reward.SPACY_MODEL`)."""

    num_products: int = num(NUM_PRODUCTS, ge=1)
    # Goal set: WebShop's synthetic goals (False, one per product and option combination; verl-agent's default,
    # env.webshop.human_goals: False in verl/trainer/config/ppo_trainer.yaml) or its human-written ones (True).
    human_goals: bool = HUMAN_GOALS
    # Product and attribute files in env.data_dir: the 1,000-product subset (setup.sh -d small), or
    # items_shuffle.json and items_ins_v2.json for WebShop's full catalog (-d all)
    items_file: str = ITEMS_FILE
    attributes_file: str = ATTRIBUTES_FILE
    # spaCy pipeline for the type reward's title nouns (en_core_web_lg, as WebShop's own scorer; must be installed);
    # null: content words
    spacy_model: str | None = SPACY_MODEL


def _catalog(env: Any) -> dict[str, Any]:
    w = env.webshop
    return {"data_dir": env_path(env.data_dir, "env.data_dir"), "num_products": w.num_products,
            "human_goals": w.human_goals, "items_file": w.items_file, "attributes_file": w.attributes_file}


def _env_kwargs(env: Any) -> dict[str, Any]:
    return _catalog(env) | {"max_steps": env.max_steps, "spacy_model": env.webshop.spacy_model}


def _task_list(env: Any, split: str) -> list[Task]:
    return load_tasks(split, **_catalog(env))


def _sample_data(folder: Path) -> None:
    """Generated WebShop files in the real schema (:func:`.synthetic.write_synthetic_webshop_data`, seed 0), as
    many products as ``env.webshop.num_products`` keeps by default (:data:`.catalog.NUM_PRODUCTS`)."""
    from megatron_gigpo.envs.webshop.synthetic import write_synthetic_webshop_data

    write_synthetic_webshop_data(folder, num_products=NUM_PRODUCTS, seed=0)


def _installed_pipeline(model: str) -> bool:
    """A spaCy pipeline package of that name, or a pipeline directory (``spacy.load`` takes either)."""
    import importlib.util

    if Path(model).expanduser().is_dir():
        return True
    try:
        return importlib.util.find_spec(model) is not None
    except (ImportError, ValueError):
        return False


def _check_resources(env: Any) -> list[str]:
    """The data folder and its files (both task lists load), and the spaCy pipeline when one is named."""
    problems = data_dir_problems(env, _task_list)
    model = env.webshop.spacy_model
    if model is not None:
        import importlib.util

        if importlib.util.find_spec("spacy") is None:
            problems.append(f"env.webshop.spacy_model={model!r} needs spaCy: pip install spacy")
        elif not _installed_pipeline(model):
            problems.append(f"env.webshop.spacy_model={model!r} is not installed: python -m spacy download {model}")
    return problems


WEBSHOP_TEMPLATE = PromptTemplate(
    env="webshop",
    preamble=(
        "You are an expert shopping agent in WebShop, an online store shown as text (page elements are "
        "separated by [SEP]). Find the product the instruction describes: search with search[your query], "
        "open results and choose product options with click[...], and finish with click[buy now] once the "
        "product and its options match the instruction."
    ),
    task_label="Your instruction",
    history_intro="each as the page you saw and the action you took",
    instruction=THINK_THEN_ACTION.format(what="admissible action", example="search[red cotton t-shirt]"),
)

COMPACT_WEBSHOP_TEMPLATE = PromptTemplate(
    env="webshop",
    preamble="WebShop: a text store. search[query], click[...] on results and options, then click[buy now].",
    task_label="Instruction",
    history_intro="",
    instruction=COMPACT_REPLY.format(what="one action from the list"),
    layout=COMPACT_LAYOUT,
)


RECIPE = EnvRecipe(section="webshop", settings=WebShopConfig, env_kwargs=_env_kwargs, task_list=_task_list,
                   check_resources=_check_resources, templates=(WEBSHOP_TEMPLATE, COMPACT_WEBSHOP_TEMPLATE),
                   step_limit=MAX_STEPS, sample_data=_sample_data)
