"""WebShop's purchase score (Yao et al., 2022, "WebShop", Sec. 3.2 and ``web_agent_site/engine/goal.py``).

    score = r_type · (|attributes matched| + |options matched| + 1[price ≤ ceiling])
                   / (|goal attributes| + |goal options| + 1)

* attributes: a goal attribute matches when a product attribute has fuzzy token-set similarity > 85, or the
  attribute text appears in the product's title, bullet points or description;
* options: each chosen option matches a goal option exactly (``size``) or by fuzzy similarity > 85 (after
  colour normalisation), or appears in the product text;
* r_type ∈ {0, 0.1, 0.5, 1}: whether the product is the goal's type, from the query, the category path and the
  overlap of the titles' nouns.

Fuzzy similarity is rapidfuzz's ``token_set_ratio`` with the default processor (the same scores as thefuzz,
which WebShop uses). Title nouns come from a spaCy pipeline with a tagger when ``spacy_model`` is given
(WebShop uses ``en_core_web_lg``); without one, the title's content words (alphabetic words that are not
function words) stand in for the nouns, which keeps the goal product's own title score at 1 and avoids
importing spaCy (seconds per worker process) when no pipeline is installed.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from rapidfuzz import fuzz, utils

FUZZY_THRESHOLD = 85
# spaCy pipeline for the title nouns by default: none (content words). WebShopEnv and the recipe's
# env.webshop.spacy_model read this default.
SPACY_MODEL: str | None = None
EXACT_MATCH_OPTIONS = ("size",)
# Colour names checked longest-first so that "light blue" wins over "blue".
_COLORS = sorted(
    [
        "black", "white", "red", "blue", "green", "yellow", "pink", "purple", "orange", "brown", "grey", "gray",
        "silver", "gold", "beige", "navy", "navy blue", "light blue", "dark blue", "sky blue", "royal blue",
        "dark green", "light green", "olive", "khaki", "ivory", "cream", "tan", "maroon", "burgundy", "wine",
        "teal", "turquoise", "aqua", "coral", "peach", "rose", "rose gold", "lavender", "violet", "mint",
        "charcoal", "dark grey", "light grey", "clear", "multicolor", "camel", "coffee", "apricot", "champagne",
    ],
    key=len,
    reverse=True,
)


_WORD = re.compile(r"[a-z]+")
# Function words dropped by the content-word fallback: articles, pronouns, prepositions, conjunctions,
# auxiliaries and quantifiers that never name a product type.
_FUNCTION_WORDS = frozenset(
    """a an the this that these those it its i me my we our you your he she they them their
    of in on at to for from by with without about into onto over under up down out off as than
    and or nor but so if then both either neither each every all any some no not only very
    is are was were be been being am do does did has have had will would can could should may might must
    x per pcs pc pack count""".split()
)


def normalize_color(text: str) -> str:
    """The first known colour name contained in ``text``, else ``text`` unchanged (WebShop's normalisation)."""
    for color in _COLORS:
        if color in text:
            return color
    return text


def _similar(a: str, b: str) -> bool:
    return fuzz.token_set_ratio(a, b, processor=utils.default_process) > FUZZY_THRESHOLD


@functools.lru_cache(maxsize=2)
def _pipeline(spacy_model: str):
    import spacy

    try:
        return spacy.load(spacy_model)
    except OSError as exc:
        raise OSError(
            f"WebShop reward: spaCy pipeline {spacy_model!r} is not installed; install it (e.g. "
            f"`python -m spacy download {spacy_model}`) or set spacy_model to None"
        ) from exc


def type_words(title: str, spacy_model: str | None) -> list[str]:
    """Lower-cased nouns (NOUN/PROPN, spaCy tagger) or, without ``spacy_model``, content words of a title."""
    if spacy_model is None:
        return [w for w in _WORD.findall(title.lower()) if w not in _FUNCTION_WORDS]
    return [t.text.lower() for t in _pipeline(spacy_model)(title) if t.pos_ in ("NOUN", "PROPN")]


def type_reward(product: dict[str, Any], goal: dict[str, Any], spacy_model: str | None) -> dict[str, Any]:
    """r_type and its parts: query match, category match (≥ 2 shared path parts), title score."""
    query_match = product["query"] == goal["query"]
    bought_path = {x.strip() for x in product["product_category"].split("›")}
    goal_path = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(bought_path & goal_path) >= 2
    bought, wanted = set(type_words(product["name"], spacy_model)), type_words(goal["name"], spacy_model)
    title_score = 0.2 if not wanted else len(bought & set(wanted)) / len(wanted)
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match, "title_score": title_score}


def _in_product_text(text: str, product: dict[str, Any]) -> bool:
    return (
        text in product["Title"].lower()
        or text in " ".join(map(str, product["BulletPoints"])).lower()
        or text in product["Description"].lower()
    )


def attribute_matches(product: dict[str, Any], goal: dict[str, Any]) -> int:
    """Number of goal attributes found among the product's attributes or in its text."""
    count = 0
    for wanted in goal["attributes"]:
        if any(_similar(have, wanted) for have in product["Attributes"]) or _in_product_text(wanted, product):
            count += 1
    return count


def option_matches(product: dict[str, Any], goal_options: list[str], chosen: dict[str, str]) -> int:
    """Number of chosen options that match a goal option (exactly for size, fuzzily otherwise) or the text."""
    goal_norm = [normalize_color(o) for o in goal_options]
    count = 0
    for name, value in chosen.items():
        value = normalize_color(value)
        if name.lower() in EXACT_MATCH_OPTIONS:
            matched = value in goal_norm
        else:
            matched = any(_similar(g, value) for g in goal_norm)
        if matched or _in_product_text(value, product):
            count += 1
    return count


def purchase_score(
    product: dict[str, Any], goal: dict[str, Any], price: float, chosen_options: dict[str, str],
    spacy_model: str | None = SPACY_MODEL,
) -> tuple[float, dict[str, Any]]:
    """WebShop's score of buying ``product`` at ``price`` with ``chosen_options`` for ``goal``.

    Args:
        product: a catalog product (see :class:`~megatron_gigpo.envs.webshop.catalog.Catalog`).
        goal: a catalog goal (``attributes``, ``goal_options`` as list or dict, ``price_upper``, ``query``,
            ``product_category``, ``name``).
        price: the paid price in dollars.
        chosen_options: option name → chosen value.
        spacy_model: spaCy pipeline for the title nouns (None: content words, see module docstring).

    Returns:
        (score in [0, 1], components: r_type, r_att, r_option, r_price, title_score, ...).
    """
    goal_options = list(goal["goal_options"].values()) if isinstance(goal["goal_options"], dict) else list(
        goal["goal_options"]
    )
    type_parts = type_reward(product, goal, spacy_model)
    price_ok = price <= goal["price_upper"]
    n_attr = attribute_matches(product, goal)
    # Capped: WebShop counts every matching chosen option, which can exceed the goal's option count.
    n_opt = min(option_matches(product, goal_options, chosen_options), len(goal_options))
    total = len(goal["attributes"]) + len(goal_options) + 1
    score = (n_attr + n_opt + float(price_ok)) / total * type_parts["r_type"]
    info = dict(type_parts)
    info.update(
        r_att=n_attr / max(len(goal["attributes"]), 1),
        r_option=None if not goal_options else n_opt / len(goal_options),
        r_price=price_ok,
    )
    return score, info
