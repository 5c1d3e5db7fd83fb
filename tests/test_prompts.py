"""Prompts: deterministic forms, token-budget truncation with a real tokenizer, robust action parsing."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common import prompts
from common.prompts import TRUNCATION_MARK, build_prompt, encode_prompt, format_response, parse_action

TASK = "put a clean apple in fridge"
ADMISSIBLE = ["go to fridge 1", "go to countertop 1", "take apple 1 from countertop 1", "inventory", "look"]
HISTORY = [(f"obs{k} you see a thing {k}", f"act{k} go to place {k}") for k in range(6)]
OBS = "You arrive at countertop 1. On the countertop 1, you see a apple 1, a fork 1, and a potato 1."

CHAT_TEMPLATE = "{% for m in messages %}<|user|> {{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def _corpus() -> list[str]:
    texts = [TASK, OBS, *ADMISSIBLE, TRUNCATION_MARK]
    for o, a in HISTORY:
        texts += [o, a]
    for short in (False, True):
        texts.append(build_prompt(TASK, OBS, HISTORY, ADMISSIBLE, history_len=6, short=short))
        texts.append(format_response("look", short))
    return texts


def _make_tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    # Character-level fallback (every char in the alphabet) keeps truncated observations encodable.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<pad>", "<eos>", "<|user|>", "<|end|>", "<|assistant|>"]
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    if chat:
        hf.chat_template = CHAT_TEMPLATE
    return hf


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "chat"])
def tokenizer(request):
    return _make_tokenizer(chat=request.param)


def test_build_prompt_contents_and_determinism():
    for short in (False, True):
        p = build_prompt(TASK, OBS, HISTORY, ADMISSIBLE, history_len=2, short=short)
        assert p == build_prompt(TASK, OBS, list(HISTORY), list(ADMISSIBLE), history_len=2, short=short)
        assert TASK in p and OBS in p
        assert all(a in p for a in ADMISSIBLE)
        # Only the last two turns, oldest first.
        assert "act3" not in p and "obs3" not in p
        if short:  # past actions only
            assert "obs4" not in p and p.index("act4") < p.index("act5") < p.index("You arrive")
        else:
            assert p.index("obs4") < p.index("act4") < p.index("obs5") < p.index("act5") < p.index("You arrive")
    long = build_prompt(TASK, OBS, HISTORY, ADMISSIBLE, history_len=2)
    short = build_prompt(TASK, OBS, HISTORY, ADMISSIBLE, history_len=2, short=True)
    assert "<think></think>" in long and "<action></action>" in long
    assert "<think>" not in short
    assert len(short) < len(long) / 2
    assert short.startswith(f"task: {TASK}\n") and short.endswith(
        "actions: " + " | ".join(f"{k} {a}" for k, a in enumerate(ADMISSIBLE, 1)) + "\n"
    )


def test_history_len_zero_and_short_form_is_one_line_per_field():
    for short in (False, True):
        p = build_prompt(TASK, OBS, HISTORY, ADMISSIBLE, history_len=0, short=short)
        assert "obs5" not in p and "act5" not in p
    multi = build_prompt(TASK, "line one\n\nline  two", [("a\nb", "c\n d")], ["x"], history_len=1, short=True)
    # The short form's history is the past actions only.
    assert multi == "task: put a clean apple in fridge\nprev: c d\nobs: line one line two\nactions: 1 x\n"


def test_short_form_does_not_repeat_the_task_in_the_observation():
    obs = "WebShop [SEP] Instruction: [SEP] i need  a red\nmug [SEP] Search"
    p = build_prompt("i need a red mug", obs, [], ["search[<query>]"], short=True)
    assert (
        p == "task: i need a red mug\nobs: WebShop [SEP] Instruction: [SEP] [SEP] Search\nactions: 1 search[<query>]\n"
    )
    # the long form keeps the observation as it is
    assert obs.strip() in build_prompt("i need a red mug", obs, [], ["search[<query>]"])


def test_short_form_writes_actions_answered_by_number_as_their_number():
    by_number = re.compile(r"click\[(b0[0-9a-z]{8})\]")
    obs = "Back to Search [SEP] B0AAAA1111 [SEP] red mug [SEP] $9.99 [SEP] B0BBBB2222 [SEP] blue mug [SEP] $5.99"
    adm = ["click[back to search]", "click[b0aaaa1111]", "click[b0bbbb2222]"]
    p = build_prompt("i need a red mug", obs, [("page", "search[red mug]")], adm, short=True, by_number=by_number)
    assert p == (
        "task: i need a red mug\nprev: search[red mug]\n"
        "obs: Back to Search [SEP] #2 [SEP] red mug [SEP] $9.99 [SEP] #3 [SEP] blue mug [SEP] $5.99\n"
        "actions: 1 click[back to search] | 2 | 3\n"
    )
    # the answer "2" is still the product's click, and without by_number (or in the long form) nothing changes
    assert parse_action("<action>2</action>", adm) == ("click[b0aaaa1111]", True)
    plain = build_prompt("i need a red mug", obs, [], adm, short=True)
    assert "B0AAAA1111" in plain and "2 click[b0aaaa1111]" in plain
    assert build_prompt("t", obs, [], adm, by_number=by_number) == build_prompt("t", obs, [], adm)


def test_encode_prompt_matches_tokenizer_when_it_fits(tokenizer):
    ids = encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, history_len=3, short=False, max_prompt_tokens=None)
    text = build_prompt(TASK, OBS, HISTORY, ADMISSIBLE, history_len=3)
    if tokenizer.chat_template:
        expect = tokenizer(f"<|user|> {text}<|end|><|assistant|>", add_special_tokens=False).input_ids
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|user|>")
    else:
        expect = tokenizer(text).input_ids
    assert ids == expect


@pytest.mark.parametrize("short", [False, True])
def test_truncation_drops_oldest_turns_first(tokenizer, short):
    def n_tokens(h):
        return len(encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, history_len=h, short=short))

    full, two = n_tokens(5), n_tokens(2)
    assert full > two
    ids = encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, history_len=5, short=short, max_prompt_tokens=two)
    # Exactly the prompt with the two newest turns: the budget fits them but not a third.
    assert n_tokens(3) > two
    assert ids == encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, history_len=2, short=short)
    text = tokenizer.decode(ids)
    assert "act5" in text.replace(" ", "") and "act4" in text.replace(" ", "")
    assert "act3" not in text.replace(" ", "")


@pytest.mark.parametrize("short", [False, True])
def test_truncation_cuts_observation_from_the_left(tokenizer, short):
    no_hist = len(encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, history_len=0, short=short))
    budget = no_hist - 8
    ids = encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, history_len=2, short=short, max_prompt_tokens=budget)
    assert len(ids) <= budget
    text = tokenizer.decode(ids).replace(" ", "")
    assert "act5" not in text  # all history went first
    assert "potato1." in text  # the newest text of the observation stays
    assert "Youarrive" not in text  # its beginning was cut
    assert TASK.replace(" ", "") in text
    assert all(a.replace(" ", "") in text for a in ADMISSIBLE)


def test_truncation_last_resort_and_clear_error(tokenizer):
    bare = len(encode_prompt(tokenizer, TASK, "", [], [], history_len=0, short=True))
    with_obs_mark = len(encode_prompt(tokenizer, TASK, TRUNCATION_MARK, [], ADMISSIBLE[:1], history_len=0, short=True))
    ids = encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, short=True, max_prompt_tokens=with_obs_mark)
    assert len(ids) <= with_obs_mark
    text = tokenizer.decode(ids).replace(" ", "")
    assert ADMISSIBLE[0].replace(" ", "") in text and ADMISSIBLE[-1].replace(" ", "") not in text
    with pytest.raises(ValueError, match="too small"):
        encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, short=True, max_prompt_tokens=bare // 2)
    with pytest.raises(ValueError):
        encode_prompt(tokenizer, TASK, OBS, HISTORY, ADMISSIBLE, short=True, max_prompt_tokens=0)


def test_truncation_budget_holds_on_random_inputs(tokenizer):
    rng = random.Random(0)
    words = "you see a apple fridge countertop go to take from 1 2 3 the is open closed".split()
    for _ in range(15):
        obs = " ".join(rng.choice(words) for _ in range(rng.randint(0, 80)))
        hist = [(" ".join(rng.choices(words, k=rng.randint(1, 30))), rng.choice(ADMISSIBLE)) for _ in range(4)]
        budget = rng.randint(70, 200)
        short = rng.random() < 0.5
        try:
            ids = encode_prompt(
                tokenizer, TASK, obs, hist, ADMISSIBLE, history_len=4, short=short, max_prompt_tokens=budget
            )
        except ValueError:
            continue
        assert len(ids) <= budget


def test_parse_action_cases():
    assert parse_action("<think>hmm</think><action> go to desk 1 \n</action>") == ("go to desk 1", True)
    assert parse_action("<action>a</action> then <action>b</action>") == ("b", True)
    assert parse_action("<action>a</action> then <action>b") == ("a", True)  # unfinished last tag ignored
    assert parse_action("<action><action>inner</action></action>") == ("inner", True)
    assert parse_action("<action>x</action></action>") == ("x", True)
    assert parse_action("<action>   </action>") == ("", False)
    assert parse_action("<action></action>") == ("", False)
    assert parse_action("go to desk 1") == ("", False)
    assert parse_action("") == ("", False)
    assert parse_action("</action><action>x") == ("", False)
    assert parse_action("<ACTION>x</ACTION>") == ("", False)  # tags are exact lower case
    assert parse_action("<action>click[b09abc1234]</action><eos>") == ("click[b09abc1234]", True)
    assert parse_action("<action>ouvrir le frigo ❄ 1</action>") == ("ouvrir le frigo ❄ 1", True)


def test_parse_action_resolves_a_number_of_the_short_prompts_list():
    adm = ["click[back to search]", "click[next >]", "click[b02wtyj3tv]"]
    assert parse_action("<action>3</action>", adm) == ("click[b02wtyj3tv]", True)
    assert parse_action("<action> 1 </action>", adm) == ("click[back to search]", True)
    # Out of range, zero, signed, non-ASCII digits and numbers inside text stay as they are (the env rejects them).
    for raw in ["0", "4", "-1", "+2", "３", "2a", "click[2]", "1 2"]:
        assert parse_action(f"<action>{raw}</action>", adm) == (raw, True)
    assert parse_action("<action>3</action>") == ("3", True)  # no list given: the long form does not number
    assert parse_action("<action>1</action>", []) == ("1", True)
    assert parse_action("<action></action>", adm) == ("", False)
    # Numbers in the prompt and the parser agree: the k-th listed action is the k-th admissible one.
    prompt = build_prompt("t", "o", [], adm, short=True)
    listed = prompt.split("actions: ", 1)[1].rstrip("\n").split(" | ")
    for entry in listed:
        k, text = entry.split(" ", 1)
        assert parse_action(f"<action>{k}</action>", adm) == (text, True)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["<action>", "</action>", "<", ">", "/", "a", " ", "\n", "é", "🍎", "\x00"])).map("".join)
)
def test_parse_action_never_raises_and_is_consistent(text):
    action, valid = parse_action(text)
    assert isinstance(action, str) and isinstance(valid, bool)
    assert valid == bool(action)
    # Independent reference: the last innermost pair found by a regex scan.
    pairs = re.findall(r"<action>((?:(?!<action>).)*?)</action>", text, flags=re.S)
    expect = pairs[-1].strip() if pairs else ""
    assert (action, valid) == (expect, bool(expect))
    assert "</action>" not in action and "<action>" not in action


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_action_any_unicode(text):
    action, valid = parse_action(text)
    assert valid == bool(action)
    wrapped, ok = parse_action(f"<think>{text}</think><action> {text} look </action>")
    if "<action>" not in text and "</action>" not in text:
        assert ok and wrapped == f"{text} look".strip()


def test_parse_action_never_raises_on_a_long_number():
    admissible = ["search[x]", "click[y]"]
    # more digits than int() accepts (4,300): no ValueError, the answer stays text (the env finds it invalid)
    long_number = "9" * 5000
    assert parse_action(f"<action>{long_number}</action>", admissible) == (long_number, True)
    assert parse_action(f"<action>{'0' * 5000}2</action>", admissible) == ("click[y]", True)
    assert parse_action("<action>02</action>", admissible) == ("click[y]", True)
    assert parse_action("<action>3</action>", admissible) == ("3", True)


def test_format_response_round_trips_through_parse():
    for short in (False, True):
        resp = format_response("take apple 1 from countertop 1", short)
        assert parse_action(resp) == ("take apple 1 from countertop 1", True)
    assert format_response("look", True) == "<action>look</action>"
    assert format_response("look", False).startswith("<think>")


def test_action_token_mask_marks_the_tokens_inside_the_last_action():
    from tiny_models.build import train_tiny_tokenizer

    corpus = ["<think>the next step</think> click[buy now] search[red shoes] <action>3</action>"] * 20
    tok = train_tiny_tokenizer(corpus, vocab_size=300)
    ids = tok("<think>x</think><action>click[buy now]</action>").input_ids + [tok.eos_token_id]
    mask = prompts.action_token_mask(tok, ids)
    inside = "".join(tok.decode([t]) for t, m in zip(ids, mask) if m)
    assert inside == "click[buy now]"
    assert len(mask) == len(ids) and not mask[-1]
    no_action = tok("<action>click[buy now]").input_ids
    assert prompts.action_token_mask(tok, no_action) == [False] * len(no_action)
    two = tok("<action>3</action><action>click[buy now]</action>").input_ids
    picked = [tok.decode([t]) for t, m in zip(two, prompts.action_token_mask(tok, two)) if m]
    assert "".join(picked) == "click[buy now]" and "3" not in picked
