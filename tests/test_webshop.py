"""The WebShop environment: reward formula, catalog and goals, pages and actions, expert, robustness, real adapter."""

import json
import random
import re
import subprocess
import sys
import textwrap
import time

import pytest

from envs import webshop
from envs._webshop_catalog import COLOR_SET, PRICE_RANGE, fuzzy_ratio, generate_catalog, normalize_color
from envs.webshop import SEARCH_RETURN_N, get_shop, make_env, reward_breakdown, split_seeds, webshop_reward

PRESETS = ["small", "default"]


# ------------------------------------------------------------------------------------------------ reward (units)
def _product(**kw):
    p = {
        "name": "Lumera Natural Looking Hair Extension",
        "Title": "Lumera Natural Looking Hair Extension",
        "name_nouns": ["lumera", "hair", "extension"],
        "BulletPoints": ["Heat resistant fiber", "Easy to apply"],
        "Description": "A clip in extension for daily styling.",
        "Attributes": ["natural looking"],
        "product_category": "Beauty & Personal Care › Hair Care › Extensions",
        "query": "hair extensions",
    }
    p.update(kw)
    return p


def _goal(**kw):
    g = {
        "name": "Lumera Natural Looking Hair Extension",
        "name_nouns": ["lumera", "hair", "extension"],
        "query": "hair extensions",
        "product_category": "Beauty & Personal Care › Hair Care › Extensions",
        "attributes": ["natural looking"],
        "goal_options": ["black"],
        "price_upper": 40.0,
    }
    g.update(kw)
    return g


def test_fuzzy_ratio_is_thefuzz_token_set_ratio():
    # thefuzz lowercases and strips punctuation before the token-set comparison
    assert fuzzy_ratio("Heat-Resistant!", "heat resistant") == 100.0
    assert fuzzy_ratio("natural looking", "natural") == 100.0  # a token subset scores 100
    # "12 ounce" vs "16 ounce": longest common subsequence "1 ounce" (7 chars): 2 * 7 / 16 = 87.5
    assert fuzzy_ratio("12 ounce", "16 ounce") == pytest.approx(87.5)
    assert fuzzy_ratio("", "black") == 0.0


def test_colour_list_and_normalisation():
    assert len(COLOR_SET) == 102 and COLOR_SET[0] == "alabaster" and COLOR_SET[-1] == "yellow"
    assert COLOR_SET == sorted(COLOR_SET)  # WebShop's list is alphabetical, so "first contained" = alphabetical
    assert normalize_color("dark brown") == "brown"  # 'brown' precedes 'dark'
    assert normalize_color("light blue") == "blue"
    assert normalize_color("navy blue") == "blue"
    assert normalize_color("rose gold") == "gold"
    assert normalize_color("peppered") == "red"  # substring test, as in WebShop
    assert normalize_color("clear") == "clear"


def test_reward_exact_match_is_one():
    assert webshop_reward(_product(), _goal(), 30.0, {"color": "black"}) == 1.0


def test_reward_type_factor_branches():
    # same nouns -> title_score 1 -> r_type 1
    assert reward_breakdown(_product(), _goal(), 30.0, {})["r_type"] == 1.0
    other = dict(query="wigs", product_category="Wigs › Synthetic › Full")
    # 2 of 3 goal nouns shared: title_score 2/3 > 0.2 -> 1.0 without query/category match
    b = reward_breakdown(_product(name_nouns=["hair", "extension"], **other), _goal(), 30.0, {})
    assert b["title_score"] == pytest.approx(2 / 3) and b["r_type"] == 1.0
    # 1 of 5 nouns: title_score 0.2 is not > 0.2 and no query/category match -> 0.5
    g5 = _goal(name_nouns=["lumera", "hair", "extension", "clip", "women"])
    b = reward_breakdown(_product(name_nouns=["hair"], **other), g5, 30.0, {})
    assert b["title_score"] == pytest.approx(0.2) and b["r_type"] == 0.5
    # ... but the same query keeps r_type 1
    assert reward_breakdown(_product(name_nouns=["hair"]), g5, 30.0, {})["r_type"] == 1.0
    # >= 2 shared category levels (order ignored) also keep 1
    cat = "Hair Care › Beauty & Personal Care › Other"
    assert reward_breakdown(_product(name_nouns=["hair"], query="x", product_category=cat), g5, 30, {})["r_type"] == 1
    # 1 of 11 nouns: title_score < 0.1 -> 0.1 even with the same query
    g11 = _goal(name_nouns=["hair"] + [f"n{i}" for i in range(10)])
    b = reward_breakdown(_product(name_nouns=["hair"]), g11, 30.0, {})
    assert b["title_score"] == pytest.approx(1 / 11) and b["r_type"] == 0.1
    # no shared noun -> 0
    assert reward_breakdown(_product(name_nouns=["wig"]), _goal(), 30.0, {})["r_type"] == 0.0
    assert webshop_reward(_product(name_nouns=["wig"]), _goal(), 30.0, {"color": "black"}) == 0.0
    # a goal title without nouns: title_score 0.2 (-> 1.0 with the same query, 0.5 without)
    assert reward_breakdown(_product(), _goal(name_nouns=[]), 30, {})["title_score"] == 0.2
    assert reward_breakdown(_product(), _goal(name_nouns=[]), 30, {})["r_type"] == 1.0
    assert reward_breakdown(_product(**other), _goal(name_nouns=[]), 30, {})["r_type"] == 0.5


def test_reward_attribute_branches():
    def n_att(attrs, **kw):
        return reward_breakdown(_product(**kw), _goal(attributes=attrs, goal_options=[]), 30.0, {})["n_att"]

    assert n_att(["Natural-Looking"]) == 1  # fuzzy against Attributes, case and punctuation ignored
    assert n_att(["heat resistant"]) == 1  # substring of the lowercased bullet points
    assert n_att(["clip in"]) == 1  # substring of the description
    assert n_att(["lumera natural"]) == 1  # fuzzy: token subset of an attribute? no -> substring of the title
    assert n_att(["Clip In"]) == 0  # the goal attribute is not lowercased for the substring test
    assert n_att(["tangle free"]) == 0
    # 2 goal attributes, one found; no options; price ok: (1 + 0 + 1) / (2 + 0 + 1)
    g = _goal(attributes=["natural looking", "tangle free"], goal_options=[])
    assert webshop_reward(_product(), g, 30.0, {}) == pytest.approx(2 / 3)


def test_reward_option_branches():
    def n_opt(goal_options, chosen):
        return reward_breakdown(_product(), _goal(goal_options=goal_options), 30.0, chosen)["n_opt"]

    assert n_opt(["dark brown"], {"color": "light brown"}) == 1  # both normalise to "brown"
    assert n_opt(["dark brown"], {"color": "black"}) == 0
    assert n_opt(["large"], {"size": "x-large"}) == 1  # token subset -> 100
    assert n_opt(["12 ounce"], {"size": "16 ounce"}) == 1  # 87.5 > 85
    assert n_opt(["8 ounce"], {"size": "16 ounce"}) == 0  # 83.3
    assert n_opt(["black", "large"], {"color": "black"}) == 1
    assert n_opt(["black", "large"], {}) == 0
    # dict goal options (WebShop's synthetic goals) use their values
    assert n_opt({"color": "black"}, {"color": "Black"}) == 1
    # 1 attribute (found) + 2 options (1 chosen right) + price: (1 + 1 + 1) / (1 + 2 + 1) = 0.75
    g = _goal(goal_options=["black", "20 inch"])
    assert webshop_reward(_product(), g, 30.0, {"color": "black", "size": "36 inch"}) == pytest.approx(0.75)


def test_reward_price_and_type_scaling():
    b = reward_breakdown(_product(), _goal(), 45.0, {"color": "black"})
    assert b["r_price"] == 0.0 and b["reward"] == pytest.approx(2 / 3)
    assert webshop_reward(_product(), _goal(), 40.0, {"color": "black"}) == 1.0  # price <= price_upper
    # r_type 0.5 halves the total: (1 + 1 + 1) / 3 * 0.5
    g5 = _goal(name_nouns=["lumera", "hair", "extension", "clip", "women"])
    p = _product(name_nouns=["hair"], query="wigs", product_category="Wigs › Synthetic › Full")
    assert webshop_reward(p, g5, 30.0, {"color": "black"}) == pytest.approx(0.5)


# ----------------------------------------------------------------------------------------------- catalog, goals
@pytest.mark.parametrize("preset,size", [("small", 200), ("default", 1000)])
def test_catalog_fields_and_sizes(preset, size):
    products = get_shop(preset).products
    assert len(products) == size
    assert {p["category"] for p in products} == {"beauty", "food", "fashion", "furniture", "electronics"}
    asins = [p["asin"] for p in products]
    assert len(set(asins)) == len(asins)
    for p in products:
        assert re.fullmatch(r"B0[A-Z0-9]{8}", p["asin"])
        assert p["name"] == p["Title"] and p["name_nouns"] and isinstance(p["BulletPoints"], list)
        assert len(p["product_category"].split(" › ")) >= 3 and p["query"] and p["Description"]
        assert re.fullmatch(r"\$\d+\.\d\d", p["Price"]) and p["Price"] == f"${p['pricing'][0]:.2f}"
        assert p["options"] and all(v == v.lower() for vals in p["options"].values() for v in vals)


@pytest.mark.parametrize("preset", PRESETS)
def test_attributes_are_earned_only_by_products_that_have_them(preset):
    """Distractors lack an attribute for real: no fuzzy or substring match gives it to them."""
    for p in get_shop(preset).products:
        for a in p["attribute_pool"]:
            got = reward_breakdown(p, _goal(attributes=[a], goal_options=[]), 0.0, {})["n_att"]
            assert got == (a in p["Attributes"]), (p["Title"], a)
        values = [v for vals in p["options"].values() for v in vals]
        for i, v in enumerate(values):  # no option value can pass for another one of the same product
            assert all(reward_breakdown(p, _goal(goal_options=[v]), 0, {"o": w})["n_opt"] == 0 for w in values[i + 1 :])


def test_catalog_is_deterministic_and_hash_independent():
    assert generate_catalog("small", 0) == generate_catalog("small", 0)
    assert generate_catalog("small", 0) != generate_catalog("small", 1)
    code = (
        "import json; from envs import webshop as w; e = w.make_env(preset='small'); "
        "print(json.dumps([e.reset(s)[0] for s in (0, 7, 612)] + [w.get_shop('small').products[5]['Title']]))"
    )
    outs = []
    for hash_seed in ("1", "2"):
        env = {"PYTHONHASHSEED": hash_seed, "PYTHONPATH": ".", "PATH": "/usr/bin:/bin"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    env = make_env(preset="small")
    here = [env.reset(s)[0] for s in (0, 7, 612)] + [get_shop("small").products[5]["Title"]]
    assert outs[0] == outs[1] == here


@pytest.mark.parametrize("preset", PRESETS)
def test_goals_follow_webshop_rules(preset):
    shop = get_shop(preset)
    partial_distractor = 0
    seeds = list(range(0, 500, 5)) + list(range(500, 1500, 10))
    for seed in seeds:
        g = shop.goal(seed)
        target = shop.products[g["target_index"]]
        assert g["asin"] == target["asin"] and g["name"] == target["Title"] and g["query"] == target["query"]
        assert set(g["attributes"]) <= set(target["Attributes"]) and g["attributes"]
        assert all(target["options"][k] and v in target["options"][k] for k, v in g["goal_option_groups"].items())
        assert g["goal_options"] == list(g["goal_option_groups"].values())
        # price_upper: the larger of two of the first four multiples of 10 above the price
        candidates = [x for x in PRICE_RANGE if x > target["pricing"][0]][:4]
        assert g["price_upper"] in candidates[1:]
        assert g["instruction_text"].endswith(f", and price lower than {g['price_upper']:.2f} dollars")
        assert g["instruction_text"] == g["instruction_text"].lower()
        for v in g["goal_options"] + g["attributes"]:
            assert v in g["instruction_text"]
        # a same-type product with some but not all of the goal's attributes exists among the hits
        hits = shop.index.search(g["search_text"].lower())
        for i in hits:
            p = shop.products[i]
            n = sum(a in p["Attributes"] for a in g["attributes"])
            values = [v for vals in p["options"].values() for v in vals]
            has_options = all(v in values for v in g["goal_options"])
            if p["query"] == g["query"] and n > 0 and (n < len(g["attributes"]) or not has_options):
                partial_distractor += 1
                break
    assert partial_distractor >= 0.8 * len(seeds)


def test_search_is_bm25s_ranking():
    """The hits are bm25s' own top-k (scores from its retriever), restricted to positive scores."""
    index = get_shop("default").index
    for query in ["black hair extension", "gluten free protein bar in size 12 count", "Office-Chair, lumbar!"]:
        hits = index.search(query.lower())
        q = index.tokenizer.tokenize([query.lower()], update_vocab=False, return_as="ids", show_progress=False)
        docs, scores = index.bm25.retrieve(q, k=SEARCH_RETURN_N, show_progress=False, n_threads=1)
        ours = index.bm25.get_scores([i for i in q[0] if i != 0])[list(hits)]
        n = len(hits)
        assert n > 10 and list(ours) == pytest.approx(list(scores[0][:n])) and all(scores[0][n:] <= 0)
        assert list(ours) == sorted(ours, reverse=True)
        # same documents as bm25s' retrieve up to ties at the cut-off score
        cut = ours[-1]
        assert {h for h, x in zip(hits, ours) if x > cut} <= set(docs[0].tolist())
    assert index.search("zzzz the and of") == ()


def test_split_seeds():
    assert split_seeds("test", 3) == [0, 1, 2]
    assert split_seeds("train", 3) == [500, 501, 502]
    assert split_seeds("test", 500)[-1] == 499 and split_seeds("train", 0) == []
    with pytest.raises(ValueError, match="500 goals"):
        split_seeds("test", 501)
    with pytest.raises(ValueError, match="split"):
        split_seeds("valid", 3)
    with pytest.raises(ValueError, match="backend"):
        split_seeds("test", 3, backend="nope")


def test_make_env_errors():
    with pytest.raises(ValueError, match="preset"):
        make_env(preset="huge")
    with pytest.raises(ValueError, match="backend"):
        make_env(backend="web")
    with pytest.raises(TypeError, match="unknown options"):
        make_env(colour="red")


def test_shop_is_built_once_and_envs_are_cheap():
    get_shop("default")
    t = time.perf_counter()
    envs = [make_env(preset="default") for _ in range(32)]
    assert time.perf_counter() - t < 1.0
    assert all(e.shop is envs[0].shop for e in envs)


# -------------------------------------------------------------------------------------------------- pages, actions
def _expert_until(env, page):
    obs, info = env.reset(env.seed)
    while env.page != page:
        obs, _, _, info = env.step(info["expert_action"])
    return obs, info


def test_search_and_results_pages():
    env = make_env(preset="default")
    obs, info = env.reset(3)
    g = env.goal
    assert obs == f"WebShop [SEP] Instruction: [SEP] {g['instruction_text']} [SEP] Search"
    assert info["admissible_actions"] == ["search[<query>]"] and info["task"] == g["instruction_text"]
    assert info["process_reward"] == 0.0 and not info["won"] and info["anchor"] == obs and info["task_score"] == 0.0
    obs, r, done, info = env.step("search[hair extension]")
    assert (r, done) == (0.0, False) and info["action_valid"]
    n = len(env.hits)
    assert n == SEARCH_RETURN_N
    head = f"Instruction: [SEP] {g['instruction_text']} [SEP] Back to Search [SEP] Page 1 (Total results: {n}) [SEP] "
    assert obs.startswith(head + "Next > [SEP] B0") and "< Prev" not in obs
    items = obs[len(head + "Next > [SEP] ") :].split(" [SEP] ")
    assert len(items) == 30 and all(re.fullmatch(r"\$\d+\.\d\d", x) for x in items[2::3])
    assert info["admissible_actions"][:2] == ["click[back to search]", "click[next >]"]
    assert info["admissible_actions"][2:] == [f"click[{a.lower()}]" for a in items[0::3]]
    for page in range(2, 6):
        obs, _, _, info = env.step("click[Next >]")  # the argument is lowercased, as in WebShop
        assert f"Page {page} (Total results: 50) [SEP] < Prev" in obs
        assert ("Next >" in obs) == (page < 5)
    assert not env.step("click[next >]")[3]["action_valid"]  # no Next > on the last page
    obs, _, _, _ = env.step("click[< prev]")
    assert "Page 4 (Total results: 50)" in obs
    obs, _, _, info = env.step("click[back to search]")
    assert obs.startswith("WebShop [SEP] Instruction:")
    obs, _, _, _ = env.step("search[zzzz qqqq]")
    assert obs.endswith("Page 1 (Total results: 0)")


def test_item_page_sub_pages_and_navigation():
    env = make_env(preset="default")
    env.seed = 11
    obs, info = _expert_until(env, "item")
    p = env.shop.products[env.item]
    head = f"Instruction: [SEP] {env.goal['instruction_text']} [SEP] Back to Search [SEP] < Prev [SEP] "
    opts = " [SEP] ".join(x for k, v in p["options"].items() for x in [k, *v])
    tail = f"{p['Title']} [SEP] Price: {p['Price']} [SEP] Rating: {p['Rating']} [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
    assert obs == head + opts + " [SEP] " + tail
    expected = ["back to search", "< prev", "description", "features", "reviews", "buy now"]
    expected += [v for vals in p["options"].values() for v in vals]
    assert info["admissible_actions"] == [f"click[{c}]" for c in expected]
    value = next(iter(p["options"].values()))[0]
    env.step(f"click[{value}]")
    assert env.options == {next(iter(p["options"])): value}
    obs, _, _, _ = env.step("click[features]")
    assert obs == head + " [SEP] ".join(p["BulletPoints"])
    obs, _, _, info = env.step("click[< prev]")
    assert obs.startswith(head) and env.options == {next(iter(p["options"])): value}  # options kept
    obs, _, _, _ = env.step("click[description]")
    assert obs == head + p["Description"]
    env.step("click[< prev]")
    obs, _, _, _ = env.step("click[reviews]")
    assert obs.startswith(head) and (("No reviews found" in obs) == (not p["Reviews"]))
    env.step("click[< prev]")
    results_page = env.page_num
    obs, _, _, _ = env.step("click[< prev]")  # item page -> its results page; options cleared
    assert env.page == "results" and env.page_num == results_page and env.options == {}
    # search runs from any page, as in WebShop
    env.step(f"click[{p['asin'].lower()}]")
    obs, _, _, info = env.step("search[office chair]")
    assert env.page == "results" and info["action_valid"]


def test_invalid_actions_change_nothing():
    env = make_env(preset="small")
    env.seed = 4
    obs, info = _expert_until(env, "item")
    for bad in ["buy now", "click[]", "click[nothing]", "click[search]", "search[]", "Click[buy now]", "[buy now]",
                "click[next >]", "think[hmm]", "", "click buy now"]:  # fmt: skip
        state = (env.page, env.hits, env.page_num, env.item, dict(env.options), env.best_phi)
        o, r, d, i = env.step(bad)
        assert (o, r, d) == (obs, 0.0, False), bad
        assert i["anchor"] == obs and i["process_reward"] == 0.0 and not i["action_valid"]
        assert state == (env.page, env.hits, env.page_num, env.item, dict(env.options), env.best_phi)
        assert i["admissible_actions"] == info["admissible_actions"]


def test_step_limit_truncates():
    env = make_env(preset="small", max_steps=3)
    env.reset(0)
    for k in range(3):
        obs, r, done, info = env.step("click[nothing]")
        assert done == (k == 2)
    assert info["truncated"] and not info["won"] and r == 0.0
    assert env.step("search[x]")[2] and env.steps == 3  # no further steps after the end


# ------------------------------------------------------------------------------------------ rewards in the env
def test_expert_purchase_pays_outcome_and_process():
    env = make_env(preset="small")
    obs, info = env.reset(42)
    total, steps, done = 0.0, 0, False
    while not done:
        obs, r, done, info = env.step(info["expert_action"])
        total += info["process_reward"]
        steps += 1
    assert r == 1.0 and info["won"] and info["task_score"] == 1.0 and info["process_reward"] == 1.0
    assert total == pytest.approx(2.0)  # best phi (1.0) + the purchase's R (1.0)
    assert obs == "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 1.0"
    assert info["admissible_actions"] == [] and info["expert_action"] == ""


def test_near_match_pays_partial_process_reward_but_no_outcome():
    """The dense reward disagrees with the outcome: a near-match item pays phi, buying it pays R < 1, outcome 0."""
    env = make_env(preset="small")
    found = 0
    for seed in range(500, 540):
        env.reset(seed)
        env.step(env.expert_action())
        g = env.goal
        for i in env.hits:
            p = env.shop.products[i]
            R = webshop_reward(p, g, p["pricing"][0], {})
            if i != g["target_index"] and 0 < R < 1:
                while env.hits.index(i) // 10 + 1 != env.page_num:
                    env.step("click[next >]")
                _, r, _, info = env.step(f"click[{p['asin'].lower()}]")
                assert info["process_reward"] == pytest.approx(R) and r == 0.0
                _, r, done, info = env.step("click[buy now]")
                assert done and r == 0.0 and not info["won"]
                assert info["task_score"] == pytest.approx(R) and info["process_reward"] == pytest.approx(R)
                found += 1
                break
    assert found >= 20


@pytest.mark.parametrize("preset", PRESETS)
def test_expert_solves_every_goal(preset):
    """100% of the test goals and of 1,000 train goals reach R == 1 within 15 steps."""
    env = make_env(preset=preset, max_steps=15)
    failures = []
    for seed in split_seeds("test", 500) + split_seeds("train", 1000):
        obs, info = env.reset(seed)
        done = False
        while not done:
            obs, r, done, info = env.step(info["expert_action"])
        if not (r == 1.0 and info["won"] and info["task_score"] == 1.0 and "truncated" not in info):
            failures.append(seed)
    assert failures == []


def test_expert_opens_the_first_listed_product_that_solves_the_goal():
    env = make_env(preset="small")
    first_is_top = 0
    seeds = split_seeds("train", 300)
    for seed in seeds:
        obs, info = env.reset(seed)
        obs, _, _, info = env.step(info["expert_action"])
        page = env.hits[: webshop.PRODUCTS_PER_PAGE]
        solving = [i for i in page if env._solves(i)]
        action = info["expert_action"]
        if solving:
            assert action == f"click[{env.shop.products[solving[0]]['asin'].lower()}]"
            first_is_top += solving[0] == page[0]
        else:
            assert action in ("click[next >]", "click[back to search]")
        # _solves agrees with buying: the expert's purchase of that product pays R == 1 (the episode ends won).
        while not env.done:
            obs, r, _, info = env.step(info["expert_action"])
        assert info["won"] and r == 1.0
    # The expert's clicks follow the ranking: the top hit is its pick for most goals (59% on the small preset).
    assert first_is_top / len(seeds) > 0.5


# ----------------------------------------------------------------------------------------------------- robustness
def test_fuzz_actions_never_raise_and_invalid_changes_nothing():
    rng = random.Random(0)
    env = make_env(preset="small", max_steps=10_000)
    alphabet = "abcxyz []<>!?/\\\n\t\"'0123456789ĀéЖ漢"
    pieces = ["search[", "click[", "]", "[", "next >", "< prev", "buy now", "b0", "back to search", "description"]
    for seed in range(30):
        obs, info = env.reset(seed)
        for _ in range(40):
            u = rng.random()
            if u < 0.3:
                action = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            elif u < 0.55:
                action = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
            elif u < 0.65:
                action = f"click[b0{''.join(rng.choices('ABCDEFGHJK0123', k=8))}]"  # absent items
            elif u < 0.7:
                action = "search[" + " ".join(rng.choice(["hair", "zz", "ölig", "a" * 50]) for _ in range(20_000)) + "]"
            else:
                action = rng.choice(info["admissible_actions"] or ["click[x]"]).replace("<query>", "black shirt")
            before = (env.page, env.hits, env.page_num, env.item, dict(env.options), obs)
            obs2, r, done, info2 = env.step(action)
            assert isinstance(obs2, str) and r in (0.0, 1.0) and set(info2) >= {"anchor", "won", "task_score"}
            if not info2["action_valid"]:
                assert before == (env.page, env.hits, env.page_num, env.item, dict(env.options), obs2)
                assert info2["anchor"] == obs and r == 0.0
            obs, info = obs2, info2
            if done:
                break
    for weird in [None, 123, b"click[next >]", ["search[x]"]]:
        env.reset(0)
        obs, r, done, info = env.step(weird)
        assert not info["action_valid"] and r == 0.0 and not done


# --------------------------------------------------------------------------------------------------------- corpus
def test_text_corpus_covers_every_printed_word():
    corpus = webshop.text_corpus("small")
    vocab = set(re.findall(r"[a-z]+", " ".join(corpus).lower()))
    env = make_env(preset="small")
    rng = random.Random(1)
    seen = set()
    for seed in range(7000, 7040):  # goals the corpus did not include
        obs, info = env.reset(seed)
        seen |= set(re.findall(r"[a-z]+", (obs + " " + info["expert_action"]).lower()))
        for _ in range(12):
            action = rng.choice(info["admissible_actions"] + [info["expert_action"]] * 2)
            action = action.replace("<query>", env.goal["search_text"])
            obs, _, done, info = env.step(action)
            seen |= set(re.findall(r"[a-z]+", (obs + " " + action).lower()))
            if done:
                break
    assert seen - vocab == set()


# ------------------------------------------------------------------------------------------------ real backend
def test_real_backend_missing_package_names_the_setup(monkeypatch):
    monkeypatch.setitem(sys.modules, "web_agent_site", None)  # makes `import web_agent_site...` fail
    with pytest.raises(RuntimeError, match=r"not installed[\s\S]*git clone https://github.com/princeton-nlp/WebShop"):
        make_env(backend="real")


# A stand-in for web_agent_site: NOT WebShop. It exposes only the calls envs/_webshop_real.py makes, with a
# two-product shop, so that the adapter's contract is tested where the real package (Java, pyserini, spaCy
# and several GB of product data) cannot run.
_STAND_IN = """
import re

PRODUCTS = {
    "B000000001": {"Title": "Black Shirt", "options": {"color": ["black", "white"]}},
    "B000000002": {"Title": "Red Mug", "options": {}},
}
GOAL = {"instruction_text": "i want a black shirt", "goal_options": ["black"]}


class _Server:
    def __init__(self):
        self.user_sessions = {}
        self.product_item_dict = PRODUCTS
        self.product_prices = {"B000000001": 10.0, "B000000002": 5.0}

    def get_page_name(self, url):
        for name in ("search_results", "item_page", "item_sub_page", "done"):
            if url and name in url:
                return name
        return ""


class _Browser:
    current_url = None


class WebAgentTextEnv:
    def __init__(self, observation_mode="html", num_products=None, human_goals=None, **kwargs):
        if num_products == 7:
            raise FileNotFoundError("data/items_shuffle_1000.json")
        assert observation_mode == "text" and human_goals
        self.server, self.browser, self.session = _Server(), _Browser(), None

    def _obs(self):
        s = self.server.user_sessions[self.session]
        page = self.server.get_page_name(self.browser.current_url)
        if page == "search_results":
            return "Back to Search [SEP] B000000001 [SEP] Black Shirt [SEP] B000000002 [SEP] Red Mug"
        if page == "item_page":
            return "Back to Search [SEP] < Prev [SEP] " + PRODUCTS[s["asin"]]["Title"] + " [SEP] Buy Now"
        if page == "done":
            return "Thank you for shopping with us!"
        return "WebShop [SEP] Instruction: [SEP] " + GOAL["instruction_text"] + " [SEP] Search"

    def reset(self, session=None):
        self.session = str(session)
        self.server.user_sessions[self.session] = {"goal": dict(GOAL), "asin": None, "options": {}}
        self.browser.current_url = "http://127.0.0.1:3000/" + self.session
        return self._obs(), None

    def get_available_actions(self):
        page = self.server.get_page_name(self.browser.current_url)
        if page == "search_results":
            clickables = ["back to search", "b000000001", "b000000002"]
        elif page == "item_page":
            asin = self.server.user_sessions[self.session]["asin"]
            clickables = ["back to search", "< prev", "buy now"] + PRODUCTS[asin]["options"].get("color", [])
        else:
            clickables = ["search"] if page == "" else []
        return {"has_search_bar": page == "", "clickables": clickables}

    def step(self, action):
        from web_agent_site.engine.goal import get_reward

        m = re.match(r"(.+)\\[(.+)\\]", action)
        name, arg = m.groups()
        arg = arg.lower()
        s = self.server.user_sessions[self.session]
        if name == "search":
            self.browser.current_url = "http://x/search_results/" + arg
        elif arg == "back to search":
            self.browser.current_url = "http://x/" + self.session
        elif arg == "< prev":
            self.browser.current_url = "http://x/search_results/"
            s["asin"], s["options"] = None, {}
        elif arg == "buy now":
            self.browser.current_url = "http://x/done/"
            p = PRODUCTS[s["asin"]]
            r = get_reward(p, s["goal"], price=self.server.product_prices[s["asin"]], options=s["options"])
            return self._obs(), r, True, None
        elif arg.startswith("b0"):
            s["asin"] = arg.upper()
            self.browser.current_url = "http://x/item_page/" + s["asin"]
        else:
            s["options"]["color"] = arg
        return self._obs(), 0.0, False, None
"""

_STAND_IN_GOAL = '''
def get_reward(product, goal, price, options, **kwargs):
    """Stand-in score: (goal options chosen + shirt bought) / (len(goal options) + 1)."""
    n = sum(v in options.values() for v in goal["goal_options"]) + (product["Title"] == "Black Shirt")
    return n / (len(goal["goal_options"]) + 1)
'''


@pytest.fixture
def stand_in_webshop(tmp_path, monkeypatch):
    root = tmp_path / "web_agent_site"
    for sub in ("", "envs", "engine"):
        (root / sub).mkdir(exist_ok=True)
        (root / sub / "__init__.py").write_text("")
    (root / "envs" / "web_agent_text_env.py").write_text(textwrap.dedent(_STAND_IN))
    (root / "engine" / "goal.py").write_text(textwrap.dedent(_STAND_IN_GOAL))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("web_agent_site")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m.startswith("web_agent_site")]:
        del sys.modules[name]


def test_real_adapter_contract_on_a_stand_in(stand_in_webshop):
    with pytest.raises(RuntimeError, match=r"data could not be loaded[\s\S]*setup.sh"):
        make_env(backend="real", num_products=7)
    env = make_env(backend="real", max_steps=15)
    obs, info = env.reset(3)
    assert obs == "WebShop [SEP] Instruction: [SEP] i want a black shirt [SEP] Search"
    assert info["task"] == "i want a black shirt" and info["admissible_actions"] == ["search[<query>]"]
    assert info["process_reward"] == 0.0 and info["anchor"] == obs and "expert_action" not in info
    obs, r, done, info = env.step("search[black shirt]")
    assert info["admissible_actions"] == ["click[back to search]", "click[b000000001]", "click[b000000002]"]
    before = obs
    obs, r, done, info = env.step("click[b000000009]")  # absent item: nothing happens
    assert obs == before and info["anchor"] == before and not info["action_valid"] and r == 0.0
    obs, r, done, info = env.step("click[b000000002]")  # wrong product: phi = 0/2
    assert info["process_reward"] == 0.0
    env.step("click[< prev]")
    obs, r, done, info = env.step("click[b000000001]")  # the shirt: phi = 1/2
    assert info["process_reward"] == pytest.approx(0.5)
    obs, r, done, info = env.step("click[white]")  # phi stays 1/2: pays nothing
    assert info["process_reward"] == 0.0
    obs, r, done, info = env.step("click[black]")  # phi = 2/2
    assert info["process_reward"] == pytest.approx(0.5)
    obs, r, done, info = env.step("click[buy now]")
    assert done and r == 1.0 and info["won"] and info["task_score"] == 1.0 and info["process_reward"] == 1.0
    # a partial purchase: task_score R < 1, outcome 0; and the step limit
    env.reset(4)
    env.step("search[shirt]")
    env.step("click[b000000001]")
    env.step("click[white]")
    obs, r, done, info = env.step("click[buy now]")
    assert done and r == 0.0 and not info["won"] and info["task_score"] == pytest.approx(0.5)
    # misaligned: the options are scored as chosen, and a purchase pays the phi of the item bought
    env = make_env(backend="real", max_steps=15, process_reward="misaligned")
    env.reset(3)
    env.step("search[black shirt]")
    assert env.step("click[b000000001]")[3]["process_reward"] == pytest.approx(1.0)  # the shirt, no option chosen
    env.step("click[< prev]")
    env.step("click[b000000002]")  # a wrong product, bought: its own blind score (the options' 1/2), not the shirt's
    obs, r, done, info = env.step("click[buy now]")
    assert done and r == 0.0 and info["process_reward"] == pytest.approx(0.5)
    env.reset(3)
    env.step("search[black shirt]")
    env.step("click[b000000001]")
    obs, r, done, info = env.step("click[buy now]")  # the hurried purchase: full credit, no success
    assert done and not info["won"] and info["process_reward"] == pytest.approx(1.0)
    env = make_env(backend="real", max_steps=2)
    env.reset(0)
    env.step("nonsense")
    obs, r, done, info = env.step("click[nothing]")
    assert done and info["truncated"]


# ------------------------------------------------------------------------------------ process-reward variants
def _play(env, seed: int, choose) -> tuple[float, bool]:
    """(process return, won) of one episode; choose(info, rng) picks each action."""
    rng = random.Random(seed)
    _, info = env.reset(seed)
    total, done = 0.0, False
    while not done:
        _, _, done, info = env.step(choose(info, rng))
        total += info["process_reward"]
    return total, bool(info["won"])


_EXPERT = lambda info, rng: info["expert_action"]  # noqa: E731
_HURRIED = lambda info, rng: webshop.hurried_action(info["expert_action"], info["admissible_actions"])  # noqa: E731


def _random_agent(info, rng):
    action = rng.choice(info["admissible_actions"])
    return f"search[{info['task']}]" if action == webshop.SEARCH_PLACEHOLDER else action


def _agents_on(process_reward: str, seeds) -> dict[str, tuple[list[float], list[bool]]]:
    env = make_env(preset="small", process_reward=process_reward)
    out = {}
    for name, choose in (("expert", _EXPERT), ("hurried", _HURRIED), ("random", _random_agent)):
        results = [_play(env, seed, choose) for seed in seeds]
        out[name] = ([r for r, _ in results], [w for _, w in results])
    return out


def test_misaligned_process_reward_pays_the_hurried_purchase_like_the_expert():
    """Scripted agents on 200 train goals: under the misaligned reward the hurried shopper (buys the right product
    without choosing its options) earns the expert's process return on every goal while it succeeds far less
    often; the expert earns far more than a random agent."""
    seeds = split_seeds("train", 200)
    agents = _agents_on("misaligned", seeds)
    expert_ret, expert_won = agents["expert"]
    hurried_ret, hurried_won = agents["hurried"]
    random_ret, _ = agents["random"]
    assert all(expert_won)
    assert all(h >= e - 1e-9 for h, e in zip(hurried_ret, expert_ret))
    assert sum(hurried_won) / len(seeds) <= 0.05  # every small-preset goal asks for options: 0 of 200 here
    # 2.00 against 1.27 here: a random click on a listed product is often a near-match, which phi pays in part
    assert sum(expert_ret) / len(seeds) >= sum(random_ret) / len(seeds) + 0.5


def test_aligned_process_reward_pays_the_expert_more_than_every_failure():
    seeds = split_seeds("train", 200)
    agents = _agents_on("aligned", seeds)
    best = max(agents["expert"][0])
    assert min(agents["expert"][0]) == pytest.approx(2.0) == best
    for returns, won in agents.values():
        for r, w in zip(returns, won):
            assert (r == pytest.approx(2.0)) if w else (r < 2.0 - 1e-9)


def test_options_blind_reward_equals_the_reward_with_the_goal_options():
    product, goal = _product(), _goal()
    assert webshop_reward(product, goal, 10.0, {}) < 1.0
    assert webshop.options_blind_reward(product, goal, 10.0) == webshop_reward(product, goal, 10.0, {"c": "black"})
    with pytest.raises(ValueError, match="process_reward"):
        make_env(preset="small", process_reward="dense")
