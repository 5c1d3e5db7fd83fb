"""HFGenerator: log-probs equal a teacher-forced forward pass, stop at `</action>` / EOS, batching, no top-k."""

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from common.generation import Generation, HFGenerator, VLLMGenerator, make_generator

TEXTS = [
    "You arrive at countertop 1. On the countertop 1, you see a apple 2, a fork 1, and a potato 1.",
    "Your task is to: put a clean apple in fridge. Admissible actions: go to desk 1, take apple 2 from countertop 1",
    "<action>go to desk 1</action> <action>take apple 2 from countertop 1</action> <action>click[buy now]</action>",
    "WebShop [SEP] Instruction: [SEP] i need a long clip-in hair extension, and price lower than 40.00 dollars",
    "search[long clip-in hair extension] click[b09xyz1234] done finished the end garbage words tail",
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", padding_side="left"
    )


def make_model(tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config).eval()


def forward_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return F.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def overfit(tokenizer):
    """A model trained to answer two prompts: one with an action followed by junk, one with EOS followed by junk."""
    model = make_model(tokenizer, seed=1)
    pairs = [
        ("Your task is to: put a clean apple in fridge.", "<action>go to desk 1</action> garbage words tail"),
        ("WebShop [SEP] Instruction: [SEP] i need", "done<|endoftext|> finished the end"),
    ]
    rows = [(tokenizer.encode(p), tokenizer.encode(r)) for p, r in pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(120):
        loss = 0.0
        for p, r in rows:
            ids = torch.tensor([p + r])
            labels = ids.clone()
            labels[0, : len(p)] = -100
            loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, [p for p, _ in rows]


def test_logprobs_match_forward_pass(tokenizer):
    model = make_model(tokenizer)
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]  # different lengths -> left padding
    assert len({len(p) for p in prompts}) > 1
    gen = HFGenerator(tokenizer, max_new_tokens=12)
    torch.manual_seed(0)
    for temperature in (1.0, 0.7):
        outs = gen.generate(model, prompts, temperature=temperature)
        assert len(outs) == len(prompts)
        for prompt, out in zip(prompts, outs):
            assert isinstance(out, Generation)
            assert len(out.token_ids) == len(out.logprobs) >= 1
            ref = forward_logprobs(model, prompt, out.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
    # greedy: argmax tokens, log-probs still at the given temperature
    outs = gen.generate(model, prompts, greedy=True, temperature=0.5)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == out.token_ids
        ref = F.log_softmax(logits / 0.5, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_stops_at_action_and_eos(tokenizer, overfit):
    model, prompts = overfit
    gen = HFGenerator(tokenizer, max_new_tokens=24)
    action, eos = gen.generate(model, prompts, greedy=True)
    assert action.text == "<action>go to desk 1</action>"
    assert tokenizer.decode(action.token_ids).startswith("<action>go to desk 1</action>")
    assert "garbage" not in tokenizer.decode(action.token_ids)
    assert eos.text == "done"
    assert eos.token_ids[-1] == tokenizer.eos_token_id
    assert len(eos.token_ids) < 24 and len(eos.logprobs) == len(eos.token_ids)
    # sampled: still cut right after the first </action>
    torch.manual_seed(0)
    for out in gen.generate(model, prompts[:1] * 8, temperature=1.0):
        assert out.text.count("</action>") <= 1
        assert out.text.endswith("</action>") or len(out.token_ids) == 24 or out.token_ids[-1] == tokenizer.eos_token_id


def test_batching_and_padding_do_not_change_results(tokenizer, overfit):
    model, prompts = overfit
    prompts = prompts + [tokenizer.encode(TEXTS[0])]
    whole = HFGenerator(tokenizer, max_new_tokens=16).generate(model, prompts, greedy=True)
    pairs = HFGenerator(tokenizer, max_new_tokens=16, batch_size=2).generate(model, prompts, greedy=True)
    alone = [HFGenerator(tokenizer, max_new_tokens=16).generate(model, [p], greedy=True)[0] for p in prompts]
    for a, b, c in zip(whole, pairs, alone):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.text == b.text == c.text
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(c.logprobs), atol=1e-4, rtol=0)
    assert model.training is False


def test_sampling_is_not_top_k_truncated(tokenizer):
    """A random model is near-uniform over ~400 tokens: top-k 50 (transformers' default) would hide most of them."""
    model = make_model(tokenizer)
    # the model's own generation_config must not leak into sampling either
    model.generation_config.top_k = 5
    model.generation_config.repetition_penalty = 5.0
    prompt = tokenizer.encode(TEXTS[1])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    rank = torch.argsort(logits, descending=True).argsort()
    torch.manual_seed(0)
    outs = HFGenerator(tokenizer, max_new_tokens=1).generate(model, [prompt] * 64, temperature=1.0)
    ranks = [int(rank[o.token_ids[0]]) for o in outs]
    assert sum(r >= 50 for r in ranks) > 32
    assert model.generation_config.top_k == 5  # restored


def test_model_train_mode_restored_and_empty_batch(tokenizer):
    model = make_model(tokenizer).train()
    gen = HFGenerator(tokenizer, max_new_tokens=3)
    assert gen.generate(model, []) == []
    gen.generate(model, [tokenizer.encode("hello")])
    assert model.training
    with pytest.raises(ValueError):
        gen.generate(model, [[]])


def test_make_generator_backends(tokenizer):
    assert isinstance(make_generator("hf", tokenizer, max_new_tokens=4), HFGenerator)
    with pytest.raises(ValueError, match="unknown rollout backend"):
        make_generator("tgi", tokenizer, max_new_tokens=4)
    with pytest.raises(ValueError, match="model_path"):
        make_generator("vllm", tokenizer, max_new_tokens=4)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="requirements-gpu.txt"):
            VLLMGenerator(tokenizer, max_new_tokens=4, model_path="/nonexistent")


def test_make_generator_saves_the_model_for_the_vllm_engine(tokenizer, tmp_path):
    """Without model_path the engine's folder is written from the model and tokenizer (here vLLM then refuses to
    start on a machine without it; tests/test_vllm_backend.py runs the scripts on a stand-in engine)."""
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed: this checks the folder written before the ImportError")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="requirements-gpu.txt"):
        make_generator("vllm", tokenizer, max_new_tokens=4, model=make_model(tokenizer), engine_dir=tmp_path / "engine")
    assert (tmp_path / "engine" / "config.json").is_file() and (tmp_path / "engine" / "tokenizer.json").is_file()
