"""WebShop over generated data files in the real schema: search, pages, purchase reward, task lists."""

import dataclasses
import inspect
import json
import math

import pytest

from megatron_gigpo.envs.base import Task
from megatron_gigpo.envs.webshop import RECIPE, WebShopConfig, WebShopEnv, load_tasks
from megatron_gigpo.envs.webshop.catalog import CatalogFiles, load_catalog
from megatron_gigpo.envs.webshop.env import SEARCH_ACTION
from megatron_gigpo.envs.webshop.reward import normalize_color, purchase_score
from megatron_gigpo.envs.webshop.synthetic import write_synthetic_webshop_data

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("webshop")
    write_synthetic_webshop_data(path, num_products=60, seed=1)
    return path


def _goal_task(data_dir, with_options, human_goals=False):
    for task in load_tasks("train", data_dir, num_val=5, human_goals=human_goals):
        if bool(task.payload["goal"]["goal_options"]) == with_options:
            return task
    raise AssertionError("no goal of the wanted kind in the generated data")


def _goal_options(goal):
    """The option values a goal asks for: synthetic goals name them per option, human goals list them."""
    options = goal["goal_options"]
    return list(options.values()) if isinstance(options, dict) else list(options)


def _open_product(env, task, asin):
    """Search with the instruction and open ``asin`` (paging through results if needed)."""
    step = env.step(f"search[{task.payload['goal']['instruction_text']}]")
    assert step.action_valid
    while f"click[{asin.lower()}]" not in step.admissible_actions:
        assert "click[next >]" in step.admissible_actions, f"{asin} not among the search results"
        step = env.step("click[next >]")
    step = env.step(f"click[{asin.lower()}]")
    assert step.action_valid and step.observation.startswith("Back to Search [SEP] < Prev")
    return step


@pytest.mark.parametrize("human_goals", [False, True])
def test_buying_the_goal_product_earns_10(data_dir, human_goals):
    env = WebShopEnv(data_dir=data_dir, human_goals=human_goals)
    task = _goal_task(data_dir, with_options=True, human_goals=human_goals)
    goal = task.payload["goal"]
    reset = env.reset(task, seed=0)
    assert reset.observation == "Search" and reset.admissible_actions == [SEARCH_ACTION]
    assert reset.task_description == goal["instruction_text"]
    _open_product(env, task, goal["asin"])
    for option in _goal_options(goal):
        assert env.step(f"click[{option}]").action_valid
    step = env.step("click[buy now]")
    assert step.done and step.won and step.reward == 10.0
    assert step.info["score"] == 1.0 and step.info["purchased_asin"] == goal["asin"]
    with pytest.raises(RuntimeError):
        env.step("click[back to search]")


def test_wrong_product_or_options_score_less(data_dir):
    env = WebShopEnv(data_dir=data_dir)
    task = _goal_task(data_dir, with_options=True)
    goal = task.payload["goal"]
    # Right product, options left unchosen.
    env.reset(task, 0)
    _open_product(env, task, goal["asin"])
    step = env.step("click[buy now]")
    assert step.done and not step.won and step.reward == 0.0 and 0.0 < step.info["score"] < 1.0
    # A product of another category.
    catalog = load_catalog(env.catalog.files)
    other = next(p for p in catalog.products if p["category"] != goal["category"])
    env.reset(task, 0)
    env.step(f"search[{other['Title']}]")
    step = env.step(f"click[{other['asin'].lower()}]")
    assert step.action_valid
    step = env.step("click[buy now]")
    assert step.done and step.reward == 0.0 and step.info["score"] < 0.5


def test_pages_and_invalid_actions(data_dir):
    env = WebShopEnv(data_dir=data_dir, max_steps=9)
    task = _goal_task(data_dir, with_options=False)
    env.reset(task, 0)
    bad = env.step("click[buy now]")  # not on the search page
    assert not bad.action_valid and bad.observation == "Search" and not bad.done
    results = env.step("search[shoe chair tea earbuds cream]")
    assert "Page 1 (Total results: " in results.observation and "click[next >]" in results.admissible_actions
    assert SEARCH_ACTION not in results.admissible_actions
    assert not env.step("search[again]").action_valid  # no search bar on result pages
    page2 = env.step("click[next >]")
    assert "Page 2" in page2.observation and "click[< prev]" in page2.admissible_actions
    asin = page2.admissible_actions[-1][len("click["):-1]
    env.step(f"click[{asin}]")
    features = env.step("click[features]")
    assert features.admissible_actions == ["click[back to search]", "click[< prev]"]
    item = env.step("click[< prev]")
    assert "click[buy now]" in item.admissible_actions
    back = env.step("click[< prev]")
    assert "Page 2" in back.observation
    last = env.step("click[back to search]")
    assert last.observation == "Search" and last.done and not last.won  # 9th step: the step limit


def test_reset_is_byte_identical_across_instances(data_dir):
    tasks = load_tasks("val", data_dir, num_val=5)
    a = WebShopEnv(data_dir=data_dir)
    load_catalog.cache_clear()  # the second instance rebuilds catalog and index from the files
    b = WebShopEnv(data_dir=data_dir)
    assert a.catalog is not b.catalog
    for task in tasks:
        assert a.reset(task, 1).observation.encode() == b.reset(task, 1).observation.encode()
        query = f"search[{task.payload['goal']['instruction_text']}]"
        assert a.step(query).observation.encode() == b.step(query).observation.encode()


def test_task_lists_are_deterministic_and_split(data_dir):
    train, val = load_tasks("train", data_dir, num_val=5), load_tasks("val", data_dir, num_val=5)
    load_catalog.cache_clear()
    again = load_tasks("train", data_dir, num_val=5)
    assert [t.payload for t in train] == [t.payload for t in again]
    assert len(val) == 5 and len(train) == len(WebShopEnv(data_dir).catalog.goals) - 5
    assert not {t.task_id for t in train} & {t.task_id for t in val}
    json.dumps([t.payload for t in train])  # payloads travel to workers
    assert len(load_tasks("train", data_dir, num_val=5, num_tasks=3)) == 3
    with pytest.raises(ValueError, match="empty"):
        load_tasks("train", data_dir, num_val=10_000)
    with pytest.raises(ValueError, match="split"):
        load_tasks("test", data_dir)


def test_synthetic_goals_by_default_and_human_goals_on_request(data_dir):
    # verl-agent's default (env.webshop.human_goals: False): one synthetic goal per product with a synthetic
    # instruction and per combination of its options.
    assert WebShopEnv(data_dir).catalog.files.human_goals is False
    synthetic = load_catalog(CatalogFiles(str(data_dir)))
    combos = [math.prod(len(v) for v in p["options"].values()) for p in synthetic.products if p["instruction_text"]]
    assert len(synthetic.goals) == sum(combos) > len(synthetic.products)
    assert all(isinstance(g["goal_options"], dict) for g in synthetic.goals)
    human = load_catalog(CatalogFiles(str(data_dir), human_goals=True))
    assert len(human.goals) == len(human.products)  # the generated data has one human goal per product
    assert all(isinstance(g["goal_options"], list) for g in human.goals)
    tasks = load_tasks("val", data_dir, num_val=5, human_goals=True)
    assert [t.payload["goal"] for t in tasks] == human.goals[:5]


def test_project_action(data_dir):
    env = WebShopEnv(data_dir=data_dir)
    adm = ["click[back to search]", "click[b000000001]"]
    ok = env.project_action("<think>t</think><action>click[B000000001]</action>", adm)
    assert ok.valid and ok.action == "click[b000000001]"
    # verl-agent's rule is the format only: well-formed actions the page does not offer are not penalised;
    # they are sent lower-cased, and the page ignores them (StepResult.action_valid False).
    search = env.project_action("<think>t</think><action>search[Red Shoes]</action>", adm)
    assert search.valid and search.action == "search[red shoes]"
    buy = env.project_action("<think>t</think><action>buy it</action>", adm)
    assert buy.valid and buy.action == "buy it"
    assert not env.project_action("<action>click[b000000001]</action>", adm).valid  # no think tags
    cjk = env.project_action("<think>\u8d2d\u4e70</think><action>click[b000000001]</action>", adm)
    assert not cjk.valid and cjk.action == "click[b000000001]"
    text = "I will click on the first result"
    no_tag = env.project_action(text, adm)
    assert not no_tag.valid and no_tag.action == text.lower()[-20:]
    env.reset(_goal_task(data_dir, with_options=False), 0)
    step = env.step(buy.action)
    assert not step.action_valid and step.observation == "Search" and not step.done


def test_reward_components():
    product = {
        "name": "Acme Running Shoe", "Title": "Acme Running Shoe", "query": "running shoes",
        "product_category": "Clothing › Men › Shoes", "Attributes": ["rubber sole", "lace up"],
        "BulletPoints": ["machine washable"], "Description": "light",
    }
    goal = {
        "name": "Acme Running Shoe", "query": "running shoes", "product_category": "Clothing › Men › Shoes",
        "attributes": ["rubber-sole", "machine washable", "waterproof"], "goal_options": ["navy blue", "10"],
        "price_upper": 50.0,
    }
    score, info = purchase_score(product, goal, 40.0, {"color": "dark navy blue", "size": "10"})
    assert info["r_type"] == 1.0 and info["r_price"]
    assert score == pytest.approx((2 + 2 + 1) / (3 + 2 + 1))  # "waterproof" is missing
    score, info = purchase_score(product, goal, 60.0, {"size": "10.5"})  # size needs an exact match
    assert score == pytest.approx((2 + 0 + 0) / 6)
    assert normalize_color("dark navy blue") == "navy blue" and normalize_color("plaid") == "plaid"
    other = dict(product, name="Cobalt Tea Bags", Title="Cobalt Tea Bags")
    assert purchase_score(other, goal, 40.0, {})[1]["r_type"] == 0.0


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_dir"):
        WebShopEnv(data_dir=tmp_path / "nowhere")
    write_synthetic_webshop_data(tmp_path, num_products=3)
    (tmp_path / "items_ins_v2_1000.json").unlink()
    with pytest.raises(FileNotFoundError, match="items_ins_v2_1000.json"):
        WebShopEnv(data_dir=tmp_path)
    write_synthetic_webshop_data(tmp_path, num_products=3)
    env = WebShopEnv(data_dir=tmp_path)
    with pytest.raises(ValueError, match="payload has no 'goal'"):
        env.reset(Task(env="webshop", task_id="0", split="train"), 0)


def test_reviews_file_is_shown(data_dir, tmp_path):
    task = _goal_task(data_dir, with_options=False)
    asin = task.payload["goal"]["asin"]
    files = CatalogFiles(str(data_dir))
    for name in (files.items_file, files.attributes_file, files.human_goals_file):
        (tmp_path / name).write_bytes((data_dir / name).read_bytes())
    reviews = [{"asin": asin, "average_rating": 4.5, "reviews": [{"title": "Great", "stars": 5, "review": "fits"}]}]
    (tmp_path / "reviews.json").write_text(json.dumps(reviews))
    env = WebShopEnv(data_dir=tmp_path, reviews_file="reviews.json")
    env.reset(task, 0)
    item = _open_product(env, task, asin)
    assert "Rating: 4.5" in item.observation
    assert env.step("click[reviews]").observation == "Back to Search [SEP] < Prev [SEP] Great 5 fits"


def test_catalog_defaults_are_webshops_and_every_layer_reads_them(tmp_path):
    # WebShop's small setting (setup.sh -d small): the 1,000-product files, synthetic goals, goal seed 233.
    files = CatalogFiles("data")
    assert (files.items_file, files.attributes_file, files.human_goals_file, files.reviews_file) == (
        "items_shuffle_1000.json", "items_ins_v2_1000.json", "items_human_ins.json", None)
    assert (files.num_products, files.human_goals, files.goal_seed) == (1000, False, 233)
    for layer in (WebShopEnv, load_tasks):
        params = inspect.signature(layer).parameters
        for field in dataclasses.fields(CatalogFiles)[1:]:  # all but data_dir
            assert params[field.name].default == getattr(files, field.name), (layer.__name__, field.name)
    recipe = WebShopConfig()
    for key in ("num_products", "human_goals", "items_file", "attributes_file"):
        assert getattr(recipe, key) == getattr(files, key), key
    assert recipe.spacy_model is None and inspect.signature(WebShopEnv).parameters["spacy_model"].default is None
    written = write_synthetic_webshop_data(tmp_path, num_products=1)
    assert sorted(p.name for p in written.values()) == sorted(
        [files.items_file, files.attributes_file, files.human_goals_file])


def test_recipe_sample_data_runs_with_the_recipe_defaults(tmp_path):
    from megatron_gigpo.config import EnvConfig
    from megatron_gigpo.envs.registry import check_env_resources, env_kwargs, make_env

    RECIPE.sample_data(tmp_path / "webshop")
    env = EnvConfig(name="webshop", data_dir=str(tmp_path / "webshop"), max_steps=RECIPE.step_limit)
    assert check_env_resources(env) == []
    shop = make_env("webshop", **env_kwargs(env))
    assert len(shop.catalog.products) == WebShopConfig().num_products and shop.max_steps == 15
