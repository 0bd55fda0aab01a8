"""WebShop's product catalog, goals and BM25 product search, loaded from the benchmark's data files.

Files (the names of WebShop's ``data/`` folder; the small setting uses the ``_1000`` files):

* ``items_shuffle_1000.json`` — list of products: ``asin``, ``name``, ``full_description``,
  ``small_description`` (list of bullet points or a string), ``pricing`` (``"$12.99"`` or ``"$12.99 - $15.99"``),
  ``product_category`` (``"A › B › C"``), ``category``, ``query``, ``customization_options``
  (``{option name: [{"value": str, "image": str}, ...] | None}``), ``images``.
* ``items_ins_v2_1000.json`` — ``{asin: {"attributes": [...], "instruction": str,
  "instruction_attributes": [...]}}``: product attributes, and the synthetic instructions.
* ``items_human_ins.json`` — ``{asin: [{"instruction": str, "instruction_attributes": [...],
  "instruction_options": [...]}, ...]}``: the human-written goals (used when ``human_goals``).
* optional reviews file — ``[{"asin": str, "average_rating": ..., "reviews": [{"title", "score"|"stars",
  "review"|"body"}]}]``.

Product fields are derived as in WebShop's ``web_agent_site/engine/engine.py::load_products`` and goals as in
``engine/goal.py`` (human goals, or one synthetic goal per option combination), with one change: the random
draws (goal price ceilings, the price of a product whose pricing is a range) come from generators seeded per
goal/product instead of the global ``random`` module, so the goal list is the same in every process. Goals are
then shuffled with ``random.Random(goal_seed)`` (WebShop uses seed 233); the first ``num_val`` goals are the
val split (verl-agent: 500), the rest train.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import zlib
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

# The catalog's defaults, each stated only here: CatalogFiles, WebShopEnv, load_tasks, the recipe's env.webshop
# settings (WebShopConfig) and the synthetic data writer read them.
ITEMS_FILE = "items_shuffle_1000.json"  # WebShop's 1,000-product subset (setup.sh -d small)
ATTRIBUTES_FILE = "items_ins_v2_1000.json"
HUMAN_GOALS_FILE = "items_human_ins.json"
REVIEWS_FILE: str | None = None  # no reviews file: no reviews, rating "N.A."
# Synthetic goals (verl-agent's default: env.webshop.human_goals: False in verl/trainer/config/ppo_trainer.yaml).
HUMAN_GOALS = False
NUM_PRODUCTS = 1000  # products kept from the items file (the recipe's env.webshop.num_products)
GOAL_SEED = 233  # WebShop's goal shuffle seed

SEARCH_RETURN_N = 50  # WebShop returns the top 50 hits, shown 10 per page.
PRICE_RANGE = [10.0 * i for i in range(1, 100)]
_NO_PRICE_CEILING = 1_000_000.0
_HOW_TO_GET_DATA = (
    f"Get the WebShop data files ({ITEMS_FILE}, {ATTRIBUTES_FILE}, {HUMAN_GOALS_FILE}) from the "
    "WebShop repository's setup script (princeton-nlp/WebShop, setup.sh -d small) and set the WebShop data_dir "
    "to the folder holding them; megatron_gigpo.envs.webshop.synthetic.write_synthetic_webshop_data writes "
    "small files in the same schema for tests and smoke runs."
)


@dataclass(frozen=True)
class CatalogFiles:
    """Where the WebShop data lives. All names are relative to ``data_dir``.

    Attributes:
        data_dir: folder with the data files.
        items_file: product list.
        attributes_file: per-product attributes and synthetic instructions.
        human_goals_file: human instructions (read only when ``human_goals``).
        reviews_file: optional reviews/ratings file; None shows no reviews and rating "N.A.".
        human_goals: use the human instructions (True) or the synthetic ones (False, the default: verl-agent's
            ``env.webshop.human_goals: False`` in ``verl/trainer/config/ppo_trainer.yaml``).
        num_products: keep only the first ``num_products`` products (None: all), like WebShop's ``num_products``;
            default :data:`NUM_PRODUCTS` (1000).
        goal_seed: seed of the goal shuffle and of the per-goal price draws (WebShop: 233).

    The defaults are the module constants above (:data:`ITEMS_FILE`, ...).
    """

    data_dir: str
    items_file: str = ITEMS_FILE
    attributes_file: str = ATTRIBUTES_FILE
    human_goals_file: str = HUMAN_GOALS_FILE
    reviews_file: str | None = REVIEWS_FILE
    human_goals: bool = HUMAN_GOALS
    num_products: int | None = NUM_PRODUCTS
    goal_seed: int = GOAL_SEED


def _read_json(data_dir: Path, name: str, what: str) -> Any:
    path = data_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"WebShop {what} file {str(path)!r} not found. {_HOW_TO_GET_DATA}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _parse_pricing(pricing: Any) -> tuple[list[float], str]:
    """WebShop's price list and price tag from the raw ``pricing`` string (``$100.0`` when missing)."""
    if not pricing:
        return [100.0], "$100.0"
    values = [float(Decimal(re.sub(r"[^\d.]", "", part))) for part in str(pricing).split("$")[1:]]
    if not values:
        return [100.0], "$100.0"
    if len(values) == 1:
        return values, f"${values[0]}"
    return values[:2], f"${values[0]} to ${values[1]}"


def _parse_options(customization_options: Any) -> dict[str, list[str]]:
    """Option name → values, lower-cased, ``/`` shown as `` | `` (as WebShop's loader does)."""
    options: dict[str, list[str]] = {}
    if not customization_options:
        return options
    for name, contents in customization_options.items():
        if contents is None:
            continue
        options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
    return options


def _seeded(*parts: Any) -> random.Random:
    return random.Random(zlib.crc32("/".join(map(str, parts)).encode()))


def _price_ceiling(price: float, rng: random.Random) -> tuple[float, str]:
    """A goal's price ceiling: the larger of two of the next four multiples of 10 above ``price``."""
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) < 2:
        return _NO_PRICE_CEILING, ""
    upper = max(rng.sample(candidates, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


class Catalog:
    """Products, their prices, the goal list and a tantivy BM25 index over the products.

    Built by :func:`load_catalog` (cached per process). Products are dicts with WebShop's derived fields:
    ``Title``, ``Description``, ``BulletPoints``, ``Price`` (tag), ``pricing``, ``options``, ``Attributes``,
    ``Reviews``, ``Rating``, plus the raw ``asin``, ``name``, ``query``, ``category``, ``product_category``.
    """

    def __init__(self, files: CatalogFiles) -> None:
        data_dir = Path(files.data_dir).expanduser()
        if not data_dir.is_dir():
            raise FileNotFoundError(f"WebShop data_dir {str(data_dir)!r} does not exist. {_HOW_TO_GET_DATA}")
        self.files = files
        raw = _read_json(data_dir, files.items_file, "products")
        attributes = _read_json(data_dir, files.attributes_file, "attributes")
        human = _read_json(data_dir, files.human_goals_file, "human goals") if files.human_goals else {}
        reviews = {} if files.reviews_file is None else {
            r["asin"]: r for r in _read_json(data_dir, files.reviews_file, "reviews")
        }
        if not isinstance(raw, list):
            raise ValueError(f"WebShop products file {files.items_file!r} must hold a JSON list of products")
        if files.num_products is not None:
            raw = raw[: files.num_products]
        self.products: list[dict[str, Any]] = []
        self.by_asin: dict[str, dict[str, Any]] = {}
        for item in raw:
            product = self._derive(item, attributes, human, reviews)
            if product is not None:
                self.products.append(product)
                self.by_asin[product["asin"]] = product
        if not self.products:
            raise ValueError(f"WebShop products file {files.items_file!r} has no usable product")
        self.prices = {p["asin"]: self._price(p) for p in self.products}
        goals = self._human_goals() if files.human_goals else self._synthetic_goals()
        random.Random(files.goal_seed).shuffle(goals)
        self.goals: list[dict[str, Any]] = goals
        self._index, self._searcher = self._build_index()

    def _derive(self, item: dict, attributes: dict, human: dict, reviews: dict) -> dict[str, Any] | None:
        asin = item["asin"]
        if asin == "nan" or len(asin) > 10 or asin in self.by_asin:
            return None
        pricing, price_tag = _parse_pricing(item["pricing"] if "pricing" in item else None)
        bullets = item["small_description"]
        review = reviews[asin] if asin in reviews else None
        product = {
            "asin": asin,
            "name": item["name"],
            "category": item["category"],
            "query": item["query"].lower().strip(),
            "product_category": item["product_category"],
            "Title": item["name"],
            "Description": item["full_description"] or "",
            "BulletPoints": bullets if isinstance(bullets, list) else [bullets],
            "pricing": pricing,
            "Price": price_tag,
            "options": _parse_options(item["customization_options"]),
            "Attributes": attributes[asin]["attributes"] if asin in attributes and "attributes" in attributes[asin]
            else ["DUMMY_ATTR"],
            "Reviews": [] if review is None else review["reviews"],
            "Rating": "N.A." if review is None else review["average_rating"],
        }
        if self.files.human_goals:
            product["instructions"] = human[asin] if asin in human else []
        else:
            entry = attributes[asin] if asin in attributes else {}
            # Not every product has a synthetic instruction; those get no goal.
            product["instruction_text"] = entry["instruction"] if "instruction" in entry else None
            product["instruction_attributes"] = (
                entry["instruction_attributes"] if "instruction_attributes" in entry else None
            )
        return product

    def _price(self, product: dict[str, Any]) -> float:
        pricing = product["pricing"]
        if len(pricing) == 1:
            return pricing[0]
        return _seeded(self.files.goal_seed, "price", product["asin"]).uniform(*pricing[:2])

    def _goal(self, product: dict[str, Any], instruction: str, attrs: list, options: Any, n: int) -> dict[str, Any]:
        rng = _seeded(self.files.goal_seed, product["asin"], n)
        upper, price_text = _price_ceiling(self.prices[product["asin"]], rng)
        return {
            "asin": product["asin"],
            "category": product["category"],
            "query": product["query"],
            "name": product["name"],
            "product_category": product["product_category"],
            "instruction_text": instruction + price_text,
            "attributes": list(attrs),
            "price_upper": upper,
            "goal_options": options,
        }

    def _human_goals(self) -> list[dict[str, Any]]:
        goals = []
        for product in self.products:
            for n, ins in enumerate(product["instructions"]):
                if not ins["instruction_attributes"]:
                    continue  # WebShop skips goals without attributes
                options = [str(o).lower() for o in ins["instruction_options"]]
                instruction = ins["instruction"].strip(".")
                goals.append(self._goal(product, instruction, ins["instruction_attributes"], options, n))
        return goals

    def _synthetic_goals(self) -> list[dict[str, Any]]:
        goals = []
        for product in self.products:
            if product["instruction_text"] is None or not product["instruction_attributes"]:
                continue
            names = sorted(product["options"])
            for n, combo in enumerate(itertools.product(*(product["options"][k] for k in names))):
                chosen = dict(zip(names, combo, strict=True))
                text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
                instruction = product["instruction_text"] + (f" with {text}" if text else "")
                goals.append(self._goal(product, instruction, product["instruction_attributes"], chosen, n))
        return goals

    def _build_index(self):
        """In-memory tantivy index; the document text is WebShop's (title, description, first bullet, options)."""
        import tantivy

        builder = tantivy.SchemaBuilder()
        builder.add_text_field("asin", stored=True, tokenizer_name="raw")
        builder.add_text_field("contents", stored=False, tokenizer_name="en_stem")
        index = tantivy.Index(builder.build())
        # One thread, one commit: a single segment, so ties keep insertion order in every process.
        writer = index.writer(heap_size=50_000_000, num_threads=1)
        for p in self.products:
            option_text = ", and ".join(f"{k}: {', '.join(v)}" for k, v in p["options"].items())
            first_bullet = p["BulletPoints"][0] if p["BulletPoints"] else ""
            contents = " ".join([p["Title"], p["Description"], str(first_bullet or ""), option_text]).lower()
            writer.add_document(tantivy.Document(asin=p["asin"], contents=contents))
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        return index, index.searcher()

    def search(self, keywords: str, k: int = SEARCH_RETURN_N) -> list[dict[str, Any]]:
        """Top-``k`` products for a free-text query by BM25 (tantivy); [] when the query has no word."""
        words = re.findall(r"\w+", keywords.lower())
        if not words:
            return []
        query = self._index.parse_query(" ".join(words), ["contents"])
        hits = self._searcher.search(query, k).hits
        return [self.by_asin[self._searcher.doc(address)["asin"][0]] for _, address in hits]


@functools.lru_cache(maxsize=4)
def load_catalog(files: CatalogFiles) -> Catalog:
    """The :class:`Catalog` of ``files``, built once per process (environments in one worker share it)."""
    return Catalog(files)
