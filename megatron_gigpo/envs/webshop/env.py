"""The WebShop text environment: search page, result pages, item pages, purchase.

Pages and transitions follow WebShop's simulated server (``web_agent_site/envs/web_agent_text_env.py``,
``SimServer.receive``) in its ``text`` observation mode: page elements joined by `` [SEP] ``; the instruction
header WebShop puts on every page is left out of the observation (it is the episode's task description, and
verl-agent strips it too). Actions are ``search[query]`` (on the search page) and ``click[element]`` for the
page's clickables (lower-cased, as WebShop lists them).

Reward: ``win_reward`` (10) when the bought product scores 1.0 (:func:`purchase_score`), else 0; the score
itself is in ``info["score"]``. An episode ends at the purchase or after ``max_steps`` (15) steps.

Invalid (penalised) responses, after verl-agent ``agent_system/environments/env_package/webshop/projection.py``:
no ``<action>...</action>`` block, no ``<think>``/``</think>`` tags, or a CJK ideograph. The lower-cased action
block is sent as written; a search without a search bar, a click on something the page does not offer, or text
that is neither ``search[...]`` nor ``click[...]`` changes nothing and is *not* penalised
(``StepResult.action_valid`` False, ``action/non_admissible_rate``). Without an action block the last
:data:`MISSING_ACTION_CHARS` characters of the lower-cased response are sent, as verl-agent does.

Goals: verl-agent trains and evaluates on WebShop's *synthetic* goals (``env.webshop.human_goals: False`` in its
``verl/trainer/config/ppo_trainer.yaml``), one per product and option combination; ``human_goals=True`` uses
the human-written instructions instead (see :class:`~megatron_gigpo.envs.webshop.catalog.CatalogFiles`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from megatron_gigpo.envs.actions import project_tagged_action
from megatron_gigpo.envs.base import Environment, ProjectedAction, ResetResult, StepResult, Task
from megatron_gigpo.envs.webshop.catalog import (
    ATTRIBUTES_FILE,
    GOAL_SEED,
    HUMAN_GOALS,
    HUMAN_GOALS_FILE,
    ITEMS_FILE,
    NUM_PRODUCTS,
    REVIEWS_FILE,
    CatalogFiles,
    load_catalog,
)
from megatron_gigpo.envs.webshop.reward import SPACY_MODEL, purchase_score

PRODUCTS_PER_PAGE = 10
SEARCH_ACTION = "search[<your query>]"  # how the search bar is listed among the admissible actions
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW = "back to search", "next >", "< prev", "buy now"
SUB_PAGES = {"description": "Description", "features": "Features", "reviews": "Reviews"}
_ACTION = re.compile(r"^\s*(search|click)\[(.+)\]\s*$", re.IGNORECASE | re.DOTALL)
SEP = " [SEP] "
MAX_STEPS = 15  # episode length (the paper's WebShop setting): WebShopEnv's default and RECIPE.step_limit
# Characters of a response without an action block sent as the action (verl-agent's WebShop projection).
MISSING_ACTION_CHARS = 20


def parse_webshop_action(action_text: str) -> tuple[str, str] | None:
    """``("search" | "click", argument)`` of an action string, or None if it is neither form."""
    m = _ACTION.match(action_text)
    if m is None or not m.group(2).strip():
        return None
    return m.group(1).lower(), m.group(2).strip()


def _review_text(review: dict[str, Any]) -> str:
    """Title, score and text of a review (WebShop's reviews file names the text ``review`` or ``body``)."""
    parts = [str(review[k]) for k in ("title", "score", "stars", "body", "review") if k in review and review[k]]
    return " ".join(parts)


@dataclass
class _Session:
    """Where the shopper is. ``page`` is one of search, results, item, sub, done."""

    page: str = "search"
    keywords: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)
    result_page: int = 1
    asin: str | None = None
    sub_page: str = ""
    options: dict[str, str] = field(default_factory=dict)


class WebShopEnv(Environment):
    """One WebShop session at a time over an in-process catalog and BM25 index.

    Args:
        data_dir: folder with the WebShop data files (see :mod:`megatron_gigpo.envs.webshop.catalog`).
        items_file, attributes_file, human_goals_file, reviews_file, human_goals, num_products, goal_seed:
            see :class:`~megatron_gigpo.envs.webshop.catalog.CatalogFiles` (same defaults).
        max_steps: steps before the episode ends without a purchase (15 in the paper).
        win_reward: reward when the purchase scores 1.0 (10 in the paper).
        spacy_model: spaCy pipeline for the type reward's title nouns (default None: content words).

    Raises:
        FileNotFoundError: missing data folder or file (the message says where to get the data).
    """

    name = "webshop"

    def __init__(
        self,
        data_dir: str,
        items_file: str = ITEMS_FILE,
        attributes_file: str = ATTRIBUTES_FILE,
        human_goals_file: str = HUMAN_GOALS_FILE,
        reviews_file: str | None = REVIEWS_FILE,
        human_goals: bool = HUMAN_GOALS,
        num_products: int | None = NUM_PRODUCTS,
        goal_seed: int = GOAL_SEED,
        max_steps: int = MAX_STEPS,
        win_reward: float = 10.0,
        spacy_model: str | None = SPACY_MODEL,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"WebShopEnv: max_steps must be >= 1, got {max_steps}")
        files = CatalogFiles(
            data_dir=str(data_dir), items_file=items_file, attributes_file=attributes_file,
            human_goals_file=human_goals_file, reviews_file=reviews_file, human_goals=human_goals,
            num_products=num_products, goal_seed=goal_seed,
        )
        self.catalog = load_catalog(files)
        self.max_steps = max_steps
        self.win_reward = float(win_reward)
        self.spacy_model = spacy_model
        self._session = _Session()
        self._goal: dict[str, Any] = {}
        self._steps = 0
        self._active = False

    # ---- rendering -------------------------------------------------------------------------------------
    def _render(self) -> tuple[str, list[str], bool]:
        """(observation text, clickables, has search bar) of the current page."""
        s = self._session
        if s.page == "search":
            return "Search", [], True
        if s.page == "done":
            return "Thank you for shopping with us!", [], False
        if s.page == "results":
            total = len(s.results)
            shown = s.results[(s.result_page - 1) * PRODUCTS_PER_PAGE : s.result_page * PRODUCTS_PER_PAGE]
            parts, clicks = ["Back to Search", f"Page {s.result_page} (Total results: {total})"], [BACK_TO_SEARCH]
            if s.result_page > 1:
                parts.append("< Prev")
                clicks.append(PREV_PAGE)
            if s.result_page * PRODUCTS_PER_PAGE < total:
                parts.append("Next >")
                clicks.append(NEXT_PAGE)
            for p in shown:
                parts += [p["asin"], p["Title"], p["Price"]]
                clicks.append(p["asin"].lower())
            return SEP.join(parts), clicks, False
        product = self.catalog.by_asin[s.asin]
        if s.page == "sub":
            if s.sub_page == "description":
                body = [product["Description"]]
            elif s.sub_page == "features":
                body = [str(b) for b in product["BulletPoints"]]
            else:
                body = [_review_text(r) for r in product["Reviews"]]
            return SEP.join(["Back to Search", "< Prev", *[b for b in body if b]]), [BACK_TO_SEARCH, PREV_PAGE], False
        parts, clicks = ["Back to Search", "< Prev"], [BACK_TO_SEARCH, PREV_PAGE]
        for option_name, values in product["options"].items():
            parts += [option_name, *values]
            clicks += values
        parts += [product["Title"], f"Price: {product['Price']}", f"Rating: {product['Rating']}",
                  "Description", "Features", "Reviews", "Buy Now"]
        clicks += list(SUB_PAGES) + [BUY_NOW]
        return SEP.join(parts), list(dict.fromkeys(clicks)), False

    def _admissible(self, clickables: list[str], has_search_bar: bool) -> list[str]:
        return ([SEARCH_ACTION] if has_search_bar else []) + [f"click[{c}]" for c in clickables]

    # ---- episode -------------------------------------------------------------------------------------
    def reset(self, task: Task, seed: int) -> ResetResult:
        """Open the search page for the task's goal. ``seed`` is recorded; the goal fixes the episode.

        Raises:
            ValueError: not a WebShop task, or its payload lacks ``goal`` (use :func:`load_tasks`).
        """
        if task.env != self.name:
            raise ValueError(f"WebShopEnv.reset: task {task.task_id!r} is for env {task.env!r}, not 'webshop'")
        if "goal" not in task.payload:
            raise ValueError(f"WebShopEnv.reset: task {task.task_id!r} payload has no 'goal'")
        self._goal = task.payload["goal"]
        if self._goal["asin"] not in self.catalog.by_asin:
            raise ValueError(f"WebShopEnv.reset: goal product {self._goal['asin']!r} is not in the loaded catalog")
        self._session = _Session()
        self._steps = 0
        self._active = True
        text, clicks, search = self._render()
        return ResetResult(
            observation=text, anchor=text, task_description=self._goal["instruction_text"],
            admissible_actions=self._admissible(clicks, search),
            info={"seed": int(seed), "goal_asin": self._goal["asin"]},
        )

    def _apply(self, kind: str, arg: str, clickables: list[str], has_search_bar: bool) -> bool:
        """Change the session for a valid action; False (nothing happens) for an invalid one."""
        s = self._session
        if kind == "search":
            if not has_search_bar:
                return False
            s.page, s.keywords, s.result_page, s.asin, s.options = "results", arg, 1, None, {}
            s.results = self.catalog.search(arg)
            return True
        target = arg.lower()
        if target not in clickables:
            return False
        if target == BACK_TO_SEARCH:
            self._session = _Session()
        elif s.page == "results" and target in (NEXT_PAGE, PREV_PAGE):
            s.result_page += 1 if target == NEXT_PAGE else -1
        elif s.page == "results":
            s.page, s.asin = "item", target.upper()
        elif s.page == "sub":  # only "< prev" remains: back to the item
            s.page = "item"
        elif target == PREV_PAGE:
            s.page, s.options = "results", {}
        elif target in SUB_PAGES:
            s.page, s.sub_page = "sub", target
        elif target == BUY_NOW:
            s.page = "done"
        else:  # an option value: the last option group listing it wins, as on WebShop's pages
            groups = [k for k, v in self.catalog.by_asin[s.asin]["options"].items() if target in v]
            if not groups:
                return False
            s.options[groups[-1]] = target
        return True

    def step(self, action_text: str) -> StepResult:
        """Apply ``search[...]`` or ``click[...]``; anything else, or a target not on the page, changes nothing.

        ``action_valid`` says whether the action was admissible on the page (it is reported, not penalised).

        Raises:
            RuntimeError: called before :meth:`reset` or after the episode ended.
        """
        if not self._active:
            raise RuntimeError("WebShopEnv.step called before reset() or after the episode ended")
        _, clickables, has_search_bar = self._render()
        parsed = parse_webshop_action(action_text)
        valid = parsed is not None and self._apply(parsed[0], parsed[1], clickables, has_search_bar)
        self._steps += 1
        score, parts = 0.0, {}
        if self._session.page == "done":
            s = self._session
            price = self.catalog.prices[s.asin]
            score, parts = purchase_score(self.catalog.by_asin[s.asin], self._goal, price, s.options, self.spacy_model)
        # Float equality on purpose: a perfect purchase is exactly (n + m + 1) / (n + m + 1) * 1.0.
        won = self._session.page == "done" and score == 1.0
        done = self._session.page == "done" or self._steps >= self.max_steps
        self._active = not done
        text, clicks, search = self._render()
        info: dict[str, Any] = {"score": score, "steps": self._steps}
        if parts:
            info.update(purchased_asin=self._session.asin, purchased_options=dict(self._session.options), **parts)
        return StepResult(
            observation=text, anchor=text, reward=self.win_reward if won else 0.0, done=done, won=won,
            action_valid=valid, admissible_actions=self._admissible(clicks, search), info=info,
        )

    def project_action(self, response_text: str, admissible_actions: list[str] | None) -> ProjectedAction:
        """The lower-cased ``<action>`` text (``search[...]`` / ``click[...]``), valid iff well-formed.

        The format rule is the module docstring's; ``admissible_actions`` is not consulted (a click the page
        does not offer is the page's business, not a penalty).
        """
        del admissible_actions
        return project_tagged_action(response_text, MISSING_ACTION_CHARS)


def load_tasks(
    split: str,
    data_dir: str,
    num_val: int = 500,
    num_tasks: int | None = None,
    items_file: str = ITEMS_FILE,
    attributes_file: str = ATTRIBUTES_FILE,
    human_goals_file: str = HUMAN_GOALS_FILE,
    reviews_file: str | None = REVIEWS_FILE,
    human_goals: bool = HUMAN_GOALS,
    num_products: int | None = NUM_PRODUCTS,
    goal_seed: int = GOAL_SEED,
) -> list[Task]:
    """WebShop goals as tasks: val = the first ``num_val`` shuffled goals (verl-agent: 500), train = the rest.

    Args:
        split: ``train`` or ``val``.
        data_dir, items_file, ...: the catalog's files (see :class:`CatalogFiles`, same defaults); must match
            the env's.
        num_val: size of the val split.
        num_tasks: keep only the first ``num_tasks`` of the split.

    Returns:
        Tasks with ``task_id`` = the goal index (str) and payload ``{"goal_index": int, "goal": dict}``.

    Raises:
        ValueError: unknown split, or a split with no goal.
    """
    if split not in ("train", "val"):
        raise ValueError(f"webshop load_tasks: split must be 'train' or 'val', got {split!r}")
    catalog = load_catalog(CatalogFiles(
        data_dir=str(data_dir), items_file=items_file, attributes_file=attributes_file,
        human_goals_file=human_goals_file, reviews_file=reviews_file, human_goals=human_goals,
        num_products=num_products, goal_seed=goal_seed,
    ))
    indices = range(min(num_val, len(catalog.goals))) if split == "val" else range(num_val, len(catalog.goals))
    if num_tasks is not None:
        indices = indices[:num_tasks]
    if len(indices) == 0:
        raise ValueError(
            f"webshop load_tasks: split {split!r} is empty ({len(catalog.goals)} goals, num_val={num_val})"
        )
    return [
        Task(env="webshop", task_id=str(i), split=split, payload={"goal_index": i, "goal": catalog.goals[i]})
        for i in indices
    ]
