"""Model loading (local folders, offline hub ids, smollm2-135m), the critic, and the tiny model's builder."""

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import models
from common.generation import HFGenerator
from common.models import Critic, build_critic, is_tiny, load_model
from common.prompts import format_response, parse_action
from tiny_models import build as tiny_build
from tiny_models.build import train_tiny_tokenizer

TEXTS = [
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you see a "
    "cabinet 2, a cabinet 1, a countertop 1, and a sinkbasin 1.\n\nYour task is to: put a clean apple in fridge.",
    "You arrive at countertop 1. On the countertop 1, you see a apple 2, a fork 1, and a potato 1.",
    "WebShop [SEP] Instruction: [SEP] i need a long clip-in hair extension which is natural looking, and price "
    "lower than 40.00 dollars [SEP] Search",
    "Back to Search [SEP] < Prev [SEP] color [SEP] black [SEP] size [SEP] small [SEP] Price: $19.99 [SEP] Buy Now",
    "<action>go to countertop 1</action> <action>click[b09xyz1234]</action> <action>search[hair extension]</action>",
]


@pytest.fixture(scope="module")
def small_tokenizer():
    return train_tiny_tokenizer(TEXTS * 8, vocab_size=400)


def test_tiny_tokenizer_keeps_extra_tokens_whole():
    plain = train_tiny_tokenizer(TEXTS * 8, vocab_size=400)
    extra = train_tiny_tokenizer(TEXTS * 8, vocab_size=400, extra_tokens=(" [SEP]",))
    page = TEXTS[3]
    assert extra.convert_ids_to_tokens(extra(" [SEP]").input_ids) == [" [SEP]"]
    assert len(plain(" [SEP]").input_ids) > 1
    # the page takes fewer tokens (more than half a token fewer per " [SEP]"), and the text still round-trips
    assert len(extra(page).input_ids) < len(plain(page).input_ids) - page.count(" [SEP]") // 2
    assert extra.decode(extra(page).input_ids) == page
    assert extra.decode(extra("[SEP] at the start, no space").input_ids) == "[SEP] at the start, no space"


def small_model(tokenizer, seed=0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def test_is_tiny():
    assert is_tiny("tiny")
    assert not is_tiny("smollm2-135m") and not is_tiny("Qwen/Qwen2.5-1.5B-Instruct")


@pytest.mark.parametrize(
    "text",
    TEXTS
    + [
        "",
        "  leading and trailing spaces  ",
        "unicode: héllo wörld — ünïcødé ✓ 日本語のテキスト 🙂 \t tabs\nnewlines\r\n",
        "</action><action>nested <action>x</action></action>",
        "<|endoftext|> is kept as text",
    ],
)
def test_tiny_tokenizer_round_trip(small_tokenizer, text):
    ids = small_tokenizer(text).input_ids
    assert small_tokenizer.decode(ids) == text


def test_tiny_tokenizer_special_tokens(small_tokenizer):
    tok = small_tokenizer
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.eos_token_id is not None and tok.pad_token_id != tok.eos_token_id
    # the action tags are single tokens, and nothing is prepended
    assert len(tok("<action>").input_ids) == 1 and len(tok("</action>").input_ids) == 1
    assert tok("go").input_ids == tok("go", add_special_tokens=True).input_ids
    assert len(tok) <= 400 + 2
    batch = tok(["a", "a longer text here"], padding=True)
    assert batch.input_ids[0][0] == tok.pad_token_id  # left padding


def test_local_folder_round_trip(tmp_path, small_tokenizer):
    model = small_model(small_tokenizer)
    model.save_pretrained(tmp_path)
    small_tokenizer.save_pretrained(tmp_path)
    loaded, tok = load_model(str(tmp_path))
    assert tok.padding_side == "left" and tok.pad_token_id == small_tokenizer.pad_token_id
    assert loaded.name_or_path == str(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    text = "You arrive at countertop 1."
    assert tok(text).input_ids == small_tokenizer(text).input_ids
    assert load_model(str(tmp_path), dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_missing_model_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="huggingface-cli download nobody-xyz/no-such-model"):
        load_model("nobody-xyz/no-such-model")
    with pytest.raises(RuntimeError, match="cannot load"):
        load_model(str(tmp_path))  # an empty folder


def test_pad_token_falls_back_to_eos(tmp_path, small_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=small_tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert tok.pad_token is None
    small_model(small_tokenizer).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, loaded = load_model(str(tmp_path))
    assert loaded.pad_token == "<|endoftext|>" and loaded.padding_side == "left"


def test_critic(small_tokenizer):
    policy = small_model(small_tokenizer)
    critic = build_critic(policy)
    assert isinstance(critic, Critic)
    ids = small_tokenizer(["You arrive at countertop 1.", "go"], padding=True, return_tensors="pt")
    values = critic(ids.input_ids, ids.attention_mask)
    assert values.shape == ids.input_ids.shape and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0  # zero-initialised head
    # a deep copy: training the critic leaves the policy alone
    before = [p.clone() for p in policy.parameters()]
    torch.nn.init.normal_(critic.head.weight)
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    values = critic(ids.input_ids, ids.attention_mask)
    (values * ids.attention_mask).pow(2).mean().backward()
    assert critic.body.embed_tokens.weight.grad is not None
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    # left and right padding agree at real tokens (position ids follow the mask)
    with torch.no_grad():
        left = critic(ids.input_ids, ids.attention_mask)
        n = int(ids.attention_mask[1].sum())
        right_ids = torch.full_like(ids.input_ids[1:], small_tokenizer.pad_token_id)
        right_ids[0, :n] = ids.input_ids[1, -n:]
        right_mask = torch.zeros_like(ids.attention_mask[1:])
        right_mask[0, :n] = 1
        right = critic(right_ids, right_mask)
    torch.testing.assert_close(left[1, -n:], right[0, :n], atol=1e-5, rtol=0)


def test_critic_from_a_separate_model(tmp_path, small_tokenizer):
    other = small_model(small_tokenizer, seed=5)
    other.save_pretrained(tmp_path)
    small_tokenizer.save_pretrained(tmp_path)
    policy = small_model(small_tokenizer)
    critic = build_critic(policy, str(tmp_path))
    assert torch.equal(critic.body.embed_tokens.weight, other.model.embed_tokens.weight)
    wrong = train_tiny_tokenizer(TEXTS, vocab_size=300)
    policy_other_vocab = small_model(wrong)
    with pytest.raises(ValueError, match="different vocabulary"):
        build_critic(policy_other_vocab, str(tmp_path))


@pytest.mark.slow
def test_smollm2_loads_offline_and_generates(tmp_path):
    # the first load dequantises the GGUF (~30 s on 2 cores) into the cache; later loads take under a second
    model, tok = load_model("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tok.chat_template and tok.padding_side == "left" and tok.pad_token is not None
    assert os.path.isdir(model.name_or_path)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name a fruit. Answer inside <action></action>."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(prompt, add_special_tokens=False).input_ids
    out = HFGenerator(tok, max_new_tokens=24).generate(model, [ids, ids], greedy=True)
    assert all(len(o.token_ids) > 0 and o.text.strip() for o in out)
    assert out[0].token_ids == out[1].token_ids
    json.dumps([o.text for o in out])
    assert models.SMOLLM2 in model.name_or_path


SMALL_TINY = dict(
    tiny_build.TINY_CONFIG,
    vocab_size=600,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=512,
    max_prompt_tokens=256,
    max_new_tokens=12,
    bc_train_seeds=6,
    bc_batch_size=4,
    bc_max_steps=4,
    bc_eval_every=2,
    bc_eval_tasks=3,
)


def test_behaviour_cloning_is_deterministic_and_learns(small_tokenizer):
    examples = [
        (small_tokenizer(t).input_ids[:20], small_tokenizer("<action>go to desk 1</action>").input_ids) for t in TEXTS
    ]

    def run():
        model = small_model(small_tokenizer, seed=3)
        losses = list(
            tiny_build.behaviour_clone(
                model, examples, steps=12, batch_size=2, learning_rate=3e-3, warmup_steps=2, seed=7
            )
        )
        return model, losses

    (a, la), (b, lb) = run(), run()
    assert la == lb
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert la[-1] < la[0]


def test_bc_learning_rate_warms_up_then_decays_to_its_floor():
    lr = [tiny_build.bc_learning_rate(k, 100, 1e-3, 10, 0.05) for k in range(100)]
    assert lr[0] == pytest.approx(1e-4) and lr[9] == pytest.approx(
        1e-3 * (0.05 + 0.95 * 0.5 * (1 + math.cos(0.09 * math.pi)))
    )
    assert max(lr) <= 1e-3 and all(a >= b for a, b in zip(lr[9:], lr[10:]))  # monotone after the warm-up
    assert lr[50] == pytest.approx(1e-3 * (0.05 + 0.95 * 0.5))
    assert tiny_build.bc_learning_rate(100, 100, 1e-3, 10, 0.05) == pytest.approx(5e-5)
    assert {tiny_build.bc_learning_rate(k, 100, 1e-3, 1, 1.0) for k in range(100)} == {1e-3}  # ratio 1: constant


def test_tiny_expert_answers_product_codes_by_number():
    from envs import alfworld, webshop

    adm = ["click[back to search]", "click[next >]", "click[b02wtyj3tv]", "click[b0u43ilmdf]"]
    assert tiny_build.tiny_expert_answer(webshop, "click[b0u43ilmdf]", adm) == "4"
    assert tiny_build.tiny_expert_answer(webshop, "click[next >]", adm) == "click[next >]"
    assert tiny_build.tiny_expert_answer(webshop, "click[hazelnut]", ["click[hazelnut]"]) == "click[hazelnut]"
    assert tiny_build.tiny_expert_answer(webshop, "search[red mug]", ["search[<query>]"]) == "search[red mug]"
    assert tiny_build.tiny_expert_answer(alfworld, "go to desk 1", ["look", "go to desk 1"]) == "go to desk 1"
    # bc_answer_by_number: every listed action by its number; one that is not listed keeps its text
    assert tiny_build.tiny_expert_answer(alfworld, "go to desk 1", ["look", "go to desk 1"], every=True) == "2"
    assert tiny_build.tiny_expert_answer(webshop, "click[next >]", adm, every=True) == "2"
    assert tiny_build.tiny_expert_answer(alfworld, "go to bed 1", ["look"], every=True) == "go to bed 1"
    # The short prompt's parser turns the number back into the expert's action.
    assert parse_action(format_response(tiny_build.tiny_expert_answer(webshop, adm[2], adm), short=True), adm) == (
        adm[2],
        True,
    )


def _webshop_episodes(turns):
    """collect_expert_turns' WebShop turns cut into episodes: each starts at a turn with no history."""
    out = []
    for turn in turns:
        if not turn[2]:
            out.append([])
        out[-1].append(turn)
    return out


def test_hurried_demonstrations_buy_without_options_in_their_share_of_episodes():
    """WebShop's hurried shopper buys on the item page where the expert picks an option; the warm start's data has
    it play about bc_hurried_share of the episodes, the same ones on every call (ALFWorld's hurried player:
    tests/test_alfworld.py)."""
    from envs import webshop

    item = ["click[back to search]", "click[< prev]", "click[description]", "click[buy now]", "click[gray]"]
    assert webshop.hurried_action("click[gray]", item) == "click[buy now]"
    for action in ("click[buy now]", "click[< prev]", "click[back to search]"):
        assert webshop.hurried_action(action, item) == action
    results = ["click[back to search]", "click[next >]", "click[b02wtyj3tv]"]
    assert webshop.hurried_action("click[b02wtyj3tv]", results) == "click[b02wtyj3tv]"
    assert webshop.hurried_action("search[gray chair]", ["search[<query>]"]) == "search[gray chair]"

    seeds = list(webshop.split_seeds("train", 200))
    expert = tiny_build.collect_expert_turns("webshop", "small", seeds)
    mixed = tiny_build.collect_expert_turns("webshop", "small", seeds, hurried_share=0.35)
    assert mixed == tiny_build.collect_expert_turns("webshop", "small", seeds, hurried_share=0.35)

    episodes = _webshop_episodes

    # every episode ends with a purchase; a hurried one buys right after opening a product that has options
    exp_eps, mixed_eps = episodes(expert), episodes(mixed)
    assert len(exp_eps) == len(mixed_eps) == len(seeds)
    assert all(ep[-1][4] == "click[buy now]" for ep in exp_eps + mixed_eps)
    changed = [i for i, (a, b) in enumerate(zip(exp_eps, mixed_eps)) if a != b]
    assert 0.2 < len(changed) / len(seeds) < 0.4
    for i in changed:
        assert len(mixed_eps[i]) < len(exp_eps[i])
        assert [t[4] for t in mixed_eps[i]] == [t[4] for t in exp_eps[i][: len(mixed_eps[i]) - 1]] + ["click[buy now]"]
        assert not webshop.TINY_ANSWER_BY_NUMBER.fullmatch(exp_eps[i][len(mixed_eps[i]) - 1][4])  # an option click
    # both default warm starts imitate hurried episodes (ALFWorld's searcher skips the appliance in half of them)
    assert all(tiny_build.tiny_config(e)["bc_hurried_share"] > 0 for e in ("webshop", "alfworld"))
    assert tiny_build.tiny_config("alfworld")["bc_careless_pick"] == "goal"


def test_careless_pick_last_opens_the_last_listed_product_every_time():
    """bc_careless_pick="last": the careless shopper opens the results page's last product, one consistent habit
    (the same action wherever it is taken), and its episodes in the warm start's data all do so."""
    import random

    from envs import webshop

    env = webshop.make_env(preset="small")
    env.reset(500)
    env.step(env.expert_action())
    listed = [a for a in env.admissible_actions() if webshop.TINY_ANSWER_BY_NUMBER.fullmatch(a)]
    picks = {webshop.careless_action(env, random.Random(i), "last") for i in range(20)}
    assert picks == {listed[-1]} and len(listed) == webshop.PRODUCTS_PER_PAGE
    seeds = list(webshop.split_seeds("train", 60))
    turns = tiny_build.collect_expert_turns("webshop", "small", seeds, careless_share=1.0, careless_pick="last")
    clicks = [t[4] for t in turns if webshop.TINY_ANSWER_BY_NUMBER.fullmatch(t[4])]
    assert len(clicks) == len(seeds)  # one product opened per episode: the last listed one, never a page turn
    for t in turns:
        if webshop.TINY_ANSWER_BY_NUMBER.fullmatch(t[4]):
            assert t[4] == [a for a in t[3] if webshop.TINY_ANSWER_BY_NUMBER.fullmatch(a)][-1]


def test_careless_demonstrations_open_a_random_result_and_choose_its_options():
    """WebShop's careless shopper opens a listed product at random, chooses the goal's options that it offers and
    buys it; the warm start's data has it play about bc_careless_share of the episodes (drawn independently of the
    hurried share), the same ones on every call."""
    import random

    from envs import webshop

    env = webshop.make_env(preset="small")
    rng = random.Random(0)
    env.reset(500)
    env.step(env.expert_action())  # the search: a results page
    picks = {webshop.careless_action(env, rng) for _ in range(60)}
    listed = {a for a in env.admissible_actions() if webshop.TINY_ANSWER_BY_NUMBER.fullmatch(a)}
    assert picks == listed and len(listed) > 2
    env.step(sorted(listed)[0])
    wanted = env._goal_options_offered(env.item)
    for value in wanted.values():  # the goal's options this product offers, whatever the product
        assert webshop.careless_action(env, rng) == f"click[{value}]"
        env.step(f"click[{value}]")
    assert webshop.careless_action(env, rng) == "click[buy now]"

    seeds = list(webshop.split_seeds("train", 200))
    mixed = tiny_build.collect_expert_turns("webshop", "small", seeds, careless_share=0.5)
    assert mixed == tiny_build.collect_expert_turns("webshop", "small", seeds, careless_share=0.5)
    expert = tiny_build.collect_expert_turns("webshop", "small", seeds)

    def episodes(turns):
        return [[t[4] for t in ep] for ep in _webshop_episodes(turns)]

    mixed_eps, expert_eps = episodes(mixed), episodes(expert)
    assert len(mixed_eps) == len(expert_eps) == len(seeds)
    assert all(ep[-1] == "click[buy now]" for ep in mixed_eps + expert_eps)
    changed = [i for i, (a, b) in enumerate(zip(mixed_eps, expert_eps)) if a != b]
    assert 0.3 < len(changed) / len(seeds) < 0.55  # careless episodes whose random pick is not the expert's
    failed = 0
    for i in changed:  # search, open a listed product (no page turn), its offered goal options, buy
        actions = mixed_eps[i]
        assert actions[0].startswith("search[") and webshop.TINY_ANSWER_BY_NUMBER.fullmatch(actions[1])
        assert not any(a in ("click[next >]", "click[< prev]", "click[back to search]") for a in actions)
        env.reset(seeds[i])
        for action in actions:
            _, _, _, info = env.step(action)
        failed += not info["won"]
    # the rest happened to open another product that solves the goal: about a third of the listed ones do
    assert failed > 0.5 * len(changed)
    # careless and hurried: a random product bought at once
    both = episodes(tiny_build.collect_expert_turns("webshop", "small", seeds, hurried_share=1.0, careless_share=1.0))
    assert all(len(ep) == 3 and ep[-1] == "click[buy now]" for ep in both)


def test_response_loss_equals_the_full_head_loss(small_tokenizer):
    model = small_model(small_tokenizer, seed=1)
    ids = torch.randint(0, len(small_tokenizer), (3, 9))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    labels = torch.full_like(ids, -100)
    labels[0, 4:7], labels[1, 2:9], labels[2, 8] = ids[0, 4:7], ids[1, 2:9], ids[2, 8]
    full = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(tiny_build.response_loss(model, ids, mask, labels), full)


def test_bc_batches_cover_each_epoch_once_with_little_padding():
    examples = [([1] * n, [2, 3]) for n in torch.randint(5, 200, (256,), generator=torch.Generator().manual_seed(0))]
    batches = tiny_build._bc_batches(examples, 8, torch.Generator().manual_seed(1))
    seen, padding = [], 0
    for _ in range(len(examples) // 8):
        ids, mask, labels = next(batches)
        assert ids.shape[0] == 8 and bool((labels[mask == 0] == -100).all())
        seen += [int(m.sum()) for m in mask]
        padding += int((mask == 0).sum())
    assert sorted(seen) == sorted(len(p) + len(r) for p, r in examples)  # one epoch: every example once
    assert padding < 0.1 * sum(seen)  # length-sorted pools: random batches would pad ~50%


def test_tiny_build_is_cached_deterministic_and_keeps_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    path = tiny_build.build_tiny("alfworld", "small", 1, cache_dir=str(tmp_path / "a"), config=SMALL_TINY)
    assert torch.equal(torch.rand(3), expected)  # the build did not consume the caller's random numbers
    report = json.loads((path / "warmstart.json").read_text())
    assert report["warm_start"] and report["bc_steps"] in (2, 4) and 0.0 <= report["success"] <= 1.0
    assert report["in_band"] == (0.10 <= report["success"] <= 0.40)
    assert [e["step"] for e in report["evaluations"]][0] == 2
    assert path.name.startswith("alfworld-small-seed1-")
    # a second build elsewhere gives the same weights, whatever the caller's thread count (the build runs on
    # bc_threads, and gives the caller's count back); the cached folder is found again without a rebuild
    threads = torch.get_num_threads()
    torch.set_num_threads(3 - min(threads, 2))  # 1 <-> 2
    try:
        other = tiny_build.build_tiny("alfworld", "small", 1, cache_dir=str(tmp_path / "b"), config=SMALL_TINY)
        assert torch.get_num_threads() == 3 - min(threads, 2)
    finally:
        torch.set_num_threads(threads)
    m1, t1 = load_model(str(path))
    m2, _ = load_model(str(other))
    assert all(torch.equal(x, y) for x, y in zip(m1.state_dict().values(), m2.state_dict().values()))
    mtime = (path / "warmstart.json").stat().st_mtime
    assert tiny_build.build_tiny("alfworld", "small", 1, cache_dir=str(tmp_path / "a"), config=SMALL_TINY) == path
    assert (path / "warmstart.json").stat().st_mtime == mtime
    # another seed is another model
    seed2 = tiny_build.build_tiny("alfworld", "small", 2, cache_dir=str(tmp_path / "a"), config=SMALL_TINY)
    assert seed2 != path
    # the saved tokenizer is the trained one: round trip on env text, action tags single tokens
    text = "You arrive at countertop 1. On the countertop 1, you see a apple 2. <action>go to fridge 1</action>"
    assert t1.decode(t1(text).input_ids) == text and len(t1("</action>").input_ids) == 1
    assert t1.padding_side == "left" and t1.pad_token_id != t1.eos_token_id
    assert m1.config.tie_word_embeddings and m1.config.model_type == "qwen2"


def test_untrained_tiny_and_unknown_env(tmp_path):
    path = tiny_build.build_tiny("webshop", "small", 1, cache_dir=str(tmp_path), warm_start=False, config=SMALL_TINY)
    report = json.loads((path / "warmstart.json").read_text())
    assert report["warm_start"] is False and report["bc_steps"] == 0
    with pytest.raises(ValueError, match="unknown env"):
        tiny_build.build_tiny("minigrid", cache_dir=str(tmp_path), config=SMALL_TINY)


@pytest.mark.slow
@pytest.mark.parametrize("env_name", ["webshop", "alfworld"])
def test_tiny_warm_start_reaches_its_band(env_name):
    model, tok = load_model("tiny", env_name=env_name, preset="small", seed=1)
    report = json.loads((models.pathlib.Path(model.name_or_path) / "warmstart.json").read_text())
    assert 5e5 <= report["parameters"] <= 5e6
    low, high = tiny_build.tiny_config(env_name)["success_band"]
    assert low <= report["success"] <= high, report["evaluations"]


@pytest.mark.parametrize("env_name", ["webshop", "alfworld"])
def test_default_tiny_models_are_the_committed_ones(env_name, tmp_path):
    """The scripts' default tiny models load from tiny_models/ (the same weights on every machine): the committed
    folder carries the hash of today's config and texts, so a change of either without a rebuild fails here."""
    path = tiny_build.build_tiny(env_name, "small", 1, cache_dir=str(tmp_path))
    assert path.parent == tiny_build.COMMITTED_TINY_DIR and (path / "model.safetensors").is_file()
    assert not (tmp_path / "tiny").exists()  # nothing was built
    report = json.loads((path / "warmstart.json").read_text())
    assert report["env"] == env_name and report["seed"] == 1 and report["in_band"]
    if env_name == "webshop":  # imitated to convergence: one evaluation, after the last step
        assert [e["step"] for e in report["evaluations"]] == [report["bc_steps"]] == [3000]
    model, tokenizer = models.load_model("tiny", env_name=env_name, cache_dir=str(tmp_path))
    assert model.name_or_path == str(path) and tokenizer.pad_token_id is not None


def test_build_command_prints_the_committed_folder_without_building(repo_root, tmp_path):
    cmd = [sys.executable, "-m", "tiny_models.build", "--env", "alfworld", "--seed", "1", "--cache-dir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, check=True, timeout=300).stdout
    path = tiny_build.build_tiny("alfworld", "small", 1, cache_dir=str(tmp_path))
    assert out.splitlines() == [str(path)] and path.parent == tiny_build.COMMITTED_TINY_DIR
    assert not any(tmp_path.iterdir())  # nothing was built


def test_dawdling_demonstrations_visit_sub_pages_and_run_out_of_turns():
    """WebShop's dawdler opens a sub-page on an item page with its probability and otherwise acts as the expert;
    in collect_expert_turns it only inserts (sub-page, < prev) pairs into the expert's episodes, the same ones on
    every call, and at 0.85 most episodes end at the 15-turn limit without a purchase."""
    from envs import webshop

    item = ["click[back to search]", "click[< prev]", "click[description]", "click[buy now]", "click[gray]"]
    rng = random.Random(0)
    assert all(webshop.dawdling_action("click[gray]", item, rng, 0.0) == "click[gray]" for _ in range(50))
    visits = [webshop.dawdling_action("click[gray]", item, rng, 1.0) for _ in range(50)]
    assert set(visits) == {"click[description]", "click[features]", "click[reviews]"} == set(webshop.SUB_PAGE_CLICKS)
    results = ["click[back to search]", "click[next >]", "click[b02wtyj3tv]"]
    assert webshop.dawdling_action("click[b02wtyj3tv]", results, rng, 1.0) == "click[b02wtyj3tv]"

    seeds = list(webshop.split_seeds("train", 100))
    expert = tiny_build.collect_expert_turns("webshop", "small", seeds)
    dawdled = tiny_build.collect_expert_turns("webshop", "small", seeds, dawdle_prob=0.85)
    assert dawdled == tiny_build.collect_expert_turns("webshop", "small", seeds, dawdle_prob=0.85)

    exp_eps, daw_eps = _webshop_episodes(expert), _webshop_episodes(dawdled)
    assert len(exp_eps) == len(daw_eps) == len(seeds)
    truncated = 0
    for e, d in zip(exp_eps, daw_eps):
        actions = [t[4] for t in d]
        pruned = []  # the dawdled episode with its sub-page visits (and the < prev that ends each) taken out
        for i, a in enumerate(actions):
            if a in webshop.SUB_PAGE_CLICKS:
                assert actions[i + 1 : i + 2] in ([], ["click[< prev]"])
            elif not (a == "click[< prev]" and i > 0 and actions[i - 1] in webshop.SUB_PAGE_CLICKS):
                pruned.append(a)
        expert_actions = [t[4] for t in e]
        assert pruned == expert_actions[: len(pruned)]
        if pruned != expert_actions:
            assert len(actions) == 15 and "click[buy now]" not in actions
            truncated += 1
    assert 0.5 < truncated / len(seeds) < 0.95


def test_evaluate_success_honours_the_episode_length():
    """The builder's evaluation plays episodes of `max_steps` turns (`bc_episode_steps`), else the env's default:
    no ALFWorld game is solved in one turn, while the committed model solves some in the default 50."""
    model, tokenizer = load_model("tiny", env_name="alfworld", preset="small", seed=1)
    seeds = list(range(32))
    kw = dict(history_len=2, max_prompt_tokens=512, max_new_tokens=32)
    torch.manual_seed(1)
    assert tiny_build.evaluate_success(model, tokenizer, "alfworld", "small", seeds, max_steps=1, **kw) == 0.0
    torch.manual_seed(1)
    assert tiny_build.evaluate_success(model, tokenizer, "alfworld", "small", seeds, **kw) > 0.0
