"""Small WebShop data files in the real schema, for tests, benchmarks and smoke runs without the download.

:func:`write_synthetic_webshop_data` writes the catalog's default files (:data:`.catalog.ITEMS_FILE`,
``ATTRIBUTES_FILE``, ``HUMAN_GOALS_FILE``: ``items_shuffle_1000.json``, ``items_ins_v2_1000.json`` and
``items_human_ins.json``, the field layout documented in :mod:`megatron_gigpo.envs.webshop.catalog`) with
products drawn from a handful of categories, so that searches, wrong purchases and perfect purchases behave
as in the real benchmark. The content is generated; it is not WebShop data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_gigpo.envs.webshop.catalog import ATTRIBUTES_FILE, HUMAN_GOALS_FILE, ITEMS_FILE
from megatron_gigpo.files import write_text_atomic

# (category, query, category path, product nouns, attribute pool)
_CATEGORIES = [
    ("beauty", "face moisturizer", "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
     ["face cream", "moisturizer", "night cream", "serum"],
     ["paraben free", "long lasting", "natural ingredients", "cruelty free", "sensitive skin", "fragrance free"]),
    ("fashion", "running shoes", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
     ["running shoe", "sneaker", "trail shoe", "walking shoe"],
     ["rubber sole", "lace up", "machine washable", "non slip", "memory foam", "breathable mesh"]),
    ("grocery", "green tea", "Grocery & Gourmet Food › Beverages › Tea › Green",
     ["green tea", "matcha powder", "herbal tea", "tea bags"],
     ["gluten free", "non gmo", "low calorie", "caffeine free", "usda organic", "sugar free"]),
    ("electronics", "wireless earbuds", "Electronics › Headphones › Earbud Headphones",
     ["earbuds", "headphones", "headset", "earphones"],
     ["noise cancelling", "water resistant", "fast charging", "long battery life", "hands free", "high fidelity"]),
    ("garden", "office chair", "Home & Kitchen › Furniture › Home Office Furniture › Chairs",
     ["office chair", "desk chair", "gaming chair", "stool"],
     ["easy assemble", "lumbar support", "height adjustable", "steel frame", "high density", "living room"]),
]
_BRANDS = ["Acme", "Borealis", "Cobalt", "Dovetail", "Evergreen", "Fjord", "Granite", "Halcyon", "Indigo", "Juniper"]
_COLORS = ["black", "white", "navy blue", "red", "grey", "green"]
_SIZES = ["small", "medium", "large", "x-large", "8", "9", "10", "11"]


def _product(rng: random.Random, index: int) -> tuple[dict, dict, list[dict]]:
    """(product record, attribute record, human instructions) of one generated product."""
    category, query, path, nouns, pool = _CATEGORIES[index % len(_CATEGORIES)]
    noun = rng.choice(nouns)
    brand = rng.choice(_BRANDS)
    attributes = rng.sample(pool, 3)
    asin = f"B{index:09d}"
    options = {}
    if rng.random() < 0.8:
        options["color"] = [{"value": c.title(), "image": ""} for c in rng.sample(_COLORS, rng.randint(2, 4))]
    if rng.random() < 0.6:
        options["size"] = [{"value": s, "image": ""} for s in rng.sample(_SIZES, rng.randint(2, 4))]
    low = round(rng.uniform(5, 80), 2)
    pricing = f"${low}" if rng.random() < 0.7 else f"${low} - ${round(low * 1.3, 2)}"
    name = f"{brand} {noun.title()} {attributes[0].title()} {rng.randint(2, 99)} Pack"
    product = {
        "asin": asin,
        "name": name,
        "full_description": f"This {noun} by {brand} is {attributes[1]} and {attributes[2]}.",
        "small_description": [f"{a.capitalize()} design" for a in attributes[1:]],
        "pricing": pricing,
        "images": [""],
        "product_category": path,
        "category": category,
        "query": query,
        "customization_options": options,
    }
    goal_options = [rng.choice(v)["value"].lower() for v in options.values()]
    wanted = rng.sample(attributes, 2)
    instruction = f"i am looking for a {wanted[0]} {noun} that is {wanted[1]}"
    if goal_options:
        instruction += " in " + " and ".join(goal_options)
    attribute_record = {"attributes": attributes, "instruction": f"i want a {wanted[0]} {noun}",
                        "instruction_attributes": wanted}
    human = [{"asin": asin, "instruction": instruction, "instruction_attributes": wanted,
              "instruction_options": goal_options}]
    return product, attribute_record, human


def write_synthetic_webshop_data(out_dir: str | Path, num_products: int = 100, seed: int = 0) -> dict[str, Path]:
    """Write generated WebShop data files into ``out_dir`` (created if missing; files replaced atomically).

    Args:
        out_dir: destination folder.
        num_products: products to generate (each gets one human goal).
        seed: generator seed; the same seed gives byte-identical files.

    Returns:
        {"items": path, "attributes": path, "human_goals": path}.

    Raises:
        ValueError: ``num_products`` < 1.
    """
    if num_products < 1:
        raise ValueError(f"write_synthetic_webshop_data: num_products must be >= 1, got {num_products}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    items, attrs, human = [], {}, {}
    for i in range(num_products):
        product, attribute_record, instructions = _product(rng, i)
        items.append(product)
        attrs[product["asin"]] = attribute_record
        human[product["asin"]] = instructions
    paths = {"items": out / ITEMS_FILE, "attributes": out / ATTRIBUTES_FILE, "human_goals": out / HUMAN_GOALS_FILE}
    write_text_atomic(paths["items"], json.dumps(items))
    write_text_atomic(paths["attributes"], json.dumps(attrs))
    write_text_atomic(paths["human_goals"], json.dumps(human))
    return paths
