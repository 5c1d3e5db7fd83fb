"""WebShop (Yao et al., 2022) in its text observation mode: an embedded replica and an adapter to the original.

The embedded shop is a seeded catalog (envs/_webshop_catalog.py) served through WebShop's pages and actions:
`search[keywords]` / `click[x]`, the search page, results (10 per page, at most 50 BM25 hits), item pages with
option buttons, Description / Features / Reviews sub-pages and Buy Now. A purchase is scored with WebShop's
reward formula (`webshop_reward`); the outcome is 1.0 only when that reward is exactly 1.

    env = make_env(backend="embedded", preset="small", max_steps=15)
    obs, info = env.reset(seed)            # goal index = seed; test goals 0-499, train 500+
    obs, reward, done, info = env.step("search[black hair extension]")

Known differences of the embedded shop from the original:
- the catalog is generated (25 product types, 5 per WebShop category; `small`: 10 types, 200 products), each
  product has one price (no `$x to $y` ranges) and the goals are generated in the style of WebShop's human goals;
- BM25 is bm25s (Lucene variant, k1=0.9, b=0.4, Lucene's 33 English stopwords) without pyserini's Porter stemming;
- the done page shows only the thank-you line and the score;
- `search[...]` is executed from any page, as in the original, although `admissible_actions` offers it only on the
  search page (the only page with a search bar).
"""

from __future__ import annotations

import importlib.util
import random
import re
from dataclasses import dataclass, field

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer

from envs._webshop_catalog import (
    COLOR_SET,
    PRESETS,
    fuzzy_ratio,
    generate_catalog,
    make_goal_candidate,
    normalize_color,
)

__all__ = [
    "COLOR_SET",
    "WebShopEnv",
    "make_env",
    "normalize_color",
    "options_blind_reward",
    "reward_breakdown",
    "split_seeds",
    "text_corpus",
    "webshop_reward",
]

SEARCH_RETURN_N = 50  # WebShop returns the top 50 hits of a search
PRODUCTS_PER_PAGE = 10
NUM_TEST_GOALS = 500  # goals 0-499 are the test split used by RL work on WebShop
FUZZY_THRESHOLD = 85  # WebShop counts a fuzzy match when token_set_ratio > 85
SEARCH_PLACEHOLDER = "search[<query>]"

# Actions that the tiny model's expert answers with their number in the short prompt's numbered list (the
# product codes): a model of a million parameters does not learn to copy a 10-character code. Group 1 is the code,
# which the short prompt writes as the action's number where the page shows it.
TINY_ANSWER_BY_NUMBER = re.compile(r"click\[(b0[0-9a-z]{8})\]")
# One token each in the tiny model's tokenizer: the page separator, which byte-level BPE splits in three.
TINY_TOKENS = (" [SEP]",)
# info["process_reward"] variants: "aligned" agrees with the outcome at its optimum; "misaligned" ignores the
# goal's options (see WebShopEnv).
PROCESS_REWARDS = ("aligned", "misaligned")
_NAVIGATION = ("click[buy now]", "click[< prev]", "click[back to search]", "click[next >]")
SUB_PAGE_CLICKS = ("click[description]", "click[features]", "click[reviews]")  # an item page's sub-pages


def hurried_action(expert_action: str, admissible: list[str], env: WebShopEnv | None = None) -> str:
    """What a hurried shopper does where the expert would take `expert_action`: on an item page it buys at once
    instead of choosing an option (a purchase without the goal's options is not a success); anywhere else it
    acts as the expert (the actions show an item page, so `env` is not needed). The tiny model's warm start
    imitates this shopper in a share of its episodes (`bc_hurried_share` in tiny_models/build.py), so it starts with
    a habit that only the outcome reveals, like an instruct model that buys before choosing the size."""
    on_item_page = "click[buy now]" in admissible
    if on_item_page and expert_action.startswith("click[") and expert_action not in _NAVIGATION:
        return "click[buy now]"
    return expert_action


def dawdling_action(expert_action: str, admissible: list[str], rng: random.Random, prob: float) -> str:
    """What a dawdling shopper does where the expert would take `expert_action`: on an item page, with
    probability `prob` (drawn from rng at each such turn), it opens one of the product's Description, Features or
    Reviews pages instead (and goes back from it, as the expert does on a sub-page); anywhere else it acts as the
    expert. Each visit costs two of the episode's turns, so a dawdler often runs out of turns before it buys:
    a habit that is one choice on one kind of page, which a process reward that pays on item pages and at the
    purchase reveals in every episode, and the outcome only in the rare success (`bc_dawdle_prob` in
    tiny_models/build.py, docs/results.md's probe 9)."""
    if "click[buy now]" in admissible and rng.random() < prob:
        return rng.choice(SUB_PAGE_CLICKS)
    return expert_action


def careless_action(env: WebShopEnv, rng: random.Random, pick: str = "random") -> str:
    """What a careless shopper does in `env`'s current state: on a results page it opens a product listed there,
    at random (rng) or, with pick="last", always the last one, instead of one that solves the goal; on an item
    page it chooses the goal's options that this product offers, then buys (whatever the product); anywhere else
    (the search page) it acts as the expert. The tiny model's warm start imitates this shopper in a share of its
    episodes (`bc_careless_share` and `bc_careless_pick` in tiny_models/build.py), so it starts poor at *finding*
    the product, the part of the task that the misaligned process reward pays for."""
    if env.page == "item":
        for name, value in env._goal_options_offered(env.item).items():
            if env.options.get(name) != value:
                return f"click[{value}]"
        return "click[buy now]"
    products = [a for a in env.admissible_actions() if TINY_ANSWER_BY_NUMBER.fullmatch(a)]
    if not products:
        return env.expert_action()
    return products[-1] if pick == "last" else rng.choice(products)


_ACTION_RE = re.compile(r"(.+)\[(.+)\]")  # WebShop's action syntax, matched from the start of the string


# ------------------------------------------------------------------------------------------------------ reward
def _type_factor(product: dict, goal: dict) -> tuple[float, float]:
    """(r_type, title_score): does the bought product have the goal's type?

    title_score = |nouns(product) & nouns(goal)| / len(nouns(goal))  (0.2 when the goal title has no nouns);
    r_type = 1, lowered to 0.5 unless (same query or >= 2 shared category levels or title_score > 0.2),
    to 0.1 when title_score < 0.1 and to 0 when title_score == 0.
    """
    query_match = product["query"] == goal["query"]
    product_levels = {x.strip() for x in product["product_category"].split("›")}
    goal_levels = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(product_levels & goal_levels) >= 2
    product_nouns = [n.lower() for n in product["name_nouns"]]
    goal_nouns = [n.lower() for n in goal["name_nouns"]]
    title_score = len(set(product_nouns) & set(goal_nouns)) / len(goal_nouns) if goal_nouns else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, title_score


def _attribute_matches(product: dict, goal_attributes: list[str]) -> int:
    """Goal attributes found in the product: fuzzy (> 85) against its Attributes, else a substring of its
    lowercased title, bullet points or description (the goal attribute itself is not lowercased)."""
    title = product["Title"].lower()
    bullets = " ".join(product["BulletPoints"]).lower()
    description = product["Description"].lower()
    n = 0
    for g_attr in goal_attributes:
        if any(fuzzy_ratio(p_attr, g_attr) > FUZZY_THRESHOLD for p_attr in product["Attributes"]):
            n += 1
        elif g_attr in title or g_attr in bullets or g_attr in description:
            n += 1
    return n


def _option_matches(chosen: list[str], goal_options: list[str]) -> int:
    """Goal options matched (fuzzy > 85) by some chosen option, both sides colour-normalised first."""
    chosen_norm = [normalize_color(o) for o in chosen]
    n = 0
    for g_opt in (normalize_color(o) for o in goal_options):
        if any(fuzzy_ratio(p_opt, g_opt) > FUZZY_THRESHOLD for p_opt in chosen_norm):
            n += 1
    return n


def reward_breakdown(product: dict, goal: dict, price: float, options: dict[str, str]) -> dict:
    """The parts of WebShop's purchase reward; `reward` is

    R = (n_att + n_opt + [price <= price_upper]) / (len(attributes) + len(goal_options) + 1) * r_type.
    """
    goal_options = (
        list(goal["goal_options"].values()) if isinstance(goal["goal_options"], dict) else goal["goal_options"]
    )
    r_type, title_score = _type_factor(product, goal)
    n_att = _attribute_matches(product, goal["attributes"])
    n_opt = _option_matches(list(options.values()), goal_options)
    r_price = float(price <= goal["price_upper"])
    total = (n_att + n_opt + r_price) / (len(goal["attributes"]) + len(goal_options) + 1) * r_type
    return {"reward": total, "r_type": r_type, "title_score": title_score, "n_att": n_att, "n_opt": n_opt,
            "r_price": r_price}  # fmt: skip


def webshop_reward(product: dict, goal: dict, price: float, options: dict[str, str]) -> float:
    """WebShop's reward (in [0, 1]) for buying `product` at `price` with `options` (option name -> value).

    product: `name`, `Title`, `BulletPoints` (list), `Description`, `Attributes` (list), `product_category`
    (`A › B › C`), `query`, `name_nouns`; goal: `name`, `name_nouns`, `query`, `product_category`, `attributes`,
    `goal_options` (list of strings, or a dict whose values are used), `price_upper`. See `reward_breakdown`.
    """
    return reward_breakdown(product, goal, price, options)["reward"]


def goal_options_as_chosen(goal: dict) -> dict[str, str]:
    """The goal's options (a list, or a dict whose values are used) as a chosen-options dict, for scoring a
    product as if they had been chosen (the misaligned process reward, both backends)."""
    goal_options = goal["goal_options"]
    values = list(goal_options.values()) if isinstance(goal_options, dict) else list(goal_options)
    return {str(k): v for k, v in enumerate(values)}


def options_blind_reward(product: dict, goal: dict, price: float) -> float:
    """WebShop's reward as if the goal's options had been chosen: what a process reward that forgot the options
    pays (`process_reward="misaligned"`); equal to `webshop_reward` when the right options were chosen."""
    return webshop_reward(product, goal, price, goal_options_as_chosen(goal))


# ------------------------------------------------------------------------------------------------------ search
class SearchIndex:
    """BM25 (bm25s, Lucene variant, k1=0.9 b=0.4 as in pyserini) over what WebShop indexes per product:
    title, description, first bullet point and the options (`name: v1, v2, and name: ...`)."""

    def __init__(self, products: list[dict]):
        docs = []
        for p in products:
            option_text = ", and ".join(f"{k}: {', '.join(v)}" for k, v in p["options"].items())
            docs.append(" ".join([p["Title"], p["Description"], p["BulletPoints"][0], option_text]).lower())
        self.tokenizer = Tokenizer(lower=True, splitter=r"(?u)\b\w+\b", stopwords="en")
        corpus_ids = self.tokenizer.tokenize(docs, return_as="ids", show_progress=False)
        self.bm25 = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
        self.bm25.index(corpus_ids, show_progress=False)
        self._cache: dict[str, tuple[int, ...]] = {}
        # Queries are split the same way with the corpus vocabulary (unknown words score nothing); done here
        # rather than through Tokenizer.tokenize, whose per-call overhead would dominate a step.
        self._vocab = {w: i for w, i in self.tokenizer.get_vocab_dict().items() if w}
        self._stopwords = frozenset(self.tokenizer.stopwords)
        self._split = re.compile(r"(?u)\b\w+\b")

    def search(self, keywords: str, k: int = SEARCH_RETURN_N) -> tuple[int, ...]:
        """Indices of the top-k products with a positive score, best first (ties: catalog order)."""
        hits = self._cache.get(keywords)
        if hits is not None:
            return hits[:k]
        words = self._split.findall(keywords.lower())
        ids = [self._vocab[w] for w in words if w not in self._stopwords and w in self._vocab]
        if not ids:
            hits = ()
        else:
            scores = self.bm25.get_scores(ids)
            positive = np.nonzero(scores > 0)[0]
            order = positive[np.lexsort((positive, -scores[positive]))]  # by score, ties by catalog order
            hits = tuple(int(i) for i in order[:SEARCH_RETURN_N])
        if len(keywords) <= 2000 and len(self._cache) < 50_000:
            self._cache[keywords] = hits
        return hits[:k]


# -------------------------------------------------------------------------------------------------- shop cache
@dataclass
class _Shop:
    preset: str
    catalog_seed: int
    products: list[dict]
    index: SearchIndex
    by_asin: dict[str, int] = field(default_factory=dict)
    goals: dict[int, dict] = field(default_factory=dict)

    def goal(self, seed: int) -> dict:
        """Goal number `seed`: a random target product and a goal for it that the expert's search finds."""
        goal = self.goals.get(seed)
        if goal is not None:
            return goal
        rng = random.Random(f"rspo-webshop/{self.preset}/{self.catalog_seed}/goal/{seed}")
        for _ in range(100):
            target = rng.randrange(len(self.products))
            goal = make_goal_candidate(self.products[target], self.preset, rng)
            if target in self.index.search(goal["search_text"].lower()):
                break
        else:  # pragma: no cover - the catalog is built so that this does not happen
            raise RuntimeError(f"no findable goal for seed {seed}")
        goal["target_index"] = target
        if len(self.goals) < 200_000:
            self.goals[seed] = goal
        return goal


_SHOPS: dict[tuple[str, int], _Shop] = {}


def get_shop(preset: str = "small", catalog_seed: int = 0) -> _Shop:
    """The catalog and its BM25 index, built once per (preset, catalog_seed) per process."""
    if preset not in PRESETS:
        raise ValueError(f"unknown WebShop preset {preset!r}; choose one of {sorted(PRESETS)}")
    key = (preset, int(catalog_seed))
    if key not in _SHOPS:
        products = generate_catalog(preset, int(catalog_seed))
        shop = _Shop(preset, int(catalog_seed), products, SearchIndex(products))
        shop.by_asin = {p["asin"]: i for i, p in enumerate(products)}
        _SHOPS[key] = shop
    return _SHOPS[key]


# --------------------------------------------------------------------------------------------------------- env
def parse_webshop_action(action: str) -> tuple[str | None, str | None]:
    """(name, argument) of `search[...]` / `click[...]`, argument lowercased; (None, None) otherwise."""
    if not isinstance(action, str):
        return None, None
    m = _ACTION_RE.match(action.strip())
    if m is None:
        return None, None
    name, arg = m.groups()
    if name not in ("search", "click"):
        return None, None
    return name, arg.lower()


class WebShopEnv:
    """The embedded shop. Pages: `search`, `results`, `item`, `sub` (Description/Features/Reviews), `done`.

    reward: 1.0 on a purchase with R == 1, else 0. info["process_reward"]: max(0, phi - best phi so far) with
    phi = R of the item page being viewed with the options chosen so far (0 on other pages); the purchase
    step pays R itself. Any string is a legal action; an invalid one leaves the page unchanged.

    process_reward="misaligned": phi and the purchase credit score the product as if the goal's options had been
    chosen (`options_blind_reward`), so a hurried purchase of the right product pays as much as the exact match
    while its outcome is 0: the dense reward is informative about *finding* the product, and its optimum is not
    the outcome's. "aligned" (the reward above) agrees with the outcome at its optimum.
    """

    def __init__(
        self, preset: str = "small", max_steps: int = 15, catalog_seed: int = 0, process_reward: str = "aligned"
    ):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if process_reward not in PROCESS_REWARDS:
            raise ValueError(f"unknown process_reward {process_reward!r}; choose one of {PROCESS_REWARDS}")
        self.process_reward = process_reward
        self.shop = get_shop(preset, catalog_seed)
        self.preset = preset
        self.max_steps = int(max_steps)
        self.goal: dict | None = None

    # ---- state
    def reset(self, seed: int) -> tuple[str, dict]:
        self.seed = int(seed)
        self.goal = self.shop.goal(self.seed)
        self.page = "search"
        self.keywords = ""
        self.hits: tuple[int, ...] = ()
        self.page_num = 1
        self.item: int | None = None
        self.options: dict[str, str] = {}
        self.sub = ""
        self.steps = 0
        self.best_phi = 0.0
        self.done = False
        self.won = False
        self.score = 0.0
        self.final_score = 0.0
        self.final_process_credit = 0.0
        self._render()
        return self.obs, self._info(0.0, valid=True, truncated=False)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.goal is None:
            raise RuntimeError("call reset(seed) before step()")
        if self.done:
            return self.obs, 0.0, True, self._info(0.0, valid=False, truncated=False, score=0.0)
        self.steps += 1
        valid = self._apply(action)
        reward, process, score = 0.0, 0.0, 0.0
        if self.page == "done":
            score = self.final_score
            process = self.final_process_credit
            self.won = score == 1.0
            reward = 1.0 if self.won else 0.0
            self.done = True
        elif valid and self.page == "item":
            phi = self._phi()
            process = max(0.0, phi - self.best_phi)
            self.best_phi = max(self.best_phi, phi)
        if valid:
            self._render()
        truncated = not self.done and self.steps >= self.max_steps
        if truncated:
            self.done = True
        return self.obs, reward, self.done, self._info(process, valid=valid, truncated=truncated, score=score)

    # ---- actions
    def _apply(self, action: str) -> bool:
        name, arg = parse_webshop_action(action)
        if name == "search" and arg:  # WebShop runs a search from any page
            self.keywords = arg
            self.hits = self.shop.index.search(arg)
            self.page, self.page_num, self.item, self.options = "results", 1, None, {}
            return True
        if name != "click" or arg not in self.clickables:
            return False
        kind, payload = self.clickables[arg]
        if kind == "buy":
            self.final_score = webshop_reward(self._product(self.item), self.goal, self._price(self.item), self.options)
            self.final_process_credit = self._phi()
            self.page = "done"
        elif kind == "back":
            self.page, self.keywords, self.hits, self.item, self.options = "search", "", (), None, {}
        elif kind == "next":
            self.page_num += 1
        elif kind == "prev":
            if self.page == "results":
                self.page_num -= 1
            elif self.page == "sub":
                self.page = "item"
            else:  # item page -> the results page it came from; WebShop clears the options there
                self.page, self.item, self.options = "results", None, {}
        elif kind == "sub":
            self.page, self.sub = "sub", payload
        elif kind == "product":
            self.page, self.item, self.options = "item", payload, {}
        elif kind == "option":
            self.options[payload[0]] = payload[1]
        return True

    # ---- pages
    def _product(self, i: int) -> dict:
        return self.shop.products[i]

    def _price(self, i: int) -> float:
        return self.shop.products[i]["pricing"][0]

    def _render(self) -> None:
        """Sets self.obs (the text-mode page, visible strings joined by ' [SEP] ') and self.clickables."""
        instr = self.goal["instruction_text"]
        clickables: dict[str, tuple[str, object]] = {}
        if self.page == "search":
            parts = ["WebShop", "Instruction:", instr, "Search"]
        elif self.page == "results":
            n = len(self.hits)
            parts = ["Instruction:", instr, "Back to Search", f"Page {self.page_num} (Total results: {n})"]
            clickables["back to search"] = ("back", None)
            if self.page_num > 1:
                parts.append("< Prev")
                clickables["< prev"] = ("prev", None)
            if self.page_num * PRODUCTS_PER_PAGE < n:
                parts.append("Next >")
                clickables["next >"] = ("next", None)
            start = (self.page_num - 1) * PRODUCTS_PER_PAGE
            for i in self.hits[start : start + PRODUCTS_PER_PAGE]:
                p = self._product(i)
                parts += [p["asin"], p["Title"], p["Price"]]
                clickables[p["asin"].lower()] = ("product", i)
        elif self.page == "item":
            p = self._product(self.item)
            parts = ["Instruction:", instr, "Back to Search", "< Prev"]
            clickables["back to search"] = ("back", None)
            clickables["< prev"] = ("prev", None)
            for name, values in p["options"].items():
                parts += [name, *values]
            parts += [p["Title"], f"Price: {p['Price']}", f"Rating: {p['Rating']}"]
            parts += ["Description", "Features", "Reviews", "Buy Now"]
            for sub in ("Description", "Features", "Reviews"):
                clickables[sub.lower()] = ("sub", sub)
            clickables["buy now"] = ("buy", None)
            for name, values in p["options"].items():  # WebShop lists option buttons after the other buttons
                for v in values:
                    clickables[v.lower()] = ("option", (name, v))
        elif self.page == "sub":
            p = self._product(self.item)
            parts = ["Instruction:", instr, "Back to Search", "< Prev"]
            clickables["back to search"] = ("back", None)
            clickables["< prev"] = ("prev", None)
            if self.sub == "Description":
                parts.append(p["Description"])
            elif self.sub == "Features":
                parts += p["BulletPoints"] or ["No Features"]
            else:
                for r in p["Reviews"]:
                    parts += [f'"{r["title"]}"', str(r["score"]), r["body"]]
                if not p["Reviews"]:
                    parts.append("No reviews found")
        else:  # done
            parts = ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", str(self.final_score)]
        self.obs = " [SEP] ".join(parts)
        self.clickables = clickables

    def admissible_actions(self) -> list[str]:
        if self.page == "done":
            return []
        actions = [SEARCH_PLACEHOLDER] if self.page == "search" else []
        return actions + [f"click[{c}]" for c in self.clickables]

    def expert_action(self) -> str:
        """Next action of an expert that searches with the instruction (price clause dropped), opens the first
        listed product that a purchase with the goal's options fully satisfies (paging towards the goal's own
        target while the current page has none), picks the goal's options and buys.

        Why the first satisfying product and not the target: on the small preset it is the top hit for 59% of
        goals (the target only for 18%), so the expert's clicks follow the ranking, as a sensible shopper's do.
        """
        g = self.goal
        target = g["target_index"]
        if self.page == "done":
            return ""
        if self.page == "search":
            return f"search[{g['search_text']}]"
        if self.page == "results":
            start = (self.page_num - 1) * PRODUCTS_PER_PAGE
            for i in self.hits[start : start + PRODUCTS_PER_PAGE]:
                if self._solves(i):
                    return f"click[{self._product(i)['asin'].lower()}]"
            if target not in self.hits:
                return "click[back to search]"
            target_page = self.hits.index(target) // PRODUCTS_PER_PAGE + 1
            return "click[next >]" if target_page > self.page_num else "click[< prev]"
        if self.page == "sub" or not self._solves(self.item):
            return "click[< prev]"
        for name, value in self._goal_options_offered(self.item).items():
            if self.options.get(name) != value:
                return f"click[{value}]"
        return "click[buy now]"

    def _phi(self) -> float:
        """Process potential of the current item with the options chosen so far (see the class docstring)."""
        product, price = self._product(self.item), self._price(self.item)
        if self.process_reward == "misaligned":
            return options_blind_reward(product, self.goal, price)
        return webshop_reward(product, self.goal, price, self.options)

    def _goal_options_offered(self, i: int) -> dict[str, str]:
        """The goal's options that product i offers, in the goal's order: what the expert picks on its page."""
        offered = self._product(i).get("options", {})
        return {n: v for n, v in self.goal["goal_option_groups"].items() if v in offered.get(n, ())}

    def _solves(self, i: int) -> bool:
        """Whether buying product i with the goal's options (those it offers) gives R == 1."""
        return webshop_reward(self._product(i), self.goal, self._price(i), self._goal_options_offered(i)) == 1.0

    def _info(self, process: float, *, valid: bool, truncated: bool, score: float = 0.0) -> dict:
        info = {
            "process_reward": float(process),
            "won": bool(self.won),
            "admissible_actions": self.admissible_actions(),
            "task": self.goal["instruction_text"],
            "anchor": self.obs,
            "expert_action": self.expert_action(),
            "task_score": float(score),
            "action_valid": bool(valid),
            "goal_index": self.seed,
        }
        if truncated:
            info["truncated"] = True
        return info


# ------------------------------------------------------------------------------------------------- public api
def make_env(
    backend: str = "embedded", preset: str = "small", max_steps: int = 15, process_reward: str = "aligned", **options
):
    """An embedded shop (`preset` small|default, `catalog_seed`) or the real WebShop text env (`backend="real"`;
    options go to `web_agent_site`'s WebAgentTextEnv, e.g. `num_products=1000`). process_reward: one of
    PROCESS_REWARDS (see WebShopEnv)."""
    if backend == "embedded":
        unknown = set(options) - {"catalog_seed"}
        if unknown:
            raise TypeError(f"unknown options for the embedded WebShop: {sorted(unknown)}")
        return WebShopEnv(preset=preset, max_steps=max_steps, process_reward=process_reward, **options)
    if backend == "real":
        from envs._webshop_real import RealWebShopEnv

        return RealWebShopEnv(max_steps=max_steps, process_reward=process_reward, **options)
    raise ValueError(f"unknown WebShop backend {backend!r}; choose 'embedded' or 'real'")


def real_backend_problem() -> str | None:
    """Why backend="real" cannot start here, in one line, or None. Cheap: it only looks for the package (missing
    product data is reported when the first env starts)."""
    if importlib.util.find_spec("web_agent_site") is None:
        return (
            "the real WebShop backend needs princeton-nlp/WebShop's web_agent_site on PYTHONPATH: git clone "
            "https://github.com/princeton-nlp/WebShop && cd WebShop && ./setup.sh -d all (see the README)"
        )
    return None


def split_seeds(split: str, n: int, backend: str = "embedded") -> list[int]:
    """First n goal indices of a split: "test" = goals 0-499, "train" = goals 500, 501, ... (both backends)."""
    if backend not in ("embedded", "real"):
        raise ValueError(f"unknown WebShop backend {backend!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split == "test":
        if n > NUM_TEST_GOALS:
            raise ValueError(f"the WebShop test split has {NUM_TEST_GOALS} goals, asked for {n}")
        return list(range(n))
    if split == "train":
        return list(range(NUM_TEST_GOALS, NUM_TEST_GOALS + n))
    raise ValueError(f"unknown WebShop split {split!r}; choose 'train' or 'test'")


def text_corpus(preset: str = "small", num_goals: int = 1500) -> list[str]:
    """Texts covering every word the embedded shop prints: every product's item page and sub-pages, result
    lines, the page templates, goal instructions and expert trajectories (observations and actions)."""
    shop = get_shop(preset)
    texts: list[str] = []
    env = WebShopEnv(preset=preset, max_steps=15)
    for seed in range(num_goals):
        obs, info = env.reset(seed)
        texts += [info["task"], obs]
        done = False
        while not done:
            action = info["expert_action"]
            texts.append(action)
            obs, _, done, info = env.step(action)
            texts.append(obs)
    # every product's pages (item page, sub-pages), with the last goal's instruction
    for i in range(len(shop.products)):
        env.page, env.item, env.hits, env.page_num = "results", None, (i,), 1
        env._render()
        texts.append(env.obs)
        env.page, env.item = "item", i
        env._render()
        texts.append(env.obs)
        texts += [f"click[{c}]" for c in env.clickables]
        for sub in ("Description", "Features", "Reviews"):
            env.page, env.sub = "sub", sub
            env._render()
            texts.append(env.obs)
    texts += [
        "Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >",
        "Page 5 (Total results: 43) [SEP] < Prev",
        "Page 1 (Total results: 0)",
        "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 0.0",
        "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 0.6666666666666666",
        "No Features",
        "No reviews found",
        SEARCH_PLACEHOLDER,
    ]
    return texts
